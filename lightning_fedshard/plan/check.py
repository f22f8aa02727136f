"""The plan against reality: what the planner predicts for a finished run, next to what the run measured.

The federated strategies call :func:`check_run` at the end of ``fit`` when given ``plan=...``. The planner gets the
run's own layout, model size and measured time of a step without its exposed sync (so compute and in-group
collectives are taken as measured), and predicts the outer sum from the cluster's network: the comparison checks
the sync part of the model on the user's own cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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
    setup = replace(setup, num_groups=facts.num_groups, shard_size=facts.shard_size if facts.hybrid else None)
    prediction = predict(model, cluster, setup)
    return {
        "predicted_step_seconds": prediction.step_seconds,
        "measured_step_seconds": facts.seconds / steps,
        "predicted_sync_seconds": prediction.sync_seconds,
        "measured_sync_seconds": facts.sync_seconds / facts.syncs if facts.syncs else float("nan"),
        "predicted_exposed_sync_per_step": prediction.exposed_sync_seconds,
        "measured_exposed_sync_per_step": exposed_per_step,
    }
