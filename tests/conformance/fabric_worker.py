"""One rank of the Fabric conformance runs: Fabric's checkpoint and collective calls, one strategy after another.

Each strategy (Fabric's ``"ddp"`` and the four federation strategies, 2 groups each) trains the toy model a few steps
with gradient clipping by norm, then saves, loads and reduces the way Fabric's documentation shows. Each group sees
the same batches at each in-group position, so the groups train exactly like DDP. What each rank saw is saved for the
test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_fedshard.fabric
from tests.conformance.trainer_worker import ByPosition
from tests.toy import IndexedRegression, loss_fn, make_net

NODES, DEVICES = int(os.environ["NUM_NODES"]), int(os.environ["DEVICES"])
RANK = int(os.environ["RANK"])
STEPS = 4


def strategies() -> dict[str, Any]:
    exact = {"sync_every": 2, "reduce_dtype": "float32", "state_dict_type": "full"}
    fabric = lightning_fedshard.fabric
    return {
        "ddp": lambda: "ddp",
        "fl_fsdp": lambda: fabric.FLFSDPStrategy(**exact),
        "fl_hsdp": lambda: fabric.FLHSDPStrategy(shard_size=1, **exact),
        "fl_fsdp2": lambda: fabric.FLFSDP2Strategy(**exact),
        "fl_hsdp2": lambda: fabric.FLHSDP2Strategy(shard_size=1, **exact),
        "fl_fsdp-sharded": lambda: fabric.FLFSDPStrategy(**{**exact, "state_dict_type": "sharded"}),
    }


def weights(fabric: L.Fabric, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights on global rank 0 (a federation's consensus), as plain parameter names."""
    strategy = fabric.strategy
    if hasattr(strategy, "runtime"):
        return {k: v.clone() for k, v in strategy.runtime.checkpointer.consensus_state_dict("full").items()}
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def setup(fabric: L.Fabric) -> tuple[Any, Any]:
    model = fabric.setup_module(make_net())
    return model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))


def run(make: Any, root: Path) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, num_nodes=NODES, strategy=make())
    fabric.launch()
    torch.manual_seed(0)
    model, optimizer = setup(fabric)
    data = IndexedRegression(64)
    loader = DataLoader(data, batch_size=4, sampler=ByPosition(len(data)))
    norms = []
    for step, (_, x, y) in enumerate(loader):
        if step == STEPS:
            break
        fabric.backward(loss_fn(model, x, y))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.05)))
        optimizer.step()
        optimizer.zero_grad()
    if hasattr(fabric.strategy, "finish"):
        fabric.strategy.finish()
    out: dict[str, Any] = {"norms": norms, "trained": weights(fabric, model)}

    path = root / "full.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    if fabric.global_rank == 0:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        out["saved_keys"] = sorted(saved)
        out["saved_model"] = saved["model"]
        out["saved_optimizer_keys"] = sorted(saved["optimizer"])
    out["whole_keys"] = sorted(fabric.load(path))
    out["weights_only_rest"] = sorted(fabric.load(path, {"model": model}))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    out["resume_rest"] = sorted(fabric.load(path, state))
    out["resumed_step"] = state["step"]

    raw = root / "pretrained.pt"
    if fabric.global_rank == 0:
        torch.manual_seed(123)
        torch.save(make_net().state_dict(), raw)
    fabric.barrier()
    fabric.load_raw(raw, model)
    out["raw"] = torch.load(raw, weights_only=True)
    out["after_load_raw"] = weights(fabric, model)
    out["all_reduce"] = float(fabric.all_reduce(torch.tensor(float(RANK)), reduce_op="sum"))
    fabric.barrier()
    return out


def run_sharded(make: Any, root: Path) -> dict[str, Any]:
    """A sharded save: the DCP files hold the model under the user's key."""
    from lightning_fedshard.export import read_whole_checkpoint

    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, num_nodes=NODES, strategy=make())
    fabric.launch()
    torch.manual_seed(0)
    model, optimizer = setup(fabric)
    path = root / "sharded"
    fabric.save(path, {"net": model, "optimizer": optimizer, "step": 1})
    out: dict[str, Any] = {"trained": weights(fabric, model)}
    if fabric.global_rank == 0:
        whole = read_whole_checkpoint(path, weights_only=False)
        out["saved_keys"] = sorted(whole)
        out["saved_model"] = whole["net"]
    state = {"net": model, "optimizer": optimizer, "step": 0}
    out["resume_rest"] = sorted(fabric.load(path, state))
    out["resumed_step"] = state["step"]
    fabric.barrier()
    return out


def main(names: list[str], root: Path) -> None:
    make = strategies()
    results = {}
    for name in names:
        print(f"Fabric under {name}", flush=True)  # in the rank's log if one fails
        where = root / name
        where.mkdir(parents=True, exist_ok=True)
        results[name] = (run_sharded if name.endswith("sharded") else run)(make[name], where)
    torch.save(results, root / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
