"""Averages of the groups' weights themselves (not of pseudo-gradients), shared by the rounds that take them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fedshard.core.rounds.base import Host
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.comm import sum_over_model
from lightning_fedshard.core.wire.codecs import FloatCodec
from lightning_fedshard.core.wire.norms import squared_norm
from lightning_fedshard.core.wire.reducers import AllReduceSum

if TYPE_CHECKING:
    from lightning_fedshard.core.step.outer import OuterStep

#: How weights travel when groups average them: float32, summed by an all-reduce.
FLOAT32_SUM = AllReduceSum(FloatCodec(torch.float32))


def flat_weights(shards: Sequence[Tensor]) -> Tensor:
    """This rank's shards, concatenated into one float32 vector on their device."""
    return torch.cat([s.detach().reshape(-1).to(torch.float32) for s in shards])


@torch.no_grad()
def write_weights(shards: Sequence[Tensor], flat: Tensor) -> None:
    """Write a vector of :func:`flat_weights`' layout back into the shards."""
    for shard, part in zip(shards, flat.split([s.numel() for s in shards])):
        shard.copy_(part.view_as(shard))


@torch.no_grad()
def mean_weights(outer: OuterStep) -> Tensor:
    """:func:`flat_weights` averaged over all groups (a float32 sum over the fed ring); collective."""
    flat = flat_weights(outer.shards)
    outer.communicator.sum_over_groups(flat)
    return flat.div_(len(outer.communicator.participants()))


def mean_bytes(numel: int, groups: int) -> int:
    """Bytes one rank sends to average ``numel`` float32 values over ``groups`` groups (a ring all-reduce)."""
    return FLOAT32_SUM.wire_bytes(numel, groups)


@torch.no_grad()
def load_mean_over_groups(federation: Host) -> None:
    """Write the exact mean over all groups of their current weights into the shards; collective.

    The consensus of groups that differ. Also measures the federation's ``consensus_distance``: the root mean square
    over groups of a group's L2 distance from that mean.
    """
    outer = federation.outer
    squared = torch.zeros(1, dtype=torch.float64)
    for shard, mean in zip(outer.shards, mean_weights(outer).split([s.numel() for s in outer.shards])):
        mean = mean.view_as(shard).to(shard.device)
        squared += float(torch.linalg.vector_norm(shard.float() - mean) ** 2)
        shard.copy_(mean)
    sum_over_model(federation.communicator, squared)
    federation.consensus_distance = math.sqrt(float(squared) / len(federation.communicator.participants()))


@torch.no_grad()
def apply_weights(
    outer: OuterStep,
    flat: Tensor,
    broken: tuple[int, ...],
    num_groups: int,
    indices: Sequence[int] | None = None,
    write: bool = True,
) -> tuple[float, float]:
    """Write the weights a site sync or a mix gave this group; returns its ``outer_grad_norm`` and ``drift``.

    ``drift``: the RMS over the healthy groups of ``|theta_g - theta_g'|`` (before and after); the norm: the RMS
    over all groups of ``|anchor - theta_g'|`` (see :class:`~lightning_fedshard.core.step.stats.SyncStats`). One
    tiny sum over the model. ``indices``: the shards ``flat`` covers (default: all; a fragment's when only it syncs).
    """
    indices = range(len(outer.shards)) if indices is None else indices
    shards, anchors = [outer.shards[i] for i in indices], [outer.anchor[i] for i in indices]
    sums = torch.zeros(2, dtype=torch.float64)
    offset = 0
    for shard, anchor in zip(shards, anchors):
        new = flat[offset : offset + shard.numel()].view_as(shard)
        sums[0] += squared_norm(shard.float() - new)
        sums[1] += squared_norm(anchor.to(new.device, non_blocking=True) - new)
        offset += shard.numel()
    if outer.communicator.group_index in broken:
        sums[0] = 0.0  # its NaN distance is not a drift
    if write:  # else the caller writes them once the sync is committed
        write_weights(shards, flat)
    sums = sums.to(flat.device)
    sum_over_model(outer.communicator, sums)
    drift_sq, away_sq = sums.tolist()
    return math.sqrt(away_sq / num_groups), math.sqrt(drift_sq / (num_groups - len(broken)))


def weights_sync_stats(
    outer: OuterStep, norm: float, drift: float, sent: int, seconds: float, broken: tuple[int, ...], **extra: Any
) -> SyncStats:
    """Count a sync that averaged or mixed weights without an outer step (a site sync, a mix), with its statistics."""
    outer.site_syncs += 1
    return SyncStats(
        norm,
        drift,
        sent,
        seconds,
        outer.num_syncs,
        skipped_groups=broken,
        exposed_seconds=seconds,
        site_syncs=outer.site_syncs,
        **extra,
    )
