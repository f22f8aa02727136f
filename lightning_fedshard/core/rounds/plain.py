"""The plain round: fragments land in turn, each sum optionally overlapped with ``sync_delay`` steps.

Every ``period / fragments`` optimizer steps one fragment lands: the outer step on the groups' mean pseudo-gradient,
after which every group holds ``anchor + merge_alpha * (local - anchor)`` (the anchor itself with the default
``merge_alpha=0``). With ``sync_delay = d`` the pseudo-gradient is taken ``d`` steps before the landing and summed in
the background meanwhile. With ``error_feedback="weights"`` a landing leaves each group at ``anchor - residual``: what
its encoding did not send stays in its own weights.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_fedshard.core.fragments import landing_fragment, starting_fragment
from lightning_fedshard.core.rounds.averaging import load_mean_over_groups, mean_bytes, mean_weights, write_weights
from lightning_fedshard.core.rounds.base import Host, OnePendingRound, Refusal, drop
from lightning_fedshard.core.step.participation import Participation
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction
from lightning_fedshard.core.wire.pending import PendingSync

if TYPE_CHECKING:
    from lightning_fedshard.core.step.outer import OuterStep


#: What error feedback in the weights (a landing policy of the plain round) does not run.
FEEDBACK_IN_WEIGHTS_REFUSES = {
    "merge_alpha": Refusal("the merged weights and the residual kept in them are not defined together"),
    "sampled_outer_step": Refusal("a group left out of a round would keep the residual of a sum it added nothing to"),
}


class PlainRound(OnePendingRound):
    """Fragments that land in turn every ``period / fragments`` steps (see the module's description).

    Args:
        federation: The federation this round syncs.
        period: Optimizer steps between two landings of one fragment (``sync_every``; a hierarchical topology's
            largest period).
    """

    def __init__(self, federation: Host, period: int) -> None:
        super().__init__(federation)
        self.period = period

    @override
    def is_due(self, step: int) -> bool:
        due = landing_fragment(step, self.period, self.config.fragments) is not None
        return due and step > self.federation.last_synced_step

    @override
    def after_step(self, step: int) -> SyncStats | None:
        stats = self.land(step) if self.is_due(step) else None
        config = self.config
        starting = starting_fragment(step, self.period, config.fragments, config.sync_delay)
        if starting is not None:
            landing = step + config.sync_delay
            self._pending = self.outer.begin(self.transaction(starting, step, landing), background=True)
        return stats

    def land(self, step: int) -> SyncStats:
        """Land the fragment due after ``step``: its sum in flight, or one taken now; collective."""
        config = self.config
        fragment = landing_fragment(step, self.period, config.fragments)
        assert fragment is not None
        pending, self._pending = self._pending, None
        if pending is None or pending.fragment != fragment:  # no overlap (sync_delay=0), or resumed without one
            drop(pending)
            pending = self.outer.begin(self.transaction(fragment, step), background=False)
        stats = self._complete(pending, step, config.merge_alpha)
        since_snapshot = step - pending.started_at if pending.started_at is not None else 0
        discarded = (1.0 - config.merge_alpha) * since_snapshot / self.period
        return replace(stats, num_fragments=config.fragments, discarded_fraction=discarded)

    @override
    def take_part(self, kind: SyncKind, step: int) -> SyncStats | None:
        """Land the peers' sync now, or start its sum when it overlaps with training (``sync_delay > 0``)."""
        if self.config.sync_delay == 0:
            return self.land(step)
        fragment = kind.fragment
        assert fragment is not None
        landing = step + self.config.sync_delay
        self._pending = self.outer.begin(self.transaction(fragment, step, landing), background=True)
        return None

    @property
    def participation(self) -> Participation | None:
        """Who adds to this round's outer steps, and with what weight: the federation's rule (a per-group pace)."""
        return self.federation.participation

    def transaction(self, fragment: int, step: int, landing: int | None = None, final: bool = False) -> SyncTransaction:
        """The outer step of ``fragment`` whose pseudo-gradient is taken after ``step`` and lands after ``landing``.

        ``final``: the end of training, where every group adds (a sample no longer applies; a pace still weighs).
        """
        rule = self.federation.participation if final else self.participation
        return SyncTransaction(self.outer, SyncKind.outer_step(fragment), step, rule, landing)

    def sync(self, step: int, fragment: int = 0) -> SyncStats:
        """One fragment's outer step now, synchronously (every group restarts from the new anchor); collective."""
        pending = self.outer.begin(self.transaction(fragment, step, final=True), background=False)
        return self._complete(pending, step, 0.0)

    def _complete(self, pending: PendingSync, step: int, merge_alpha: float) -> SyncStats:
        stats = self.outer.complete(pending, step=step, merge_alpha=merge_alpha)
        if self.config.feedback_in_weights and not stats.lost:
            residual_into_weights(self.outer, pending.fragment)
        self.federation.written()
        self.federation.last_synced_step = self.federation.landed_at[pending.fragment] = step
        return stats

    @override
    def finish(self, step: int) -> list[SyncStats]:
        """A sum in flight is dropped; every fragment that did not land at ``step`` takes one synchronous outer step.

        A fragment that landed at ``step`` with ``merge_alpha > 0`` gets the new anchor copied in. With
        ``error_feedback="weights"`` the groups then take the exact mean of their weights, which becomes the anchor.
        """
        self.forget_in_flight()
        synced = []
        for fragment in range(self.config.fragments):
            if self.federation.landed_at[fragment] == step:
                if self.config.merge_alpha > 0:
                    self.outer.copy_anchor_to_shards(fragment)
                    self.federation.written()
                continue
            synced.append(self.sync(step, fragment))
        if self.config.feedback_in_weights and len(self.federation.communicator.participants()) > 1:
            synced.insert(0, agree_on_mean(self.outer))  # counted in the bytes; the norms are the last sync's
            self.federation.written()
        return synced

    @override
    def load_consensus(self) -> None:
        """The anchor; with ``error_feedback="weights"`` the exact mean of the groups' weights (they differ)."""
        if self.config.feedback_in_weights:
            self.await_in_flight()  # the mean travels on the fed ring, where the sum in flight runs
            load_mean_over_groups(self.federation)
        else:
            self.outer.copy_anchor_to_shards()

    @property
    def pending(self) -> PendingSync | None:
        """The fragment sum in flight, if any."""
        return self._pending

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"pending": self._pending.state_dict() if self._pending is not None else None}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        pending = state.get("pending")
        self._pending = None
        if pending is not None:
            self._pending = PendingSync.from_state_dict(pending, self.outer.shards[0].device)
            if not self._pending.participants:  # saved before syncs recorded their participants: every group
                self._pending.participants = self.federation.communicator.participants()


