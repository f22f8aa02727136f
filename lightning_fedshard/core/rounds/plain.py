"""The plain round: fragments land in turn, each sum optionally overlapped with ``sync_delay`` steps.

Every ``period / fragments`` optimizer steps one fragment lands: the outer step on the groups' mean pseudo-gradient
(with sampled outer steps, ``Sampled(..., outer_step=True)``, the mean of the groups the federation's participation
samples for the landing's round: the others take part with zeros and restart from the new anchor),
after which every group holds ``anchor + merge_alpha * (local - anchor)`` (the anchor itself with the default
``merge_alpha=0``). With ``sync_delay = d`` the pseudo-gradient is taken ``d`` steps before the landing and summed in
the background meanwhile.

A sync that is lost (an elastic group gone inside the sum: the communicator does not commit it) leaves the anchor and
every group's weights as they are: the group's training carries on, and the fragment's next sync sums the
pseudo-gradient of both rounds. At the end of training every group takes the anchor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_fedshard.core.rounds.base import Host, OnePendingRound, drop
from lightning_fedshard.core.step.fragments import landing_fragment, starting_fragment
from lightning_fedshard.core.step.participation import Participation
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction

if TYPE_CHECKING:
    pass


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
        stats = self._complete(pending, step, config.merge_alpha, carry_lost=True)
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
        """Who adds to this round's outer steps, and with what weight: the federation's rule (a pace, a sample)."""
        return self.federation.participation

    def transaction(self, fragment: int, step: int, landing: int | None = None, final: bool = False) -> SyncTransaction:
        """The outer step of ``fragment`` whose pseudo-gradient is taken after ``step`` and lands after ``landing``.

        ``final``: the end of training, where every group adds (a sample no longer applies; a pace still weighs).
        """
        rule = self.participation
        if final and rule is not None:
            rule = rule.at_end()
        return SyncTransaction(self.outer, SyncKind.outer_step(fragment), step, rule, landing)

    def sync(self, step: int, fragment: int = 0) -> SyncStats:
        """One fragment's outer step now, synchronously (every group restarts from the new anchor); collective."""
        pending = self.outer.begin(self.transaction(fragment, step, final=True), background=False)
        return self._complete(pending, step, 0.0)

    def _complete(self, pending: PendingSync, step: int, merge_alpha: float, carry_lost: bool = False) -> SyncStats:
        """Land ``pending``; with ``carry_lost`` a lost sync leaves each group's round to the next sync.

        The end of training (:meth:`finish`) puts the anchor back in, so every group ends on it.
        """
        stats = self.outer.complete(pending, step=step, merge_alpha=merge_alpha, carry_lost=carry_lost)
        if pending.contributors == 0:  # no group added (a sample of joining groups): every group takes the anchor
            self.outer.copy_anchor_to_shards(pending.fragment)
        self.federation.written()
        self.federation.last_synced_step = self.federation.landed_at[pending.fragment] = step
        return stats

    @override
    def finish(self, step: int) -> list[SyncStats]:
        """A sum in flight is dropped; every fragment that did not land at ``step`` takes one synchronous outer step.

        A fragment that landed at ``step`` gets the anchor copied in: the new one with ``merge_alpha > 0``, and the one
        it kept if that sync was lost (its round was carried, and no sync follows).
        """
        self.forget_in_flight()
        synced = []
        for fragment in range(self.config.fragments):
            if self.federation.landed_at[fragment] == step:
                self.outer.copy_anchor_to_shards(fragment)
                self.federation.written()
                continue
            synced.append(self.sync(step, fragment))
        return synced

    @override
    def load_consensus(self) -> None:
        """The anchor."""
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
            self._pending = PendingSync.from_state_dict(pending, self.outer.shards[0].device, self.outer)
