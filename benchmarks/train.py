"""One benchmark run on one emulated node: the example Llama on Shakespeare, through Lightning's multi-node path.

The driver (:mod:`benchmarks.run`) starts this script once per node, inside the node's network namespace, with
``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; Lightning's own launcher then re-executes it once per
further local rank (``Trainer(num_nodes=..., devices=...)``), exactly as on a real cluster.

Strategies (all from this package; ``num_groups=1`` is plain FSDP / HSDP over all ranks):

=========  ====================================================  ==============================
name       strategy                                              outer step
=========  ====================================================  ==============================
fsdp       ``FLFSDPStrategy(num_groups=1)``: FULL_SHARD over all  none
hsdp       ``FLHSDPStrategy(num_groups=1, shard_size=devices)``   none
fl_fsdp    ``FLFSDPStrategy(num_groups=num_nodes)``: group = node  every ``sync_every`` steps
fl_hsdp    ``FLHSDPStrategy(num_groups=G, shard_size=devices)``   every ``sync_every`` steps
=========  ====================================================  ==============================

Global rank 0 writes ``<out>/run.json`` (see :class:`BenchRecorder`) and Lightning's ``CSVLogger`` writes the
per-step metrics under ``<out>/csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

import lightning_fedshard  # noqa: F401  (registers the strategies)
from lightning_fedshard import FLFSDPStrategy, FLHSDPStrategy, OuterSync
from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule

STRATEGIES = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
LINK_COUNTER = "/sys/class/net/veth0/statistics/tx_bytes"


@dataclass
class RunConfig:
    """One benchmark run (the command line of this script)."""

    strategy: str
    num_nodes: int
    devices: int
    out: str
    cache_dir: str
    num_groups: int = 0
    """Federation groups of fl_hsdp (fl_fsdp always uses one per node; the baselines one in total)."""
    sync_every: int = 8
    outer_optimizer: str = "nesterov"
    max_steps: int = 64
    val_every: int = 16
    size: str = "xs"
    seq_len: int = 128
    batch_size: int = 8
    vocab_size: int = 4096
    lr: float = 3e-3
    max_train_windows: int | None = None
    max_val_windows: int = 64
    model_overrides: dict[str, int] = field(default_factory=dict)

    @property
    def federated(self) -> bool:
        return self.strategy.startswith("fl_")

    @property
    def groups(self) -> int:
        if self.strategy == "fl_fsdp":
            return self.num_nodes
        if self.strategy == "fl_hsdp":
            return self.num_groups
        return 1


def make_strategy(cfg: RunConfig) -> FLFSDPStrategy | FLHSDPStrategy:
    """The package's strategy for ``cfg.strategy``; the baselines are the same classes with one group."""
    common: dict[str, Any] = {
        "auto_wrap_policy": LlamaLM.wrap_policy(),
        "use_orig_params": True,
        "sync_every": cfg.sync_every,
        "outer_optimizer": cfg.outer_optimizer,
    }
    if cfg.strategy in ("fsdp", "fl_fsdp"):
        return FLFSDPStrategy(num_groups=cfg.groups, **common)
    if cfg.strategy in ("hsdp", "fl_hsdp"):
        return FLHSDPStrategy(num_groups=cfg.groups, shard_size=cfg.devices, **common)
    raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {cfg.strategy!r}.")


class NoOuterSync(OuterSync):
    """Stands in for the automatically attached :class:`OuterSync` in the FSDP / HSDP baselines.

    With one federation group an outer step has nothing to merge, but it would still copy the shards every sync and,
    with a momentum outer optimizer, change the weights; the baselines must be plain FSDP / HSDP, so every hook does
    nothing.
    """

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pass

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass


def _link_tx_bytes(trainer: L.Trainer) -> int | None:
    # One reader per node (the namespace's interface counts the whole node); None outside an emulated node.
    if trainer.local_rank != 0 or not os.path.exists(LINK_COUNTER):
        return None
    return int(Path(LINK_COUNTER).read_text())


@dataclass
class _Window:
    """Link bytes of a window delimited by two barriers (summed over nodes at the end)."""

    tx_start: int | None = None
    tx_bytes: int = 0

    def open(self, trainer: L.Trainer) -> None:
        dist.barrier()
        self.tx_start = _link_tx_bytes(trainer)
        # Without this second barrier, a rank that leaves the first one early could start sending before the
        # reader of its peer's node has read the counter, and those bytes would be missed.
        dist.barrier()

    def close(self, trainer: L.Trainer) -> int:
        dist.barrier()
        now = _link_tx_bytes(trainer)
        delta = 0 if now is None or self.tx_start is None else now - self.tx_start
        self.tx_bytes += delta
        return delta


