"""The checkpoint format: telling full from sharded checkpoints, entry names and layout differences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fedshard.checkpoint.format import (
    FABRIC_KEY,
    METADATA_FILENAME,
    TRAINER_MODEL_KEY,
    ModelKey,
    checkpoint_kind,
    entry_file,
    group_entry,
    layout_differences,
    outer_entry,
    pop_state_dict,
    read_full,
    rng_entry,
    saved_model_key,
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


def test_the_model_key_is_the_one_a_checkpoint_names():
    """The Trainer's layout, a Fabric checkpoint's own key, and the Fabric layout of 0.1.0 before the user's keys."""
    assert saved_model_key({"state_dict": {}, "epoch": 1}) == TRAINER_MODEL_KEY == ModelKey("state_dict", "model")
    assert saved_model_key({"net": {}, FABRIC_KEY: {"num_steps": 3, "model_key": "net"}}) == ModelKey("net", "net")
    # Written by the Fabric strategies of lightning_fedshard 0.1.0 before a checkpoint kept the user's keys.
    assert saved_model_key({"state_dict": {}, FABRIC_KEY: {"num_steps": 3}}) == TRAINER_MODEL_KEY
    checkpoint = {"net": {"w": torch.ones(1)}}
    assert torch.equal(pop_state_dict(checkpoint, Path("x"), "net")["w"], torch.ones(1)) and checkpoint == {}
