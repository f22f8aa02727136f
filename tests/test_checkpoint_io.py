"""Single-process tests of checkpoint files: round trips, atomic saves, export, and every rejected input.

One rank (a 1 x 1 x 1 federation on gloo) is enough to exercise the file formats; the multi-rank behaviour is proven in
tests/trainer/test_checkpoints.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import lightning_fedshard.checkpoint as ckpt_module
from lightning_fedshard import FLFSDPStrategy, export_consensus
from lightning_fedshard.checkpoint import (
    FEDSHARD_KEY,
    FederationCheckpointer,
    is_peer_failure,
    layout_differences,
    unsafe_to_save,
)
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.fsdp import free_unsharded_params, local_shards
from lightning_fedshard.core.mesh import build_federation_mesh
from lightning_fedshard.core.outer import NonFiniteOuterGradientError
from lightning_fedshard.core.topology import FederationTopology
from tests.launch import free_port
from tests.toy import make_net


class Rank:
    """One rank: an FSDP-wrapped toy net, AdamW, a started federation and its checkpointer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = FSDP(make_net(), device_id=torch.device("cpu"), use_orig_params=True)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=0.1)
        topology = FederationTopology(1, 1, 1)
        self.federation = Federation(FederationConfig(), build_federation_mesh(topology, "cpu").communicator())
        self.federation.start(local_shards(self.net), step=0)
        self.checkpointer = FederationCheckpointer(
            topology, False, 0, self.federation, self.net, lambda: free_unsharded_params(self.net)
        )

    def train_step(self) -> None:
        self.net(torch.randn(4, 6)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def checkpoint(self) -> dict:
        with FSDP.state_dict_type(self.net, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            return {"state_dict": self.net.state_dict(), "global_step": 1}

    def save(self, path: Path) -> None:
        self.checkpointer.save(self.checkpoint(), path, "full", [self.optimizer.state_dict()])

    def snapshot(self) -> list[torch.Tensor]:
        state = [v.clone() for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return [s.detach().clone() for s in local_shards(self.net)] + [self.federation.outer.anchor[0].clone()] + state


@pytest.fixture
def rank() -> Rank:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    r = Rank()
    r.train_step()
    return r


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_full_round_trip_restores_weights_anchor_and_inner_optimizer_exactly(rank, tmp_path):
    rank.save(tmp_path / "a.ckpt")
    before = rank.snapshot()
    rank.train_step()
    with torch.no_grad():
        rank.federation.outer.anchor[0].add_(1.0)
    assert any(not torch.equal(a, b) for a, b in zip(before, rank.snapshot()))
    metadata = rank.checkpointer.load(tmp_path / "a.ckpt", optimizers=[rank.optimizer])
    assert metadata["global_step"] == 1 and FEDSHARD_KEY not in metadata
    for a, b in zip(before, rank.snapshot()):
        assert torch.equal(a, b)


def test_interrupted_full_save_leaves_the_previous_checkpoint_intact(rank, tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    rank.save(path)
    sha = _sha(path)

    def crash(obj, target):
        Path(target).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module, "_save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        rank.save(path)
    assert _sha(path) == sha
    monkeypatch.undo()
    rank.train_step()
    rank.save(path)  # the next save replaces it and the leftover
    assert _sha(path) != sha and not (tmp_path / ".last.ckpt.partial").exists()


def test_interrupted_sharded_save_leaves_the_previous_checkpoint_intact(rank, tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    with FSDP.state_dict_type(rank.net, StateDictType.SHARDED_STATE_DICT):
        rank.checkpointer.save({"state_dict": rank.net.state_dict()}, path, "sharded", [rank.optimizer.state_dict()])
    files = {p.relative_to(path): _sha(p) for p in path.rglob("*") if p.is_file()}

    def crash(state, target):
        raise OSError("killed mid-save")

    monkeypatch.setattr(ckpt_module, "_distributed_checkpoint_save", crash)
    with (
        pytest.raises(OSError, match="killed mid-save"),
        FSDP.state_dict_type(rank.net, StateDictType.SHARDED_STATE_DICT),
    ):
        rank.checkpointer.save({"state_dict": rank.net.state_dict()}, path, "sharded", [])
    assert {p.relative_to(path): _sha(p) for p in path.rglob("*") if p.is_file()} == files


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
    with pytest.raises(ValueError, match="holds no 'state_dict'"):
        export_consensus(tmp_path / "a.ckpt", tmp_path / "out")


def test_layout_differences_name_dtype_and_topology():
    saved = {"world_size": 4, "num_groups": 2, "shard_dtypes": ["bfloat16"]}
    current = {"world_size": 8, "num_groups": 2, "shard_dtypes": ["float32"]}
    assert layout_differences(saved, current) == [
        "world_size: checkpoint 4, this run 8",
        "shard_dtypes: checkpoint ['bfloat16'], this run ['float32']",
    ]


def test_storage_options_are_rejected():
    with pytest.raises(TypeError, match="storage_options=...\\)` is not supported"):
        FLFSDPStrategy().save_checkpoint({}, "a.ckpt", storage_options={"x": 1})


def test_strategy_rejects_unknown_nonfinite_policy():
    with pytest.raises(ValueError, match="`on_nonfinite` must be one of"):
        FLFSDPStrategy(on_nonfinite="ignore")


def test_no_save_while_handling_a_failed_sync_or_a_dead_peer():
    assert "non-finite" in unsafe_to_save(NonFiniteOuterGradientError([1], 2, 7))
    dead = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert is_peer_failure(dead) and "peer rank" in unsafe_to_save(dead)
    assert unsafe_to_save(ValueError("user bug")) is None and unsafe_to_save(None) is None


# -- export ----------------------------------------------------------------------------------------------------------


def test_export_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_consensus(tmp_path / "nope.ckpt", tmp_path / "out")
    torch.save({"state_dict": make_net().state_dict()}, tmp_path / "a.ckpt")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is an existing file"):
        export_consensus(tmp_path / "a.ckpt", tmp_path / "file")
    with pytest.raises(RuntimeError, match="size mismatch"):
        export_consensus(tmp_path / "a.ckpt", tmp_path / "out", module=nn.Sequential(nn.Linear(2, 2)))


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
