"""Who adds to a sync, and with what weight: the participation rules of a federation.

A rule answers two questions of every outer step (:class:`~lightning_fedshard.core.step.transaction.SyncTransaction`
asks them, once per sync, the same on every rank):

- :meth:`Participation.idle`: which of the sync's participants it leaves out (they take part in the collective with
  zeros, and restart from the new anchor like everyone else);
- :meth:`Participation.weight`: this group's factor in the merge, given the groups that add (``None``: alike);
  :meth:`Participation.mean_weight` the same for a mean of the weights themselves (a site sync).

A rule may also decide which optimizer steps a group trains (:meth:`Participation.trains`, a per-group pace), be told
of every step (:meth:`Participation.after_step`, a pace's timings) and keep state between syncs that checkpoints and a
joining group's heal carry under its :attr:`~Participation.name`. :func:`build_participation` composes the rules a
federation's options ask for, in one place; every round asks the rule it is given.

Like a round, a rule declares the switches it does not run yet (:attr:`Participation.refuses`); the compatibility
table (:mod:`~lightning_fedshard.core.rounds.options`) is derived from the declarations. A new rule is one class: its
answers and its refusals (:class:`SitOutSlowRounds` is a short example).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from lightning_fedshard.core.options.outer_topology import Sampled, resolve_outer_topology
from lightning_fedshard.core.options.pace import PaceSchedule, median_seconds
from lightning_fedshard.core.options.refusal import Refusal

if TYPE_CHECKING:
    from lightning_fedshard.core.transport.comm import Communicator

__all__ = [
    "Everyone",
    "Paced",
    "Participation",
    "Probation",
    "SampledGroups",
    "SitOutSlowRounds",
    "build_participation",
    "combine",
    "find_rule",
    "load_rules_state",
    "pace_schedule",
    "rules_state",
]

Rule = TypeVar("Rule", bound="Participation")


class Participation:
    """Every participant adds, alike: the base of every rule (see the module)."""

    #: The switches (:mod:`~lightning_fedshard.core.rounds.options`) this rule does not run, and why.
    refuses: ClassVar[dict[str, Refusal]] = {}
    #: The key of the rule's state in checkpoints and in a joining group's heal.
    name: ClassVar[str] = "everyone"

    def trains(self, group: int, step: int) -> bool:
        """Whether ``group`` trains optimizer step ``step`` (1-based); every step by default."""
        return True

    def after_step(self, step: int, trained: bool) -> None:
        """Optimizer step ``step`` ended (``trained``: this group trained it); collective if the rule exchanges."""

    def at_end(self) -> Participation | None:
        """The rule of the end of training's sync, where every group adds (a sample no longer applies)."""
        return self

    def rules(self) -> tuple[Participation, ...]:
        """The single rules this one is made of (itself, for a single rule)."""
        return (self,)

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

    name = "sample"

    def __init__(self, topology: Sampled, period: int) -> None:
        self.topology = topology
        self.period = period

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        """The participants the landing's round did not sample."""
        chosen = set(self.topology.sample((landing - 1) // self.period, len(participants)))
        return tuple(g for position, g in enumerate(participants) if position not in chosen)

    def at_end(self) -> Participation | None:
        """Nothing: the end of training's sync takes every group, so that the run ends on the consensus."""
        return None


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
    name = "pace"

    def __init__(self, schedule: PaceSchedule, landed: Callable[[int], int], communicator: Communicator) -> None:
        self.schedule = schedule
        self.landed = landed
        self.communicator = communicator
        self._step_ended: float | None = None
        self._durations: list[float] = []

    def trains(self, group: int, step: int) -> bool:
        """Whether the pace lets ``group`` train step ``step`` (a slow group skips the last steps of a round)."""
        return self.schedule.trains(group, step)

    def after_step(self, step: int, trained: bool) -> None:
        """Time the step (see :meth:`time_step`)."""
        self.time_step(step, trained)

    def state_dict(self) -> dict[str, Any]:
        """The schedule: the steps every group trains per round, the measured speeds and the merges decided."""
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if state.get("schedule") is not None:
            self.schedule.load_state_dict(state["schedule"])

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
    name = "probation"

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


class SitOutSlowRounds(Participation):
    """A group whose last round took longer than ``seconds`` sits out the next sync (it adds nothing to it).

    The example of a new rule: what it leaves out (:meth:`idle`), what it needs to know (each group's last round's
    seconds, the same on every rank: the caller tells it with :meth:`observe`) and what it refuses (nothing: leaving a
    group out is what every round already does for a group that joined).

    Args:
        seconds: The longest round a group may have taken and still add to the next sync.
    """

    name = "sit_out_slow_rounds"

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"`seconds` must be a positive number of seconds, got {seconds!r}.")
        self.seconds = seconds
        #: Every group's last round, in seconds, by group (the same on every rank).
        self.last_round: dict[int, float] = {}

    def observe(self, seconds_by_group: dict[int, float]) -> None:
        """Every group's last round's seconds, as every rank measured them alike."""
        self.last_round = dict(seconds_by_group)

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        """The participants whose last round was slower than the bound."""
        return tuple(g for g in participants if self.last_round.get(g, 0.0) > self.seconds)

    def state_dict(self) -> dict[str, Any]:
        """The last rounds' seconds (a resume decides the next sync as the run would have)."""
        return {"last_round": {str(g): s for g, s in self.last_round.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.last_round = {int(g): float(s) for g, s in state.get("last_round", {}).items()}


class _Both(Participation):
    """Several rules at once: a group any of them leaves out adds nothing; the one rule that weighs, weighs."""

    def __init__(self, rules: Sequence[Participation]) -> None:
        self._rules = tuple(rules)

    def rules(self) -> tuple[Participation, ...]:
        return self._rules

    def trains(self, group: int, step: int) -> bool:
        return all(rule.trains(group, step) for rule in self._rules)

    def after_step(self, step: int, trained: bool) -> None:
        for rule in self._rules:
            rule.after_step(step, trained)

    def at_end(self) -> Participation | None:
        return combine(*(rule.at_end() for rule in self._rules))

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        left_out = {g for rule in self._rules for g in rule.idle(participants, landing)}
        return tuple(g for g in participants if g in left_out)

    def weight(self, fragment: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        weights = [w for rule in self._rules if (w := rule.weight(fragment, step, contributors, group)) is not None]
        assert len(weights) <= 1, "at most one participation rule weighs the groups"
        return weights[0] if weights else None

    def mean_weight(self, since: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        weights = [w for rule in self._rules if (w := rule.mean_weight(since, step, contributors, group)) is not None]
        return weights[0] if weights else None


def combine(*rules: Participation | None) -> Participation | None:
    """One rule from several (``None`` for none): each leaves its groups out; at most one of them weighs."""
    present = [rule for rule in rules if rule is not None and not isinstance(rule, Everyone)]
    if not present:
        return None
    return present[0] if len(present) == 1 else _Both(present)


def build_participation(config: Any, communicator: Communicator, landed: Callable[[int], int]) -> Participation | None:
    """Who takes part in a federation's syncs, with what weight: every rule its options ask for, composed once.

    A per-group pace (``pace``), an elastic federation's probation (``Elastic(probation=k)``) and sampled outer steps
    (``Sampled(..., outer_step=True)``); ``None`` when every group adds to every sync alike. Collective in an elastic
    federation with a pace: the number of groups is the planned one there, else the sync's participants (asked once).

    Args:
        config: The federation options (a :class:`~lightning_fedshard.core.config.FederationConfig`).
        communicator: The federation's collectives (a pace exchanges its timings over them).
        landed: The optimizer step a fragment last landed after (the federation's schedule).
    """
    rules: list[Participation] = []
    if config.pace is not None:
        # An elastic federation's speeds are given per planned group (asking for its participants is a quorum).
        groups = config.num_groups if config.elastic is not None else len(communicator.participants())
        config.pace.check(groups, config.sync_every)
        rules.append(Paced(PaceSchedule(config.pace, groups, config.sync_every), landed, communicator))
    if config.elastic is not None and config.elastic.probation > 0:
        rules.append(Probation(config.elastic.probation))
    topology = resolve_outer_topology(config.outer_topology)
    if isinstance(topology, Sampled) and topology.outer_step:
        rules.append(SampledGroups(topology, config.outer_period))
    return combine(*rules)


def find_rule(participation: Participation | None, kind: type[Rule]) -> Rule | None:
    """The rule of type ``kind`` in ``participation``, if there is one (e.g. the pace, to read its schedule)."""
    found = [rule for rule in participation.rules() if isinstance(rule, kind)] if participation is not None else []
    return found[0] if found else None


def pace_schedule(participation: Participation | None) -> PaceSchedule | None:
    """The schedule of a per-group pace (the steps each group trains per round, the merges), if there is one."""
    paced = find_rule(participation, Paced)
    return None if paced is None else paced.schedule


def rules_state(participation: Participation | None) -> dict[str, Any]:
    """The state of every rule, by its name (what checkpoints and a joining group's heal carry)."""
    return {} if participation is None else {rule.name: rule.state_dict() for rule in participation.rules()}


def load_rules_state(participation: Participation | None, state: dict[str, Any] | None) -> None:
    """Restore :func:`rules_state` into the rules of ``participation`` (a rule whose name is missing keeps its own)."""
    if participation is None or state is None:
        return
    for rule in participation.rules():
        if rule.name in state:
            rule.load_state_dict(state[rule.name])
