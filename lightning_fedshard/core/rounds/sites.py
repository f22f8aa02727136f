"""A hierarchical round: sites of groups average their weights often, the whole federation takes the outer step.

At a step the largest period of ``Hierarchical(levels)`` that divides it decides: a level below the whole federation
replaces every group's weights by the float32 mean over its site (no outer step: the anchor and the outer optimizer
are the federation's; with a per-group pace the mean weighs each group by the steps it trained since the previous sync
of any level, every token alike), and the level that spans every group is the federation's own round, run by the
round inside (plain: fragments, ``sync_delay``, ``merge_alpha``; or eager updates) with the largest period as its
period. When both fall on one step the federation's landing comes first. With eager updates a site sync also averages
where its groups started their rounds (their offsets below the anchor), so that each group's next pseudo-gradient is
its share of what the site trained.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fedshard.core.options.outer_topology import Hierarchical
from lightning_fedshard.core.rounds.averaging import (
    apply_weights,
    flat_weights,
    load_mean_over_groups,
    mean_bytes,
    weights_sync_stats,
)
from lightning_fedshard.core.rounds.base import Host, Round, combined
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SITE_SYNC, SyncKind, SyncTransaction

if TYPE_CHECKING:
    from lightning_fedshard.core.step.outer import OuterStep
    from lightning_fedshard.core.step.participation import Participation


class HierarchicalRound(Round):
    """Site syncs at the smaller periods around the federation's round at the largest (see the module).

    Args:
        federation: The federation this round syncs.
        topology: The sites and their periods.
        inner: The federation's round at the largest period.
    """

    def __init__(self, federation: Host, topology: Hierarchical, inner: Round) -> None:
        super().__init__(federation)
        self.topology = topology
        self.inner = inner

    @override
    def is_due(self, step: int) -> bool:
        return self._site_size(step) is not None or self.inner.is_due(step)

    @property
    def num_groups(self) -> int:
        """The groups the federation is planned for: the level of the largest period spans them all."""
        return self.topology.levels[max(self.topology.levels)]

    def _site_size(self, step: int) -> int | None:
        size = self.topology.block_size(step)
        return size if size is not None and size < self.num_groups else None

    @override
    def after_step(self, step: int) -> SyncStats | None:
        stats = [s for s in (self.inner.after_step(step),) if s is not None]
        return self._with_site_sync(stats, step)

    @override
    def take_part(self, kind: SyncKind, step: int) -> SyncStats | None:
        """Take part in the peers' sync at ``step``: their site sync, or the federation's round and a site sync after.

        A group that heals while its site syncs holds the anchor: it adds nothing and takes its site's mean (the
        anchor if no group of its site adds).
        """
        if kind.name == SITE_SYNC:
            return self._with_site_sync([], step)
        return self._with_site_sync([s for s in (self.inner.take_part(kind, step),) if s is not None], step)

    def _with_site_sync(self, stats: list[SyncStats], step: int) -> SyncStats | None:
        """``stats`` of the syncs after ``step`` so far, and the site sync due then, if any."""
        size = self._site_size(step)
        if size is not None:
            if self.federation.groups_may_join:  # no sum may run on the ring while a quorum rebuilds it
                self.inner.await_in_flight()
            blocks = self.topology.blocks(size, self.num_groups)
            extra, rule = self.inner.site_state(), self.federation.participation
            site = average_in_site(self.outer, size, blocks, step, extra, rule, self._since(step))
            if site.lost:  # every shard went back to the anchor
                self.inner.restart_from_anchor()
            stats.append(site)
            self.federation.written()
        return combined(stats, self.config.fragments) if len(stats) > 1 else (stats[0] if stats else None)

    def _since(self, step: int) -> int:
        """The step of the previous sync of any level before ``step`` (every multiple of the smallest period is one)."""
        return step - min(self.topology.levels)

    @override
    def finish(self, step: int) -> list[SyncStats]:
        return self.inner.finish(step)

    @override
    def load_consensus(self) -> None:
        """The exact mean over all groups of their current weights, which a site sync does not change.

        The mean travels on the fed ring, where the sums in flight run: they are awaited first. In an elastic
        federation the consensus is the anchor: a mean over the live groups would need a quorum of its own.
        """
        if self.federation.groups_may_join:
            self.outer.copy_anchor_to_shards()
            return
        self.inner.await_in_flight()
        load_mean_over_groups(self.federation)

    @override
    def in_flight(self) -> list[PendingSync]:
        return self.inner.in_flight()

    @override
    def forget_in_flight(self) -> None:
        self.inner.forget_in_flight()

    @override
    def restart_from_anchor(self) -> None:
        self.inner.restart_from_anchor()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    @override
    def group_state_dict(self) -> dict[str, Any]:
        return self.inner.group_state_dict()

    @override
    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_group_state_dict(state)

    @override
    def state_nbytes(self) -> dict[str, int]:
        return self.inner.state_nbytes()


@torch.no_grad()
def average_in_site(
    outer: OuterStep,
    size: int,
    blocks: Sequence[Sequence[int]] | None = None,
    step: int | None = None,
    extra: Sequence[Tensor] = (),
    participation: Participation | None = None,
    since: int | None = None,
) -> SyncStats:
    """Replace every shard by its mean over this group's block of ``size`` groups; collective.

    Float32, one sum over the block, no outer step. Before anything is written every group learns which groups
    hold NaN/Inf weights, over the fed ring as the outer step does: ``on_nonfinite="raise"`` then raises in every
    group; ``"skip_group"`` leaves a broken group out of its site's mean, and the broken group takes that mean too.
    The mean is plain, or weighted by a ``participation`` rule (a pace: by the steps trained after step ``since``).

    In an elastic federation a site is its groups that take part in the sync (the communicator's participants): a
    group that is gone adds nothing, and a site none of whose groups is left adds nothing to the others. A group that
    joined at this sync adds nothing either and takes its site's mean; if no group of its site adds, it keeps its
    weights (the anchor it healed). A sync the communicator does not commit writes nothing: every shard goes back to
    the anchor, as after a lost outer step.

    Args:
        outer: The outer step whose shards average.
        size: Groups per block.
        blocks: Every block of ``size`` groups (the planned sites); default: consecutive groups.
        step: The optimizer step this sync follows.
        extra: Per-group tensors the site averages too, in place (eager updates' offsets: where each group started).
        participation: Who adds with what weight; ``None``: every healthy group alike.
        since: The optimizer step of the site's previous sync.

    Raises:
        NonFiniteOuterGradientError: If a group's weights hold NaN/Inf and ``on_nonfinite="raise"``, or every group of
            a site's that adds would. No group's weights were changed then.
    """
    start = time.perf_counter()
    communicator = outer.communicator
    transaction = SyncTransaction(outer, SyncKind.site_sync(), step, participation)
    groups = transaction.open()
    if blocks is None:
        blocks = [groups[i : i + size] for i in range(0, len(groups), size)]
    flat = flat_weights(outer.shards)
    transaction.exchange(bool(torch.isfinite(flat).all()), flat.device)
    site = _own_site(transaction, blocks)
    adding = [g for g in transaction.contributors if g in site]
    factor = transaction.mean_weight(adding, since) if since is not None else None
    mean = _mean_in_site(communicator, flat, size, len(adding), transaction.adds, factor)
    flat = mean if mean is not None else flat_weights(outer.shards)  # none adds: joiners keep the anchor they healed
    if extra:
        _average_extra(communicator, extra, size, len(adding), transaction.adds, factor, flat.device)
    broken, joined = transaction.broken, transaction.joined
    norm, drift = apply_weights(outer, flat, tuple({*broken, *joined}) if adding else broken, len(groups))
    committed = transaction.commit()
    if not committed:
        outer.copy_anchor_to_shards()
    sent = site_sum_bytes(communicator, flat.numel(), size, len(blocks), len(groups))
    return _site_sync_stats(outer, transaction, (norm, drift), sent, start, size, committed)


def _site_sync_stats(
    outer: OuterStep,
    transaction: SyncTransaction,
    norms: tuple[float, float],
    sent: int,
    start: float,
    size: int,
    committed: bool,
) -> SyncStats:
    """The statistics of a site sync that began at ``start`` (``norms``: its outer gradient norm and drift)."""
    return weights_sync_stats(
        outer,
        *norms,
        sent,
        time.perf_counter() - start,
        transaction.broken,
        kind="site sync",
        joined_groups=transaction.joined,
        lost=not committed,
        syncs_lost=outer.syncs_lost,
        extra={"site_size": float(size)},
    )


def _mean_in_site(
    communicator: Any, values: Tensor, size: int, count: int, adds: bool, factor: float | None
) -> Tensor | None:
    """``values``, in place, as their mean over the ``count`` groups of the site that add; one float32 sum.

    Each group's values weigh by its ``factor`` (``None``: alike). ``None`` when no group of the site adds.
    """
    if not adds:
        values.zero_()  # adds nothing to its site's sum
    elif factor is not None:
        values.mul_(factor)
    communicator.sum_over_site(values, size)
    return values.div_(count) if count else None


def _own_site(transaction: SyncTransaction, blocks: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """This group's block; raises if a block holds broken groups and none that adds (nothing was changed)."""
    adding, broken, present = set(transaction.contributors), set(transaction.broken), transaction.participants
    stranded = [g for b in blocks if set(b) & broken and not adding & set(b) for g in b if g in present]
    if stranded:
        transaction.fail(stranded)
    (site,) = [block for block in blocks if transaction.group in block]
    return tuple(site)


def site_sum_bytes(communicator: Any, numel: int, size: int, sites: int, groups: int) -> int:
    """Bytes one rank sends to sum ``numel`` float32 values over its site of ``size`` groups (a ring all-reduce).

    Over the site's own process group; or, on a communicator that sums sites over the whole fed ring (an elastic one,
    whose ring changes with every quorum), a ``[sites, numel]`` tensor over the ring of the sync's ``groups``.
    """
    if getattr(communicator, "sums_sites_on_fed_ring", False):
        return mean_bytes(sites * numel, groups)
    return mean_bytes(numel, size)


@torch.no_grad()
def _average_extra(
    communicator: Any,
    extra: Sequence[Tensor],
    size: int,
    healthy: int,
    adds: bool,
    factor: float | None,
    device: torch.device,
) -> None:
    """Replace each of ``extra`` by its mean over the site's healthy groups (one float32 sum over the site).

    Weighted by the groups' ``factor``, as the weights were. With no healthy group in the site each group keeps its
    own (a joiner's, restarted from the anchor).
    """
    flat = _mean_in_site(
        communicator, torch.cat([t.reshape(-1).to(device, torch.float32) for t in extra]), size, healthy, adds, factor
    )
    if flat is None:
        return
    for tensor, part in zip(extra, flat.split([t.numel() for t in extra])):
        tensor.copy_(part.view_as(tensor))
