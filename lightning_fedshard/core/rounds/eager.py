"""Eager updates (arXiv 2502.12996): each fragment's sum over the groups overlaps with the whole next round.

With ``d_g`` group ``g``'s pseudo-gradient of the round that just ended (from where the group started it), ``m`` the
mean over the groups of the previous round's, landing now, ``G`` the healthy groups and ``lr`` the fragment's outer
learning rate, a fragment's sync is::

    anchor = outer_optimizer.step(anchor, grad=m)      # every group alike: the anchor is the consensus
    start  = anchor - lr * d_g / G                     # this group's own share of the sum now in flight
    shards = start                                     # the next round starts there

(``start = anchor - lr * d_g`` with ``eager_rule="local"``), and the mean of the ``d_g`` is summed in the background
until the fragment's next sync. At the end of training every fragment lands its sum in flight and syncs what it
trained since, at once; every group ends on the anchor. Nothing a group trains is thrown away.

In an elastic federation a sum starts over the groups of its sync's quorum, divides by those of them that add, and
lands at the fragment's next sync on every group of that sync, a group that joined meanwhile included: it receives the
sums in flight (completed) when it heals, starts its rounds from the anchor and adds nothing to the sum of the sync it
joins. Each sync there completes every sum in flight before its vote and its quorum, so a sum overlaps with
``period / fragments`` steps rather than a whole round; a vote that fails (a group died) loses the landing and every
sum in flight (see :meth:`EagerRound.land`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fedshard.core.rounds.base import Host, Refusal, Round, drop
from lightning_fedshard.core.step.fragments import landing_fragment
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction
from lightning_fedshard.core.wire.norms import nbytes


class EagerRound(Round):
    """Fragments whose sums land a whole round after they started (see the module's description).

    Args:
        federation: The federation this round syncs.
        period: Optimizer steps between two syncs of one fragment.

    With sampled participation (``Sampled(..., outer_step=True)``, a rule of the federation's participation) a sum
    started at a sync adds the pseudo-gradients of the groups the sync's round samples only, and divides by them; a
    group left out restarts from the anchor (no share of the sum). The end of training takes every group.
    """

    refuses = {
        "sync_delay": Refusal("eager updates already overlap each sum with a whole round", impossible=True),
        "merge_alpha": Refusal("eager updates keep all local progress, there is nothing to merge", impossible=True),
    }

    def __init__(self, federation: Host, period: int) -> None:
        super().__init__(federation)
        self.period = period
        self.rule = federation.config.eager_rule or "share"
        self._sums: dict[int, PendingSync] = {}  # each fragment's sum in flight until its next sync
        #: Per fragment, how far this group's start of the round lies below the anchor (flat, float32).
        self.offsets: list[Tensor | None] = [None] * federation.config.fragments
        self._blocked = 0.0  # seconds eager steps blocked the loop since the last one that landed a sum

    @override
    def is_due(self, step: int) -> bool:
        due = landing_fragment(step, self.period, self.config.fragments) is not None
        return due and step > self.federation.last_synced_step

    @override
    def after_step(self, step: int) -> SyncStats | None:
        if not self.is_due(step):
            return None
        fragment = landing_fragment(step, self.period, self.config.fragments)
        assert fragment is not None
        stats, started = self.step(fragment, self._sums.pop(fragment, None), step)
        assert started is not None  # only the end of training lands everything
        self._sums[fragment] = started
        self.federation.written()
        self.federation.last_synced_step = self.federation.landed_at[fragment] = step
        return None if stats is None else replace(stats, num_fragments=self.config.fragments)

    @override
    def take_part(self, kind: SyncKind, step: int) -> SyncStats | None:
        """Take part in the peers' sync of ``fragment`` at ``step``, adding nothing (a group that just healed).

        The group holds the anchor (no offset) and the peers' sums in flight (from :meth:`state_dict`), which land at
        their fragments' next syncs as the peers' do. It casts no vote here: the peers voted before this quorum.
        """
        fragment = kind.fragment
        assert fragment is not None
        _, started = self.step(fragment, None, step, vote=False)
        assert started is not None
        self._sums[fragment] = started
        self.federation.written()
        self.federation.last_synced_step = self.federation.landed_at[fragment] = step
        return None

    @torch.no_grad()
    def step(
        self,
        fragment: int,
        pending: PendingSync | None,
        step: int | None = None,
        final: bool = False,
        vote: bool = True,
    ) -> tuple[SyncStats | None, PendingSync | None]:
        """One eager update of a fragment: land the previous round's sum, start this round's; collective.

        Args:
            fragment: Which fragment.
            pending: The fragment's sum started at its previous sync (``None`` at its first).
            step: The optimizer step after which this runs.
            final: Land everything now (no sum left in flight): every group ends on the anchor.
            vote: In an elastic federation, vote on the sums in flight when none lands (see :meth:`land`); a group
                that joins the peers' sync does not.

        Returns:
            The statistics of the sum that landed (``None`` if none did) and the sum now in flight (``None`` when
            ``final``).

        Raises:
            NonFiniteOuterGradientError: As for the outer step, after the previous round's sum landed on the anchor
                (the shards are left as they are).
        """
        outer = self.outer
        clock = time.perf_counter()
        if pending is not None:
            self._detach_result(pending)  # the fragment's buffer is free again
        if self.federation.groups_may_join:
            self._complete_in_flight()
        taken = outer.pseudogradient(fragment, self.offsets[fragment])
        own = None if final else self._own_copy(fragment, taken[0])  # before a sum in place overwrites the buffer
        landed = self.land(pending, step, vote)
        rule = self.federation.participation
        if final and rule is not None:
            rule = rule.at_end()  # every group adds at the end (a pace still weighs)
        transaction = SyncTransaction(outer, SyncKind.outer_step(fragment), step, rule)
        started = outer.begin(transaction, background=not final, taken=taken)
        if own is None:
            final_stats = outer.complete(started, step=step)
            self.offsets[fragment] = None
            return final_stats if landed is None else _both(landed, final_stats), None
        self._start_from_own_share(fragment, own, started, transaction.merge_weight)
        # The loop was blocked for all of this call; a call that landed nothing hands its time to the next landing.
        self._blocked += time.perf_counter() - clock
        if landed is None:
            return None, started
        blocked, self._blocked = self._blocked, 0.0
        return replace(landed, exposed_seconds=blocked), started

    @override
    def finish(self, step: int) -> list[SyncStats]:
        """Every fragment lands its sum in flight; those that trained since it started also sync what they did.

        The final sums run in this thread over the ring the background sums use, so every sum in flight is awaited
        first.
        """
        self.await_in_flight()
        synced = []
        for fragment in range(self.config.fragments):
            pending = self._sums.pop(fragment, None)
            if self.federation.landed_at[fragment] == step:
                stats = self._settle(fragment, pending, step)
            else:
                stats, _ = self.step(fragment, pending, step, final=True)
                self.federation.landed_at[fragment] = step
            if stats is not None:
                synced.append(stats)
        self.federation.written()
        self.federation.last_synced_step = step
        return synced

    def _settle(self, fragment: int, pending: PendingSync | None, step: int) -> SyncStats | None:
        """Land a sum in flight and put every group on the anchor, with nothing trained since it started."""
        stats = self.land(pending, step)
        self.outer.copy_anchor_to_shards(fragment)
        self.offsets[fragment] = None
        return stats

    @override
    @torch.no_grad()
    def load_consensus(self) -> None:
        """Each fragment's anchor as it will be once its sum in flight has landed.

        A fragment's sum lands a round after it started, so the anchor alone lags the groups by a round; the consensus
        that validation sees includes every round trained so far. Waits for the sums (collective, in start order).
        """
        outer = self.outer
        outer.copy_anchor_to_shards()
        self.await_in_flight()
        for fragment in sorted(self._sums):
            for i, anchor in zip(outer.fragments[fragment], self.projected_anchor(self._sums[fragment])):
                outer.shards[i].copy_(anchor)

    @torch.no_grad()
    def projected_anchor(self, pending: PendingSync) -> list[Tensor]:
        """The fragment's anchor once ``pending``'s sum has landed, computed on copies (nothing changes here).

        Waits for the sum. The fragment's outer optimizer steps a copy of the anchor from a copy of its state.
        """
        outer = self.outer
        mean = pending.result() / pending.contributors
        anchors = [outer.anchor[i].detach().clone().requires_grad_(True) for i in outer.fragments[pending.fragment]]
        optimizer = outer.optimizers[pending.fragment]
        trial = type(optimizer)(anchors, **optimizer.defaults)
        trial.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        offset = 0
        for anchor in anchors:
            anchor.grad = mean[offset : offset + anchor.numel()].view_as(anchor).to(anchor.device, anchor.dtype)
            offset += anchor.numel()
        trial.step()
        return [a.detach() for a in anchors]

    def land(self, pending: PendingSync | None, step: int | None, vote: bool = True) -> SyncStats | None:
        """Land ``pending``'s sum on the anchor (the shards are the caller's); ``None`` if nothing lands.

        In an elastic federation each sync ends the period of the quorum before it with torchft's vote: the vote of a
        landing, or one of its own when a sum is in flight and none lands (with ``vote``). Every sum in flight was
        completed before the vote, so it covers each of them. A vote that fails (a group died or a sum between groups
        failed) loses the landing (the anchor stays) and every sum in flight: none of them lands, their fragments'
        error-feedback residuals are reset, and each of those fragments' next round starts from the anchor as it is.
        Every group that failed the vote drops the same sums; one that committed keeps them, and a group behind it
        heals from it at the next quorum.
        """
        outer = self.outer
        stats = outer.complete(pending, step=step, write=False) if pending is not None else None
        if stats is not None:
            committed = not stats.lost
        else:
            ask = self.federation.groups_may_join and vote and bool(self._sums)
            # No sum lands: the sums in flight vote (the first started's transaction), each counted lost below.
            committed = not ask or self.in_flight()[0].transaction.commit(count_lost=False)
        if not committed and self.federation.groups_may_join:
            for fragment in sorted(self._sums):
                del self._sums[fragment]  # completed before the vote: nothing runs on in the background
                outer.reducers[fragment].reset_residual()
                outer.syncs_lost += 1
        return stats

    def _complete_in_flight(self) -> None:
        """Complete every sum in flight in this thread, before this sync's vote and quorum (elastic).

        A sum then never runs while the quorum rebuilds the ring between groups, its failure is known to this sync's
        vote, and a peer that heals from this group receives each sum completed: torchft's thread serializes them
        without waiting for the background thread or running a collective inside the group.
        """
        self.await_in_flight()

    def _detach_result(self, pending: PendingSync) -> None:
        """Wait for ``pending``'s sum and make sure it does not live in the fragment's buffer (summed in place)."""
        result = pending.result()
        buffer = self.outer.flat_buffer(pending.fragment)
        if buffer is not None and result.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            pending._result = result.clone()

    def _own_copy(self, fragment: int, local: Tensor) -> Tensor:
        """A float32 copy of this group's pseudo-gradient, where the anchor lives."""
        device = self.outer.anchor[self.outer.fragments[fragment][0]].device
        return local.to(device=device, dtype=torch.float32, copy=True)

    def _start_from_own_share(
        self, fragment: int, offset: Tensor, pending: PendingSync, weight: float | None = None
    ) -> None:
        """Write ``anchor - lr * d_g / G`` (or ``lr * d_g``) into the fragment's shards and keep the offset.

        ``offset`` holds ``d_g`` on the way in. With a per-group pace the group's share is its term of the weighted
        merge in flight: ``d_g`` times the factor ``weight`` it took in the sum.
        """
        outer = self.outer
        if pending.absent(outer.communicator.group_index):
            offset.zero_()  # a skipped group adds nothing to the sum and restarts from the anchor
        share = (1.0 if weight is None else weight) / pending.contributors if self.rule == "share" else 1.0
        offset.mul_(float(outer.optimizers[fragment].param_groups[0]["lr"]) * share)
        self.offsets[fragment] = offset
        start = 0
        for i in outer.fragments[fragment]:
            shard, anchor = outer.shards[i], outer.anchor[i]
            part = offset[start : start + anchor.numel()].view_as(anchor)
            shard.copy_((anchor - part).to(shard.device, non_blocking=True))
            start += anchor.numel()

    @override
    def in_flight(self) -> list[PendingSync]:
        return sorted(self._sums.values(), key=lambda p: (p.started_at or 0, p.fragment))

    @override
    def forget_in_flight(self) -> None:
        for fragment in sorted(self._sums):
            drop(self._sums.pop(fragment))

    @property
    def sums(self) -> dict[int, PendingSync]:
        """Each fragment's sum in flight, by fragment."""
        return self._sums

    @override
    def site_state(self) -> list[Tensor]:
        """The offsets of the fragments that synced: a site sync averages where its groups started their rounds."""
        return [o for o in self.offsets if o is not None]

    @override
    def restart_from_anchor(self) -> None:
        self.offsets = [None] * len(self.offsets)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"eager": {f: self._sums[f].state_dict() for f in sorted(self._sums)}}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.outer.shards[0].device
        sums = state.get("eager", {}).items()
        self._sums = {int(f): PendingSync.from_state_dict(s, device, self.outer) for f, s in sums}

    @override
    def group_state_dict(self) -> dict[str, Any]:
        return {"offsets": [None if o is None else o.detach().clone() for o in self.offsets]}

    @override
    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        outer = self.outer
        for fragment, offset in enumerate(state.get("offsets", [None] * len(self.offsets))):
            device = outer.anchor[outer.fragments[fragment][0]].device
            self.offsets[fragment] = None if offset is None else offset.to(device, torch.float32, copy=True)

    @override
    def state_nbytes(self) -> dict[str, int]:
        return {"eager_offsets": nbytes(self.offsets)}


def _both(first: SyncStats, second: SyncStats) -> SyncStats:
    """One record for two syncs of a fragment in a row: the second's norms, both's bytes and seconds."""
    return replace(
        second,
        bytes_sent=first.bytes_sent + second.bytes_sent,
        exposed_seconds=first.exposed_seconds + second.exposed_seconds,
    )
