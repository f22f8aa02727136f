"""The participation rules: who adds to an outer step, and with what weight."""

import pytest

from lightning_fedshard.core.options.outer_topology import Sampled
from lightning_fedshard.core.options.pace import Pace, PaceSchedule
from lightning_fedshard.core.step.participation import Everyone, Paced, Participation, SampledGroups, combine


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
