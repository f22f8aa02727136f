"""Lightning's common callbacks and settings decide under the federation strategies as under DDP.

One launch of 4 ranks (2 nodes x 2) runs every scenario under ``"ddp"`` and under ``fl_fsdp``, ``fl_hsdp``,
``fl_fsdp2`` and ``fl_hsdp2`` (2 groups each, an outer step every 2 optimizer steps, float32 averaging). The metrics
the callbacks decide on are scripted by epoch, step and rank, and each group sees the same batches at each in-group
position, so the groups train exactly like DDP: the decisions (which checkpoint is best, which files exist, which step
``last.ckpt`` holds, when training stops) and the weights must come out as under DDP. Where a federation must differ
(a training metric of one group between syncs, a time limit checked at the ends of rounds), the test asserts the
documented difference (docs/concepts.md, "What crosses groups, and when").
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import launch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "trainer_worker.py"
FEDERATIONS = ["fl_fsdp", "fl_hsdp", "fl_fsdp2", "fl_hsdp2"]
WORLD = 4
#: Scripted inputs: rank r logs row r of `epoch_metric`. Over the world the epoch means fall to epoch 2 and rise at 3;
#: group 0's own mean (ranks 0 and 1) rises already at epoch 1, group 1's at epoch 2.
EPOCH_METRIC = [
    [1.0, 2.0, 0.5, 2.0, 0.0],
    [1.0, 1.0, 1.0, 1.0, 0.0],
    [1.0, 0.0, 0.5, 0.5, 0.0],
    [1.0, 0.0, 0.5, 0.5, 0.0],
]
SCENARIOS: dict[str, dict[str, Any]] = {
    "top_k": {
        "val_loss": [0.32, 0.246, 0.213, 0.25, 0.195],
        "checkpoint": {"monitor": "val_loss", "save_top_k": 2, "save_last": True, "filename": "{epoch}-{step}"},
        "resume": True,
    },
    "every_n_train_steps": {
        "train_metric": [0.5, 0.4, 0.45, 0.3, 0.35, 0.2, 0.25, 0.6, 0.1, 0.7],
        "checkpoint": {"monitor": "train_metric", "every_n_train_steps": 4, "save_top_k": 2, "filename": "{step}"},
    },
    "every_n_epochs": {"checkpoint": {"every_n_epochs": 2, "save_top_k": -1, "filename": "{epoch}"}},
    "early_stopping_val": {
        "val_loss": [0.3, 0.2, 0.19, 0.25, 0.1],
        "early_stopping": {"monitor": "val_loss", "patience": 1},
    },
    "early_stopping_train_epoch": {
        "epoch_metric": EPOCH_METRIC,
        "early_stopping": {"monitor": "epoch_metric", "check_on_train_epoch_end": True, "patience": 0},
    },
    "rank_metric": {
        "rank_metric": True,
        "checkpoint": {"monitor": "rank_metric", "every_n_train_steps": 2, "filename": "{step}-{rank_metric:.2f}"},
    },
    "lr_monitor": {"scheduler": True, "trainer": {"log_every_n_steps": 1}},
    "accumulate": {
        "trainer": {"accumulate_grad_batches": 2},
        "checkpoint": {"every_n_train_steps": 2, "save_top_k": -1, "filename": "{step}"},
    },
    "clip_norm": {"trainer": {"gradient_clip_val": 0.05}},
    "clip_value": {"trainer": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}},
    "max_time": {"trainer": {"max_time": {"seconds": 1.5}, "max_epochs": 1000}, "sleep": 0.02},
    "lr_find": {"lr_find": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("conformance")
    launch(WORKER, [json.dumps(["ddp", *FEDERATIONS]), json.dumps(SCENARIOS), str(root)], 2, 2, root / "logs", 600)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _both(runs: list[dict[str, Any]], scenario: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Global rank 0's results of ``scenario`` under DDP and under ``name``, after checking every rank agrees."""
    for key in ("global_step", "best", "best_k", "last_step", "files", "stopped_epoch", "should_stop"):
        seen = {repr(rank[f"{scenario}/{name}"].get(key)) for rank in runs}
        assert len(seen) == 1, f"{scenario} under {name}: the ranks disagree on {key}: {seen}"
    return runs[0][f"{scenario}/ddp"], runs[0][f"{scenario}/{name}"]


def _same_weights(ddp: dict[str, torch.Tensor], fed: dict[str, torch.Tensor], what: str) -> None:
    assert ddp.keys() == fed.keys(), what
    for key in ddp:
        torch.testing.assert_close(fed[key], ddp[key], atol=1e-6, rtol=0, msg=lambda m: f"{what}, {key}: {m}")


@pytest.mark.parametrize("name", FEDERATIONS)
def test_model_checkpoint_keeps_the_best_and_the_last_as_under_ddp(runs, name):
    ddp, fed = _both(runs, "top_k", name)
    assert ddp["best"] == "epoch=4-step=20.ckpt", ddp
    assert ddp["best_k"] == ["epoch=2-step=12.ckpt", "epoch=4-step=20.ckpt"], ddp
    for key in ("best", "best_k", "last_step", "files", "global_step"):
        assert fed[key] == ddp[key], f"{name}: {key} {fed[key]!r}, under DDP {ddp[key]!r}"
    _same_weights(ddp["weights"], fed["weights"], f"{name} after fit")


