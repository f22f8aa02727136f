"""A per-group pace: the schedule, the weighted merge against the reference, its record, resume and bad input."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Gossip, Hierarchical, Mixing, Pace, Sampled, SparseLoCo
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.options.pace import PaceSchedule
from lightning_fedshard.core.step.fragments import cut_fragments
from lightning_fedshard.core.step.participation import pace_schedule
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.toy import ReferenceGroup, initial, snapshot, start_or_resume
from tests.reference import federate, roundtrip_of

GROUPS, UNITS, SYNC_EVERY = 4, 3, 4
NAMES = [f"u{u}" for u in range(UNITS)]
SLOW_LAST = (1.0, 1.0, 1.0, 0.5)


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    return [x - (0.2 + 0.1 * g) * (x - (g + 1) * (u + 1)) + 0.05 * torch.sin(x + step) for u, x in enumerate(w)]


# -- the schedule ----------------------------------------------------------------------------------------------------


def test_each_group_trains_the_share_of_a_round_its_speed_allows() -> None:
    schedule = PaceSchedule(Pace(speeds=(1.0, 0.5, 0.3, 0.01)), num_groups=4, period=8)
    assert schedule.steps(0) == (8, 4, 2, 1)  # round(8 * 0.3) = 2; the slowest still trains min_steps
    assert [schedule.trains(1, s) for s in range(1, 10)] == [True] * 4 + [False] * 4 + [True]
    assert schedule.trained(1, 2, 10) == 2 + 2  # steps 3, 4 of round 0 and 9, 10 of round 1


def test_the_merge_weighs_groups_by_the_steps_they_trained() -> None:
    tokens = PaceSchedule(Pace(speeds=SLOW_LAST), num_groups=4, period=4)
    factors = [tokens.weights(0, 4, (0, 1, 2, 3), g) for g in range(4)]
    assert factors == pytest.approx([4 * 4 / 14] * 3 + [4 * 2 / 14])  # the plain mean of factor x delta: 4/14, 2/14
    assert tokens.weights(0, 4, (0, 3), 3) == pytest.approx(2 * 2 / 6)  # over the groups that add only
    normalized = PaceSchedule(Pace(speeds=SLOW_LAST, merge="normalized"), num_groups=4, period=4)
    assert normalized.weights(0, 4, (0, 1, 2, 3), 3) == pytest.approx(3.5 / 2)  # mean steps over own steps


def test_a_measured_pace_probes_the_first_round_then_follows_the_moving_average() -> None:
    schedule = PaceSchedule(Pace(smoothing=0.5), num_groups=2, period=10)
    assert schedule.steps(0) == (10, 10)  # nothing measured yet: every group trains
    assert [s for s in range(1, 11) if schedule.probes(s)] == [2]  # the groups exchange their times after step 2
    schedule.observe([0.1, 0.2])  # 10 and 5 steps/s
    assert schedule.steps(0) == (10, 5)  # the rest of the first round follows the probe
    assert not schedule.probes(2)
    assert schedule.steps(1) == (10, 5)
    schedule.observe([0.1, 0.1])  # the slow group caught up: its average is 7.5 steps/s
    assert schedule.steps(2) == (10, 8)
    assert schedule.steps(1) == (10, 5)  # a decided round stays decided


def test_the_first_round_keeps_the_steps_the_probe_trained_and_short_rounds_are_not_probed() -> None:
    schedule = PaceSchedule(Pace(), num_groups=2, period=10)
    schedule.observe([0.1, 1.0])  # the slow group at a tenth of the speed: 1 step of 10, but it trained 2 already
    assert schedule.steps(0) == (10, 2) and schedule.steps(1) == (10, 1)
    short = PaceSchedule(Pace(), num_groups=2, period=2)
    assert not any(short.probes(s) for s in range(1, 5)) and short.steps(0) == (2, 2)


def test_the_schedule_survives_its_state_dict() -> None:
    schedule = PaceSchedule(Pace(), num_groups=2, period=4)
    schedule.observe([0.1, 0.3])
    schedule.steps(0), schedule.steps(1)
    schedule.record(8, 0, 4, (0, 1))
    other = PaceSchedule(Pace(), num_groups=2, period=4)
    other.load_state_dict(copy.deepcopy(schedule.state_dict()))
    assert (other.rounds, other.speeds, other.merges) == (schedule.rounds, schedule.speeds, schedule.merges)


# -- in process, against the reference --------------------------------------------------------------------------------


def _run(steps: int, stop_at: int | None = None, resume: list | None = None, **options: Any) -> list[dict[str, Any]]:
    options.setdefault("reduce_dtype", "float32")
    config = FederationConfig(num_groups=GROUPS, sync_every=SYNC_EVERY, fragments=2, **options)

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = initial(UNITS)
        fed, first = start_or_resume(config, comm, shards, None if resume is None else resume[g])
        trained = []
        for step in range(first, steps + 1):
            if fed.trains(step):
                trained.append(step)
                for shard, new in zip(shards, _update(g, step - 1, shards)):
                    shard.copy_(new)
            fed.maybe_sync(step)
            if step == stop_at:
                return snapshot(fed, shards, step)
        fed.finish(steps)
        assert pace_schedule(fed.participation) is not None
        return {"final": [s.clone() for s in shards], "trained": trained, "pace": pace_schedule(fed.participation)}

    return InProcessGroups(GROUPS, site_blocks=config.site_blocks(GROUPS)).run(work)


def _reference(steps: int, merge: str = "tokens", sync_delay: int = 0, **extra: Any) -> dict[str, Any]:
    return federate(
        dict(zip(NAMES, initial(UNITS))),
        [ReferenceGroup(g, _update, NAMES) for g in range(GROUPS)],
        sync_every=SYNC_EVERY,
        outer=extra.pop("outer", "fedavg"),
        max_steps=steps,
        fragments=[[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, 2)],
        sync_delay=sync_delay,
        paced=extra.pop("paced", lambda r: (4, 4, 4, 2)),
        merge=merge,
        **extra,
    )


CASES = {
    "tokens": (dict(), {}),
    "normalized": (dict(merge="normalized"), {}),
    "tokens, overlapped": (dict(), dict(sync_delay=1)),
    "nesterov, merged halfway": (dict(), dict(outer_optimizer="nesterov", merge_alpha=0.5)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("steps", [13, 16])
def test_paced_fragments_equal_the_reference(name: str, steps: int) -> None:
    pace_options, options = CASES[name]
    reference_options: dict[str, Any] = {"sync_delay": options.get("sync_delay", 0)}
    if "outer_optimizer" in options:
        reference_options.update(outer="nesterov", merge_alpha=options["merge_alpha"], final_landing="reset")
    ref = _reference(steps, pace_options.get("merge", "tokens"), **reference_options)
    for result in _run(steps, pace=Pace(speeds=SLOW_LAST, **pace_options), **options):
        assert_close(torch.cat(result["final"]), torch.cat([ref["final"][n] for n in NAMES]), rtol=0, atol=1e-6)


def test_the_slow_group_trains_the_first_half_of_each_round_and_the_merges_are_recorded() -> None:
    results = _run(8, pace=Pace(speeds=SLOW_LAST))
    assert results[0]["trained"] == list(range(1, 9)) and results[3]["trained"] == [1, 2, 5, 6]
    merges = results[0]["pace"].merges
    # fragment 0 lands after 2 and 6 (steps 1-2, then 3-6) and at the end (7-8), fragment 1 after 4 and 8
    assert merges == [
        (2, 0, {0: 2, 1: 2, 2: 2, 3: 2}),
        (4, 1, {0: 4, 1: 4, 2: 4, 3: 2}),
        (6, 0, {0: 4, 1: 4, 2: 4, 3: 2}),
        (8, 1, {0: 4, 1: 4, 2: 4, 3: 2}),
        (8, 0, {0: 2, 1: 2, 2: 2, 3: 0}),
    ]


def _plain_reference(steps: int) -> Tensor:
    plain = federate(
        dict(zip(NAMES, initial(UNITS))),
        [ReferenceGroup(g, _update, NAMES) for g in range(GROUPS)],
        sync_every=SYNC_EVERY,
        outer="fedavg",
        max_steps=steps,
        fragments=[[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, 2)],
    )
    return torch.cat([plain["final"][n] for n in NAMES])


def test_without_the_weights_the_merge_would_differ() -> None:
    """The reference with plain means lands elsewhere: the test above can tell a weighted merge from a plain one."""
    got = _run(13, pace=Pace(speeds=SLOW_LAST))[0]["final"]
    assert (torch.cat(got) - _plain_reference(13)).abs().max() > 1e-1


@pytest.mark.parametrize(("reduce_dtype", "closer"), [("int4", 10.0), ("sparse", 1.5)])
def test_compressed_traffic_carries_the_weighted_merge(reduce_dtype: str, closer: float) -> None:
    """Each group encodes its weighted pseudo-gradient: the groups end near the weighted merge, far from the plain
    mean (within the codec's error; sparse keeps 2 bits of each of the toy's 6 values)."""
    weighted = torch.cat([_reference(16)["final"][n] for n in NAMES])
    plain = _plain_reference(16)
    for result in _run(16, pace=Pace(speeds=SLOW_LAST), reduce_dtype=reduce_dtype):
        got = torch.cat(result["final"])
        assert (got - weighted).abs().max() * closer < (got - plain).abs().max()


def test_resume_mid_round_is_exact() -> None:
    pace = Pace(speeds=SLOW_LAST)
    straight = _run(13, pace=pace, sync_delay=1)
    saved = _run(13, stop_at=7, pace=pace, sync_delay=1)  # a sum in flight, the slow group skipping its steps
    for got, want in zip(_run(13, resume=saved, pace=pace, sync_delay=1), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))
        assert got["pace"].merges == want["pace"].merges


SAMPLE = Sampled(groups_per_round=2, seed=3, outer_step=True)


@pytest.mark.parametrize("merge", ["tokens", "normalized"])
def test_a_paced_sample_weighs_the_sampled_groups_by_the_steps_they_trained(merge: str) -> None:
    """Each landing's mean runs over its round's sample only, weighted among the sampled groups; the end of training
    weighs every group (the reference renormalizes over the sample independently)."""
    rounds = {tuple(SAMPLE.sample(r, GROUPS)) for r in range(4)}
    assert len(rounds) > 1 and any(3 in r for r in rounds) and any(3 not in r for r in rounds)
    ref = _reference(14, merge, participants=lambda r: SAMPLE.sample(r, GROUPS))
    want = torch.cat([ref["final"][n] for n in NAMES])
    results = _run(14, pace=Pace(speeds=SLOW_LAST, merge=merge), outer_topology=SAMPLE)
    for result in results:
        assert_close(torch.cat(result["final"]), want, rtol=0, atol=1e-6)
    unweighted = _reference(14, merge, participants=lambda r: SAMPLE.sample(r, GROUPS), paced=None)
    assert (want - torch.cat([unweighted["final"][n] for n in NAMES])).abs().max() > 1e-2  # the weights matter
    for step, _, counts in results[0]["pace"].merges[:-2]:  # a landing's merge names the sampled groups only
        assert tuple(counts) == tuple(SAMPLE.sample((step - 1) // SYNC_EVERY, GROUPS))


def test_a_paced_sample_resumes_mid_round_exactly() -> None:
    options: dict[str, Any] = dict(pace=Pace(speeds=SLOW_LAST), outer_topology=SAMPLE, sync_delay=1)
    straight = _run(14, **options)
    saved = _run(14, stop_at=7, **options)
    for got, want in zip(_run(14, resume=saved, **options), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))
        assert got["pace"].merges == want["pace"].merges


@pytest.mark.parametrize("merge", ["tokens", "normalized"])
@pytest.mark.parametrize("steps", [13, 16])
def test_paced_eager_updates_start_each_group_from_its_term_of_the_weighted_merge(merge: str, steps: int) -> None:
    """Each sum in flight is the merge weighted by the steps trained; a group starts from its own weighted term of it.

    Ending mid-round (13) lands every sum in flight and takes a final weighted step; at 16 the last round lands."""
    ref = _reference(steps, merge, eager=True, outer="nesterov")
    want = torch.cat([ref["final"][n] for n in NAMES])
    options: dict[str, Any] = dict(eager_updates=True, outer_optimizer="nesterov")
    for result in _run(steps, pace=Pace(speeds=SLOW_LAST, merge=merge), **options):
        assert_close(torch.cat(result["final"]), want, rtol=0, atol=1e-6)
    plain = _reference(steps, merge, eager=True, outer="nesterov", paced=None)
    assert (want - torch.cat([plain["final"][n] for n in NAMES])).abs().max() > 1e-2  # the weights matter


SITES = Hierarchical({4: 2, 8: 4}, sites=[[0, 3], [1, 2]])  # the slow group shares a site with a fast one


@pytest.mark.parametrize(
    ("merge", "options"),
    [("tokens", {}), ("normalized", {}), ("tokens", dict(eager_updates=True, outer_optimizer="nesterov"))],
    ids=["tokens", "normalized", "eager"],
)
@pytest.mark.parametrize("steps", [13, 16])
def test_a_paced_site_weighs_its_groups_by_the_steps_each_trained_since_its_last_sync(
    merge: str, options: dict[str, Any], steps: int
) -> None:
    """Sites of two groups sync every round (4 steps), the federation lands a fragment every 4 of its 8 steps: a site's
    mean weighs its groups by the steps each trained since the previous multiple of 4 (every token alike, whatever the
    merge); the landings weigh by ``merge``. The reference counts the trained steps from the pace itself."""
    eager = options.get("eager_updates", False)
    outer = "nesterov" if eager else "fedavg"
    levels, sites = {4: 2, 8: 4}, [[0, 3], [1, 2]]
    ref = _reference(steps, merge, outer=outer, eager=eager, hierarchical=levels, sites=sites)
    want = torch.cat([ref["final"][n] for n in NAMES])
    for result in _run(steps, pace=Pace(speeds=SLOW_LAST, merge=merge), outer_topology=SITES, **options):
        assert_close(torch.cat(result["final"]), want, rtol=0, atol=1e-6)
    unweighted = _reference(steps, merge, outer=outer, eager=eager, hierarchical=levels, sites=sites, paced=None)
    assert (want - torch.cat([unweighted["final"][n] for n in NAMES])).abs().max() > 1e-2  # the weights matter


@pytest.mark.parametrize("eager", [False, True])
def test_a_paced_site_resumes_mid_round_exactly(eager: bool) -> None:
    options: dict[str, Any] = dict(pace=Pace(speeds=SLOW_LAST), outer_topology=SITES, sync_delay=0 if eager else 1)
    if eager:
        options.update(eager_updates=True, outer_optimizer="nesterov")
    straight = _run(13, **options)
    saved = _run(13, stop_at=6, **options)  # mid-round: the slow group skips its steps, the sites differ
    for got, want in zip(_run(13, resume=saved, **options), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))
        assert got["pace"].merges == want["pace"].merges


RING = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
MIXES = {
    "gossip": Gossip(peers=1, seed=1),
    "sampled": Sampled(groups_per_round=2, seed=1),
    "ring": Mixing(RING),
}
WIRES = {
    "float32": dict(reduce_dtype="float32"),
    "int8, overlapped": dict(reduce_dtype="int8", sync_delay=1),
}


@pytest.mark.parametrize("wire", list(WIRES))
@pytest.mark.parametrize("topology", list(MIXES))
@pytest.mark.parametrize("merge", ["tokens", "normalized"])
def test_a_paced_mix_weighs_each_column_by_the_steps_its_group_trained(topology: str, wire: str, merge: str) -> None:
    """A group takes more of the partners that trained more: ``W_ij t_j / sum_k W_ik t_k``, ``t`` over the last
    round; the end of training is the federation's outer step, weighed by ``merge``. The reference reweighs the rows
    itself, in float64."""
    mixing, options = MIXES[topology], dict(WIRES[wire])
    codec = FederationConfig(num_groups=GROUPS, **options).codec
    extra: dict[str, Any] = dict(mixing=lambda r: mixing.weights(r, GROUPS), sync_delay=options.get("sync_delay", 0))
    if not codec.exact:
        extra["roundtrip"] = roundtrip_of(codec)
    ref = _reference(14, merge, **extra)
    want = torch.cat([ref["final"][n] for n in NAMES])
    for result in _run(14, pace=Pace(speeds=SLOW_LAST, merge=merge), outer_topology=mixing, **options):
        assert_close(torch.cat(result["final"]), want, rtol=0, atol=1e-5)
    unweighted = _reference(14, merge, paced=None, **extra)
    assert (want - torch.cat([unweighted["final"][n] for n in NAMES])).abs().max() > 1e-2  # the weights matter


def test_a_paced_mix_resumes_mid_round_exactly() -> None:
    options: dict[str, Any] = dict(pace=Pace(speeds=SLOW_LAST), outer_topology=MIXES["gossip"], reduce_dtype="int8")
    options["sync_delay"] = 1
    straight = _run(14, **options)
    saved = _run(14, stop_at=7, **options)  # a mix in flight, the slow group skipping its steps
    for got, want in zip(_run(14, resume=saved, **options), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))


def test_paced_eager_updates_resume_mid_round_exactly() -> None:
    options: dict[str, Any] = dict(pace=Pace(speeds=SLOW_LAST), eager_updates=True, outer_optimizer="nesterov")
    straight = _run(13, **options)
    saved = _run(13, stop_at=7, **options)  # sums in flight, own shares in the offsets
    for got, want in zip(_run(13, resume=saved, **options), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))
        assert got["pace"].merges == want["pace"].merges


def test_a_measured_pace_agrees_on_every_rank_and_probes_the_first_round() -> None:
    results = _run(12, pace=Pace())
    schedules = [r["pace"].rounds for r in results]
    assert all(s == schedules[0] for s in schedules)  # one decision for every group, from the exchanged timings
    assert all(2 <= n <= 4 for n in schedules[0][0]) and max(schedules[0][0]) == 4  # the probe's 2 steps at least


# -- bad input --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pace", "match"),
    [
        (dict(speeds=(1.0, 0.0)), "one positive, finite speed per group"),
        (dict(merge="median"), "merge='median'"),
        (dict(smoothing=0.0), r"smoothing=0.0\)` must be in \(0, 1\]"),
        (dict(min_steps=0), "min_steps"),
    ],
)
def test_bad_pace_options_are_refused_naming_the_value(pace: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Pace(**pace)


def test_a_pace_that_does_not_fit_the_federation_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gives 4 speed\(s\) for 3 group\(s\)"):
        FederationConfig(num_groups=3, pace=Pace(speeds=SLOW_LAST))
    with pytest.raises(ValueError, match="min_steps=9.*sync_every=8"):
        FederationConfig(num_groups=4, pace=Pace(min_steps=9))
    with pytest.raises(ValueError, match="`pace=.*` and `reduce_dtype=SparseLoCo.*` are not built to run together yet"):
        FederationConfig(num_groups=4, pace=Pace(), reduce_dtype=SparseLoCo())
    with pytest.raises(ValueError, match="must be a `lightning_fedshard.Pace`"):
        FederationConfig(num_groups=4, pace={"speeds": [1, 2]})  # type: ignore[arg-type]


def test_an_elastic_federation_takes_a_pace_only_with_the_planned_groups_speeds() -> None:
    from lightning_fedshard import Elastic

    elastic = Elastic(lighthouse="http://localhost:29510", group=0)
    FederationConfig(num_groups=4, pace=Pace(speeds=SLOW_LAST), elastic=elastic)
    with pytest.raises(ValueError, match=r"A measured `Pace\(\)` is agreed by every group of one job"):
        FederationConfig(num_groups=4, pace=Pace(), elastic=elastic)
    with pytest.raises(ValueError, match=r"gives 4 speed\(s\) for 3 group\(s\)"):
        FederationConfig(num_groups=3, pace=Pace(speeds=SLOW_LAST), elastic=elastic)
