"""Single-process tests of the `OuterSync` callback: what it shows in the progress bar and writes to the loggers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from lightning_fedshard import Hierarchical, OuterSync
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.runtime import FederatedRuntime


class _ScriptedRuntime(FederatedRuntime):
    """Returns recorded sync statistics, one per optimizer step."""

    def __init__(self, stats: dict[int, SyncStats | None]) -> None:
        self._stats = stats

    def after_optimizer_step(self, step: int | None = None) -> SyncStats | None:
        assert step is not None
        return self._stats[step]


class _Recorder:
    def __init__(self) -> None:
        self.bar: list[dict[str, float]] = []
        self.rows: list[dict[str, float]] = []

    def log(self, name: str, value: float, **options: Any) -> None:
        assert options["prog_bar"] and not options["logger"]
        self.bar[-1][name] = value

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(metrics)


def _site_then_federation_stats() -> dict[int, SyncStats | None]:
    """Group 0's statistics of 3 site syncs (steps 1-3) and one federation sync (step 4) of 4 drifting groups."""
    config = FederationConfig(sync_every=1, reduce_dtype="float32", outer_topology=Hierarchical({1: 2, 4: 4}))

    def work(g: int, comm: Any) -> dict[int, SyncStats | None]:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen = {}
        for step in range(1, 5):
            shards[0].add_(float(g + 1))
            seen[step] = fed.maybe_sync(step)
        return seen

    return InProcessGroups(4, site_blocks=config.site_blocks(4)).run(work)[0]


def test_the_progress_bar_counts_site_syncs_and_the_loggers_get_their_drift():
    recorder = _Recorder()
    strategy = SimpleNamespace(runtime=_ScriptedRuntime(_site_then_federation_stats()))
    trainer = SimpleNamespace(strategy=strategy, loggers=[recorder], global_step=0)
    callback = OuterSync()
    for step in range(1, 5):
        trainer.global_step = step
        recorder.bar.append({})
        callback.on_train_batch_end(trainer, recorder, None, None, step - 1)  # type: ignore[arg-type]
    assert [bar["syncs"] for bar in recorder.bar] == [1.0, 2.0, 3.0, 4.0]  # not 0, 0, 0, 1
    assert all(bar["drift"] > 0 for bar in recorder.bar)  # the groups drift apart between syncs
    assert [row["fedshard/num_syncs"] for row in recorder.rows] == [0.0, 0.0, 0.0, 1.0]  # outer steps
    assert [row["fedshard/site_syncs"] for row in recorder.rows] == [1.0, 2.0, 3.0, 3.0]
    assert all(row["fedshard/drift"] > 0 and row["fedshard/outer_grad_norm"] > 0 for row in recorder.rows)
