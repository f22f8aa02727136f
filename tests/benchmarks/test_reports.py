"""The reports' pure parts: measures, targets and their ids, the generated doc sections (no runs needed)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.metrics import link_label, link_slug, pace_window, spread
from benchmarks.reports.docs import replace_section
from benchmarks.reports.targets import TARGET_IDS, targets, targets_table

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def test_spread_ignores_missing_values():
    assert spread([3.0, math.nan, 1.0, None, 2.0, math.inf]) == {
        "median": 2.0,
        "mean": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
    }
    assert spread([])["n"] == 0


def test_link_names():
    assert link_label(None) == link_slug(None) == "unthrottled"
    assert link_label(50.0) == "50 Mbit/s" and link_slug(50.0) == "50mbit"


@pytest.mark.parametrize(
    ("sync_every", "max_steps", "window"), [(8, 16, range(9, 17)), (32, 32, range(1, 33)), (1024, 16, range(9, 17))]
)
def test_the_pace_window_is_whole_rounds_after_the_first_sync(sync_every: int, max_steps: int, window: range):
    run = {"config": {"max_steps": max_steps, "federation": {"sync_every": sync_every}}}
    assert pace_window(run) == window


def _config(kind: str, link: float | None, tokens: float, utilization: float = math.nan, ratio: float = 1.0) -> dict:
    one = spread([tokens])
    return {
        "kind": kind, "link": link, "tokens_per_s": one, "utilization": spread([utilization]),
        "inrun_utilization": spread([utilization - 0.1]), "bytes_ratio": ratio,
        "link_bytes_per_step": spread([1.0]), "calibration_input": False, "prediction_error": -0.1,
    }  # fmt: skip


def _summary() -> dict:
    return {
        "fl_fsdp-50mbit": _config("fl_fsdp", 50.0, 100.0, utilization=0.90),
        "fl_fsdp-int8-50mbit": _config("fl_fsdp-int8", 50.0, 100.0, utilization=0.97, ratio=1.05),
        "fl_fsdp-20mbit": _config("fl_fsdp", 20.0, 800.0),
        "fl_fsdp-int8-20mbit": _config("fl_fsdp-int8", 20.0, 1000.0),
        "fsdp-20mbit": {**_config("fsdp", 20.0, 100.0), "tokens_per_s_true_reduce_scatter": 125.0},
    }


def test_targets_are_computed_from_the_medians_and_can_fail():
    rows = {r["id"]: r for r in targets(_summary())}
    utilization = rows["utilization-50mbit"]
    assert utilization["measured"] == pytest.approx(0.97) and utilization["met"]
    assert utilization["configuration"] == "fl_fsdp-int8-50mbit"
    float32 = rows["fl-fsdp-float32-speedup-20mbit"]
    assert float32["measured"] == pytest.approx(8.0) and not float32["met"]  # 8.0 < 8.04
    corrected = rows["fl-fsdp-fastest-speedup-20mbit-true-reduce-scatter"]
    assert corrected["measured"] == pytest.approx(1000 / 125) and not corrected["met"]
    assert rows["race-equal-time"]["measured"] is None and rows["race-equal-time"]["runs"] == 0
    assert rows["link-bytes-model"]["measured"] == pytest.approx(0.05) and not rows["link-bytes-model"]["met"]
    assert rows["planner-calibration"]["measured"] == pytest.approx(0.1) and rows["planner-calibration"]["met"]
    table = targets_table(list(rows.values()))
    assert "| **no** |" in table and "not run" in table and "| `utilization-50mbit` |" in table


def test_the_default_sync_is_compared_with_the_fsdp_of_its_own_sweep():
    defaults = {
        "fsdp-20mbit": {**_config("fsdp", 20.0, 50.0), "tokens_per_s_true_reduce_scatter": 80.0},
        "fl_fsdp-int4ef-20mbit": _config("fl_fsdp-int4ef", 20.0, 600.0),
    }
    rows = {r["id"]: r for r in targets(_summary(), defaults=defaults)}
    assert rows["fl-fsdp-speedup-20mbit"]["measured"] == pytest.approx(12.0) and rows["fl-fsdp-speedup-20mbit"]["met"]
    true_rs = rows["fl-fsdp-speedup-20mbit-true-reduce-scatter"]
    assert true_rs["measured"] == pytest.approx(7.5) and not true_rs["met"]
    assert list(rows) == list(TARGET_IDS)


def test_target_ids_are_unique_kebab_case_and_those_of_targets_json():
    assert len(set(TARGET_IDS)) == len(TARGET_IDS)
    assert all(KEBAB.match(target_id) and len(target_id) <= 60 for target_id in TARGET_IDS)
    recorded = json.loads((RESULTS / "targets.json").read_text())
    assert [row["id"] for row in recorded] == list(TARGET_IDS)
    assert all({"id", "target", "measured", "bound", "met", "runs"} <= set(row) for row in recorded)


def test_replace_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- generated:x -->\nold\n<!-- /generated:x -->\nb\n")
    replace_section(page, "x", "new table")
    assert page.read_text() == "a\n<!-- generated:x -->\nnew table\n<!-- /generated:x -->\nb\n"
    with pytest.raises(ValueError, match="no <!-- generated:y -->"):
        replace_section(page, "y", "z")
