"""Groups of different speeds: each group trains the share of a round its speed allows, and no group waits.

With :class:`Pace` the optimizer steps of the Trainer (or of a Fabric loop) become a clock that every group shares:
round ``r`` spans the steps ``(r H, (r + 1) H]`` (``H = sync_every``) and group ``g`` trains the first ``n_g(r)`` of
them and skips the rest (a skipped step runs no forward, backward or inner optimizer update, and takes its batch
without training on it). The fastest group trains all ``H``; a group half as fast trains ``H / 2``, so every group
reaches the sync at about the same time. The clock keeps Lightning's counters (``max_steps``, validation and
checkpoint intervals, learning-rate schedules) the same in every group.

The steps of a round follow the groups' speeds: ``n_g = clamp(round(H v_g / max_j v_j), min_steps, H)``. With
``Pace(speeds=...)`` the relative speeds are given; otherwise each group measures the median seconds of the steps it
trained in a round, the groups exchange them at the round's end (a vector of ``G`` numbers), and ``v_g`` is their
exponential moving average (``smoothing``) of ``1 / seconds``. The first round is probed: every group trains its
first ``PROBE_STEPS`` steps, the groups exchange the times of those steps, and the rest of the round follows them.

The merge weighs each group by the steps it trained since the fragment last landed (``t_g``, the same for every token
of a step), over the groups ``C`` that add to the sync:

- ``merge="tokens"``: ``delta = sum_g (t_g / sum_c t_c) delta_g``. Every trained token counts the same, as FedAvg
  weighs clients by their samples. With the groups' data drawn from one distribution the update is unbiased; with
  data that differ by group the faster groups' data weigh more (they train more of them).
- ``merge="normalized"``: ``delta = tau sum_g (1 / |C|) delta_g / t_g`` with ``tau = sum_c t_c / |C|``: every group's
  update per step counts the same, scaled to the mean number of steps (FedNova, arXiv 2007.07481): no group's data
  weigh more, at the price of a noisier update from the slow groups.

Pure bookkeeping; the one collective (the timings' exchange) is the caller's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_fedshard.core.options.checks import check_positive_int

#: The merge rules of :class:`Pace`.
MERGES = ("tokens", "normalized")
#: Steps of the first round every group trains before a measured pace exchanges their times and decides the rest.
PROBE_STEPS = 2


@dataclass(frozen=True)
class Pace:
    """Let groups of different speeds each train what they can in a round, merged by the steps they trained.

    Args:
        speeds: The groups' relative speeds, in group order (e.g. ``(1, 1, 1, 0.5)``: the last group is half as fast);
            ``None``: measured while training (the median step time of each round, exchanged at its end).
        merge: How a sync weighs the groups: ``"tokens"`` (by the steps each trained, every token equal) or
            ``"normalized"`` (each group's update per step equal, scaled to the mean number of steps).
        smoothing: Weight of the latest round in the moving average of measured speeds (``1``: the latest only).
        min_steps: Fewest steps a group trains in a round, however slow.
    """

    speeds: tuple[float, ...] | None = None
    merge: str = "tokens"
    smoothing: float = 0.5
    min_steps: int = 1

    def __post_init__(self) -> None:
        if self.speeds is not None:
            speeds = tuple(float(s) for s in self.speeds)
            if not speeds or not all(math.isfinite(s) and s > 0 for s in speeds):
                raise ValueError(f"`Pace(speeds={self.speeds!r})` must list one positive, finite speed per group.")
            object.__setattr__(self, "speeds", speeds)
        if self.merge not in MERGES:
            raise ValueError(f"`Pace(merge={self.merge!r})` must be one of {list(MERGES)}.")
        if not (0 < self.smoothing <= 1):
            raise ValueError(f"`Pace(smoothing={self.smoothing!r})` must be in (0, 1].")
        check_positive_int("Pace(min_steps)", self.min_steps)

    @property
    def measured(self) -> bool:
        """Whether the speeds are measured while training (none given)."""
        return self.speeds is None

    def check(self, num_groups: int, sync_every: int, fragments: int = 1) -> None:
        """Raise ``ValueError`` if the pace cannot run ``num_groups`` groups with these rounds."""
        if self.speeds is not None and len(self.speeds) != num_groups:
            raise ValueError(
                f"`Pace(speeds={self.speeds!r})` gives {len(self.speeds)} speed(s) for {num_groups} group(s): give one"
                " per group, in group order."
            )
        if self.min_steps > sync_every:
            raise ValueError(
                f"`Pace(min_steps={self.min_steps})` is more than a round's `sync_every={sync_every}` steps."
            )

    def describe(self) -> str:
        """One phrase for the federation's summary."""
        speeds = "measured" if self.speeds is None else "speeds " + ":".join(f"{s:g}" for s in self.speeds)
        return f"per-group pace ({speeds}, merged by {self.merge})"


@dataclass
class PaceSchedule:
    """The steps every group trains in every round, as decided and recorded (the same on every rank).

    Args:
        pace: The options.
        num_groups: Groups of the federation.
        period: ``H``: optimizer steps of one round.
    """

    pace: Pace
    num_groups: int
    period: int
    #: Steps each group trains, by round (decided when the round starts; kept for the rounds still counted).
    rounds: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: The moving average of the measured speeds (steps per second), once a round was measured.
    speeds: list[float] | None = None
    #: Every merge's weights: ``(step, fragment, {group: steps trained})``.
    merges: list[tuple[int, int, dict[int, int]]] = field(default_factory=list)

    def round_of(self, step: int) -> int:
        """The round that optimizer step ``step`` (1-based) belongs to."""
        return (step - 1) // self.period

    def steps(self, round_index: int) -> tuple[int, ...]:
        """Steps each group trains in round ``round_index`` (decided on first ask, from the speeds known then).

        A measured pace's first round is undecided (every step trained) until :meth:`probes` says the groups' first
        times are known; it then keeps at least the steps trained by then.
        """
        if round_index not in self.rounds:
            if round_index == 0 and self._probing:
                return (self.period,) * self.num_groups
            floor = min(PROBE_STEPS, self.period) if round_index == 0 and self.pace.measured else 0
            self.rounds[round_index] = self._decide(floor)
        return self.rounds[round_index]

    @property
    def _probing(self) -> bool:
        return self.pace.measured and self.speeds is None and self.period > PROBE_STEPS

    def probes(self, step: int) -> bool:
        """Whether the groups exchange their times after optimizer step ``step`` to decide the first round's rest."""
        return self._probing and step == PROBE_STEPS

    def trains(self, group: int, step: int) -> bool:
        """Whether ``group`` trains optimizer step ``step`` (1-based), or skips it."""
        position = (step - 1) % self.period
        return position < self.steps(self.round_of(step))[group]

    def trained(self, group: int, after: int, until: int) -> int:
        """Steps ``group`` trained among the steps ``(after, until]``."""
        return sum(self.trains(group, s) for s in range(after + 1, until + 1))

    def weights(
        self, after: int, until: int, contributors: Sequence[int], group: int, merge: str | None = None
    ) -> float:
        """The factor this group's pseudo-gradient takes so that the plain mean over ``contributors`` is the merge.

        ``after``/``until``: the steps the pseudo-gradient covers. A group's factor is ``|C| t_g / sum_c t_c``
        (``"tokens"``) or ``mean_c t_c / t_g`` (``"normalized"``; ``0`` when it trained nothing, its update is zero).
        ``merge``: the rule, if not the pace's own (a mean of the weights themselves is always by tokens).
        """
        counts = {c: self.trained(c, after, until) for c in contributors}
        total = sum(counts.values())
        if total == 0:
            return 1.0
        own = counts.get(group, 0)
        if (merge or self.pace.merge) == "tokens":
            return len(counts) * own / total
        return 0.0 if own == 0 else (total / len(counts)) / own

    def record(self, step: int, fragment: int, after: int, contributors: Sequence[int]) -> None:
        """Keep the merge at ``step`` of ``fragment``: the steps each contributor trained since ``after``."""
        self.merges.append((step, fragment, {c: self.trained(c, after, step) for c in contributors}))

    def observe(self, seconds_per_step: Sequence[float]) -> None:
        """Take every group's median seconds per trained step of the round that ended (measured pace)."""
        latest = [1.0 / s if s > 0 else math.inf for s in seconds_per_step]
        finite = [v for v in latest if math.isfinite(v)]
        if not finite:
            return
        ceiling = max(finite)
        latest = [v if math.isfinite(v) else ceiling for v in latest]
        if self.speeds is None:
            self.speeds = latest
        else:
            a = self.pace.smoothing
            self.speeds = [(1 - a) * old + a * new for old, new in zip(self.speeds, latest)]

    def _decide(self, floor: int = 0) -> tuple[int, ...]:
        speeds = self.pace.speeds if self.pace.speeds is not None else self.speeds
        if speeds is None:
            return (self.period,) * self.num_groups
        fastest = max(speeds)
        low, high = max(self.pace.min_steps, floor), self.period
        return tuple(min(high, max(low, round(self.period * s / fastest))) for s in speeds)

    def state_dict(self) -> dict[str, Any]:
        """The decided rounds, the measured speeds and the merges (a resume continues the same schedule)."""
        return {
            "rounds": {int(r): list(n) for r, n in self.rounds.items()},
            "speeds": None if self.speeds is None else list(self.speeds),
            "merges": [[s, f, {int(g): int(t) for g, t in counts.items()}] for s, f, counts in self.merges],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rounds = {int(r): tuple(int(x) for x in n) for r, n in state.get("rounds", {}).items()}
        self.speeds = None if state.get("speeds") is None else [float(v) for v in state["speeds"]]
        self.merges = [(int(s), int(f), {int(g): int(t) for g, t in c.items()}) for s, f, c in state.get("merges", [])]


def median_seconds(durations: Sequence[float]) -> float:
    """The median of a round's step durations, ``0`` when none was measured.

    A validation or checkpoint inside one step does not move it.
    """
    return statistics.median(durations) if durations else 0.0
