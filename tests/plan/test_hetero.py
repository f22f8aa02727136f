"""The planner's pace of groups of different speeds: the barrier, a per-group pace, what is attainable."""

from __future__ import annotations

import pytest

from lightning_fedshard.plan.command import plan
from lightning_fedshard.plan.hetero import heterogeneous_pace


def test_one_group_twice_as_slow_halves_the_barrier_and_not_the_pace() -> None:
    h = heterogeneous_pace([1.0, 1.0, 1.0, 2.0], tokens_per_group_step=100.0, sync_every=8, sync_seconds=0.0)
    assert h.barrier == pytest.approx(4 * 8 * 100 / 16)  # a round takes the slow group's 16 s
    assert h.steps == (8, 8, 8, 4) and h.pace == pytest.approx(28 * 100 / 8)
    assert h.attainable == pytest.approx(350.0) and h.pace == pytest.approx(h.attainable)  # (2G - 1) / (2G) of G


def test_syncs_and_skipped_steps_cost_the_pace_time() -> None:
    h = heterogeneous_pace([1.0, 3.0], tokens_per_group_step=10.0, sync_every=4, sync_seconds=1.0, skip_seconds=0.1)
    assert h.steps == (4, 1)  # round(4 / 3) = 1
    assert h.pace == pytest.approx(5 * 10 / (max(4 * 1.0, 1 * 3.0 + 3 * 0.1) + 1.0))
    assert h.barrier == pytest.approx(2 * 4 * 10 / (4 * 3.0 + 1.0))


def test_bad_step_times_are_refused() -> None:
    with pytest.raises(ValueError, match="positive time"):
        heterogeneous_pace([1.0, 0.0], 1.0, 8)


def test_the_plan_command_shows_the_heterogeneous_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    plan(model="xs", cluster="emulated-4x2", node_speeds=[1, 1, 1, 0.5])
    out = capsys.readouterr().out
    assert "With node speeds 1, 1, 1, 0.5" in out and "| fl_fsdp | 4 x 1 x 2 |" in out and "8/8/8/4" in out
    with pytest.raises(ValueError, match="each of the 4 nodes"):
        plan(model="xs", cluster="emulated-4x2", node_speeds=[1, 0.5])


def test_a_measured_pace_probes_its_first_round() -> None:
    steady = heterogeneous_pace([1.0, 2.0], tokens_per_group_step=10.0, sync_every=4)
    run = heterogeneous_pace([1.0, 2.0], tokens_per_group_step=10.0, sync_every=4, rounds=3)
    # the first round: 2 probe steps at the slow group's 2 s each, then the fast group's 2 more (6 steps in 6 s);
    # then two paced rounds of 6 steps in 4 s
    assert run.pace == pytest.approx((6 + 2 * 6) * 10 / (6.0 + 2 * 4.0))
    unprobed = heterogeneous_pace([1.0, 2.0], tokens_per_group_step=10.0, sync_every=4, rounds=3, probe=4)
    assert unprobed.pace == pytest.approx((8 + 2 * 6) * 10 / (8.0 + 2 * 4.0))  # a barrier round of 8 s first
    assert run.barrier < run.pace < steady.pace == pytest.approx(6 * 10 / 4.0)
    once = heterogeneous_pace([1.0, 2.0], tokens_per_group_step=10.0, sync_every=4, rounds=1)
    assert once.pace == pytest.approx(6 * 10 / 6.0)  # the probed round alone
