"""One sync as a transaction: who takes part, who adds nothing, with what weight, and whether it counts.

Every sync of every round (the outer step of a fragment, a site sync, a mix) makes the same moves, written here once:

1. :meth:`SyncTransaction.open` marks the sync (a group that heals meanwhile receives the mark and takes part in the
   same sync) and asks the communicator for the sync's participants, once;
2. :meth:`SyncTransaction.exchange` learns, in one tiny sum of two flags per participant, which groups hold NaN/Inf
   and which joined at this sync; the participation rule (:mod:`~lightning_fedshard.core.step.participation`) names
   the groups it leaves out (*idle*); ``on_nonfinite`` decides whether a broken group ends the sync;
3. :meth:`SyncTransaction.weight` gives this group's factor in the merge (a rule that weighs groups, e.g. by the steps
   each trained);
4. :meth:`SyncTransaction.commit` is the communicator's vote (an elastic federation's; one job always commits): a
   sync that is not committed is counted as lost, and the round puts the groups back where the sync found them.

The kind of a sync is a value (:class:`SyncKind`), not a number: it travels in the heal state of an elastic federation
(:meth:`SyncKind.marker`), so that a group that heals knows which sync its peers are in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch

from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from lightning_fedshard.core.transport.comm import sum_over_model

if TYPE_CHECKING:
    from lightning_fedshard.core.step.participation import Participation
    from lightning_fedshard.core.transport.comm import Communicator

__all__ = ["MIX", "OUTER_STEP", "SITE_SYNC", "OuterStep", "SyncKind", "SyncTransaction"]

#: The kinds of sync, as :class:`SyncKind` names them (also the ``kind`` of their statistics).
OUTER_STEP, SITE_SYNC, MIX = "outer step", "site sync", "mix"
_KINDS = (OUTER_STEP, SITE_SYNC, MIX)


class OuterStep(Protocol):
    """What a sync needs of the outer step (:class:`~lightning_fedshard.core.step.outer.OuterStep`)."""

    communicator: Communicator
    on_nonfinite: str
    num_syncs: int
    syncs_lost: int
    syncing: tuple[str, int | None, int | None] | None


@dataclass(frozen=True)
class SyncKind:
    """What a sync is: an outer step of a fragment, a site sync (every shard) or a mix of a fragment.

    Attributes:
        name: ``"outer step"``, ``"site sync"`` or ``"mix"``.
        fragment: The fragment it moves; ``None`` for a site sync (every shard).
    """

    name: str
    fragment: int | None = None

    def __post_init__(self) -> None:
        if self.name not in _KINDS:
            raise ValueError(f"A sync is one of {list(_KINDS)}, got {self.name!r}.")

    @classmethod
    def outer_step(cls, fragment: int) -> SyncKind:
        """The outer step of ``fragment``."""
        return cls(OUTER_STEP, fragment)

    @classmethod
    def site_sync(cls) -> SyncKind:
        """A site sync: every group's weights become its site's mean."""
        return cls(SITE_SYNC)

    @classmethod
    def mix(cls, fragment: int) -> SyncKind:
        """A mix of ``fragment``'s weights."""
        return cls(MIX, fragment)

    def marker(self, step: int | None) -> tuple[str, int | None, int | None]:
        """This sync after optimizer step ``step`` as plain values (the heal state carries it to a joining group)."""
        return (self.name, self.fragment, step)

    @classmethod
    def from_marker(cls, marker: Sequence[Any]) -> tuple[SyncKind, int]:
        """The kind and step of :meth:`marker`'s value."""
        name, fragment, step = marker
        return cls(str(name), None if fragment is None else int(fragment)), int(step)


