"""The plan against reality: what the planner predicts for a finished run, next to what the run measured.

Given ``plan=...``, the federated strategies add a :class:`PlanCheck` to their runtime's listeners: it measures the
run's pace and syncs and calls :func:`check_run` at the end of ``fit``. The planner gets the
run's own layout, model size and measured time of a step without its exposed sync (so compute and in-group
collectives are taken as measured), and predicts the outer sum from the cluster's network: the comparison checks
the sync part of the model on the user's own cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.plan.predict import predict
from lightning_fedshard.plan.specs import CLUSTERS, ClusterSpec, ModelSpec, TrainSetup


@dataclass(frozen=True)
class RunFacts:
    """What a federated run knows about itself at the end of ``fit``.

    Attributes:
        num_nodes: Nodes.
        devices_per_node: Ranks per node.
        hybrid: FL+HSDP.
        num_groups: Federation groups.
        shard_size: Shard size inside a group.
        num_parameters: Parameters of the whole model.
        num_units: Sharded units (FSDP1 units or FSDP2 parameters).
        steps: Optimizer steps measured.
        seconds: Wall time of those steps, syncs included.
        syncs: Fragment landings measured.
        sync_seconds: Their total time (from the start of the sum to the new anchor).
        exposed_seconds: Their total time that training waited for.
    """

    num_nodes: int
    devices_per_node: int
    hybrid: bool
    num_groups: int
    shard_size: int
    num_parameters: int
    num_units: int
    steps: int
    seconds: float
    syncs: int
    sync_seconds: float
    exposed_seconds: float


def cluster_of(plan: str | dict[str, Any], num_nodes: int, devices_per_node: int) -> ClusterSpec:
    """The cluster of a strategy's ``plan`` argument, with the run's nodes and devices.

    ``plan`` is a preset name, or a dict with ``"cluster"`` (a preset name, default ``"leonardo-512"``) and
    :class:`ClusterSpec` fields to change.

    Raises:
        ValueError: For an unknown preset or field, naming it.
    """
    spec = {"cluster": plan} if isinstance(plan, str) else dict(plan)
    name = spec.pop("cluster", "leonardo-512")
    if name not in CLUSTERS:
        raise ValueError(f"Unknown cluster preset {name!r} in `plan`; choose one of {sorted(CLUSTERS)}.")
    fields = set(ClusterSpec.__dataclass_fields__) - {"name", "num_nodes", "devices_per_node"}
    unknown = set(spec) - fields
    if unknown:
        raise ValueError(f"`plan` keys {sorted(unknown)} are not cluster fields; use {sorted(fields)}.")
    return replace(CLUSTERS[name], num_nodes=num_nodes, devices_per_node=devices_per_node, **spec)


def check_run(plan: str | dict[str, Any], setup: TrainSetup, facts: RunFacts) -> dict[str, float]:
    """Predicted and measured step time, sync time and exposed sync time per step of a finished run."""
    cluster = cluster_of(plan, facts.num_nodes, facts.devices_per_node)
    steps = max(facts.steps, 1)
    exposed_per_step = facts.exposed_seconds / steps
    inner = facts.seconds / steps - exposed_per_step
    cluster = replace(cluster, step_seconds=inner / setup.grad_accum, overlap_collectives=True)
    model = ModelSpec("run", facts.num_parameters, 0, max(facts.num_units - 1, 1), 1, 1, 1)
    federation = replace(
        setup.federation, num_groups=facts.num_groups, shard_size=facts.shard_size if facts.hybrid else None
    )
    setup = replace(setup, federation=federation)
    prediction = predict(model, cluster, setup)
    return {
        "predicted_step_seconds": prediction.step_seconds,
        "measured_step_seconds": facts.seconds / steps,
        "predicted_sync_seconds": prediction.sync_seconds,
        "measured_sync_seconds": facts.sync_seconds / facts.syncs if facts.syncs else float("nan"),
        "predicted_exposed_sync_per_step": prediction.exposed_sync_seconds,
        "measured_exposed_sync_per_step": exposed_per_step,
    }


class PlanCheck:
    """A sync listener that times training and, at the end, sets :attr:`report`: the plan next to the run.

    Args:
        plan: A cluster preset of ``fedshard plan`` or a dict of one with fields changed (see :func:`cluster_of`).
        log: Where the one-line summary goes (e.g. Lightning's ``rank_zero_info``); ``None``: nowhere.
    """

    def __init__(self, plan: str | dict[str, Any], log: Callable[[str], None] | None = None) -> None:
        cluster_of(plan, 1, 1)  # a bad preset or field fails here, before any process starts
        self.plan = plan
        self.log = log
        self.report: dict[str, float] | None = None
        self._reset(0)

    def _reset(self, step: int) -> None:
        self._start_step, self._clock = step, time.perf_counter()
        self._steps, self._seconds, self._stopped = 0, 0.0, False
        self._syncs, self._sync_seconds, self._exposed_seconds = 0, 0.0, 0.0

    def on_start(self, step: int) -> None:
        """Measure from here (a second ``fit`` measures afresh)."""
        self._reset(step)

    def on_sync(self, stats: SyncStats) -> SyncStats:
        """Count the sync (syncs after the training loop ended are not part of its pace)."""
        if not self._stopped:
            self._syncs += 1
            self._sync_seconds += stats.seconds
            self._exposed_seconds += stats.exposed_seconds
        return stats

    def on_stop(self, step: int) -> None:
        """The end of the measured training."""
        if not self._stopped:
            self._steps, self._seconds = step - self._start_step, time.perf_counter() - self._clock
            self._stopped = True

    def on_finish(self, runtime: Any) -> None:
        """Predict this run and keep the comparison in :attr:`report`; collective (sums the model's size)."""
        t, config = runtime.topology, runtime.config
        shards = runtime.model.local_shards()
        local = torch.tensor(float(sum(s.numel() for s in shards)), dtype=torch.float64)
        if t.shard_size > 1:
            dist.all_reduce(local, group=runtime.mesh.group("shard"))
        facts = RunFacts(
            num_nodes=t.world_size // runtime.devices_per_node,
            devices_per_node=runtime.devices_per_node,
            hybrid=runtime.hybrid,
            num_groups=t.num_groups,
            shard_size=t.shard_size,
            num_parameters=int(local.item()),
            num_units=len(shards),
            steps=self._steps,
            seconds=self._seconds,
            syncs=self._syncs,
            sync_seconds=self._sync_seconds,
            exposed_seconds=self._exposed_seconds,
        )
        setup = TrainSetup(strategy="fl_hsdp" if runtime.hybrid else "fl_fsdp", federation=config)
        report = self.report = check_run(self.plan, setup, facts)
        if self.log is None:
            return
        self.log(
            f"{runtime.name}: plan vs run over {self._steps} step(s): step {report['predicted_step_seconds']:.3g} s"
            f" predicted, {report['measured_step_seconds']:.3g} s measured; outer sum"
            f" {report['predicted_sync_seconds']:.3g} s predicted, {report['measured_sync_seconds']:.3g} s measured;"
            f" training waited {report['predicted_exposed_sync_per_step']:.3g} s per step predicted,"
            f" {report['measured_exposed_sync_per_step']:.3g} s measured."
        )
