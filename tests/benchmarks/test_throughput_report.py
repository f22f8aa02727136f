"""The throughput report's pure parts: names, targets and the generated doc sections (no runs needed)."""

from __future__ import annotations

import math

import pytest

from benchmarks.throughput_report import (
    config_and_repeat,
    kind_of,
    link_of,
    replace_section,
    spread,
    targets,
    targets_table,
)


def test_names():
    assert config_and_repeat("fl_fsdp-int8-50mbit-r2") == ("fl_fsdp-int8-50mbit", 2)
    assert link_of("fsdp-unthrottled") is None and link_of("fl_hsdp-nosync-20mbit") == 20.0
    assert kind_of("fl_fsdp-int4ef-f4-d1-20mbit") == "fl_fsdp-int4ef-f4-d1"


def test_spread_ignores_missing_values():
    assert spread([3.0, math.nan, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([])["n"] == 0


def _config(kind: str, link: float | None, tokens: float, utilization: float = math.nan, ratio: float = 1.0) -> dict:
    one = spread([tokens])
    return {
        "kind": kind, "link": link, "tokens_per_s": one, "utilization": spread([utilization]),
        "inrun_utilization": spread([utilization - 0.1]), "bytes_ratio": ratio,
        "link_bytes_per_step": spread([1.0]),
    }  # fmt: skip


def test_targets_are_computed_from_the_medians_and_can_fail():
    summary = {
        "fl_fsdp-50mbit": _config("fl_fsdp", 50.0, 100.0, utilization=0.90),
        "fl_fsdp-int8-50mbit": _config("fl_fsdp-int8", 50.0, 100.0, utilization=0.97, ratio=1.05),
        "fl_fsdp-20mbit": _config("fl_fsdp", 20.0, 800.0),
        "fl_fsdp-int8-20mbit": _config("fl_fsdp-int8", 20.0, 1000.0),
        "fsdp-20mbit": {**_config("fsdp", 20.0, 100.0), "tokens_per_s_true_reduce_scatter": 125.0},
    }
    rows = targets(summary)
    by_name = {r["target"]: r for r in rows}
    utilization = rows[0]
    assert utilization["measured"] == pytest.approx(0.97) and utilization["met"]
    assert utilization["configuration"] == "fl_fsdp-int8-50mbit"
    default = by_name["FL+FSDP / FSDP tokens/s at 20 Mbit/s (float32 outer traffic; FSDP on gloo)"]
    assert default["measured"] == pytest.approx(8.0) and not default["met"]  # 8.0 < 8.04
    corrected = next(r for r in rows if "fastest option" in r["target"] and "corrected" in r["target"])
    assert corrected["measured"] == pytest.approx(1000 / 125) and not corrected["met"]
    race = next(r for r in rows if "perplexity" in r["target"])
    assert race["measured"] is None and race["met"] is False and race["runs"] == 0
    assert rows[-1]["measured"] == pytest.approx(0.05) and not rows[-1]["met"]  # bytes 5% off the model
    assert "| **no** |" in targets_table(rows) and "not run" in targets_table(rows)
    # the default sync's rows come from the `defaults` sweep, against that sweep's own FSDP
    defaults = {
        "fsdp-20mbit": {**_config("fsdp", 20.0, 50.0), "tokens_per_s_true_reduce_scatter": 80.0},
        "fl_fsdp-int4ef-20mbit": _config("fl_fsdp-int4ef", 20.0, 600.0),
    }
    rows = {r["target"]: r for r in targets(summary, defaults=defaults)}
    gloo = rows["FL+FSDP / FSDP tokens/s at 20 Mbit/s (the default sync, int4 + error feedback; FSDP on gloo)"]
    assert gloo["measured"] == pytest.approx(12.0) and gloo["met"]
    true_rs = rows[
        "FL+FSDP / FSDP tokens/s at 20 Mbit/s (the default sync, int4 + error feedback; FSDP corrected to a true"
        " reduce-scatter)"
    ]
    assert true_rs["measured"] == pytest.approx(7.5) and not true_rs["met"]


def test_replace_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- generated:x -->\nold\n<!-- /generated:x -->\nb\n")
    replace_section(page, "x", "new table")
    assert page.read_text() == "a\n<!-- generated:x -->\nnew table\n<!-- /generated:x -->\nb\n"
    with pytest.raises(ValueError, match="no <!-- generated:y -->"):
        replace_section(page, "y", "z")
