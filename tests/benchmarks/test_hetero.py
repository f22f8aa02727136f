"""The heterogeneous sweep's report: committed tokens/s against each group's own pace, from results alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness.config import RunConfig
from benchmarks.presets import HETERO_QUOTA, PRESETS
from benchmarks.reports import hetero


def _run(kind: str, repeat: int, trained: list[int], seconds: float, own: list[float] | None = None) -> dict[str, Any]:
    return {
        "identity": {"configuration": kind, "repeat": repeat},
        "tokens_per_step": 4 * 1000,  # 4 groups of 1,000 tokens a step
        "trained_steps": trained,
        "train_seconds": seconds,
        "own_train_seconds": own or [seconds] * 4,
        "group_of_rank": [0, 1, 2, 3],
        "config": {"max_steps": 96, "federation": {"sync_every": 8}},
        "strategy_syncs": [[{"when": "train", "sync_exposed_seconds": 0.5}]],
    }


def _results() -> dict[str, Any]:
    runs = []
    for repeat in range(3):
        runs += [
            _run("hetero-nosync", repeat, [96] * 4, 200.0, own=[96.0, 96.0, 96.0, 192.0]),  # 1,000 x3 + 500 tokens/s
            _run("hetero-barrier", repeat, [96] * 4, 192.0),  # 2,000 tokens/s: 4/7 of 3,500
            _run("hetero-pace", repeat, [96, 96, 96, 48 + repeat], 96.0 + repeat),
        ]
    return {"runs": runs}


def test_the_pace_is_held_against_the_sum_of_each_groups_own_pace() -> None:
    results = _results()
    assert hetero.ratios(results, "hetero-barrier") == [pytest.approx(2000 / 3500)] * 3
    row, efficiency, planner = hetero.targets(results)
    assert planner["runs"] == 0  # no all-fast runs: no sync time to predict with
    assert efficiency["runs"] == 0 and not efficiency["met"]
    assert row["measured"] == pytest.approx((3 * 96 + 49) * 1000 / 97.0 / 3500)  # the median repeat
    assert row["met"] and row["barrier"]["median"] == pytest.approx(4 / 7)
    assert "hetero-pace" in hetero.table(results) and "Attainable: 3,500 tokens/s" in hetero.table(results)


def test_the_pace_is_judged_against_what_the_all_fast_run_gets_of_its_own_attainable() -> None:
    results = _results()
    for repeat in range(3):  # all fast: 4 x 1,000 tokens/s attainable, 3,600 committed with its syncs
        results["runs"] += [
            _run("hetero-allfast-nosync", repeat, [96] * 4, 96.0),
            _run("hetero-allfast", repeat, [96] * 4, 96.0 * 4000 / 3600),
        ]
    paced = [(3 * 96 + 48 + r) * 1000 / (96.0 + r) / 3500 for r in range(3)]
    assert hetero.efficiencies(results) == [pytest.approx(p / 0.9) for p in paced]
    rows = {r["id"]: r for r in hetero.targets(results)}
    assert rows["hetero-efficiency"]["measured"] == pytest.approx(sorted(paced)[1] / 0.9)
    assert rows["hetero-efficiency"]["met"] == (sorted(paced)[1] / 0.9 >= hetero.EFFICIENCY_BOUND)


def test_without_results_the_targets_are_listed_not_run() -> None:
    rows = hetero.targets(None)
    assert [r["id"] for r in rows] == list(hetero.TARGET_IDS)
    assert all(r["measured"] is None and not r["met"] and r["runs"] == 0 for r in rows)


def test_the_preset_slows_the_last_node_by_a_quota_and_records_it() -> None:
    jobs = {job.identity.configuration: job.config for job in PRESETS["hetero"].jobs(Path("/w"))}
    assert jobs["hetero-pace"].cpu_quota == HETERO_QUOTA and jobs["hetero-pace"].federation.pace is not None
    again = RunConfig.from_record(jobs["hetero-pace"].record())
    assert again == jobs["hetero-pace"]  # the pace and the quotas survive the JSON every rank reads
    with pytest.raises(ValueError, match=r"needs one quota per node \(4\)"):
        RunConfig(strategy="fl_fsdp", num_nodes=4, devices=1, out="o", cache_dir="c", cpu_quota=(0.5,))
