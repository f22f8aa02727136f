"""Who adds to a sync, and with what weight: the participation rules of a federation.

A rule answers two questions of every outer step (:class:`~lightning_fedshard.core.step.transaction.SyncTransaction`
asks them, once per sync, the same on every rank):

- :meth:`Participation.idle`: which of the sync's participants it leaves out (they take part in the collective with
  zeros, and restart from the new anchor like everyone else);
- :meth:`Participation.weight`: this group's factor in the merge, given the groups that add (``None``: alike);
  :meth:`Participation.mean_weight` the same for a mean of the weights themselves (a site sync).

Like a round, a rule declares the switches it does not run yet (:attr:`Participation.refuses`); the compatibility
table (:mod:`~lightning_fedshard.core.rounds.options`) is derived from the declarations. A new rule is one class: its
answers and its refusals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lightning_fedshard.core.options.pace import PaceSchedule, median_seconds
from lightning_fedshard.core.options.refusal import Refusal

if TYPE_CHECKING:
    from lightning_fedshard.core.options.outer_topology import Sampled
    from lightning_fedshard.core.transport.comm import Communicator

__all__ = ["Everyone", "Paced", "Participation", "Probation", "SampledGroups", "combine"]


class Participation:
    """Every participant adds, alike: the base of every rule (see the module)."""

    #: The switches (:mod:`~lightning_fedshard.core.rounds.options`) this rule does not run, and why.
    refuses: ClassVar[dict[str, Refusal]] = {}

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        """The participants that add nothing to the sync landing after optimizer step ``landing``."""
        return ()

    def weight(self, fragment: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        """``group``'s factor in the merge of ``fragment``'s values taken after ``step``; ``None``: alike."""
        return None

    def mean_weight(self, since: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        """``group``'s factor in a mean of the weights themselves (a site sync, a mix); ``None``: alike.

        ``since``/``step``: the optimizer steps whose training the weights hold since the previous sync. A mix asks
        for every group's factor: the answer must be the same on every rank.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """What the rule keeps between syncs (checkpoints, and a joining group's heal); nothing by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class Everyone(Participation):
    """Every participant adds to every sync, with the same weight (the default)."""


