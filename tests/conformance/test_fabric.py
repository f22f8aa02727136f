"""Fabric's checkpoint conventions and collectives hold under the federation strategies as under DDP.

One launch of 4 ranks (2 nodes x 2) runs the same Fabric script under ``"ddp"`` and under the Fabric ``fl_fsdp``,
``fl_hsdp``, ``fl_fsdp2`` and ``fl_hsdp2`` (2 groups each; each group sees the same batches at each in-group position,
so the groups train exactly like DDP): clipping by norm, ``fabric.save`` with the user's keys, ``fabric.load`` with
and without state, ``fabric.load_raw`` of a plain state dict, ``fabric.all_reduce``. What a federation adds to a
file lives under its own keys (``"fedshard"``, ``"fedshard_fabric"``); the user's keys hold what DDP's do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import launch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "fabric_worker.py"
FEDERATIONS = ["fl_fsdp", "fl_hsdp", "fl_fsdp2", "fl_hsdp2"]
OWN_KEYS = ["fedshard", "fedshard_fabric"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fabric_conformance")
    names = ["ddp", *FEDERATIONS, "fl_fsdp-sharded"]
    launch(WORKER, [json.dumps(names), str(root)], 2, 2, root / "logs", timeout=400)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(4)]


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0, msg=lambda m: f"{what}, {key}: {m}")


@pytest.mark.parametrize("name", FEDERATIONS)
def test_clipping_by_norm_clips_the_group_norm_as_ddp_does(runs, name):
    ddp, fed = runs[0]["ddp"], runs[0][name]
    assert max(ddp["norms"]) > 0.05, "the gradients never exceeded the clip: the test would not see clipping"
    torch.testing.assert_close(torch.tensor(fed["norms"]), torch.tensor(ddp["norms"]), atol=1e-6, rtol=0)
    _close(fed["trained"], ddp["trained"], f"{name}: weights after clipped steps")


@pytest.mark.parametrize("name", FEDERATIONS)
def test_a_full_save_keeps_the_users_keys_with_the_consensus_under_model(runs, name):
    ddp, fed = runs[0]["ddp"], runs[0][name]
    assert ddp["saved_keys"] == ["model", "optimizer", "step"]
    assert fed["saved_keys"] == sorted(ddp["saved_keys"] + OWN_KEYS)
    _close(fed["saved_model"], ddp["saved_model"], f"{name}: checkpoint['model']")
    _close(fed["saved_model"], fed["trained"], f"{name}: checkpoint['model'] against the consensus")
    assert fed["saved_optimizer_keys"] == ddp["saved_optimizer_keys"] == ["param_groups", "state"]


@pytest.mark.parametrize("name", FEDERATIONS)
def test_load_returns_what_ddp_returns(runs, name):
    """Without state the whole checkpoint; with the model alone the rest; with model and optimizer the rest."""
    ddp, fed = runs[0]["ddp"], runs[0][name]
    assert set(ddp["whole_keys"]) <= set(fed["whole_keys"]) <= set(ddp["whole_keys"] + OWN_KEYS)
    assert ddp["weights_only_rest"] == ["optimizer", "step"] and fed["weights_only_rest"] == ddp["weights_only_rest"]
    assert fed["resume_rest"] == ddp["resume_rest"] == [] and fed["resumed_step"] == ddp["resumed_step"] == 4


@pytest.mark.parametrize("name", FEDERATIONS)
def test_load_raw_puts_a_plain_state_dict_into_every_group(runs, name):
    """The federation starts afresh from the loaded weights: they are its consensus."""
    ddp, fed = runs[0]["ddp"], runs[0][name]
    _close(ddp["after_load_raw"], ddp["raw"], "ddp after load_raw")
    _close(fed["after_load_raw"], fed["raw"], f"{name}: the consensus after load_raw")


@pytest.mark.parametrize("name", ["ddp", *FEDERATIONS])
def test_all_reduce_spans_every_rank(runs, name):
    assert [rank[name]["all_reduce"] for rank in runs] == [6.0] * 4


def test_a_sharded_save_holds_the_model_under_the_users_key(runs):
    fed = runs[0]["fl_fsdp-sharded"]
    assert fed["saved_keys"] == ["fedshard", "fedshard_fabric", "net", "step"]
    _close(fed["saved_model"], fed["trained"], "checkpoint['net'] of a sharded save")
    assert fed["resume_rest"] == [] and fed["resumed_step"] == 1
