"""One rank of the simulator's exactness test: runs scenarios with the Trainer's ``fl_fsdp2`` strategy, one rank per
group, and saves the consensus it ends with. The test runs the same scenarios with the simulator."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_fedshard
from benchmarks.harness.config import topology_from_record
from lightning_fedshard.core.step.participation import pace_schedule
from tests.toy import IndexedRegression, loss_fn, make_net

#: Federation options a scenario may set (the rest of its keys set up the Trainer and the data).
FEDERATION_KEYS = ("sync_every", "outer_optimizer", "fragments", "sync_delay", "merge_alpha", "reduce_dtype",
                   "error_feedback", "eager_updates")  # fmt: skip


class Module(L.LightningModule):
    """The toy regression with dropout on its inputs (so each group's random draws must be its own)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.net = make_net()
        self.drop = torch.nn.Dropout(0.1)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = loss_fn(self.net, self.drop(x), y)
        self.log("train_loss", loss, sync_dist=True)  # a collective at every step the group trains
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", loss_fn(self.net, x, y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


def federation_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The scenario's federation options, as a strategy or ``FederationConfig`` takes them."""
    options = {k: spec[k] for k in FEDERATION_KEYS if k in spec}
    if "outer_topology" in spec:
        options["outer_topology"] = topology_from_record(spec["outer_topology"])
    if "pace" in spec:
        options["pace"] = lightning_fedshard.Pace(**{**spec["pace"], "speeds": tuple(spec["pace"]["speeds"])})
    return options


def trainer_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The scenario's Trainer arguments, the same for the Trainer run and the simulation."""
    return dict(
        max_steps=spec["max_steps"],
        accumulate_grad_batches=spec.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=spec.get("val_check_interval"),
        limit_val_batches=2,
    )


def loaders(spec: dict[str, Any]) -> tuple[DataLoader, DataLoader | None]:
    """Training data (shuffled: each group's sampler order must match) and validation data."""
    train = DataLoader(IndexedRegression(), batch_size=4, shuffle=True)
    val = DataLoader(IndexedRegression(64, seed=7), batch_size=8) if spec.get("val_check_interval") else None
    return train, val


def run(spec: dict[str, Any], root: Path) -> None:
    world = int(os.environ["DEVICES"]) * int(os.environ["NUM_NODES"])
    torch.manual_seed(0)
    module = Module()
    strategy = lightning_fedshard.FLFSDP2Strategy(num_groups=world, **federation_options(spec))
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, **trainer_options(spec))
    trainer.fit(module, *loaders(spec))
    final = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        pace = pace_schedule(trainer.strategy.runtime.federation.participation)  # type: ignore[attr-defined]
        merges = pace.merges if pace is not None else None
        torch.save({"final": final, "metrics": metrics, "merges": merges}, root / f"{spec['name']}.pt")


if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        run(spec, Path(sys.argv[2]))


class ToyData(L.LightningDataModule):
    """The scenarios' data as a data module (for the command line)."""

    def train_dataloader(self) -> DataLoader:
        return loaders({})[0]

    def val_dataloader(self) -> DataLoader:
        return loaders({"val_check_interval": 1})[1]  # type: ignore[return-value]