@torch.no_grad()
def residual_into_weights(outer: OuterStep, fragment: int) -> None:
    """This group keeps what its encoding dropped: the fragment's shards become ``anchor - residual``.

    The residual leaves the reducer (its next sync adds nothing): the next pseudo-gradient ``anchor - shard`` already
    holds it. With ``R`` replicas each kept the residual of the part it encoded; the parts are gathered inside the
    group (float32, the replicate axis only).
    """
    residual = outer.reducers[fragment].take_residual()
    if residual is None:  # nothing was encoded (a single group)
        return
    indices = outer.fragments[fragment]
    flat = residual.reshape(-1).to(outer.shards[indices[0]].device)
    replicas = outer.communicator.num_replicas
    if replicas > 1:
        parts = torch.empty(replicas * flat.numel(), dtype=flat.dtype, device=flat.device)
        outer.communicator.gather_replicas(parts, flat)
        flat = parts
    offset = 0
    for i in indices:
        shard = outer.shards[i]
        n = shard.numel()
        shard.sub_(flat[offset : offset + n].view_as(shard).to(shard.dtype))
        offset += n


@torch.no_grad()
def agree_on_mean(outer: OuterStep) -> SyncStats:
    """Every group's shards and the anchor become the exact float32 mean of the groups' weights; collective.

    The end of training with ``error_feedback="weights"``: the groups differ by what they have not sent, their mean is
    the consensus. No outer step (the outer optimizer does not change).
    """
    start = time.perf_counter()
    groups = len(outer.communicator.participants())
    flat = mean_weights(outer)
    write_weights(outer.shards, flat)
    for anchor, shard in zip(outer.anchor, outer.shards):
        anchor.copy_(shard.detach().reshape(anchor.shape))
    seconds = time.perf_counter() - start
    sent = mean_bytes(flat.numel(), groups)
    return SyncStats(0.0, 0.0, sent, seconds, outer.num_syncs, exposed_seconds=seconds, site_syncs=outer.site_syncs)