class BenchRecorder(L.Callback):
    """Measures a run: a training clock that stops during validation, link bytes, syncs, validation, memory.

    Must come *before* :class:`OuterSync` in the callback list; :class:`AfterSync` comes after it. Link counters
    are read by local rank 0 of each node between world barriers (a barrier moves a few hundred bytes), so no
    rank has started the measured collective before the first reading or still has bytes of it in flight at the
    last.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.train = _Window()
        self.val = _Window()
        self.sync = _Window()
        self.t0 = 0.0
        self.paused = 0.0
        self.pause_start = 0.0
        self.steps: list[dict[str, float]] = []
        self.syncs: list[dict[str, float]] = []
        self.vals: list[dict[str, float]] = []
        self._sync_due = False

    def clock(self) -> float:
        """Seconds of training so far: wall time since training started, minus validation."""
        return time.perf_counter() - self.t0 - self.paused

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train.open(trainer)
        self.t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        self._sync_due = self.cfg.federated and strategy.federation.is_due(trainer.global_step)  # type: ignore[attr-defined]
        if self._sync_due:
            self.sync.open(trainer)
            self._sync_clock = self.clock()

    def after_sync(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Called by :class:`AfterSync` once the outer step of this batch (if any) has run."""
        step = trainer.global_step
        if self._sync_due:
            seconds = self.clock() - self._sync_clock
            tx = self.sync.close(trainer)
            self.syncs.append({"step": step, "seconds": seconds, "tx_bytes": tx})
        self.steps.append({"step": step, "clock": self.clock()})
        pl_module.log("bench/clock", self.clock(), on_step=True, rank_zero_only=True)
        pl_module.log("bench/tokens", float(step * self.tokens_per_step(trainer)), on_step=True, rank_zero_only=True)

    def tokens_per_step(self, trainer: L.Trainer) -> int:
        """Tokens all ranks together train on per optimizer step."""
        return trainer.world_size * self.cfg.batch_size * self.cfg.seq_len

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.t0:
            return
        self.pause_start = time.perf_counter()
        self.val.open(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.t0:
            return
        self.val.close(trainer)
        self.paused += time.perf_counter() - self.pause_start
        metrics = trainer.callback_metrics
        self.vals.append(
            {
                "step": trainer.global_step,
                "clock": self.clock(),
                "tokens": trainer.global_step * self.tokens_per_step(trainer),
                "val_loss": float(metrics["val_loss"]),
                "val_ppl": float(metrics["val_ppl"]),
                "val_bpb": float(metrics.get("val_bpb", float("nan"))),
            }
        )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # OuterSync's final sync (if training stopped mid-round) runs after this hook; runs here end on a sync.
        train_seconds = self.clock()
        self.train.close(trainer)
        mine = {
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "train_tx": self.train.tx_bytes,
            "val_tx": self.val.tx_bytes,
            "syncs": self.syncs,
        }
        every: list[dict[str, Any]] = [{} for _ in range(trainer.world_size)]
        dist.all_gather_object(every, mine)
        if trainer.global_rank == 0:
            self._write(trainer, pl_module, every, train_seconds)

    def _write(
        self, trainer: L.Trainer, pl_module: L.LightningModule, ranks: list[dict[str, Any]], train_seconds: float
    ) -> None:
        readers = [r for r in ranks if r["local_rank"] == 0]
        num_syncs = len(self.syncs)
        sync_tx = [sum(r["syncs"][i]["tx_bytes"] for r in readers) for i in range(num_syncs)]
        strategy = trainer.strategy
        result = {
            "config": asdict(self.cfg),
            "world_size": trainer.world_size,
            "num_parameters": pl_module.num_parameters(),  # type: ignore[operator]
            "bytes_per_value": 4,
            "topology": str(strategy.topology),  # type: ignore[attr-defined]
            "tokens_per_step": self.tokens_per_step(trainer),
            "train_seconds": train_seconds,
            "steps": self.steps,
            "vals": self.vals,
            "syncs": [{**s, "tx_bytes": tx} for s, tx in zip(self.syncs, sync_tx)],
            "link_tx_train": sum(r["train_tx"] for r in readers),
            "link_tx_val": sum(r["val_tx"] for r in readers),
            "link_tx_per_node": [r["train_tx"] - r["val_tx"] for r in readers],
            "maxrss_mib": [r["maxrss_mib"] for r in ranks],
            "versions": {"torch": torch.__version__, "lightning": L.__version__},
        }
        Path(self.cfg.out, "run.json").write_text(json.dumps(result, indent=1))


class AfterSync(L.Callback):
    """Placed after :class:`OuterSync` so that :class:`BenchRecorder` sees each step with its outer step done."""

    def __init__(self, recorder: BenchRecorder) -> None:
        self.recorder = recorder

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.recorder.after_sync(trainer, pl_module)


def run(cfg: RunConfig) -> None:
    """Train once; every rank of every node calls this."""
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True, verbose=False)
    model = LlamaLM(size=cfg.size, vocab_size=cfg.vocab_size, max_seq_len=cfg.seq_len, lr=cfg.lr, **cfg.model_overrides)  # type: ignore[arg-type]
    data = ShakespeareDataModule(
        cache_dir=cfg.cache_dir,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        vocab_size=cfg.vocab_size,
        split="iid",
        max_train_windows=cfg.max_train_windows,
        max_val_windows=cfg.max_val_windows,
    )
    recorder = BenchRecorder(cfg)
    outer = OuterSync() if cfg.federated else NoOuterSync()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=make_strategy(cfg),
        precision="32-true",
        max_steps=cfg.max_steps,
        val_check_interval=cfg.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[recorder, outer, AfterSync(recorder)],
        logger=CSVLogger(cfg.out, name="csv", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Read a :class:`RunConfig` given as one JSON object (``--config '{...}'``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="RunConfig fields as a JSON object")
    return RunConfig(**json.loads(parser.parse_args(argv).config))


if __name__ == "__main__":
    run(parse_args())
