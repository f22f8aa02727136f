"""Validation of the user-facing federation options, shared by the Trainer and Fabric strategies.

Everything here runs in the constructor, before any process is launched, so that a typo fails in seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning_fedshard.core.outer import NONFINITE_POLICIES, OuterOptimizerFactory, build_outer_optimizer
from lightning_fedshard.core.topology import FederationTopology

#: Named outer optimizers. "fedavg" (the default) replaces every group by the groups' mean, which is what the paper's
#: published runs do and what won our benchmarks at sync_every=8 (docs/benchmarks.md); "nesterov" is DiLoCo's outer
#: step (torchft's and OpenDiLoCo's default), tuned there for hundreds of inner steps between syncs.
OUTER_OPTIMIZERS: dict[str, OuterOptimizerFactory] = {
    "nesterov": functools.partial(SGD, lr=0.7, momentum=0.9, nesterov=True),
    "fedavg": functools.partial(SGD, lr=1.0),
}

_REDUCE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

OuterOptimizerSpec = str | Callable[[Iterable[Tensor]], Optimizer]


@dataclass(frozen=True)
class FederationConfig:
    """The federation options of an FL+FSDP / FL+HSDP strategy, validated.

    Args:
        num_groups: Federation groups ``G``; ``None`` means one group per node.
        shard_size: Ranks sharding one replica; ``None`` means the strategy's default (all ranks of a group for
            FL+FSDP, the devices of one node for FL+HSDP).
        sync_every: Inner optimizer steps between two outer steps (``H``).
        outer_optimizer: ``"fedavg"`` (default), ``"nesterov"`` or a callable building an optimizer from the anchor
            tensors.
        reduce_dtype: Data type of the pseudo-gradient in the outer all-reduce: ``"float32"``, ``"bfloat16"`` or
            ``"float16"`` (or the matching ``torch.dtype``).
        anchor_device: ``"cpu"`` keeps the anchor and outer optimizer state in host memory; ``"device"`` keeps
            them next to the model shards.
        on_nonfinite: What a sync does when a group's pseudo-gradient holds NaN/Inf: ``"raise"`` (default) stops
            with an error naming the groups, the step and the sync, leaving the anchor untouched; ``"skip_group"``
            averages over the healthy groups only and restarts the broken ones from the new anchor.

    Raises:
        ValueError: For a non-positive ``num_groups``, ``shard_size`` or ``sync_every``, an unknown outer
            optimizer name, an outer optimizer factory that does not return an optimizer, an unknown reduce dtype,
            anchor device or ``on_nonfinite`` policy.
    """

    num_groups: int | None = None
    shard_size: int | None = None
    sync_every: int = 8
    outer_optimizer: OuterOptimizerSpec = "fedavg"
    reduce_dtype: str | torch.dtype = "float32"
    anchor_device: str = "cpu"
    on_nonfinite: str = "raise"

    def __post_init__(self) -> None:
        for name in ("num_groups", "shard_size"):
            _check_positive_int(name, getattr(self, name), allow_none=True)
        _check_positive_int("sync_every", self.sync_every, allow_none=False)
        # Build the outer optimizer once on a probe tensor, so a broken factory fails before any rank starts.
        build_outer_optimizer(self.outer_optimizer_factory, [torch.zeros(1, requires_grad=True)])
        resolve_reduce_dtype(self.reduce_dtype)
        if self.anchor_device not in ("cpu", "device"):
            raise ValueError(f"`anchor_device` must be 'cpu' or 'device', got {self.anchor_device!r}.")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"`on_nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {self.on_nonfinite!r}.")

    def topology(self, num_nodes: int, devices_per_node: int, hybrid: bool) -> FederationTopology:
        """The job's topology once the number of nodes and devices per node are known.

        Args:
            num_nodes: Nodes in the job.
            devices_per_node: Ranks per node.
            hybrid: FL+HSDP (shard over ``shard_size``, default a node) instead of FL+FSDP (shard over the group).

        Raises:
            ValueError: If the world size is not divisible by the number of groups, or a group by the shard size.
        """
        world_size = num_nodes * devices_per_node
        num_groups = self.num_groups or num_nodes
        if world_size % num_groups:
            raise ValueError(
                f"The world size ({world_size} = {num_nodes} node(s) x {devices_per_node} device(s)) must be"
                f" divisible by `num_groups={num_groups}`."
            )
        group_size = world_size // num_groups
        shard_size = (self.shard_size or devices_per_node) if hybrid else group_size
        return FederationTopology(world_size=world_size, num_groups=num_groups, shard_size=shard_size)

    @property
    def outer_optimizer_factory(self) -> OuterOptimizerFactory:
        """A callable that builds the outer optimizer from a list of anchor tensors."""
        return resolve_outer_optimizer(self.outer_optimizer)

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        """``reduce_dtype`` as a ``torch.dtype``."""
        return resolve_reduce_dtype(self.reduce_dtype)


def resolve_outer_optimizer(spec: OuterOptimizerSpec) -> OuterOptimizerFactory:
    """Turn an outer optimizer name or factory into a factory.

    Raises:
        ValueError: For an unknown name or something that is neither a name nor callable.
    """
    if isinstance(spec, str):
        if spec not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"Unknown `outer_optimizer={spec!r}`; choose one of {sorted(OUTER_OPTIMIZERS)} or pass a callable."
            )
        return OUTER_OPTIMIZERS[spec]
    if not callable(spec):
        raise ValueError(f"`outer_optimizer` must be a name or a callable returning an optimizer, got {spec!r}.")
    return spec


def resolve_reduce_dtype(value: str | torch.dtype) -> torch.dtype:
    """Turn ``"bfloat16"``-style names (or dtypes) into a supported ``torch.dtype``.

    Raises:
        ValueError: For anything but float32, bfloat16 and float16.
    """
    if isinstance(value, torch.dtype):
        if value in _REDUCE_DTYPES.values():
            return value
    elif isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _REDUCE_DTYPES:
            return _REDUCE_DTYPES[name]
    raise ValueError(f"Unsupported `reduce_dtype={value!r}`; choose one of {sorted(_REDUCE_DTYPES)}.")


def _check_positive_int(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
