"""Older checkpoint formats load, through their upgrade (lightning_fedshard/checkpoint/upgrades.py).

Files of the formats a run could have written are in ``fixtures/``, each written by the commit that its name carries
(``fixtures/write_old_formats.py`` says how); the older states of the federation's own entries are built here as that
version wrote them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fedshard import export_consensus
from lightning_fedshard.checkpoint import upgrades
from lightning_fedshard.checkpoint.format import FABRIC_KEY, TRAINER_MODEL_KEY, ModelKey
from lightning_fedshard.core.step.participation import pace_schedule
from tests.checkpoint.one_rank import start_one_rank
from tests.simulate.test_simulator import PACED, fit, weights

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_paced_simulation_from_before_rules_named_their_state_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Written at step 6 by eb2ee93 (the pace's schedule under the federation's own key): the run goes on exactly."""
    old = FIXTURES / "paced_simulation_eb2ee93.ckpt"
    saved = torch.load(old, weights_only=False)["fedshard_simulation"]["groups"][0]["fedshard_simulated"]["federation"]
    assert "pace" in saved and saved["participation"] == {}  # the old layout indeed
    straight = fit(10, config=PACED)
    resumed = fit(10, ckpt_path=old, enable_checkpointing=False, config=PACED)
    assert all(torch.equal(a, b) for ga, gb in zip(weights(straight), weights(resumed)) for a, b in zip(ga, gb))
    schedules = [pace_schedule(r.trainers[0].strategy.runtime.federation.participation) for r in (straight, resumed)]
    assert schedules[0].merges == schedules[1].merges


def test_a_fabric_checkpoint_from_before_the_users_keys_loads_and_exports(tmp_path: Path) -> None:
    """Written by 90ab9ae: the consensus under ``"state_dict"``, no model key in ``"fedshard_fabric"``."""
    old = FIXTURES / "fabric_full_90ab9ae.ckpt"
    checkpoint = torch.load(old, weights_only=False)
    assert "model" not in checkpoint and upgrades.model_key(checkpoint) == TRAINER_MODEL_KEY
    exported = torch.load(export_consensus(old, tmp_path / "out"))
    assert all(torch.equal(exported[k], v) for k, v in checkpoint["state_dict"].items())
    rank = start_one_rank()
    optimizer = torch.optim.SGD(rank.net.parameters(), lr=0.1)
    rest = rank.checkpointer.load(old, optimizers=[optimizer])
    assert rest["step"] == 3 and rest[FABRIC_KEY] == {"num_steps": 3}
    consensus = rank.checkpointer.consensus_state_dict("full")
    assert all(torch.equal(consensus[k], v) for k, v in checkpoint["state_dict"].items())


def test_the_model_key_is_the_one_a_checkpoint_names():
    assert upgrades.model_key({"state_dict": {}, "epoch": 1}) == TRAINER_MODEL_KEY == ModelKey("state_dict", "model")
    assert upgrades.model_key({"net": {}, FABRIC_KEY: {"num_steps": 3, "model_key": "net"}}) == ModelKey("net", "net")


def _pending(**given):
    return {"fragment": 0, "started_at": 4, "broken": [], "own_sq": 1.0, "bytes_sent": 8, "result": torch.zeros(2),
            "own_dot_sum": None, **given}  # fmt: skip


def test_a_federation_state_from_before_fragments_and_recorded_participants_is_upgraded():
    """a5ff39f had no schedule of fragments; 57e56ed recorded no participants; 761c98c no joined or idle groups."""
    old = {"outer": {"num_syncs": 2}, "last_synced_step": 8, "pending": _pending(), "eager": {}}
    new = upgrades.federation_state(old, fragments=1, groups=3)
    assert new["last_step"] == 8 and new["landed_at"] == [8] and new["outer"]["site_syncs"] == 0  # d929bc3
    pending = {k: v for k, v in new["pending"].items() if k != "result"}
    expected = {**_pending(), "kind": "outer step", "participants": [0, 1, 2], "joined": [], "idle": []}
    assert pending == {k: v for k, v in expected.items() if k != "result"}
    again = upgrades.federation_state(new, fragments=1, groups=3)
    assert {k: v for k, v in again["pending"].items() if k != "result"} == pending, "an upgraded state stays as it is"


@pytest.mark.parametrize(
    ("pace", "participation", "expected"),
    [
        ({"steps": [8]}, {}, {"pace": {"schedule": {"steps": [8]}}}),
        (None, {"seen": [[0, 1]]}, {"probation": {"seen": [[0, 1]]}}),
        ({"steps": [8]}, {"0": {}, "1": {"seen": [[0]]}}, {"pace": {"schedule": {"steps": [8]}}, "probation": {
            "seen": [[0]]}}),
        (None, None, {}),
    ],
    ids=["pace", "probation", "pace_and_probation", "neither"],
)  # fmt: skip
def test_participation_state_from_before_rules_named_their_state_is_named(pace, participation, expected):
    old = {"last_synced_step": 4, "last_step": 4, "landed_at": [4], "pace": pace, "participation": participation}
    assert upgrades.federation_state(old, fragments=1, groups=2)["participation"] == expected


def test_a_mix_in_flight_names_its_kind_and_a_layout_its_fragments():
    assert upgrades.group_state({"mix": _pending(participants=[0, 1])}, groups=2)["mix"]["kind"] == "mix"
    assert upgrades.layout({"world_size": 4})["fragments"] == 1
