"""One rank of a multi-process test: runs the scenarios given as JSON and saves what each rank saw."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

import lightning_fedshard
from benchmarks.harness.config import topology_from_record
from lightning_fedshard.checkpoint.checkpointer import fsdp_state_dict_type
from lightning_fedshard.core.backends import fsdp
from tests import runtime_spy
from tests.toy import IndexedRegression, loss_fn, make_net

runtime_spy.install()

STRATEGIES = {
    "fl_fsdp": lightning_fedshard.FLFSDPStrategy,
    "fl_hsdp": lightning_fedshard.FLHSDPStrategy,
    "fl_fsdp2": lightning_fedshard.FLFSDP2Strategy,
    "fl_hsdp2": lightning_fedshard.FLHSDP2Strategy,
}


class PlainCPUFSDP(FSDPStrategy):
    """Lightning's stock FSDPStrategy over all ranks, with the one change FSDP needs to run on the CPU."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)

    def local_shards(self) -> list[torch.Tensor]:
        return fsdp.local_shards(self.model)

    def lightning_module_state_dict(self):
        # Lightning asks FSDP to offload the full state dict to the CPU, which segfaults for a model on the CPU.
        with fsdp_state_dict_type(self.model, "full"):
            return self.model.state_dict()


class Module(L.LightningModule):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.net = make_net()
        self.micro_batches: list[list[int]] = []
        self.val_shards: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.micro_batches.append(idx.tolist())
        loss = loss_fn(self.net, x, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, x, y = batch
        self.log("val_loss", loss_fn(self.net, x, y), sync_dist=True)

    def configure_model(self):
        if self.spec.get("own_sharding"):  # FSDP2 sharding written by the user, on the strategy's mesh
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

    def configure_optimizers(self):
        if self.spec["inner"] == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.spec["lr"])
        return torch.optim.AdamW(self.parameters(), lr=self.spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)


def _flat_shards(trainer: L.Trainer) -> torch.Tensor:
    return torch.cat([s.detach().reshape(-1).clone() for s in trainer.strategy.local_shards()])


def _full_state_dict(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


class Probe(L.Callback):
    """A user's callback: what it sees of the shards at each sync step and when training ends."""

    def __init__(self, sync_every: int) -> None:
        self.sync_every = sync_every
        self.at_sync: dict[int, torch.Tensor] = {}
        self.at_train_end: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.sync_every == 0:
            self.at_sync[trainer.global_step] = _flat_shards(trainer)

    def on_train_end(self, trainer, pl_module):
        self.at_train_end = _flat_shards(trainer)


class Recorder(L.Callback):
    def __init__(self, spec: dict[str, Any], out: Path) -> None:
        self.spec, self.out = spec, out
        self.shards_at: dict[int, torch.Tensor] = {}
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = _full_state_dict(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.spec["accumulate"] == 0:  # the weights after the previous step and its sync
            self.shards_at[trainer.global_step] = _flat_shards(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.spec.get("mid_ckpt_step") == trainer.global_step and (batch_idx + 1) % self.spec["accumulate"] == 0:
            trainer.save_checkpoint(self.out / "mid.ckpt")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        # outside the forward pass, where FSDP holds only the local shards
        if batch_idx == 0:
            pl_module.val_shards.append((trainer.global_step, _flat_shards(trainer)))

    def on_fit_end(self, trainer, pl_module):
        self.shards_at[-1] = _flat_shards(trainer)


def _num_syncs(trainer: L.Trainer) -> int | None:
    federation = getattr(trainer.strategy, "federation", None)
    return federation.outer.num_syncs if federation is not None and federation.started else None


def run(spec: dict[str, Any], root: Path) -> None:
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0 if spec.get("same_init") else 1000 + rank)
    module = Module(spec)
    if spec["strategy"] == "plain_fsdp":
        strategy: Any = PlainCPUFSDP()
    else:
        cls = STRATEGIES[spec["strategy"]]
        keys = ("num_groups", "shard_size", "sync_every", "outer_optimizer", "fragments", "sync_delay", "merge_alpha",
                "reduce_dtype", "error_feedback", "plan", "eager_updates")  # fmt: skip
        kwargs = {k: spec[k] for k in keys if k in spec}
        if "outer_topology" in spec:
            kwargs["outer_topology"] = topology_from_record(spec["outer_topology"])
        if spec.get("wrap_linear"):  # one FSDP unit per Linear layer, so the model can be cut into fragments
            kwargs["fsdp_modules" if spec["strategy"].endswith("2") else "auto_wrap_policy"] = {torch.nn.Linear}
        strategy = spec["strategy"] if spec.get("by_name") else cls(**kwargs)
    recorder = Recorder(spec, out)
    callbacks: list[L.Callback] = [recorder]
    probe = Probe(spec.get("sync_every", 8))
    if "order" in spec:  # a user callback and ModelCheckpoint, in the order the spec gives
        every_sync = ModelCheckpoint(
            dirpath=out / "ckpts", filename="{step}", every_n_train_steps=spec["sync_every"], save_top_k=-1
        )
        pair = [probe, every_sync] if spec["order"] == "user_first" else [every_sync, probe]
        callbacks = pair + callbacks
    runtime_spy.take()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy=strategy,
        max_steps=spec["max_steps"],
        accumulate_grad_batches=spec["accumulate"],
        callbacks=callbacks,
        logger=CSVLogger(out, name="csv") if spec.get("csv") else False,
        log_every_n_steps=1,
        enable_checkpointing="order" in spec,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=spec.get("val_check_interval"),
        limit_val_batches=2,
    )
    if isinstance(strategy, str):  # the registered name must resolve to our class
        assert type(trainer.strategy) is STRATEGIES[strategy]
    data = DataLoader(IndexedRegression(), batch_size=spec["batch_size"])
    val = DataLoader(IndexedRegression(64, seed=7), batch_size=8) if spec.get("val_check_interval") else None
    trainer.fit(module, data, val)
    final = _full_state_dict(trainer)
    trainer.save_checkpoint(out / "final.ckpt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save(
        {
            "micro_batches": module.micro_batches,
            "shards_at": recorder.shards_at,
            "val_shards": module.val_shards,
            "initial": recorder.initial,
            "final": final,
            "metrics": metrics,
            "global_step": trainer.global_step,
            "probe_at_sync": probe.at_sync,
            "probe_at_train_end": probe.at_train_end,
            "runtime_calls": runtime_spy.take(),
            "num_syncs": _num_syncs(trainer),
            "callback_order": [type(c).__name__ for c in trainer.callbacks],
            "fragment_names": getattr(trainer.strategy, "fragment_parameter_names", None),
            "plan_report": getattr(trainer.strategy, "plan_report", None),
            "fsdp2_units": sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule)),
        },
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    for spec in specs:
        run(spec, Path(sys.argv[2]))
