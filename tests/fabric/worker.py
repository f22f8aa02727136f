"""One rank of the Fabric tests: a plain Fabric training loop over the toy model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader

import lightning_fedshard.fabric
from tests.toy import IndexedRegression, loss_fn, make_net


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
        return {f"net.{k}": v.clone() for k, v in module.state_dict().items()}


def run(spec: dict[str, Any], root: Path) -> None:
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    cls = (
        lightning_fedshard.fabric.FLHSDPStrategy
        if spec["strategy"] == "fl_hsdp"
        else lightning_fedshard.fabric.FLFSDPStrategy
    )
    kwargs = {k: spec[k] for k in ("num_groups", "shard_size", "sync_every", "outer_optimizer") if k in spec}
    strategy = spec["strategy"] if spec.get("by_name") else cls(**kwargs)
    fabric = L.Fabric(
        accelerator="cpu", devices=int(os.environ["DEVICES"]), num_nodes=int(os.environ["NUM_NODES"]), strategy=strategy
    )
    fabric.launch()
    torch.manual_seed(1000 + rank)  # different on every rank: the strategy must make them equal
    model = fabric.setup_module(make_net())
    initial = full_state_dict(model._forward_module)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    )
    loader = fabric.setup_dataloaders(DataLoader(IndexedRegression(), batch_size=spec["batch_size"], shuffle=True))
    micro_batches, steps = [], 0
    stats = []
    for idx, x, y in loader:
        if steps == spec["max_steps"]:
            break
        micro_batches.append(idx.tolist())
        fabric.backward(loss_fn(model, x, y))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if fabric.strategy.last_sync_stats is not None:
            stats.append(fabric.strategy.last_sync_stats.num_syncs)
    last = fabric.strategy.finish()
    torch.save(
        {
            "micro_batches": micro_batches,
            "initial": initial,
            "final": full_state_dict(model._forward_module),
            "syncs_seen": sorted(set(stats)),
            "final_sync": None if last is None else last.num_syncs,
            "strategy_type": type(fabric.strategy).__name__,
        },
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        run(spec, Path(sys.argv[2]))
