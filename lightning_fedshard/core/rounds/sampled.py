"""Sampled participation (FedAvg, Photon): the outer step on the mean of the groups sampled for the round.

Every group trains every step; at each landing only the groups that ``Sampled(..., outer_step=True)`` samples for the
landing's round add their pseudo-gradient, the others take part in the collective with zeros (they are *idle*), and
the mean divides by the sampled groups. The anchor takes the outer step (any outer optimizer) on that mean and every
group, sampled or not, restarts from the new anchor, exactly as in the plain round: fragments, ``sync_delay`` and
``merge_alpha`` work as there.

The landing after optimizer step ``s`` belongs to round ``(s - 1) // sync_every``: with one fragment round ``r`` lands
after step ``(r + 1) sync_every``; with ``P`` fragments the ``P`` landings of one ``sync_every``-step period share the
round's sample. With ``sync_delay`` a sum starts before its landing and already leaves out the groups of the landing's
round. The end of training takes the plain round's final outer step on every group, so the run ends on the consensus.

The sample is drawn among the sync's participants, in ring order: ``sample(round, len(participants))`` gives positions
into them. Without an elastic federation the participants are every group, ``(0, ..., G - 1)``; in an elastic one
they are the live groups of the sync's quorum, and with fewer of them than ``groups_per_round`` every one is sampled.
A group that joined at the sync adds nothing, sampled or not; when the sample holds only such groups there is no outer
step, and every group restarts from the anchor as it is.
"""

from __future__ import annotations

from typing_extensions import override

from lightning_fedshard.core.options.outer_topology import Sampled
from lightning_fedshard.core.rounds.base import Host
from lightning_fedshard.core.rounds.plain import PlainRound
from lightning_fedshard.core.step.participation import Participation, SampledGroups, combine
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.wire.pending import PendingSync


class SampledRound(PlainRound):
    """The plain round whose landings take the mean over the round's sampled groups only (see the module).

    Args:
        federation: The federation this round syncs.
        topology: The sampling schedule (``Sampled(..., outer_step=True)``).
        period: Optimizer steps between two landings of one fragment (``sync_every``): the length of a round.
    """

    def __init__(self, federation: Host, topology: Sampled, period: int) -> None:
        super().__init__(federation, period)
        self.topology = topology
        self.sampled = SampledGroups(topology, period)

    @property
    @override
    def participation(self) -> Participation | None:
        """The round's sample, with the federation's rule (a per-group pace)."""
        return combine(self.sampled, self.federation.participation)

    @override
    def _complete(self, pending: PendingSync, step: int, merge_alpha: float, carry_lost: bool = False) -> SyncStats:
        """As the plain round's; a sample of joining groups only moves no anchor, and every group restarts from it."""
        stats = super()._complete(pending, step, merge_alpha, carry_lost)
        if pending.contributors == 0:
            self.outer.copy_anchor_to_shards(pending.fragment)
            self.federation.written()
        return stats