class SyncTransaction:
    """One sync's participants, absent groups, this group's weight and vote (see the module).

    Made before the sync starts and opened (:meth:`open`) where the sync waits for its groups. Absent groups are known
    to every rank of the sync once :meth:`exchange` ran.

    Args:
        outer: The outer step whose communicator, counters and ``on_nonfinite`` policy the sync uses.
        kind: What the sync is.
        step: The optimizer step the sync follows (its values are taken then).
        participation: Who adds, and with what weight; ``None``: every participant, alike.
        landing: The optimizer step the sync lands after, when later than ``step`` (a sum that overlaps with
            training): the participation rule decides for the landing's round. Default: ``step``.
    """

    def __init__(
        self,
        outer: OuterStep,
        kind: SyncKind,
        step: int | None,
        participation: Participation | None = None,
        landing: int | None = None,
    ) -> None:
        self.outer = outer
        self.kind = kind
        self.step = step
        self.participation = participation
        self.landing = step if landing is None else landing
        #: The groups taking part, in fed-ring order (known once :meth:`open` ran).
        self.participants: tuple[int, ...] = ()
        #: Participants whose values hold NaN/Inf (left out under ``on_nonfinite="skip_group"``).
        self.broken: tuple[int, ...] = ()
        #: Participants that took the federation's state from a peer at this sync: they add nothing.
        self.joined: tuple[int, ...] = ()
        #: Participants the participation rule leaves out of this sync: they add nothing.
        self.idle: tuple[int, ...] = ()
        #: The factor this group's values took in the merge (:meth:`weight`, asked once), ``None``: alike or absent.
        self.merge_weight: float | None = None

    def open(self) -> tuple[int, ...]:
        """Mark the sync and ask for its participants (once per sync); collective in an elastic federation.

        While the communicator waits for the groups, a peer that heals from this rank reads the mark and takes part in
        this same sync.
        """
        outer = self.outer
        outer.syncing = self.kind.marker(self.step)
        try:
            self.participants = outer.communicator.participants()
        finally:
            outer.syncing = None
        return self.participants

    @property
    def group(self) -> int:
        """This group's index."""
        return self.outer.communicator.group_index

    @property
    def absent(self) -> tuple[int, ...]:
        """The participants that add nothing: broken, joined or idle."""
        return tuple(g for g in self.participants if g in self.broken or g in self.joined or g in self.idle)

    @property
    def adds(self) -> bool:
        """Whether this group adds to the sync."""
        return self.group not in self.absent

    @property
    def contributors(self) -> tuple[int, ...]:
        """The participants that add, in ring order."""
        absent = set(self.absent)
        return tuple(g for g in self.participants if g not in absent)

    def exchange(self, finite: bool, device: torch.device, joined: bool | None = None) -> None:
        """Learn the absent groups: this group's flags against every participant's, in one tiny sum; collective.

        The idle groups come from the participation rule (the same on every rank); the broken and the joined ones from
        two flags per participant, summed over the fed ring and then inside the group. A group that adds nothing
        anyway (joined or idle) is not checked for NaN/Inf.

        Args:
            finite: Whether this group's values are all finite.
            device: Where the flags are summed (the values' device).
            joined: Whether this group joined at this sync; default: the communicator's answer.

        Raises:
            NonFiniteOuterGradientError: If a group is broken and ``on_nonfinite="raise"``. Nothing was changed then.
        """
        rule, landing = self.participation, self.landing
        self.idle = rule.idle(self.participants, landing) if rule is not None and landing is not None else ()
        joined_here = self.outer.communicator.joined() if joined is None else joined
        flags = torch.zeros(2, len(self.participants), dtype=torch.float64, device=device)
        mine = self.participants.index(self.group)
        flags[0, mine] = 0.0 if finite or joined_here or self.group in self.idle else 1.0
        flags[1, mine] = 1.0 if joined_here else 0.0
        sum_over_model(self.outer.communicator, flags.view(-1))
        nonfinite, joining = flags.tolist()
        self.broken = tuple(g for g, f in zip(self.participants, nonfinite) if f > 0)
        self.joined = tuple(g for g, f in zip(self.participants, joining) if f > 0)
        if self.broken and self.outer.on_nonfinite == "raise":
            self.fail(self.broken)

    def fail(self, groups: Sequence[int]) -> NoReturn:
        """Raise for broken ``groups`` that this sync cannot leave out (nothing was changed).

        Raises:
            NonFiniteOuterGradientError: Always.
        """
        outer = self.outer
        raise NonFiniteOuterGradientError(groups, outer.num_syncs, self.step, self.kind.name, outer.on_nonfinite)

    def weight(self) -> float | None:
        """This group's factor in the merge; ``None``: every contributor alike.

        Asked once per sync, after :meth:`exchange` (a rule may record the merge it decides).
        """
        rule, step, fragment = self.participation, self.step, self.kind.fragment
        if rule is None or step is None or fragment is None:
            return None
        self.merge_weight = rule.weight(fragment, step, self.contributors, self.group)
        return self.merge_weight

    def mean_weight(self, among: Sequence[int], since: int) -> float | None:
        """This group's factor in a mean of the weights over ``among``, trained after step ``since``; ``None``: alike.

        ``among``: the groups that add to this group's sum (e.g. its site's). Asked once per sync, after
        :meth:`exchange`.
        """
        rule, step = self.participation, self.step
        if rule is None or step is None or self.group not in among:
            return None
        self.merge_weight = rule.mean_weight(since, step, tuple(among), self.group)
        return self.merge_weight

    def column_weights(self, since: int) -> list[float] | None:
        """Every participant's factor in a mix of the weights, by position (an absent group's column is gone anyway).

        ``since``: the mix holds what the steps after it trained. ``None``: alike. Collective-free: the rule answers
        for every group the same on every rank.
        """
        rule, step = self.participation, self.step
        if rule is None or step is None:
            return None
        adding = self.contributors
        factors = [rule.mean_weight(since, step, adding, g) if g in adding else 1.0 for g in self.participants]
        return None if any(f is None for f in factors) else [float(f) for f in factors if f is not None]

    def commit(self, count_lost: bool = True) -> bool:
        """The communicator's vote on this sync: an elastic federation's, or ``True`` (one job always commits).

        It closes the sync: every collective of the sync must come before it (groups may vote differently, and a group
        that voted no must not wait in a collective the others never make). The vote covers what this rank did since
        the last vote, sums in flight included. With ``count_lost`` a vote that fails counts this sync lost (a round
        that votes for its sums in flight counts each of them itself).
        """
        committed = self.outer.communicator.should_commit()
        if not committed and count_lost:
            self.outer.syncs_lost += 1
        return committed

    @classmethod
    def restored(
        cls,
        outer: OuterStep,
        kind: SyncKind,
        step: int | None,
        participants: tuple[int, ...],
        broken: tuple[int, ...] = (),
        joined: tuple[int, ...] = (),
        idle: tuple[int, ...] = (),
    ) -> SyncTransaction:
        """A transaction opened and exchanged before a checkpoint, as it was then (a sum in flight that was saved)."""
        transaction = cls(outer, kind, step)
        transaction.participants = participants
        transaction.broken, transaction.joined, transaction.idle = broken, joined, idle
        return transaction
