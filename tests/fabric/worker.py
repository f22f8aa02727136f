"""One rank of the Fabric tests: a plain Fabric training loop over the toy model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader

import lightning_fedshard.fabric
from tests import collective_spy, runtime_spy
from tests.toy import IndexedRegression, loss_fn, make_net

runtime_spy.install()
collective_spy.install()
collective_spy.label_runtime_calls()


STRATEGIES = {
    "fl_fsdp": lightning_fedshard.fabric.FLFSDPStrategy,
    "fl_hsdp": lightning_fedshard.fabric.FLHSDPStrategy,
    "fl_fsdp2": lightning_fedshard.fabric.FLFSDP2Strategy,
    "fl_hsdp2": lightning_fedshard.fabric.FLHSDP2Strategy,
}


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank (FSDP1 or FSDP2)."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        state_dict = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        return {f"net.{k}": v.clone() for k, v in state_dict.items()}
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
        return {f"net.{k}": v.clone() for k, v in module.state_dict().items()}


def run(spec: dict[str, Any], root: Path) -> None:
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    cls = STRATEGIES[spec["strategy"]]
    keys = ("num_groups", "shard_size", "sync_every", "outer_optimizer", "fragments", "sync_delay", "merge_alpha",
            "reduce_dtype", "eager_updates")  # fmt: skip
    kwargs = {k: spec[k] for k in keys if k in spec}
    if spec.get("gossip"):  # (peers, seed) of a gossip mixing
        kwargs["outer_topology"] = lightning_fedshard.Gossip(*spec["gossip"])
    if spec.get("pace"):  # relative speeds of a per-group pace
        kwargs["pace"] = lightning_fedshard.Pace(speeds=tuple(spec["pace"]))
    if spec.get("wrap_linear"):  # one FSDP unit per Linear layer, so the model can be cut into fragments
        kwargs["fsdp_modules" if spec["strategy"].endswith("2") else "auto_wrap_policy"] = {torch.nn.Linear}
    strategy = spec["strategy"] if spec.get("by_name") else cls(**kwargs)
    runtime_spy.take()
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
    micro_batches, steps, trained = [], 0, []
    stats = []
    collective_spy.take()
    for idx, x, y in loader:
        if steps == spec["max_steps"]:
            break
        collective_spy.set_phase("between", steps)  # a training step of the loop begins
        micro_batches.append(idx.tolist())
        if fabric.strategy.trains():  # False only for a slow group's last steps of a round (a per-group pace)
            fabric.backward(loss_fn(model, x, y))
            trained.append(steps + 1)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if fabric.strategy.last_sync_stats is not None:
            stats.append(fabric.strategy.last_sync_stats.num_syncs)
    last = fabric.strategy.finish()
    collective_spy.set_phase("outside")
    topology = fabric.strategy.runtime.topology
    torch.save(
        {
            "micro_batches": micro_batches,
            "trained": trained,
            "initial": initial,
            "final": full_state_dict(model._forward_module),
            "syncs_seen": sorted(set(stats)),
            "final_sync": None if last is None else last.num_syncs,
            "strategy_type": type(fabric.strategy).__name__,
            "runtime_calls": runtime_spy.take(),
            "num_syncs": fabric.strategy.federation.outer.num_syncs,
            "fragment_names": fabric.strategy.fragment_parameter_names,
            "collectives": [(c.op, c.ranks, c.phase) for c in collective_spy.take()],
            "groups": [topology.group_ranks(g) for g in range(topology.num_groups)],
        },
        out / f"rank{rank}.pt",
    )


def _train(spec: dict[str, Any], steps: range, resume_from: Path | None = None, save_at: Path | None = None):
    """Fresh Fabric, model and optimizer; batches chosen from (step, rank) so a resumed run sees the same data."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    strategy = STRATEGIES[spec.get("strategy", "fl_fsdp")](
        num_groups=2, sync_every=2, outer_optimizer="nesterov", state_dict_type=spec["state_dict_type"]
    )
    fabric = L.Fabric(
        accelerator="cpu", devices=int(os.environ["DEVICES"]), num_nodes=int(os.environ["NUM_NODES"]), strategy=strategy
    )
    fabric.launch()
    torch.manual_seed(1000 + rank)
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95)))
    state = {"model": model, "optimizer": optimizer, "step": steps.start}
    if resume_from is not None:
        rest = fabric.load(resume_from, state)
        assert not rest, rest
        assert state["step"] == steps.start and fabric.strategy.num_steps == steps.start
    data = IndexedRegression()
    for step in steps:
        idx = (torch.arange(4) + 4 * (rank + world * step)) % len(data)
        fabric.backward(loss_fn(model, data.x[idx], data.y[idx]))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if save_at is not None and step + 1 == steps.stop:
            fabric.save(save_at, state)
    fabric.strategy.finish()
    shards = torch.cat([p.detach().reshape(-1).clone() for p in fabric.strategy.local_shards()])
    return shards, full_state_dict(model._forward_module)


def run_resume(spec: dict[str, Any], root: Path) -> None:
    """Uninterrupted 7 steps versus 3 steps, save (between syncs), then a fresh setup that loads and runs 4 more."""
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ckpt"
    straight, straight_full = _train(spec, range(0, 7))
    _train(spec, range(0, 3), save_at=path)
    resumed, resumed_full = _train(spec, range(3, 7), resume_from=path)
    consensus = torch.load(path, weights_only=False)["model"] if path.is_file() else None  # the user's key
    torch.save({"straight": straight, "resumed": resumed, "straight_full": straight_full,
                "resumed_full": resumed_full, "consensus_keys": None if consensus is None else sorted(consensus)},
               out / f"rank{os.environ['RANK']}.pt")  # fmt: skip


def run_unchecked_pace(spec: dict[str, Any], root: Path) -> None:
    """A loop that never asks ``fabric.strategy.trains()``, as adding ``pace=`` to an existing script gives."""
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    strategy = STRATEGIES[spec["strategy"]](num_groups=2, sync_every=4, reduce_dtype="float32",
                                            pace=lightning_fedshard.Pace(speeds=(1.0, 0.5)))  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    data = IndexedRegression()
    error, steps = None, 0
    try:
        for step in range(8):
            idx = torch.arange(4) + 4 * (rank + 2 * step)
            fabric.backward(loss_fn(model, data.x[idx], data.y[idx]))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    except RuntimeError as exc:  # the slow group, at its first skipped step; the fast one then finds it gone
        error = str(exc)
    torch.save({"error": error, "steps": steps}, out / f"rank{rank}.pt")
    os._exit(0)  # the other group may still wait in a collective: leave without tearing down


if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        if spec.get("unchecked_pace"):
            run_unchecked_pace(spec, Path(sys.argv[2]))
        else:
            (run_resume if spec.get("resume") else run)(spec, Path(sys.argv[2]))