class SampledGroups(Participation):
    """Only the groups sampled for the landing's round add (``Sampled(..., outer_step=True)``).

    The landing after optimizer step ``s`` belongs to round ``(s - 1) // period``; the sample is drawn by position
    among the sync's participants, in ring order (in an elastic federation: the live groups of the quorum).

    Args:
        topology: The sampling schedule.
        period: Optimizer steps of one round (``sync_every``).
    """

    def __init__(self, topology: Sampled, period: int) -> None:
        self.topology = topology
        self.period = period

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        """The participants the landing's round did not sample."""
        chosen = set(self.topology.sample((landing - 1) // self.period, len(participants)))
        return tuple(g for position, g in enumerate(participants) if position not in chosen)


class Paced(Participation):
    """Groups of different speeds (``pace=Pace(...)``): each weighs by the steps it trained since the last landing.

    See :mod:`~lightning_fedshard.core.options.pace` for the merge rules. The merge a sync decides is recorded in the
    schedule (a resume and a joining group replay it). A measured pace also times the steps this group trains and
    exchanges the times at the end of each round (:meth:`time_step`).

    Args:
        schedule: The steps every group trains in every round.
        landed: The optimizer step a fragment last landed after (the federation's schedule).
        communicator: The collectives of the timings' exchange (tiny, on the statistics ring).
    """

    #: The sync options a per-group pace does not run yet, and why.
    refuses: ClassVar[dict[str, Refusal]] = {
        "sparseloco": Refusal("its median clip and per-coordinate mean would re-weigh the groups' weighted updates"),
    }

    def __init__(self, schedule: PaceSchedule, landed: Callable[[int], int], communicator: Communicator) -> None:
        self.schedule = schedule
        self.landed = landed
        self.communicator = communicator
        self._step_ended: float | None = None
        self._durations: list[float] = []

    def weight(self, fragment: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        """``group``'s factor from the steps each contributor trained since ``fragment`` last landed."""
        after = self.landed(fragment)
        self.schedule.record(step, fragment, after, contributors)
        return self.schedule.weights(after, step, contributors, group)

    def mean_weight(self, since: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        """``group``'s factor by the steps each contributor trained in ``(since, step]``, every token alike.

        A mean of the weights (a site sync) has no common start to normalize updates against, so it always weighs by
        tokens, whatever the pace's ``merge``.
        """
        return self.schedule.weights(since, step, contributors, group, merge="tokens")

    def time_step(self, step: int, trained: bool) -> None:
        """Optimizer step ``step`` ended (``trained``: this group trained it); collective at a round's end.

        A measured pace times the steps this group trained; the groups agree on what comes next at a round's end, and
        once early in the first round (after :data:`~lightning_fedshard.core.options.pace.PROBE_STEPS` steps), so
        that the first round is paced too.
        """
        schedule = self.schedule
        now = time.perf_counter()
        if self._step_ended is not None and trained:
            self._durations.append(now - self._step_ended)
        if schedule.pace.measured and (step % schedule.period == 0 or schedule.probes(step)):
            schedule.observe(self._exchange_seconds(median_seconds(self._durations)))
            self._durations = []
        self._step_ended = time.perf_counter()

    def _exchange_seconds(self, seconds: float) -> list[float]:
        """Every group's seconds per step, the same on every rank; collective (tiny, on the statistics ring).

        The ranks of a group agree first (the mean over its shards, the slowest of its replicas), so that every rank
        of every group decides the same next round.
        """
        comm = self.communicator
        own = torch.tensor([seconds, 1.0], dtype=torch.float64)
        comm.sum_in_group(own)
        replicas = torch.empty(comm.num_replicas, dtype=torch.float64)
        comm.gather_replicas(replicas, own[:1] / own[1])
        everyone = torch.zeros(len(comm.participants()), dtype=torch.float64)
        everyone[comm.group_index] = replicas.max()
        comm.sum_stats_over_groups(everyone)
        return everyone.tolist()


class Probation(Participation):
    """A group adds only once it was present at each of the federation's last syncs (``Elastic(probation=k)``).

    Availability is measured from the syncs themselves: each sync's participants (the same on every rank) are kept
    for the last ``k + 1`` syncs, and a group adds to a sync only if it took part in every one of them (of those the
    federation had, at its start). A group that joined at sync ``j`` adds nothing at ``j`` (it joined), nor at the
    ``k`` syncs after it; from sync ``j + k + 1`` on it adds like any other. Every sync counts: each fragment's landing,
    site sync and mix. The participants of those syncs are the rule's state: checkpoints keep it, and a joining group
    receives it with the federation's (so that it decides what its peers decide).

    Args:
        syncs: ``k``: the syncs after its join a group adds nothing to.
    """

    #: Leaving a group out of a sync is what every round already does for a group that joined: it composes with all.
    refuses: ClassVar[dict[str, Refusal]] = {}

    def __init__(self, syncs: int) -> None:
        self.syncs = syncs
        #: The participants of the last ``syncs + 1`` syncs, oldest first (this one last, once asked).
        self.seen: list[tuple[int, ...]] = []

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        """The participants missing from any of the syncs before this one kept; records this sync's participants."""
        before = self.seen
        self.seen = [*before, tuple(participants)][-(self.syncs + 1) :]
        return tuple(g for g in participants if any(g not in earlier for earlier in before))

    def state_dict(self) -> dict[str, Any]:
        """The participants of the syncs kept."""
        return {"seen": [list(groups) for groups in self.seen]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.seen = [tuple(int(g) for g in groups) for groups in state.get("seen", [])]


class _Both(Participation):
    """Several rules at once: a group any of them leaves out adds nothing; the one rule that weighs, weighs."""

    def __init__(self, rules: Sequence[Participation]) -> None:
        self.rules = tuple(rules)

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        left_out = {g for rule in self.rules for g in rule.idle(participants, landing)}
        return tuple(g for g in participants if g in left_out)

    def weight(self, fragment: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        weights = [w for rule in self.rules if (w := rule.weight(fragment, step, contributors, group)) is not None]
        assert len(weights) <= 1, "at most one participation rule weighs the groups"
        return weights[0] if weights else None

    def mean_weight(self, since: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        weights = [w for rule in self.rules if (w := rule.mean_weight(since, step, contributors, group)) is not None]
        return weights[0] if weights else None

    def state_dict(self) -> dict[str, Any]:
        return {str(i): rule.state_dict() for i, rule in enumerate(self.rules)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, rule in enumerate(self.rules):
            rule.load_state_dict(state.get(str(i), {}))


def combine(*rules: Participation | None) -> Participation | None:
    """One rule from several (``None`` for none): each leaves its groups out; at most one of them weighs."""
    present = [rule for rule in rules if rule is not None and not isinstance(rule, Everyone)]
    if not present:
        return None
    return present[0] if len(present) == 1 else _Both(present)
