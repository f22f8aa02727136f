"""The checkpoint format: telling full from sharded checkpoints, entry names and layout differences."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.checkpoint.format import (
    METADATA_FILENAME,
    checkpoint_kind,
    entry_file,
    group_entry,
    layout_differences,
    outer_entry,
    pop_state_dict,
    read_full,
    rng_entry,
)


def test_checkpoint_kind(tmp_path):
    torch.save({}, tmp_path / "a.ckpt")
    (tmp_path / "sharded").mkdir()
    torch.save({}, tmp_path / "sharded" / METADATA_FILENAME)
    assert checkpoint_kind(tmp_path / "a.ckpt") == "full"
    assert checkpoint_kind(tmp_path / "sharded") == "sharded"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_kind(tmp_path / "nope.ckpt")
    with pytest.raises(ValueError, match=r"not a checkpoint: expected a file \(full\) or a directory with 'meta.pt'"):
        checkpoint_kind(tmp_path)


def test_read_full_and_pop_state_dict(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "a.ckpt")
    checkpoint = read_full(tmp_path / "a.ckpt")
    assert torch.equal(pop_state_dict(checkpoint, tmp_path / "a.ckpt")["w"], torch.ones(2))
    with pytest.raises(ValueError, match="holds no 'state_dict'; its keys are \\['epoch'\\]"):
        pop_state_dict(checkpoint, tmp_path / "a.ckpt")


def test_entry_names_and_files():
    assert [group_entry(1, 0), outer_entry(2), rng_entry(5)] == ["group1/shard0", "outer/shard2", "rng/rank5"]
    assert entry_file(group_entry(1, 0)) == "group1.shard0.pt"


def test_layout_differences_name_dtype_and_topology():
    saved = {"world_size": 4, "num_groups": 2, "shard_dtypes": ["bfloat16"]}
    current = {"world_size": 8, "num_groups": 2, "shard_dtypes": ["float32"]}
    assert layout_differences(saved, current) == [
        "world_size: checkpoint 4, this run 8",
        "shard_dtypes: checkpoint ['bfloat16'], this run ['float32']",
    ]
