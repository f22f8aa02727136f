"""One rank of the Trainer conformance runs: Lightning's common callbacks and settings, one strategy after another.

Every scenario runs under Lightning's ``"ddp"`` (the oracle of what a user expects) and under each federation strategy,
with the same per-rank inputs: the metrics the callbacks decide on are scripted (by epoch, step and rank), not learned,
so the decisions must come out as under DDP unless the docs say why not. What each rank saw is saved for the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, Sampler

import lightning_fedshard
from tests.toy import IndexedRegression, loss_fn, make_net

NODES, DEVICES = int(os.environ["NUM_NODES"]), int(os.environ["DEVICES"])
RANK = int(os.environ["RANK"])
#: Steps between syncs: an epoch (4 batches) ends on a sync, so every scenario can compare the consensus with DDP.
SYNC_EVERY = 2
BATCHES, EPOCHS = 4, 5


def strategies() -> dict[str, Any]:
    """Lightning's DDP and the four federation strategies, 2 groups each (FL+HSDP: 2 replicas of 1 shard)."""
    exact = {"sync_every": SYNC_EVERY, "reduce_dtype": "float32"}
    return {
        "ddp": lambda: "ddp",
        "fl_fsdp": lambda: lightning_fedshard.FLFSDPStrategy(**exact),
        "fl_hsdp": lambda: lightning_fedshard.FLHSDPStrategy(shard_size=1, **exact),
        "fl_fsdp2": lambda: lightning_fedshard.FLFSDP2Strategy(**exact),
        "fl_hsdp2": lambda: lightning_fedshard.FLHSDP2Strategy(shard_size=1, **exact),
    }


class ByPosition(Sampler[int]):
    """The same samples for the ranks at one in-group position of every group: each group sees the same batches.

    Under DDP over all ranks the mean gradient is then the mean over the positions, which is what each group's FSDP
    computes: the groups train exactly like DDP, and a sync of equal groups changes nothing.
    """

    def __init__(self, size: int) -> None:
        self.indices = list(range(RANK % DEVICES, size, DEVICES))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Scripted(L.LightningModule):
    """The toy regression model; logs the metrics a scenario scripts (by epoch, global step and rank)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.lr = 0.5  # the attribute `lr_find` tunes
        self.net = make_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = loss_fn(self.net, x, y)
        step = self.trainer.global_step
        if "train_metric" in self.spec:  # a training metric logged at every step, the same on every rank
            self.log("train_metric", self.spec["train_metric"][step % len(self.spec["train_metric"])], sync_dist=True)
        if "rank_metric" in self.spec:  # a training metric that differs between the groups
            self.log("rank_metric", float(RANK), sync_dist=True)
        if "epoch_metric" in self.spec:  # an epoch's training metric: rank r logs its own row
            value = self.spec["epoch_metric"][RANK][self.current_epoch]
            self.log("epoch_metric", value, on_step=False, on_epoch=True, sync_dist=True)
        if self.spec.get("sleep"):
            time.sleep(self.spec["sleep"])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        schedule = self.spec.get("val_loss")
        value = schedule[min(self.current_epoch, len(schedule) - 1)] if schedule else loss_fn(self.net, *batch[1:])
        self.log("val_loss", value, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.spec.get("scheduler"):
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)}


def callbacks(spec: dict[str, Any]) -> list[L.Callback]:
    found: list[L.Callback] = []
    if "checkpoint" in spec:
        found.append(ModelCheckpoint(**spec["checkpoint"]))
    if "early_stopping" in spec:
        found.append(EarlyStopping(**spec["early_stopping"]))
    if spec.get("scheduler"):
        found.append(LearningRateMonitor(logging_interval="step"))
    return found


def trainer(strategy: Any, spec: dict[str, Any], root: Path, **overrides: Any) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=DEVICES,
        num_nodes=NODES,
        strategy=strategy,
        max_epochs=EPOCHS,
        limit_train_batches=BATCHES,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks(spec),
        logger=CSVLogger(root, name="logs", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    settings.update(spec.get("trainer", {}))
    settings.update(overrides)
    return L.Trainer(**settings)


def loaders() -> tuple[DataLoader, DataLoader]:
    train, val = IndexedRegression(64), IndexedRegression(32, seed=7)
    return (
        DataLoader(train, batch_size=4, sampler=ByPosition(len(train))),
        DataLoader(val, batch_size=8, sampler=ByPosition(len(val))),
    )


def consensus(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's weights on global rank 0: the consensus for a federation (collective), the model for DDP."""
    strategy = trainer.strategy
    if hasattr(strategy, "runtime"):
        return {k: v.clone() for k, v in strategy.lightning_module_state_dict().items()}
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


def checkpoint_callback(trainer: L.Trainer) -> dict[str, Any]:
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint):
        return {}
    last = callback.last_model_path
    trainer.strategy.barrier()  # global rank 0 removes a replaced checkpoint after the others went on
    return {
        "best": Path(callback.best_model_path).name,
        "best_k": sorted(Path(p).name for p in callback.best_k_models),
        "last_step": torch.load(last, map_location="cpu", weights_only=False)["global_step"] if last else None,
        "files": sorted(p.name for p in Path(callback.dirpath).glob("*.ckpt")),
    }


def run(make: Any, spec: dict[str, Any], root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Scripted(spec)
    t = trainer(make(), spec, root)
    train, val = loaders()
    if spec.get("lr_find"):
        result = Tuner(t).lr_find(
            module, train, val, min_lr=1e-3, max_lr=1.0, num_training=6, early_stop_threshold=None
        )
        return {"lr_find": result.results if result is not None else None, "global_step": t.global_step}
    t.fit(module, train, val)
    out: dict[str, Any] = {
        "global_step": t.global_step,
        "epoch": t.current_epoch,
        "should_stop": t.should_stop,
        "weights": consensus(t),
        **checkpoint_callback(t),
    }
    early = next((c for c in t.callbacks if isinstance(c, EarlyStopping)), None)
    if early is not None:
        out["stopped_epoch"] = early.stopped_epoch
    if spec.get("scheduler") and t.is_global_zero:
        out["metrics_csv"] = (root / "logs" / "version_0" / "metrics.csv").read_text()
    if spec.get("resume"):
        resumed = trainer(make(), spec, root, max_epochs=EPOCHS + 1)
        train, val = loaders()
        resumed.fit(Scripted(spec), train, val, ckpt_path="last")
        out["resumed_step"] = resumed.global_step
        out["resumed_weights"] = consensus(resumed)
    return out


def main(names: list[str], scenarios: dict[str, dict[str, Any]], root: Path) -> None:
    make = strategies()
    results = {}
    for scenario, spec in scenarios.items():
        for name in names:
            print(f"scenario {scenario} under {name}", flush=True)  # in the rank's log if one fails
            results[f"{scenario}/{name}"] = run(make[name], spec, root / scenario / name)
    torch.save(results, root / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
