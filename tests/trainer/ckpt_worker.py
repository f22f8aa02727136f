"""One rank of the checkpoint tests: runs the scenarios given as JSON (fits, resumes, failures) and saves what it saw.

Each optimizer step trains on samples chosen from the global step and the rank alone: Lightning's own loop replays or
skips batches of a non-resumable DataLoader when it resumes from a mid-epoch or epoch-end checkpoint (Lightning issues
#19815, #18060), which would hide what the strategy restores. The model has dropout, so resuming exactly also needs
each rank's RNG state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from benchmarks.harness.config import topology_from_record
from tests.toy import HIDDEN, IN, OUT, IndexedRegression, loss_fn
from tests.trainer.worker import STRATEGIES

BATCH_SIZE = 4


class Module(L.LightningModule):
    def __init__(self, world: int = 4, rank: int = 0, lr: float = 0.01) -> None:
        super().__init__()
        self.world, self.rank, self.lr = world, rank, lr
        self.after_optimizer_step = None  # set by the Recorder: runs between the optimizer step and the sync
        self.user_error_at_step: int | None = None  # set from the spec, see `on_train_batch_start`
        self.data = IndexedRegression(n=world * BATCH_SIZE)
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN),
            nn.Tanh(),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, OUT),
        )

    def on_train_batch_start(self, batch, batch_idx):
        # A user error whose words read like a failed collective. Not raised in `training_step`: FSDP1 stays in its
        # forward state after an error there, and any later state dict (`OnExceptionCheckpoint`'s) asserts.
        if self.global_step == self.user_error_at_step:
            raise RuntimeError("timeout reading shard from gloo nccl")

    def training_step(self, batch, batch_idx):
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.global_step))
        idx = order[self.rank * BATCH_SIZE : (self.rank + 1) * BATCH_SIZE]  # every rank its own samples
        return loss_fn(self.net, self.data.x[idx], self.data.y[idx])

    def lr_scheduler_step(self, scheduler, metric):
        # Lightning steps the LR scheduler after the optimizer step and before any `on_train_batch_end`.
        super().lr_scheduler_step(scheduler, metric)
        if self.after_optimizer_step is not None:
            self.after_optimizer_step(self.trainer)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _flat(tensors) -> torch.Tensor:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)  # FSDP2 optimizer state
    return torch.cat([t.detach().reshape(-1).clone().float() for t in local])


def _optimizer_flat(trainer: L.Trainer) -> torch.Tensor:
    optimizer = trainer.optimizers[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return _flat(v for p in params for _, v in sorted(optimizer.state[p].items()) if torch.is_tensor(v))


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


class Recorder(L.Callback):
    """Records shards at each step; injects failures (NaN, exceptions, a dying rank) where the spec says."""

    def __init__(self, spec: dict[str, Any], out: Path, rank: int) -> None:
        self.spec, self.out, self.rank = spec, out, rank
        self.shards_at: dict[int, torch.Tensor] = {}
        self.before_nan: dict[str, Any] = {}
        self.initial: torch.Tensor | None = None
        self.pending_at_save: dict[int, bool] = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = _flat(trainer.strategy.local_shards())
        pl_module.after_optimizer_step = self.after_optimizer_step

    def after_optimizer_step(self, trainer):
        # Every callback's `on_train_batch_end` comes after OuterSync's sync of the step; a checkpoint written after
        # the optimizer step, from the LightningModule's `lr_scheduler_step`, still has that sync due.
        step = trainer.global_step
        if self.spec.get("presync_ckpt_step") == step:
            trainer.save_checkpoint(self.out / f"presync{step}.ckpt")
        if self.spec.get("nan_at_step") == step:
            strategy = trainer.strategy
            self.before_nan = {
                "anchor": _flat(strategy.federation.outer.anchor),
                "shards": _flat(strategy.local_shards()),
                "ckpt_sha": _sha(self.out / "ckpts" / "step=2.ckpt"),
            }
            if strategy.mesh.group_index == 1:
                with torch.no_grad():
                    strategy.local_shards()[0][0] = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.shards_at[trainer.global_step] = _flat(trainer.strategy.local_shards())
        if self.spec.get("boundary_ckpt_step") == trainer.global_step:  # right after the sync of the previous step
            trainer.save_checkpoint(self.out / f"boundary{trainer.global_step}.ckpt")
        if self.spec.get("raise_at_step") == trainer.global_step:
            raise RuntimeError(f"injected failure at step {trainer.global_step}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.pending_at_save[trainer.global_step] = trainer.strategy.federation.pending is not None
        if self.spec.get("die_at_save_step") == trainer.global_step and self.rank == self.spec["dying_rank"]:
            (self.out.parent / "died_at").write_text(str(time.time()))
            os._exit(1)  # dies in the middle of a save, while the other ranks are in its collectives


def _strategy(spec: dict[str, Any]) -> Any:
    cls = STRATEGIES[spec["strategy"]]
    keys = ("num_groups", "shard_size", "on_nonfinite", "state_dict_type", "fragments", "sync_delay", "merge_alpha",
            "reduce_dtype", "error_feedback", "eager_updates")  # fmt: skip
    kwargs = {k: spec[k] for k in keys if k in spec}
    if spec.get("fragments", 1) > 1:  # one FSDP unit per Linear layer, so the model can be cut into fragments
        kwargs["fsdp_modules" if spec["strategy"].endswith("2") else "auto_wrap_policy"] = {nn.Linear}
    if "timeout_s" in spec:
        kwargs["timeout"] = timedelta(seconds=spec["timeout_s"])
    if "outer_topology" in spec:
        kwargs["outer_topology"] = topology_from_record(spec["outer_topology"])
    outer = spec.get("outer_optimizer", "nesterov")
    return cls(sync_every=spec.get("sync_every", 3), outer_optimizer=outer, **kwargs)


def _data() -> DataLoader:
    # Only drives the loop (see the module docstring). A generator of its own keeps iterator creation from drawing on
    # the global RNG, which dropout uses.
    return DataLoader(list(range(64)), batch_size=1, generator=torch.Generator().manual_seed(0))


def run(spec: dict[str, Any], root: Path) -> None:
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["NUM_NODES"]) * int(os.environ["DEVICES"])
    torch.manual_seed(1000 + rank)
    module = Module(world, rank)
    module.user_error_at_step = spec.get("user_error_at_step")
    recorder = Recorder(spec, out, rank)
    callbacks: list[L.Callback] = [recorder]
    if spec.get("ckpt"):
        every_step = ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        callbacks += [every_step, OnExceptionCheckpoint(dirpath=out, filename="on_exception")]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy=_strategy(spec),
        max_steps=spec.get("max_steps", 8),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(spec.get("ckpt")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=out,
    )
    ckpt_path = str(root / spec["resume_from"]) if spec.get("resume_from") else None
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, _data(), ckpt_path=ckpt_path)
        except Exception as e:  # the spec says whether one was expected; the test checks
            if not spec.get("expect_error"):
                raise
            error = f"{type(e).__name__}: {e}"
    strategy = trainer.strategy
    result = {
        "error": error,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "initial": recorder.initial,
        "shards_at": recorder.shards_at,
        "before_nan": recorder.before_nan,
        "final_shards": _flat(strategy.local_shards()),
        "final_anchor": _flat(strategy.federation.outer.anchor) if strategy.federation.started else None,
        "final_optimizer": _optimizer_flat(trainer),
        "global_step": trainer.global_step,
        "num_syncs": strategy.federation.outer.num_syncs if strategy.federation.started else 0,
        "pending_at_save": recorder.pending_at_save,
        "ckpt_sha_after": _sha(out / "ckpts" / "step=2.ckpt"),
    }
    if error is None and spec.get("state_dict_type", "full") == "full":  # a sharded one holds ShardedTensors
        result["consensus"] = {k: v.clone() for k, v in strategy.lightning_module_state_dict().items()}
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_DUMP_AFTER", "1e9")), exit=True)
    specs = json.loads(sys.argv[1])
    for spec in specs:
        start = time.perf_counter()
        run(spec, Path(sys.argv[2]))
        print(f"scenario {spec['name']}: {time.perf_counter() - start:.1f} s", flush=True)
