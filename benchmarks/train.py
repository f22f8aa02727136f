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
    seed: int = 0
    """``seed_everything``: the data order (the initial weights depend on ``init_seed`` only)."""
    init_seed: int = 0
    """``LlamaLM``'s ``init_seed``: the initial weights."""
    # Sync options of the federated strategies (see `FederationConfig`); the baselines ignore them.
    fragments: int = 1
    sync_delay: int = 0
    merge_alpha: float = 0.0
    reduce_dtype: str = "float32"
    quant_block_size: int | None = None
    """None: the package's default block size."""
    error_feedback: bool = False

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
        # One group averaging with itself never runs an outer step (see `FederatedRuntime.syncs_are_identity`): the
        # baselines are exactly FSDP / HSDP.
        "outer_optimizer": cfg.outer_optimizer if cfg.federated else "fedavg",
    }
    if cfg.federated:
        common.update(
            fragments=cfg.fragments,
            sync_delay=cfg.sync_delay,
            merge_alpha=cfg.merge_alpha,
            reduce_dtype=cfg.reduce_dtype,
            error_feedback=cfg.error_feedback,
        )
        if cfg.quant_block_size is not None:
            common["quant_block_size"] = cfg.quant_block_size
    if cfg.strategy in ("fsdp", "fl_fsdp"):
        return FLFSDPStrategy(num_groups=cfg.groups, **common)
    if cfg.strategy in ("hsdp", "fl_hsdp"):
        return FLHSDPStrategy(num_groups=cfg.groups, shard_size=cfg.devices, **common)
    raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {cfg.strategy!r}.")


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

    The strategy runs :class:`MeasuredOuterSync` before every other callback, so each step this recorder sees has
    its outer step done. Link counters are read by local rank 0 of each node between world barriers (a barrier
    moves a few hundred bytes), so no rank has started the measured collective before the first reading or still
    has bytes of it in flight at the last.

    Windows: ``train`` (from the start of training to its end, validation and the end-of-fit syncs included: the
    latter two are also counted separately), ``val`` (every validation), ``sync`` (around each landing of an outer
    step) and ``finish`` (the syncs that ``fit`` runs at its end, so that every group holds the consensus). With
    ``sync_delay > 0`` the sum of a fragment travels during the ``sync_delay`` training steps before it lands, so a
    ``sync`` window sees only the landing: its bytes are then in the ``train`` window, and the strategy's own
    figures (``runtime.last_sync_stats``: bytes, exposed seconds, compute utilization) are recorded per sync and per
    rank. The training clock stops during validation and during the end-of-fit syncs.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.train = _Window()
        self.val = _Window()
        self.sync = _Window()
        self.finish = _Window()
        self.finish_seconds = 0.0
        self.strategy_syncs: list[dict[str, Any]] = []
        self._last_stats: Any = None
        self.t0 = 0.0
        self.paused = 0.0
        self.pause_start = 0.0
        self.steps: list[dict[str, float]] = []
        self.syncs: list[dict[str, float]] = []
        self.vals: list[dict[str, float]] = []
        self._sync_due = False
        self.gradient_bytes = 0
        self.cpu0 = 0.0

    def clock(self) -> float:
        """Seconds of training so far: wall time since training started, minus validation."""
        return time.perf_counter() - self.t0 - self.paused

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train.open(trainer)
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu_seconds()

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.gradient_bytes = max(self.gradient_bytes, _tensor_bytes(p.grad for p in pl_module.parameters()))

    def open_sync(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` right before an outer step."""
        self.sync.open(trainer)
        self._sync_clock = self.clock()
        self._sync_due = True

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._sync_due:
            seconds = self.clock() - self._sync_clock
            tx = self.sync.close(trainer)
            self.syncs.append({"step": step, "seconds": seconds, "tx_bytes": tx})
            self._sync_due = False
        self._record_strategy_sync(trainer, step)
        self.steps.append({"step": step, "clock": self.clock()})
        pl_module.log("bench/clock", self.clock(), on_step=True, rank_zero_only=True)
        pl_module.log("bench/tokens", float(step * self.tokens_per_step(trainer)), on_step=True, rank_zero_only=True)

    def _record_strategy_sync(self, trainer: L.Trainer, step: int, when: str = "train") -> None:
        """What the strategy reports about the sync that just landed (this rank's view), if one did."""
        runtime = getattr(trainer.strategy, "runtime", None)
        stats = getattr(runtime, "last_sync_stats", None)
        if stats is None or stats is self._last_stats:
            return
        self._last_stats = stats
        self.strategy_syncs.append(
            {
                "step": step,
                "when": when,
                "fragment": stats.fragment,
                "num_syncs": stats.num_syncs,
                "sync_bytes": stats.bytes_sent,
                "sync_seconds": stats.seconds,
                "sync_exposed_seconds": stats.exposed_seconds,
                "compute_utilization": stats.compute_utilization,
            }
        )

    def open_finish(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` before the end-of-fit syncs: stop the clock, open a link window."""
        self._finish_start = time.perf_counter()
        self.finish.open(trainer)

    def close_finish(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` after the end-of-fit syncs."""
        self.finish.close(trainer)
        self.finish_seconds = time.perf_counter() - self._finish_start
        self.paused += self.finish_seconds
        self._record_strategy_sync(trainer, trainer.global_step, when="finish")

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
        # OuterSync's `on_train_end` (the end-of-fit syncs) ran before this hook, inside the `finish` window, with the
        # clock stopped. Runs with one fragment end on a sync step, so it has nothing left to do there.
        train_seconds = self.clock()
        cpu_seconds = _cpu_seconds() - self.cpu0  # this rank's process (threads included), validation included
        self.train.close(trainer)
        mine = {
            "cpu_seconds": cpu_seconds,
            "model_state_bytes": {**_model_state_bytes(trainer), "gradients": self.gradient_bytes},
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "train_tx": self.train.tx_bytes,
            "val_tx": self.val.tx_bytes,
            "syncs": self.syncs,
            "finish_tx": self.finish.tx_bytes,
            "strategy_syncs": self.strategy_syncs,
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
            "link_tx_finish": sum(r["finish_tx"] for r in readers),
            "finish_seconds": self.finish_seconds,
            "strategy_syncs": [r["strategy_syncs"] for r in ranks],
            "maxrss_mib": [r["maxrss_mib"] for r in ranks],
            "cpu_seconds": [r["cpu_seconds"] for r in ranks],
            "model_state_bytes": [r["model_state_bytes"] for r in ranks],
            "versions": {"torch": torch.__version__, "lightning": L.__version__},
        }
        Path(self.cfg.out, "run.json").write_text(json.dumps(result, indent=1))


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _model_state_bytes(trainer: L.Trainer) -> dict[str, int]:
    """This rank's model state, from the tensors themselves: local parameter shards, inner optimizer state, anchor and
    outer optimizer state (gradients are measured before each optimizer step, while they exist)."""
    strategy: Any = trainer.strategy
    inner = [v for opt in trainer.optimizers for state in opt.state.values() for v in state.values()]
    federation = strategy.federation
    anchor, outer = 0, 0
    if federation.started:
        anchor = _tensor_bytes(federation.outer.anchor)
        outer = _tensor_bytes(
            v for opt in federation.outer.optimizers for state in opt.state.values() for v in state.values()
        )
    return {
        "parameters": _tensor_bytes(strategy.local_shards()),
        "inner_optimizer": _tensor_bytes(inner),
        "anchor": anchor,
        "outer_optimizer": outer,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class MeasuredOuterSync(OuterSync):
    """:class:`OuterSync` that opens :class:`BenchRecorder`'s sync window (link bytes, clock) before each outer step.

    It also wraps the end-of-fit syncs in the recorder's ``finish`` window. With ``sync_delay > 0`` a window opened
    here covers the landing only (waiting for the sum, the outer step); the sum itself started ``sync_delay`` steps
    earlier.
    """

    def __init__(self, recorder: BenchRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.strategy.runtime.is_due(trainer.global_step):  # type: ignore[attr-defined]
            self.recorder.open_sync(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.recorder.open_finish(trainer)
        super().on_train_end(trainer, pl_module)
        self.recorder.close_finish(trainer)


def run(cfg: RunConfig) -> None:
    """Train once; every rank of every node calls this."""
    torch.set_num_threads(1)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = LlamaLM(
        size=cfg.size,  # type: ignore[arg-type]
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.seq_len,
        lr=cfg.lr,
        init_seed=cfg.init_seed,
        **cfg.model_overrides,  # type: ignore[arg-type]
    )
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
        callbacks=[recorder, MeasuredOuterSync(recorder)],  # the strategy runs the OuterSync first
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