@pytest.mark.parametrize("name", FEDERATIONS)
def test_fit_resumes_from_last_as_under_ddp(runs, name):
    ddp, fed = _both(runs, "top_k", name)
    assert fed["resumed_step"] == ddp["resumed_step"] == 24
    _same_weights(ddp["resumed_weights"], fed["resumed_weights"], f"{name} resumed from last.ckpt")


@pytest.mark.parametrize("name", FEDERATIONS)
@pytest.mark.parametrize("scenario", ["every_n_train_steps", "every_n_epochs", "accumulate"])
def test_checkpoints_by_steps_and_epochs_are_the_ones_ddp_writes(runs, scenario, name):
    ddp, fed = _both(runs, scenario, name)
    assert ddp["files"], f"{scenario}: DDP saved nothing"
    assert (fed["files"], fed["best"], fed["global_step"]) == (ddp["files"], ddp["best"], ddp["global_step"])
    _same_weights(ddp["weights"], fed["weights"], f"{scenario} under {name}")


@pytest.mark.parametrize("name", FEDERATIONS)
@pytest.mark.parametrize("scenario", ["early_stopping_val", "early_stopping_train_epoch"])
def test_early_stopping_stops_where_ddp_stops(runs, scenario, name):
    """On a validation metric and on an epoch's training metric: both are reduced over every rank, as under DDP."""
    ddp, fed = _both(runs, scenario, name)
    assert ddp["stopped_epoch"] == 3 and ddp["global_step"] == 16, ddp
    assert (fed["stopped_epoch"], fed["global_step"]) == (ddp["stopped_epoch"], ddp["global_step"])


@pytest.mark.parametrize("name", FEDERATIONS)
def test_a_training_metric_of_one_group_names_the_checkpoints_alike_on_every_rank(runs, name):
    """The documented difference: a step's training metric is its group's, and checkpoints are named by group 0's.

    Rank r logs r: DDP reduces over the world (1.5); each group over its own ranks (0.5 and 2.5). Every rank of every
    group must still name, rank and keep the same files (a save is a collective of every rank).
    """
    ddp, fed = _both(runs, "rank_metric", name)
    assert ddp["best"] == "step=2-rank_metric=1.50.ckpt", ddp
    assert fed["best"] == "step=2-rank_metric=0.50.ckpt", fed
    assert fed["files"] == ["step=2-rank_metric=0.50.ckpt"]


@pytest.mark.parametrize("name", FEDERATIONS)
def test_learning_rate_monitor_logs_what_ddp_logs(runs, name):
    ddp, fed = _both(runs, "lr_monitor", name)

    def learning_rates(text: str) -> list[tuple[str, str]]:
        return [(row["step"], row["lr-SGD"]) for row in csv.DictReader(io.StringIO(text)) if row.get("lr-SGD")]

    assert learning_rates(ddp["metrics_csv"]) and learning_rates(fed["metrics_csv"]) == learning_rates(
        ddp["metrics_csv"]
    )


@pytest.mark.parametrize("name", FEDERATIONS)
@pytest.mark.parametrize("scenario", ["clip_norm", "clip_value"])
def test_gradient_clipping_clips_as_ddp_does(runs, scenario, name):
    """By norm, the norm is the group's whole model's: with the same batches in each group, the step is DDP's."""
    ddp, fed = _both(runs, scenario, name)
    plain, _ = _both(runs, "every_n_epochs", name)  # the same training without clipping
    moved = max((ddp["weights"][k] - plain["weights"][k]).abs().max().item() for k in ddp["weights"])
    assert moved > 1e-3, f"{scenario}: clipping changed nothing under DDP; the scenario does not test it"
    _same_weights(ddp["weights"], fed["weights"], f"{scenario} under {name}")


@pytest.mark.parametrize("name", FEDERATIONS)
def test_a_time_limit_stops_every_group_at_the_end_of_a_round(runs, name):
    """The documented difference: DDP stops at the first batch past the limit, a federation at the next sync."""
    ddp, fed = _both(runs, "max_time", name)
    assert 0 < ddp["global_step"] < 4000 and 0 < fed["global_step"] < 4000
    assert fed["global_step"] % 2 == 0, f"{name} stopped at step {fed['global_step']}, between two syncs"


@pytest.mark.parametrize("name", FEDERATIONS)
def test_lr_find_finds_what_ddp_finds(runs, name):
    ddp, fed = _both(runs, "lr_find", name)
    assert ddp["lr_find"] is not None and fed["lr_find"] is not None
    assert fed["lr_find"]["lr"] == ddp["lr_find"]["lr"]
    torch.testing.assert_close(
        torch.tensor(fed["lr_find"]["loss"]), torch.tensor(ddp["lr_find"]["loss"]), atol=1e-5, rtol=0
    )
    assert fed["global_step"] == ddp["global_step"]
