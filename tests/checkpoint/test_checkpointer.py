"""Single-process tests of the save and load paths: round trips, interrupted saves and every rejected input.

One rank (a 1 x 1 x 1 federation on gloo) is enough to exercise the file formats; the multi-rank behaviour is proven in
tests/trainer/test_checkpoints.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fedshard import FLFSDPStrategy
from lightning_fedshard.checkpoint import FEDSHARD_KEY
from tests.checkpoint.one_rank import Rank


class Unpicklable:
    """Stands in for a crash in the middle of writing a file: serializing it fails."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self):
        raise OSError(self.message)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(path: Path) -> dict[Path, str]:
    return {p.relative_to(path): _sha(p) for p in path.rglob("*") if p.is_file()}


def _change(rank: Rank) -> None:
    rank.train_step()
    with torch.no_grad():
        rank.federation.outer.anchor[0].add_(1.0)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_round_trip_restores_weights_anchor_and_inner_optimizer_exactly(rank, tmp_path, kind):
    path = tmp_path / "a.ckpt"
    rank.save(path) if kind == "full" else rank.save_sharded(path)
    before = rank.snapshot()
    _change(rank)
    assert any(not torch.equal(a, b) for a, b in zip(before, rank.snapshot()))
    metadata = rank.checkpointer.load(path, optimizers=[rank.optimizer])
    assert metadata["global_step"] == 1 and FEDSHARD_KEY not in metadata
    for a, b in zip(before, rank.snapshot()):
        assert torch.equal(a, b)


def test_interrupted_full_save_leaves_the_previous_checkpoint_intact(rank, tmp_path):
    path = tmp_path / "last.ckpt"
    rank.save(path)
    sha = _sha(path)
    with pytest.raises(OSError, match="disk full"):
        rank.checkpointer.save({**rank.checkpoint(), "bad": Unpicklable("disk full")}, path, "full", [])
    assert _sha(path) == sha
    rank.train_step()
    rank.save(path)  # the next save replaces it and the leftover
    assert _sha(path) != sha and not (tmp_path / ".last.ckpt.partial").exists()


def test_interrupted_sharded_save_leaves_the_previous_checkpoint_intact(rank, tmp_path):
    path = tmp_path / "last.ckpt"
    rank.save_sharded(path)
    files = _tree(path)
    with pytest.raises(CheckpointException, match="killed mid-save"):  # DCP reports its writers' errors this way
        rank.save_sharded(path, extra={"state_dict": {"w": Unpicklable("killed mid-save")}})
    assert (tmp_path / ".last.ckpt.partial").is_dir()  # the DCP files were being written
    assert _tree(path) == files


# -- the bad-input table (docs/checkpoints.md) ---------------------------------------------------------------------


def test_missing_checkpoint_path(rank, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rank.checkpointer.load(tmp_path / "nope.ckpt", optimizers=[rank.optimizer])


def test_directory_that_is_not_a_checkpoint(rank, tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint: expected a file"):
        rank.checkpointer.load(tmp_path, optimizers=[rank.optimizer])


def test_url_paths_are_rejected(rank):
    with pytest.raises(ValueError, match="is a URL"):
        rank.save("s3://bucket/last.ckpt")


def test_checkpoint_from_a_newer_format(rank, tmp_path):
    rank.save(tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    checkpoint[FEDSHARD_KEY]["format_version"] = 99
    torch.save(checkpoint, tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="format version 99; this version of lightning_fedshard reads versions up"):
        rank.checkpointer.load(tmp_path / "a.ckpt", optimizers=[rank.optimizer])


def test_incomplete_checkpoint(rank, tmp_path):
    rank.save(tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    del checkpoint[FEDSHARD_KEY]["entries"]["group0/shard0"]
    torch.save(checkpoint, tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError, match="is incomplete: entry 'group0/shard0' is missing"):
        rank.checkpointer.load(tmp_path / "a.ckpt", optimizers=[rank.optimizer])


def test_different_number_of_inner_optimizers(rank, tmp_path):
    rank.save(tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError, match=r"holds 1 inner optimizer state\(s\), but this run configures 2"):
        rank.checkpointer.load(tmp_path / "a.ckpt", optimizers=[rank.optimizer, rank.optimizer])


def test_checkpoint_without_a_state_dict(rank, tmp_path):
    torch.save({"epoch": 0}, tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="holds no 'state_dict'"):
        rank.checkpointer.load(tmp_path / "a.ckpt", optimizers=None)


def test_unknown_state_dict_type(rank, tmp_path):
    with pytest.raises(ValueError, match="Unknown `state_dict_type='weird'`"):
        rank.checkpointer.save(rank.checkpoint(), tmp_path / "a.ckpt", "weird", [])  # type: ignore[arg-type]


def test_storage_options_are_rejected():
    with pytest.raises(TypeError, match="storage_options=...\\)` is not supported"):
        FLFSDPStrategy().save_checkpoint({}, "a.ckpt", storage_options={"x": 1})


def test_strategy_rejects_unknown_nonfinite_policy():
    with pytest.raises(ValueError, match="`on_nonfinite` must be one of"):
        FLFSDPStrategy(on_nonfinite="ignore")
