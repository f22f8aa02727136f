"""Exporting the consensus of full and sharded checkpoints, in a single process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fedshard import export_consensus
from tests.checkpoint.one_rank import start_one_rank
from tests.toy import make_net


def test_export_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_consensus(tmp_path / "nope.ckpt", tmp_path / "out")
    torch.save({"epoch": 0}, tmp_path / "empty.ckpt")
    with pytest.raises(ValueError, match="holds no 'state_dict'"):
        export_consensus(tmp_path / "empty.ckpt", tmp_path / "out")
    torch.save({"state_dict": make_net().state_dict()}, tmp_path / "a.ckpt")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is an existing file"):
        export_consensus(tmp_path / "a.ckpt", tmp_path / "file")
    with pytest.raises(RuntimeError, match="size mismatch"):
        export_consensus(tmp_path / "a.ckpt", tmp_path / "out", module=nn.Sequential(nn.Linear(2, 2)))


def test_full_and_sharded_checkpoints_export_the_same_consensus(tmp_path):
    rank = start_one_rank()
    rank.save(tmp_path / "full.ckpt")
    rank.save_sharded(tmp_path / "sharded.ckpt")
    want = rank.checkpoint()["state_dict"]
    for source in ("full.ckpt", "sharded.ckpt"):
        exported = torch.load(export_consensus(tmp_path / source, tmp_path / f"out_{source}"))
        assert sorted(exported) == sorted(want)
        for k, v in want.items():
            assert torch.equal(exported[k], v)


def test_export_writes_save_pretrained_for_a_wrapped_transformers_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

    torch.manual_seed(1)
    trained = Wrapper()
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "a.ckpt")
    out = export_consensus(tmp_path / "a.ckpt", tmp_path / "hf", module=Wrapper())
    assert (out / "config.json").is_file()
    loaded = LlamaForCausalLM.from_pretrained(out)
    for k, v in trained.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_a_fabric_checkpoint_exports_the_model_under_the_users_key(tmp_path):
    net = make_net()
    torch.save({"net": net.state_dict(), "step": 3, "fedshard_fabric": {"num_steps": 3, "model_key": "net"}},
               tmp_path / "fabric.ckpt")  # fmt: skip
    exported = torch.load(export_consensus(tmp_path / "fabric.ckpt", tmp_path / "out"))
    assert all(torch.equal(exported[k], v) for k, v in net.state_dict().items())
