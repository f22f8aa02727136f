"""Observers of a federation's syncs: told when training starts and stops and of every sync that lands.

The runtime holds the federation only; what watches it (the compute utilization of each round, the planner's check
of a run) is a :class:`SyncListener` given to it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

from lightning_fedshard.core.step.stats import SyncStats


class SyncListener(Protocol):
    """Hooks around a federation's training; every rank calls them at the same points."""

    def on_start(self, step: int) -> None:
        """Training starts (or resumes) after optimizer step ``step``."""

    def on_sync(self, stats: SyncStats) -> SyncStats:
        """A sync landed; returns its statistics, completed with what the listener measures."""

    def on_stop(self, step: int) -> None:
        """The training loop ended after optimizer step ``step`` (before the end-of-training sync)."""

    def on_finish(self, runtime: Any) -> None:
        """After the end-of-training sync; collective (``runtime`` is the federated runtime)."""


class Listeners(list[SyncListener]):
    """A runtime's listeners, in order, told of each hook as one listener.

    A list: listeners can be added to it. A sync's statistics pass through each listener in turn.
    """

    def on_start(self, step: int) -> None:
        """Tell every listener that training starts (or resumes) after optimizer step ``step``."""
        for listener in self:
            listener.on_start(step)

    def on_sync(self, stats: SyncStats) -> SyncStats:
        """``stats`` completed by every listener, in order."""
        for listener in self:
            stats = listener.on_sync(stats)
        return stats

    def on_stop(self, step: int) -> None:
        """Tell every listener that the training loop ended after optimizer step ``step``."""
        for listener in self:
            listener.on_stop(step)

    def on_finish(self, runtime: Any) -> None:
        """Tell every listener that the end-of-training sync ran; collective."""
        for listener in self:
            listener.on_finish(runtime)


class UtilizationClock:
    """Sets ``compute_utilization`` of each sync: ``1 - exposed / round`` over the round the sync closes.

    A round runs from the previous landing (or the start of training) to this one; its compute is everything but the
    sync's exposed time, validation and checkpoints included. ``effective_utilization`` counts only the compute whose
    progress the landing keeps: ``compute_utilization * (1 - discarded_fraction)``.
    """

    def __init__(self) -> None:
        self._round_clock = time.perf_counter()

    def on_start(self, step: int) -> None:
        """A round starts with training."""
        self._round_clock = time.perf_counter()

    def on_sync(self, stats: SyncStats) -> SyncStats:
        """``stats`` with the utilization of the round it closes."""
        now = time.perf_counter()
        round_seconds, self._round_clock = now - self._round_clock, now
        if round_seconds <= 0:
            return stats
        utilization = max(0.0, 1.0 - stats.exposed_seconds / round_seconds)
        effective = utilization * (1.0 - stats.discarded_fraction)
        return replace(stats, compute_utilization=utilization, effective_utilization=effective)

    def on_stop(self, step: int) -> None:
        """Nothing to do."""

    def on_finish(self, runtime: Any) -> None:
        """Nothing to do."""


__all__ = ["Listeners", "SyncListener", "UtilizationClock"]
