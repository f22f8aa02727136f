"""The compute-utilization clock (core.listeners) and the discarded work a landing reports to it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_fedshard.core import listeners
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.listeners import Listeners, UtilizationClock
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.inprocess import InProcessGroups


def test_clock_counts_exposed_time_and_discarded_work(monkeypatch):
    readings = iter([0.0, 10.0, 10.2])  # built at 0 s, the round starts at 10 s and its sync comes 0.2 s later
    monkeypatch.setattr(listeners, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    clock = UtilizationClock()
    clock.on_start(0)
    stats = clock.on_sync(SyncStats(0.0, 0.0, 0, 0.05, 1, exposed_seconds=0.05, discarded_fraction=0.25))
    assert stats.compute_utilization == pytest.approx(0.75)
    assert stats.effective_utilization == pytest.approx(stats.compute_utilization * 0.75)
    logged = stats.as_dict()
    assert logged["fedshard/effective_utilization"] == stats.effective_utilization


@pytest.mark.parametrize(
    ("options", "discarded"),
    [
        (dict(sync_every=4), 0.0),
        (dict(sync_every=4, sync_delay=2), 0.5),  # the 2 steps since the snapshot are replaced by the anchor
        (dict(sync_every=4, sync_delay=2, merge_alpha=0.5), 0.25),  # half of them are kept
        (dict(sync_every=4, fragments=2, sync_delay=1), 0.25),  # 1 step of the fragment's 4-step round
        (dict(sync_every=4, eager_updates=True), 0.0),  # nothing trained is thrown away
    ],
)
def test_landings_report_the_share_of_the_round_they_discard(options, discarded):
    config = FederationConfig(reduce_dtype="float32", **options)

    def work(g: int, comm: Any) -> list[float]:
        shards = [torch.zeros(3), torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen = []
        for step in range(1, 13):
            for shard in shards:
                shard.add_(g + 1)
            stats = fed.maybe_sync(step)
            if stats is not None:
                seen.append(stats.discarded_fraction)
        fed.finish(12)
        return seen

    seen = InProcessGroups(2).run(work)[0]
    assert seen and all(d == pytest.approx(discarded) for d in seen)


class _Recorder:
    def __init__(self, name: str, calls: list[tuple[str, Any]]) -> None:
        self.name, self.calls = name, calls

    def on_start(self, step: int) -> None:
        self.calls.append((self.name, ("start", step)))

    def on_sync(self, stats: SyncStats) -> SyncStats:
        self.calls.append((self.name, ("sync", stats.syncs_lost)))
        return dataclasses.replace(stats, syncs_lost=stats.syncs_lost + 1)

    def on_stop(self, step: int) -> None:
        self.calls.append((self.name, ("stop", step)))

    def on_finish(self, runtime: Any) -> None:
        self.calls.append((self.name, ("finish", runtime)))


def test_listeners_are_told_in_order_and_a_syncs_statistics_pass_through_each():
    calls: list[tuple[str, Any]] = []
    chain = Listeners([_Recorder("a", calls)])
    chain.append(_Recorder("b", calls))  # still a list
    chain.on_start(3)
    stats = chain.on_sync(SyncStats(0.0, 0.0, 0, 0.05, 1))
    chain.on_stop(4)
    chain.on_finish("runtime")
    assert stats.syncs_lost == 2
    assert calls == [
        ("a", ("start", 3)), ("b", ("start", 3)), ("a", ("sync", 0)), ("b", ("sync", 1)),
        ("a", ("stop", 4)), ("b", ("stop", 4)), ("a", ("finish", "runtime")), ("b", ("finish", "runtime")),
    ]  # fmt: skip
