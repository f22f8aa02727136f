"""One rank of the "groups never meet between syncs" test: a Trainer with its defaults, every collective recorded.

Each collective is recorded with the phase of training it happened in (``tests/collective_spy.py``):

- ``between``: inside a training step that ends without a sync (from the start of the epoch loop's ``advance``
  to the end of the runtime's ``after_optimizer_step`` that ran no sync), and anything else until the next sync;
- ``sync``: inside a runtime call that ran a sync (``after_optimizer_step`` returning statistics, ``finish``);
- ``boundary``: after a sync (or at the start of training) until the next training step begins, and from the end of
  an epoch's batches: epoch-end hooks and metrics, checkpoints and validation that fall on a sync step;
- ``validation``: between ``on_validation_start`` and ``on_validation_end``;
- ``outside``: set-up before training and everything after it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_fedshard
from tests import collective_spy as spy
from tests.toy import IndexedRegression, loss_fn, make_net

spy.install()
spy.label_runtime_calls()

STRATEGIES = {
    "fl_fsdp": lightning_fedshard.FLFSDPStrategy,
    "fl_hsdp": lightning_fedshard.FLHSDPStrategy,
    "fl_fsdp2": lightning_fedshard.FLFSDP2Strategy,
    "fl_hsdp2": lightning_fedshard.FLHSDP2Strategy,
}


class Module(L.LightningModule):
    def __init__(self, sync_dist: bool) -> None:
        super().__init__()
        self.sync_dist = sync_dist
        self.net = make_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = loss_fn(self.net, x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.sync_dist)
        self.log("train_loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", loss_fn(self.net, x, y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ManualModule(Module):
    """Steps its optimizer itself (manual optimization)."""

    def __init__(self, sync_dist: bool) -> None:
        super().__init__(sync_dist)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


class Phases(L.Callback):
    """Marks the phases the Trainer's hooks show: the start of training, validation, the end of training."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        spy.set_phase("boundary", trainer.global_step)
        advance = trainer.fit_loop.epoch_loop.advance

        def advance_marked(*args: Any, **kwargs: Any) -> Any:
            spy.set_phase("between", trainer.global_step)  # a training step begins
            return advance(*args, **kwargs)

        trainer.fit_loop.epoch_loop.advance = advance_marked  # type: ignore[method-assign]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        spy.set_phase("boundary", trainer.global_step)  # every group ends the epoch at this step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = spy.current_phase()
        spy.set_phase("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        spy.set_phase(self._before)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        spy.set_phase("outside")


def run(spec: dict[str, Any], root: Path) -> None:
    out = root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)
    spy.set_phase("outside", -1)
    spy.take()
    strategy: Any = spec["strategy"]
    if spec.get("kwargs") or spec.get("pace"):
        pace = lightning_fedshard.Pace(speeds=tuple(spec["pace"])) if spec.get("pace") else None
        strategy = STRATEGIES[strategy](**spec.get("kwargs", {}), pace=pace)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["DEVICES"]),
        num_nodes=int(os.environ["NUM_NODES"]),
        strategy=strategy,
        max_steps=spec["max_steps"],
        val_check_interval=spec["val_check_interval"],
        limit_val_batches=2,
        log_every_n_steps=1,
        default_root_dir=out,
        callbacks=[Phases(), *spec_callbacks(spec)],
        **spec.get("trainer", {}),
    )
    data = DataLoader(IndexedRegression(), batch_size=4)
    val = DataLoader(IndexedRegression(64, seed=7), batch_size=8)
    module = (ManualModule if spec.get("manual") else Module)(spec["sync_dist"])
    if spec.get("manual"):  # refused when `fit` starts, on every rank, before anything is set up
        try:
            trainer.fit(module, data, val)
        except ValueError as error:
            torch.save({"error": str(error), "global_step": trainer.global_step}, out / f"rank{rank}.pt")
            return
    trainer.fit(module, data, val)
    runtime = trainer.strategy.runtime
    groups = [runtime.topology.group_ranks(g) for g in range(runtime.topology.num_groups)]
    records = spy.take()
    torch.save(
        {
            "records": [(c.op, c.ranks, c.phase, c.step) for c in records],
            "groups": groups,
            "sync_every": runtime.config.sync_every,
            "global_step": trainer.global_step,
            "num_syncs": trainer.strategy.federation.outer.num_syncs,
            "checkpoints": sorted(p.name for p in out.rglob("step=*.ckpt")),
        },
        out / f"rank{rank}.pt",
    )


def spec_callbacks(spec: dict[str, Any]) -> list[L.Callback]:
    if "checkpoint_interval_s" not in spec:
        return []
    interval = timedelta(seconds=spec["checkpoint_interval_s"])
    return [ModelCheckpoint(train_time_interval=interval, save_top_k=-1, filename="{step}")]


if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        run(spec, Path(sys.argv[2]))
