"""The pace of a federation whose groups compute at different speeds: the barrier against a per-group pace.

Group ``g`` takes ``t_g`` seconds for a step it trains (its compute, slowed by its speed, plus its collectives inside
the group) and a round ends with a sync of ``s`` exposed seconds. With ``H = sync_every`` steps a round and ``b``
tokens per group step:

- **barrier** (every group trains every step, then waits): a round takes ``H max_g t_g + s`` and trains ``G H b``;
- **per-group pace** (``Pace``): group ``g`` trains ``n_g = clamp(round(H t_min / t_g), min_steps, H)`` steps and
  skips the rest (``skip`` seconds each); a round takes ``max_g (n_g t_g + (H - n_g) skip) + s`` and trains
  ``sum_g n_g b``;
- **attainable**: every group at its own pace with no sync, ``sum_g b / t_g``.

Over ``rounds`` rounds of a *measured* pace the first round is probed: every group trains its first ``probe`` steps
at the slowest group's pace (they exchange their times after them), then the paced rest of the round; the pace is
the tokens of both kinds of round over their time.

Pure arithmetic on the planner's predictions, no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_fedshard.core.options.pace import PROBE_STEPS
from lightning_fedshard.plan.predict import Prediction, inner_step_seconds


@dataclass(frozen=True)
class HeterogeneousPace:
    """Predicted tokens/s of one federation with groups of different speeds.

    Attributes:
        barrier: Every group trains every step and waits for the slowest at each sync.
        pace: Each group trains the share of a round its speed allows (``Pace``).
        attainable: Every group at its own pace, never waiting (the sum of the groups' own paces).
        steps: Steps each group trains in a round under the pace.
    """

    barrier: float
    pace: float
    attainable: float
    steps: tuple[int, ...]


def heterogeneous_pace(
    step_seconds: Sequence[float],
    tokens_per_group_step: float,
    sync_every: int,
    sync_seconds: float = 0.0,
    skip_seconds: float = 0.0,
    min_steps: int = 1,
    rounds: int | None = None,
    probe: int = PROBE_STEPS,
) -> HeterogeneousPace:
    """Predict the barrier's and the per-group pace's tokens/s from each group's seconds per trained step.

    Args:
        step_seconds: ``t_g``: each group's seconds for a step it trains (no sync).
        tokens_per_group_step: ``b``: tokens one group trains in a step.
        sync_every: ``H``.
        sync_seconds: ``s``: exposed seconds of one sync (once per round).
        skip_seconds: Seconds of a step a group skips (drawing a batch, the loop's hooks).
        min_steps: ``Pace(min_steps)``.
        rounds: The run's rounds, for a measured pace whose first round is probed; ``None``: the steady pace.
        probe: Steps of the first round every group trains before the groups exchange their times.

    Raises:
        ValueError: For an empty or non-positive ``step_seconds`` or ``sync_every < 1``.
    """
    if not step_seconds or any(t <= 0 for t in step_seconds):
        raise ValueError(f"`step_seconds={list(step_seconds)!r}` must give every group a positive time.")
    if sync_every < 1:
        raise ValueError(f"`sync_every={sync_every}` must be at least 1.")
    groups, fastest = len(step_seconds), min(step_seconds)
    steps = tuple(min(sync_every, max(min_steps, round(sync_every * fastest / t))) for t in step_seconds)
    # one round of each kind: its tokens and its seconds
    barrier_round = (groups * sync_every, sync_every * max(step_seconds) + sync_seconds)
    paced_round = (sum(steps), max(n * t + (sync_every - n) * skip_seconds for n, t in zip(steps, step_seconds)))
    paced_round = (paced_round[0], paced_round[1] + sync_seconds)
    barrier = barrier_round[0] * tokens_per_group_step / barrier_round[1]
    first, later = (
        (_probed_round(steps, step_seconds, sync_every, probe, skip_seconds, sync_seconds), max(rounds - 1, 0))
        if rounds is not None
        else ((0, 0.0), 1)
    )
    tokens = first[0] + later * paced_round[0]
    pace = tokens * tokens_per_group_step / (first[1] + later * paced_round[1])
    attainable = sum(tokens_per_group_step / t for t in step_seconds)
    return HeterogeneousPace(barrier=barrier, pace=pace, attainable=attainable, steps=steps)


def _probed_round(
    steps: Sequence[int], step_seconds: Sequence[float], sync_every: int, probe: int, skip: float, sync: float
) -> tuple[float, float]:
    """Steps trained and seconds of a measured pace's first round: the probe's steps in step, then the paced rest."""
    if sync_every <= probe:  # too short to probe: every group trains every step
        return len(steps) * sync_every, sync_every * max(step_seconds) + sync
    kept = [max(n, probe) for n in steps]
    rest = max((n - probe) * t + (sync_every - n) * skip for n, t in zip(kept, step_seconds))
    return sum(kept), probe * max(step_seconds) + rest + sync


def lockstep_tokens_per_second(p: Prediction, node_speeds: Sequence[float]) -> float:
    """Tokens/s of a setup whose every step waits for its slowest node (plain FSDP or HSDP, no federation).

    The slowest node stretches each step's compute; the collectives stay as they were (overlapped with it where the
    cluster overlaps them).
    """
    inner = inner_step_seconds(p.compute_seconds / min(node_speeds), p.collective_seconds, p.cluster)
    return p.tokens_per_second * p.step_seconds / (inner + p.exposed_sync_seconds)


def heterogeneous(p: Prediction, node_speeds: Sequence[float]) -> HeterogeneousPace | None:
    """A federated prediction's pace when its nodes compute at ``node_speeds`` (a group at its slowest node's).

    A slower node stretches a step's compute only: a step bound by its collectives or a run bound by its syncs
    loses less to it than a compute-bound one.
    """
    if not p.setup.federated:
        return None
    groups = p.topology.num_groups
    per_group = len(node_speeds) // groups
    speeds = [min(node_speeds[g * per_group : (g + 1) * per_group]) for g in range(groups)]
    training = p.step_seconds - p.exposed_sync_seconds  # a step without its share of the sync
    others = training - p.compute_seconds
    tokens = p.tokens_per_second * p.step_seconds / groups
    sync = p.exposed_sync_seconds * p.setup.federation.sync_every
    steps = [p.compute_seconds / v + others for v in speeds]
    return heterogeneous_pace(steps, tokens, p.setup.federation.sync_every, sync_seconds=sync)
