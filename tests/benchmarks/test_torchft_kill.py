"""One group killed on each side: the survivors' stall and the committed tokens/s, by one rule for both systems."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks import torchft_kill
from benchmarks.reports import torchft


def _syncs(seconds: list[float], lost: set[int] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """Syncs at steps 8, 16, ... at t = 10, 20, ..., each taking ``seconds[i]``."""
    return [
        {"step": 8 * (i + 1), "t": 10.0 * (i + 1), "seconds": s, "lost": 8 * (i + 1) in lost}
        for i, s in enumerate(seconds)
    ]


def test_the_stall_runs_from_the_kill_to_the_first_committed_sync_over_the_usual_sync_time():
    usual = [1.0, 1.2, 1.1]
    by_group = {
        0: _syncs([*usual, 1.5, 3.0, 1.1], lost={32}),  # the sync at 32 fails after 0.4 s extra, 40 commits late
        1: _syncs(usual),  # the victim
        2: _syncs([*usual, 1.3, 1.2, 1.1], lost={32}),
    }
    stall = torchft_kill.survivors_stall(by_group, victim=1, killed=35.0)  # after the sync at 24 (t=30)
    assert stall == pytest.approx((1.5 - 1.1) + (3.0 - 1.1))  # group 0, the worst survivor


def test_a_survivor_with_no_sync_before_or_after_the_kill_gives_no_stall():
    assert torchft_kill.survivors_stall({0: _syncs([1.0]), 1: _syncs([1.0])}, victim=1, killed=5.0) is None
    assert torchft_kill.survivors_stall({0: _syncs([1.0]), 1: _syncs([1.0])}, victim=1, killed=50.0) is None


def test_a_lost_sync_commits_none_of_its_round():
    syncs = [
        {"step": 8, "participants": 4, "lost": False},
        {"step": 16, "participants": 4, "lost": True},
        {"step": 24, "participants": 3, "lost": False},
    ]
    result = torchft_kill._measures({}, syncs, span=10.0, killed=0.0, wall=12.0)
    assert result["committed_tokens"] == (4 * 8 + 3 * 8) * torchft_kill.TOKENS_PER_GROUP_STEP
    assert result["committed_tokens_per_s"] == pytest.approx(result["committed_tokens"] / 10.0)
    assert result["lost_syncs"] == 1


def _kill_results(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    runs = [{"side": "fedshard", "result": {"stall_seconds": s, "committed_tokens_per_s": 100.0, "lost_syncs": 0}}
            for s in ours]  # fmt: skip
    runs += [{"side": "torchft", "result": {"stall_seconds": s, "committed_tokens_per_s": 80.0, "lost_syncs": 1}}
             for s in theirs]  # fmt: skip
    return {"runs": runs}


def test_the_kill_target_compares_the_median_stalls():
    row = torchft.kill_target(_kill_results([1.0, 2.0, 3.0], [4.0, 4.0, 5.0]))
    assert row["measured"] == pytest.approx(0.5) and row["met"] and row["runs"] == 6
    assert row["committed_tokens_per_s"] == {"torchft": 80.0, "fedshard": 100.0}
    assert not torchft.kill_target(_kill_results([3.0], [2.0]))["met"]


def test_when_torchft_did_not_stall_ours_must_not_either():
    assert torchft.kill_target(_kill_results([0.01], [0.0]))["met"]
    row = torchft.kill_target(_kill_results([1.0], [0.0]))
    assert not row["met"] and row["measured"] == math.inf


def test_without_results_the_kill_target_is_not_met():
    row = torchft.kill_target(None)
    assert row["measured"] is None and not row["met"] and row["note"] == "not run yet"


def test_the_kill_table_has_a_row_per_side():
    text = torchft.kill_table(torchft.kill_rows(_kill_results([1.0, 2.0], [4.0, 6.0])))
    assert "| torchft | 2 | 5.00 [4.00, 6.00] | 80 [80, 80] | 1 |" in text
    assert "| fedshard | 2 | 1.50 [1.00, 2.00] | 100 [100, 100] | 0 |" in text
