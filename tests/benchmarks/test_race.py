"""The race's scoring (no runs): learning-rate choice, equal wall time on a link, the target row."""

from __future__ import annotations

import pytest

from benchmarks.race import next_lr
from benchmarks.reports.race import analyze, at_time, budget_table, link_table, wall_time_table
from benchmarks.reports.targets import race_row


def _run(configuration: str, steps: int, lr: float, seed: int, ppl: float) -> dict:
    return {
        "name": f"{configuration}-s{steps}-lr{lr:g}-seed{seed}",
        "identity": {"preset": "race", "configuration": configuration, "repeat": seed, "link_mbit": None, "seed": seed},
        "config": {"max_steps": steps, "lr": lr, "seed": seed},
        "vals": [{"step": steps, "val_ppl": ppl}],
    }


def _pace(seconds: float) -> dict:
    return {"run_pace": {"median": seconds}}


def _race() -> dict:
    runs = []
    # FSDP: lr 3e-3 wins at both budgets; seeds 1, 2 at it.
    for steps, base in ((8, 700.0), (16, 500.0)):
        runs += [_run("fsdp", steps, 1.5e-3, 0, base + 100), _run("fsdp", steps, 3e-3, 0, base)]
        runs += [_run("fsdp", steps, 6e-3, 0, base + 50), _run("fsdp", steps, 3e-3, 1, base + 10)]
        runs += [_run("fsdp", steps, 3e-3, 2, base - 10)]
    # FL+FSDP: worse per step (600 at 8, 520 at 16), faster per step on slow links.
    for steps, base in ((8, 600.0), (16, 520.0)):
        runs += [_run("fl_fsdp", steps, 3e-3, seed, base + seed) for seed in (0, 1, 2)]
    # a sync option, run at the shortest budget only (and no better there)
    runs += [_run("fl_fsdp-int8", 8, 3e-3, seed, 900.0) for seed in (0, 1, 2)]
    runs.append(_run("hsdp", 16, 3e-3, 0, 500.5))
    return {"runs": runs}


def test_next_lr_steps_outward_only_from_an_edge():
    assert next_lr({1e-3: 5.0, 2e-3: 4.0, 4e-3: 3.0}) == 8e-3
    assert next_lr({1e-3: 3.0, 2e-3: 4.0, 4e-3: 5.0}) == 5e-4
    assert next_lr({1e-3: 5.0, 2e-3: 3.0, 4e-3: 4.0}) is None


def test_budgets_choose_the_seed0_winner_and_average_its_seeds():
    analysis = analyze(_race(), {})
    fsdp = analysis["curves"]["fsdp"]
    assert fsdp[8]["lr"] == 3e-3 and not fsdp[8]["lr_at_edge"]
    assert fsdp[8]["ppl"] == {"median": 700.0, "mean": pytest.approx(700.0), "min": 690.0, "max": 710.0, "n": 3}
    assert analysis["hsdp_check"]["rel"] == pytest.approx(0.001)
    table = budget_table(analysis)
    assert "| fsdp | 8 | 0.0015: 800, 0.003: 700, 0.006: 750 | 0.003 | 700.0 (690.0-710.0), 3 |" in table


def test_at_time_picks_the_best_budget_that_fits():
    items = [
        {"kind": "fsdp", "seconds": 8.0, "ppl": {"mean": 700.0}},
        {"kind": "fsdp", "seconds": 16.0, "ppl": {"mean": 500.0}},
    ]
    assert at_time(items, 10.0)["fsdp"]["seconds"] == 8.0
    assert at_time(items, 16.0)["fsdp"]["seconds"] == 16.0
    assert at_time(items, 7.9) == {}


def test_the_race_target_is_met_only_where_the_federated_curve_is_ahead_at_every_moment():
    # Fast link: FSDP and FL+FSDP take equally long per step, and FSDP learns more per step: the target fails.
    # Slow link: FSDP's step takes 2x longer: by the time it has 8 steps, FL+FSDP has 16 steps (521 < 700).
    paces = {
        "fsdp-200mbit": _pace(1.0),
        "hsdp-200mbit": _pace(1.0),
        "fl_fsdp-200mbit": _pace(1.0),
        "fsdp-20mbit": _pace(2.0),
        "hsdp-20mbit": _pace(2.0),
        "fl_fsdp-20mbit": _pace(1.0),
        "fl_fsdp-int8-20mbit": _pace(1.0),
    }
    analysis = analyze(_race(), paces)
    slow = next(link for link in analysis["links"] if link["link"] == 20.0)
    # up to FL+FSDP's largest budget: the option's single budget (8 s) does not cut the race short
    assert [t["seconds"] for t in slow["times"]] == [8.0, 16.0]
    assert slow["times"][0]["ratio"] is None  # no baseline model at 8 s
    assert slow["times"][1]["ratio"] == pytest.approx(521.0 / 700.0)
    fast = next(link for link in analysis["links"] if link["link"] == 200.0)
    assert [t["ratio"] for t in fast["times"]] == [pytest.approx(601.0 / 700.0), pytest.approx(521.0 / 500.0)]
    row = race_row(analysis)
    assert row["id"] == "race-equal-time"
    assert row["measured"] == pytest.approx(521.0 / 500.0) and not row["met"]
    assert "200 Mbit/s" in row["note"]
    assert "no model yet" in wall_time_table(analysis)
    assert "| 200 Mbit/s | 2 | 1 of 2 | 1.042 (16) | 0.859 (8) | 1.042 (16) |" in link_table(analysis)

    paces["fsdp-200mbit"] = paces["hsdp-200mbit"] = _pace(2.0)
    row = race_row(analyze(_race(), paces))
    assert row["measured"] == pytest.approx(521.0 / 700.0)
    assert not row["met"]  # the 50 Mbit/s link was not raced: no pass by absence
    paces.update({f"{kind}-50mbit": paces[f"{kind}-20mbit"] for kind in ("fsdp", "hsdp", "fl_fsdp")})
    assert race_row(analyze(_race(), paces))["met"]


def test_without_the_race_its_target_says_not_run():
    row = race_row(None)
    assert row["measured"] is None and row["met"] is False and row["runs"] == 0
