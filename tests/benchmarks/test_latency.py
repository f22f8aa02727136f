"""The latency report: paired ratios by repeat, one sync against the planner, the table (synthetic runs)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.reports import latency
from lightning_fedshard.core.config import FederationConfig

STEPS = 16


def _run(configuration: str, rtt: float, repeat: int, step_s: float, sync_s: float = 0.0) -> dict[str, Any]:
    strategy = configuration.split("-")[0]
    federation = FederationConfig(num_groups=2 if strategy == "fl_hsdp" else None,
                                  sync_every=1024 if "nosync" in configuration else 8)  # fmt: skip
    fields = {f: getattr(federation, f) for f in federation.__dataclass_fields__}
    syncs = [{"step": s, "when": "train", "sync_seconds": sync_s} for s in range(8, STEPS + 1, 8)]
    return {
        "identity": {
            "preset": "latency",
            "configuration": configuration,
            "repeat": repeat,
            "link_mbit": 20.0,
            "seed": 0,
            "rtt_ms": rtt,
        },  # fmt: skip
        "config": {"strategy": strategy, "max_steps": STEPS, "size": "xs", "batch_size": 4, "federation": fields},
        "tokens_per_step": 1000,
        "steps": [{"step": s, "clock": s * step_s} for s in range(1, STEPS + 1)],
        "strategy_syncs": [syncs],
    }


def _results() -> dict[str, Any]:
    runs = []
    for repeat in range(3):
        runs += [
            _run("fl_fsdp-nosync-long", 0.0, repeat, 0.100),
            _run("fl_fsdp-nosync-long", 100.0, repeat, 0.101 + 0.001 * repeat),
            _run("fl_fsdp-int4ef", 100.0, repeat, 0.2, sync_s=2.0 + repeat),
            _run("fsdp", 0.0, repeat, 0.5),
            _run("fsdp", 100.0, repeat, 5.0),
            _run("fl_hsdp-int4ef", 0.0, repeat, 0.25),
            _run("fl_hsdp-int4ef", 100.0, repeat, 0.5),
        ]
    return {"runs": runs}


def test_the_no_sync_pace_is_paired_by_repeat_and_the_sync_held_against_the_planner(monkeypatch):
    monkeypatch.setattr(latency, "predicted_sync_seconds", lambda run, rtt: 2.5)
    no_sync, model = latency.targets(_results())
    assert no_sync["per_repeat"] == [pytest.approx(100 / 101), pytest.approx(100 / 102), pytest.approx(100 / 103)]
    assert no_sync["measured"] == pytest.approx(100 / 102) and no_sync["met"] and no_sync["runs"] == 3
    # syncs of 2, 3 and 4 s (one landing in each run's pace window, steps 9-16): median 3 s against 2.5 s predicted
    assert model["measured_s"] == 3.0 and model["measured"] == pytest.approx(0.2) and not model["met"]


def test_a_missing_sweep_misses_both_targets_with_the_reason():
    rows = latency.targets(None)
    assert [r["id"] for r in rows] == list(latency.TARGET_IDS) and not any(r["met"] for r in rows)


def test_the_planner_predicts_a_longer_sync_at_a_longer_round_trip():
    run = _run("fl_fsdp-int4ef", 100.0, 0, 0.2)
    assert latency.predicted_sync_seconds(run, 100.0) > latency.predicted_sync_seconds(run, 0.0) + 0.05


def test_the_table_gives_each_configuration_at_both_round_trips_and_fl_hsdp_over_fsdp():
    text = latency.table(_results())
    assert "| fsdp | 2,000 [2,000, 2,000] | 200 [200, 200] | 0.100 [0.100, 0.100] |" in text
    assert "2.00x at 0 ms, 10.00x at 100 ms" in text
