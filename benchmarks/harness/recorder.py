"""What a benchmark run measures inside the ranks: clocks, link bytes, the strategy's syncs, validation, memory.

:class:`BenchRecorder` is a Lightning callback; :class:`MeasuredOuterSync` is the package's ``OuterSync`` with the
recorder's windows around each outer step. Global rank 0 writes everything to ``<out>/run.json`` at the end.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from benchmarks.harness.config import RunConfig
from benchmarks.harness.threads import ThreadClock
from lightning_fedshard import OuterSync
from lightning_fedshard.core.step.participation import pace_schedule
from lightning_fedshard.core.step.stats import SyncStats

#: The node's link counter, inside an emulated node's network namespace.
LINK_COUNTER = "/sys/class/net/veth0/statistics/tx_bytes"


def link_tx_bytes(trainer: L.Trainer) -> int | None:
    """Bytes this node has sent into its link, read by its local rank 0 only; ``None`` outside an emulated node."""
    if trainer.local_rank != 0 or not os.path.exists(LINK_COUNTER):
        return None
    return int(Path(LINK_COUNTER).read_text())


@dataclass
class LinkWindow:
    """Link bytes sent between two world barriers, summed over the windows opened and closed so far."""

    tx_start: int | None = None
    tx_bytes: int = 0

    def open(self, trainer: L.Trainer) -> None:
        """Read the counter between two barriers."""
        dist.barrier()
        self.tx_start = link_tx_bytes(trainer)
        # Without the second barrier a rank that leaves the first one early could start sending before the reader
        # of its peer's node has read the counter, and those bytes would be missed.
        dist.barrier()

    def close(self, trainer: L.Trainer) -> int:
        """Read the counter after a barrier; return this window's bytes (this node's, 0 on other ranks)."""
        dist.barrier()
        now = link_tx_bytes(trainer)
        delta = 0 if now is None or self.tx_start is None else now - self.tx_start
        self.tx_bytes += delta
        return delta


def sync_record(stats: SyncStats, step: int, when: str) -> dict[str, Any]:
    """One sync as the strategy reported it (this rank's view)."""
    return {
        "step": step,
        "when": when,
        "fragment": stats.fragment,
        "num_syncs": stats.num_syncs,
        "sync_bytes": stats.bytes_sent,
        "sync_seconds": stats.seconds,
        "sync_exposed_seconds": stats.exposed_seconds,
        "compute_utilization": stats.compute_utilization,
        "discarded_fraction": stats.discarded_fraction,
        "effective_utilization": stats.effective_utilization,
    }


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def model_state_bytes(trainer: L.Trainer) -> dict[str, int]:
    """This rank's model state from the tensors: parameter shards, inner optimizer state and the federation's state.

    The federation's (anchor, outer optimizer state, error-feedback residuals) come from
    ``Federation.state_nbytes``; gradients are measured by the recorder before each optimizer step, while they exist.
    """
    strategy: Any = trainer.strategy
    inner = [v for opt in trainer.optimizers for state in opt.state.values() for v in state.values()]
    return {
        "parameters": tensor_bytes(strategy.local_shards()),
        "inner_optimizer": tensor_bytes(inner),
        **strategy.federation.state_nbytes(),
    }


def trained_steps(trainer: L.Trainer) -> list[int]:
    """Optimizer steps each group trained (with a per-group pace a slow group skips some; else every step)."""
    federation: Any = trainer.strategy.federation  # type: ignore[attr-defined]
    groups = trainer.strategy.topology.num_groups  # type: ignore[attr-defined]
    pace = pace_schedule(federation.participation)
    if pace is None:
        return [trainer.global_step] * groups
    return [pace.trained(g, 0, trainer.global_step) for g in range(groups)]


def pace_record(trainer: L.Trainer) -> dict[str, Any] | None:
    """A per-group pace's schedule as it ran (steps per group per round, the measured speeds), if there is one."""
    pace = pace_schedule(trainer.strategy.federation.participation)  # type: ignore[attr-defined]
    return None if pace is None else {k: v for k, v in pace.state_dict().items() if k != "merges"}


def sigterm_groups(trainer: L.Trainer) -> list[list[int]]:
    """The ranks of each process group this rank broadcasts the SIGTERM flag over at every step, in order."""
    groups = trainer.strategy.runtime.fsdp_process_group  # type: ignore[attr-defined]
    ordered = reversed(groups) if isinstance(groups, tuple) else (groups,)
    return [dist.get_process_group_ranks(group) for group in ordered]


def cpu_seconds() -> float:
    """CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    figures (its ``SyncStats``: bytes, exposed seconds, compute utilization) are recorded per sync and per rank. The
    training clock stops during validation and during the end-of-fit syncs.

    Args:
        cfg: The run.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.train = LinkWindow()
        self.val = LinkWindow()
        self.sync = LinkWindow()
        self.finish = LinkWindow()
        self.finish_seconds = 0.0
        self.strategy_syncs: list[dict[str, Any]] = []
        self.steps: list[dict[str, float]] = []
        self.syncs: list[dict[str, float]] = []
        self.vals: list[dict[str, float]] = []
        self.gradient_bytes = 0
        self._last_stats: SyncStats | None = None
        self._t0 = 0.0
        self._paused = 0.0
        self._pause_start = 0.0
        self._finish_start = 0.0
        self._sync_clock: float | None = None
        self._cpu0 = 0.0
        self.threads = ThreadClock()

    def clock(self) -> float:
        """Seconds of training so far: wall time since training started, minus validation and end-of-fit syncs."""
        return time.perf_counter() - self._t0 - self._paused

    def tokens_per_step(self, trainer: L.Trainer) -> int:
        """Tokens all ranks together train on per optimizer step (of every group's job, elastic groups too)."""
        ranks = self.cfg.num_nodes * self.cfg.devices if self.cfg.elastic_groups else trainer.world_size
        return ranks * self.cfg.batch_size * self.cfg.seq_len

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train.open(trainer)
        self._t0 = time.perf_counter()
        self._cpu0 = cpu_seconds()
        self.threads.start()

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.gradient_bytes = max(self.gradient_bytes, tensor_bytes(p.grad for p in pl_module.parameters()))

    def open_sync(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` right before an outer step."""
        self.sync.open(trainer)
        self._sync_clock = self.clock()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._sync_clock is not None:
            seconds = self.clock() - self._sync_clock
            self.syncs.append({"step": step, "seconds": seconds, "tx_bytes": self.sync.close(trainer)})
            self._sync_clock = None
        self._record_strategy_sync(trainer, step)
        self.threads.sample()
        self.steps.append({"step": step, "clock": self.clock()})
        pl_module.log("bench/clock", self.clock(), on_step=True, rank_zero_only=True)
        pl_module.log("bench/tokens", float(step * self.tokens_per_step(trainer)), on_step=True, rank_zero_only=True)

    def _record_strategy_sync(self, trainer: L.Trainer, step: int, when: str = "train") -> None:
        """The strategy's statistics of the sync that just landed, if one did."""
        stats = trainer.strategy.runtime.last_sync_stats  # type: ignore[attr-defined]
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.strategy_syncs.append(sync_record(stats, step, when))

    def open_finish(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` before the end-of-fit syncs: stop the clock, open a link window."""
        self._finish_start = time.perf_counter()
        self.finish.open(trainer)

    def close_finish(self, trainer: L.Trainer) -> None:
        """Called by :class:`MeasuredOuterSync` after the end-of-fit syncs."""
        self.finish.close(trainer)
        self.finish_seconds = time.perf_counter() - self._finish_start
        self._paused += self.finish_seconds
        self._record_strategy_sync(trainer, trainer.global_step, when="finish")

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._t0:
            return
        self._pause_start = time.perf_counter()
        self.val.open(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._t0:
            return
        self.val.close(trainer)
        self._paused += time.perf_counter() - self._pause_start
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
        cpu = cpu_seconds() - self._cpu0  # this rank's process (threads included), validation included
        self.threads.sample()
        self.train.close(trainer)
        every: list[dict[str, Any]] = [{} for _ in range(trainer.world_size)]
        dist.all_gather_object(every, self._rank_record(trainer, cpu))
        if trainer.global_rank != 0:
            return
        result = self._run_record(trainer, pl_module, every, train_seconds)
        group = trainer.strategy.federation.communicator.group_index  # type: ignore[attr-defined]
        if self.cfg.elastic_groups and group != 0:  # each group is a job: group 0 writes the run, the others their link
            Path(self.cfg.out, f"link_tx{group}.json").write_text(json.dumps({"train": result["link_tx_train"]}))
            return
        if self.cfg.elastic_groups:
            Path(self.cfg.out, "link_tx0.json").write_text(json.dumps({"train": result["link_tx_train"]}))
        Path(self.cfg.out, "run.json").write_text(json.dumps(result, indent=1))

    def _rank_record(self, trainer: L.Trainer, cpu: float) -> dict[str, Any]:
        return {
            "cpu_seconds": cpu,
            "thread_cpu_seconds": self.threads.seconds(),
            "model_state_bytes": {**model_state_bytes(trainer), "gradients": self.gradient_bytes},
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "train_tx": self.train.tx_bytes,
            "val_tx": self.val.tx_bytes,
            "syncs": self.syncs,
            "finish_tx": self.finish.tx_bytes,
            "strategy_syncs": self.strategy_syncs,
            # this rank's clock at its last step: its own pace when no sync made it wait for the others
            "own_train_seconds": self.steps[-1]["clock"] if self.steps else 0.0,
            "group": trainer.strategy.federation.communicator.group_index,  # type: ignore[attr-defined]
            "sigterm_groups": sigterm_groups(trainer),
        }

    def _run_record(
        self, trainer: L.Trainer, pl_module: L.LightningModule, ranks: list[dict[str, Any]], train_seconds: float
    ) -> dict[str, Any]:
        readers = [r for r in ranks if r["local_rank"] == 0]  # one link reader per node
        sync_tx = [sum(r["syncs"][i]["tx_bytes"] for r in readers) for i in range(len(self.syncs))]
        return {
            "config": self.cfg.record(),
            "world_size": trainer.world_size,
            "num_parameters": pl_module.num_parameters(),  # type: ignore[operator]
            "bytes_per_value": 4,
            "topology": str(trainer.strategy.topology),  # type: ignore[attr-defined]
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
            "own_train_seconds": [r["own_train_seconds"] for r in ranks],
            "group_of_rank": [r["group"] for r in ranks],
            # the process groups Lightning's per-step SIGTERM flag is broadcast over (each group's own)
            "sigterm_groups": sorted({tuple(g) for r in ranks for g in r["sigterm_groups"]}),
            "trained_steps": trained_steps(trainer),
            "pace": pace_record(trainer),
            "maxrss_mib": [r["maxrss_mib"] for r in ranks],
            "cpu_seconds": [r["cpu_seconds"] for r in ranks],
            "thread_cpu_seconds": [r["thread_cpu_seconds"] for r in ranks],
            "model_state_bytes": [r["model_state_bytes"] for r in ranks],
            "versions": {"torch": torch.__version__, "lightning": L.__version__},
        }


class MeasuredOuterSync(OuterSync):
    """:class:`OuterSync` that opens :class:`BenchRecorder`'s sync window (link bytes, clock) before each outer step.

    It also wraps the end-of-fit syncs in the recorder's ``finish`` window. With ``sync_delay > 0`` a window opened
    here covers the landing only (waiting for the sum, the outer step); the sum itself started ``sync_delay`` steps
    earlier.

    Args:
        recorder: The run's recorder.
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
