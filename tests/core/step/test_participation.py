"""The participation rules: who adds to an outer step, and with what weight."""

import pytest
import torch

from lightning_fedshard.core.options.outer_topology import Sampled
from lightning_fedshard.core.options.pace import Pace, PaceSchedule
from lightning_fedshard.core.step.participation import Everyone, Paced, Participation, Probation, SampledGroups, combine


def test_everyone_adds_alike():
    rule = Everyone()
    assert rule.idle((0, 1, 2), 8) == () and rule.weight(0, 8, (0, 1, 2), 1) is None
    assert combine(Everyone(), None) is None


def test_a_sample_leaves_out_the_groups_its_round_did_not_draw_by_position_among_the_participants():
    topology = Sampled(groups_per_round=2, seed=3, outer_step=True)
    rule = SampledGroups(topology, period=4)
    for landing in (4, 8, 12):
        chosen = set(topology.sample((landing - 1) // 4, 3))
        participants = (5, 7, 9)  # the live groups of an elastic quorum, in ring order
        assert rule.idle(participants, landing) == tuple(g for i, g in enumerate(participants) if i not in chosen)
    assert rule.idle((5, 7, 9), 1) == rule.idle((5, 7, 9), 4)  # steps 1-4 are one round


def test_a_pace_weighs_by_the_steps_each_group_trained_since_the_fragment_landed_and_records_the_merge():
    schedule = PaceSchedule(Pace(speeds=(1.0, 0.5)), num_groups=2, period=4)
    rule = Paced(schedule, landed=lambda fragment: 0, communicator=None)  # type: ignore[arg-type]
    weights = [rule.weight(0, 4, (0, 1), group) for group in (0, 1)]
    assert weights == pytest.approx([4 / 6 * 2, 2 / 6 * 2])  # 4 and 2 steps trained; the sum's mean weighs them


@pytest.mark.parametrize("merge", ["tokens", "normalized"])
def test_a_mean_of_the_weights_weighs_by_tokens_over_its_own_window_whatever_the_merge(merge):
    schedule = PaceSchedule(Pace(speeds=(1.0, 0.5), merge=merge), num_groups=2, period=4)
    rule = Paced(schedule, landed=lambda fragment: 0, communicator=None)  # type: ignore[arg-type]
    assert [rule.mean_weight(4, 8, (0, 1), g) for g in (0, 1)] == pytest.approx([4 / 6 * 2, 2 / 6 * 2])
    assert [rule.mean_weight(6, 8, (0, 1), g) for g in (0, 1)] == [2.0, 0.0]  # steps 7-8: the slow group skips
    assert [rule.mean_weight(8, 8, (0, 1), g) for g in (0, 1)] == [1.0, 1.0]  # nothing trained: alike
    assert schedule.merges == []  # a mean of the weights is not a merge of the outer step: nothing recorded
    assert Everyone().mean_weight(0, 4, (0, 1), 0) is None


def test_combined_rules_leave_out_either_rules_groups_and_at_most_one_weighs():
    class Out(Participation):
        def __init__(self, out):
            self.out = out

        def idle(self, participants, landing):
            return tuple(g for g in participants if g in self.out)

    both = combine(Out((2,)), Out((0,)))
    assert both is not None and both.idle((0, 1, 2, 3), 4) == (0, 2)
    assert both.weight(0, 4, (1, 3), 1) is None
    assert "sparseloco" in Paced.refuses and Participation.refuses == SampledGroups.refuses == {}


def test_probation_leaves_a_group_out_of_the_k_syncs_after_the_one_it_joined_at():
    rule = Probation(2)
    syncs = [(0, 1, 2), (0, 1, 2), (0, 3, 2), (0, 3, 2), (0, 3, 2), (0, 3, 2), (3, 2)]
    idle = [rule.idle(participants, landing=4 * (i + 1)) for i, participants in enumerate(syncs)]
    # group 3 joins at the third sync (adding nothing then), and the two after it; it adds from the sixth on
    assert idle == [(), (), (3,), (3,), (3,), (), ()]
    assert Probation.refuses == {}


def test_probation_decides_the_same_after_its_state_is_restored():
    syncs = [(0, 1), (0, 1), (0, 2), (0, 2), (0, 2), (1, 0, 2)]
    straight, first = Probation(2), Probation(2)
    expected = [straight.idle(s, 0) for s in syncs]
    for s in syncs[:3]:
        first.idle(s, 0)
    resumed = Probation(2)
    resumed.load_state_dict(first.state_dict())  # a checkpoint, or the state a joining group heals
    assert [resumed.idle(s, 0) for s in syncs[3:]] == expected[3:]
    assert expected[-1] == (1,)  # group 1 came back: on probation again


def test_probation_is_an_elastic_option_refused_when_negative():
    from lightning_fedshard.core.options.elastic import Elastic

    assert Elastic(probation=2).probation == 2
    with pytest.raises(ValueError, match=r"`Elastic\(probation=...\)` must be a non-negative integer, got -1"):
        Elastic(probation=-1)


def _probation_run(probation: int):
    """Three live groups of four planned, plain averaging: group 1 is gone before step 6 and group 3 joins the sync
    after step 8; every thread's weights after every step."""
    from lightning_fedshard.core.config import FederationConfig
    from lightning_fedshard.core.options.elastic import Elastic
    from tests.core.rounds.live import run_live

    elastic = Elastic(lighthouse="http://localhost:29510", group=0, probation=probation)
    config = FederationConfig(num_groups=4, sync_every=4, reduce_dtype="float32", elastic=elastic)
    return run_live(config, [(0, (0, 1, 2)), (6, (0, 3, 2))], {3: 8}, 16)


def _replay(probation_idle: dict[int, set[int]]) -> dict[int, dict[int, torch.Tensor]]:
    """Independently: plain averaging over the groups that add (not joined, not on probation) at each sync."""
    from tests.core.rounds.live import update

    held = {g: [torch.full((2,), float(u)) for u in range(3)] for g in range(4)}
    anchor = [torch.full((2,), float(u)) for u in range(3)]
    after: dict[int, dict[int, torch.Tensor]] = {}
    for step in range(1, 17):
        live = (0, 1, 2) if step < 6 else (0, 3, 2)
        if step == 6:
            held[3] = [a.clone() for a in anchor]
        for g in live:
            update(g, step, held[g])
        if step % 4 == 0:
            adding = [g for g in live if not (g == 3 and step == 8) and g not in probation_idle.get(step, set())]
            anchor = [torch.stack([held[g][u] for g in adding]).mean(0) for u in range(3)]
            for g in live:
                held[g] = [a.clone() for a in anchor]
        after[step] = {g: torch.cat(held[g]) for g in live}
    return after


@pytest.mark.parametrize(("probation", "idle"), [(0, {}), (1, {12: {3}}), (2, {12: {3}, 16: {3}})])
def test_an_elastic_federation_on_probation_equals_an_independent_replay(probation, idle):
    """The replacement adds nothing at the sync it joins (step 8) nor at the ``probation`` syncs after it."""
    results = _probation_run(probation)
    replay = _replay(idle)
    labels = {t: g for t, g in enumerate((0, 3, 2))}
    for t, result in enumerate(results):
        for step in (12, 16):
            got = torch.cat(result["history"][step])
            assert torch.allclose(got, replay[step][labels[t]], rtol=0, atol=1e-6), (probation, t, step)
    if probation:
        plain = torch.cat(_probation_run(0)[0]["history"][12])
        assert not torch.allclose(torch.cat(results[0]["history"][12]), plain, atol=1e-4)  # the probation acted


def test_build_participation_composes_the_rules_the_options_ask_for_once():
    from lightning_fedshard.core.config import FederationConfig
    from lightning_fedshard.core.step.participation import build_participation, find_rule, pace_schedule
    from lightning_fedshard.core.transport.inprocess import InProcessGroups

    comm = InProcessGroups(2).run(lambda g, c: c)[0]
    assert build_participation(FederationConfig(), comm, lambda f: 0) is None
    sampled = FederationConfig(outer_topology=Sampled(1, outer_step=True), pace=Pace(speeds=(1.0, 0.5)))
    rule = build_participation(sampled, comm, lambda f: 0)
    assert isinstance(find_rule(rule, Paced), Paced) and isinstance(find_rule(rule, SampledGroups), SampledGroups)
    assert pace_schedule(rule) is find_rule(rule, Paced).schedule  # the slow group trains 4 of 8 steps:
    assert rule.trains(1, 4) and not rule.trains(1, 5) and rule.trains(0, 5)
    end = rule.at_end()  # the end of training: every group adds, the pace still weighs
    assert find_rule(end, SampledGroups) is None and find_rule(end, Paced) is find_rule(rule, Paced)


def test_a_group_slower_than_the_bound_sits_out_the_next_sync_and_the_mean_takes_the_others():
    """The example of a new rule (SitOutSlowRounds): group 1's last round took 5 s against a bound of 2 s."""
    from lightning_fedshard.core.config import FederationConfig
    from lightning_fedshard.core.federation import Federation
    from lightning_fedshard.core.step.participation import SitOutSlowRounds
    from lightning_fedshard.core.transport.inprocess import InProcessGroups

    def work(g, comm):
        shard = torch.zeros(3)
        fed = Federation(FederationConfig(sync_every=2, reduce_dtype="float32"), comm)
        fed.start([shard], step=0)
        rule = SitOutSlowRounds(seconds=2.0)
        fed.participation = combine(fed.participation, rule)
        rule.observe({0: 1.0, 1: 5.0, 2: 1.5})  # every rank measured the same last rounds
        shard.fill_(g + 1.0)
        stats = fed.maybe_sync(2)
        return shard.clone(), stats

    for shard, stats in InProcessGroups(3).run(work):
        torch.testing.assert_close(shard, torch.full((3,), (1.0 + 3.0) / 2))  # groups 0 and 2 only
        assert stats is not None and not stats.lost
    rule = SitOutSlowRounds(2.0)
    rule.observe({1: 5.0})
    restored = SitOutSlowRounds(2.0)
    restored.load_state_dict(rule.state_dict())
    assert restored.idle((0, 1), 8) == rule.idle((0, 1), 8) == (1,)
    with pytest.raises(ValueError, match="`seconds` must be a positive number of seconds, got 0"):
        SitOutSlowRounds(0)
