"""Between two syncs the groups of a federation never meet: no collective spans more than one group.

A Trainer with its defaults (progress bar, logger, checkpointing, validation on sync steps) trains with every
strategy, with and without ``self.log(..., sync_dist=True)`` in ``training_step``; every collective of every rank is
recorded from any caller (Lightning's loops and callbacks, FSDP, this package; ``tests/collective_spy.py``), with the
phase of training it happened in (``tests/trainer/collectives_worker.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.launch import launch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "collectives_worker.py"
BASE = {"max_steps": 20, "val_check_interval": 8}
SCENARIOS_4 = [
    dict(BASE, name=f"{strategy}-{'sync_dist' if sync_dist else 'local'}", strategy=strategy, sync_dist=sync_dist)
    for strategy in ("fl_fsdp", "fl_fsdp2")
    for sync_dist in (False, True)
] + [
    # A time limit and time-based checkpoints: Lightning broadcasts their decisions after every batch.
    dict(
        BASE,
        name="fl_fsdp-time_limits",
        strategy="fl_fsdp",
        sync_dist=True,
        max_steps=400,
        trainer={"max_time": "00:00:00:03"},
        checkpoint_interval_s=1.0,
    ),
    # Groups of different speeds: the slow group skips steps, the fast one never waits for it between syncs.
    dict(BASE, name="fl_fsdp2-pace", strategy="fl_fsdp2", sync_dist=True, pace=[1.0, 0.5]),
    # A pace with manual optimization: refused when `fit` starts (kept last: the launch ends with it)
    dict(BASE, name="fl_fsdp-pace-manual", strategy="fl_fsdp", sync_dist=False, pace=[1.0, 0.5], manual=True),
]
# 4 nodes x 2 devices, 2 groups of 2 replicas x 2 shards
SCENARIOS_8 = [
    dict(BASE, name=f"{strategy}-{'sync_dist' if sync_dist else 'local'}", strategy=strategy, sync_dist=sync_dist,
         kwargs={"num_groups": 2})
    for strategy in ("fl_hsdp", "fl_hsdp2")
    for sync_dist in (False, True)
]  # fmt: skip


def _run(root: Path, specs: list[dict], nodes: int, devices: int) -> dict[str, list[dict]]:
    launch(WORKER, [json.dumps(specs), str(root)], nodes, devices, root / "logs", timeout=400)
    return {s["name"]: [torch.load(root / s["name"] / f"rank{r}.pt") for r in range(nodes * devices)] for s in specs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    results = _run(tmp_path_factory.mktemp("four"), SCENARIOS_4, nodes=2, devices=2)
    results.update(_run(tmp_path_factory.mktemp("eight"), SCENARIOS_8, nodes=4, devices=2))
    return results


def _wide(rank: dict) -> Counter:
    """The collectives of one rank that span more than one group, by (phase, op)."""
    groups = [set(g) for g in rank["groups"]]
    return Counter((phase, op) for op, ranks, phase, _ in rank["records"] if not any(set(ranks) <= g for g in groups))


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS_4 + SCENARIOS_8 if "pace-manual" not in s["name"]
                                  and "time_limits" not in s["name"]])  # fmt: skip
def test_no_collective_spans_two_groups_between_syncs(runs, name):
    for rank, result in enumerate(runs[name]):
        assert result["global_step"] == BASE["max_steps"] and result["num_syncs"] == 3
        _assert_groups_meet_only_at_syncs(rank, result)


def test_a_time_limit_and_timed_checkpoints_are_decided_at_the_ends_of_rounds(runs):
    """``max_time`` and ``train_time_interval`` decide only where every group meets: all stop and save alike."""
    ranks = runs["fl_fsdp-time_limits"]
    steps = {r["global_step"] for r in ranks}
    assert len(steps) == 1, f"the groups stopped at different steps: {steps}"
    step = steps.pop()
    assert 0 < step < 400 and step % ranks[0]["sync_every"] == 0, f"stopped at step {step}, not at a sync"
    saved = [int(name.removeprefix("step=").removesuffix(".ckpt")) for name in ranks[0]["checkpoints"]]
    assert saved and all(s % ranks[0]["sync_every"] == 0 for s in saved), saved
    for rank, result in enumerate(ranks):
        _assert_groups_meet_only_at_syncs(rank, result)


def test_a_pace_with_manual_optimization_is_refused_when_fit_starts(runs):
    for result in runs["fl_fsdp-pace-manual"]:
        assert result["global_step"] == 0
        assert "manual optimization" in result["error"] and "`automatic_optimization = False`" in result["error"]


def _assert_groups_meet_only_at_syncs(rank: int, result: dict) -> None:
    wide = _wide(result)
    between = {key: n for key, n in wide.items() if key[0] == "between"}
    assert not between, f"rank {rank}: collectives across groups between syncs: {between}"
    # The spy sees what crosses groups: every sync sums over the fed ring, validation reduces over every group.
    assert wide[("sync", "allreduce")] >= 2, f"rank {rank}: the spy saw no sync: {wide}"
    assert any(phase == "validation" for phase, _ in wide), f"rank {rank}: the spy saw no validation: {wide}"
    assert sum(1 for record in result["records"] if record[2] == "between") > 10, "no step was recorded"
