"""The tuning targets of the recipe study on synthetic runs: what each holds against what."""

from __future__ import annotations

from typing import Any

import pytest

import benchmarks.recipes as study
from benchmarks.reports import tuning


def _run(recipe: str, seed: int, final: float) -> dict[str, Any]:
    steps = study.RECIPES[recipe].steps
    return {"recipe": recipe, "seed": seed, "tokens_per_step": study.RECIPES[recipe].tokens_per_step,
            "curve": [[steps // 2 - 1, final + 1.0], [steps - 1, final]]}  # fmt: skip


def _row(results: list[dict[str, Any]], target_id: str) -> dict[str, Any]:
    (row,) = (r for r in tuning.targets(results) if r["id"] == target_id)
    return row


def test_the_federation_is_held_against_fsdp_at_equal_tokens_not_by_its_longer_runs() -> None:
    """A run of 3x the tokens ends lower than FSDP; the target compares runs of FSDP's tokens only."""
    results = [_run("fsdp", s, 4.0) for s in (0, 1)]
    results += [_run("fedavg_f32", s, 4.2) for s in (0, 1)] + [_run("int4ef", s, 4.3) for s in (0, 1)]
    results += [_run("fedavg_f32_x3", s, 3.9) for s in (0, 1)]
    row = _row(results, "fed-vs-fsdp-loss")
    assert row["recipe"] == "fedavg_f32" and row["measured"] == pytest.approx(4.2 / 4.0) and not row["met"]
    results += [_run("sgd07_f32", s, 4.1) for s in (0, 1)]  # 1.025: within the bound
    row = _row(results, "fed-vs-fsdp-loss")
    assert row["recipe"] == "sgd07_f32" and row["met"]


def test_the_papers_regime_takes_the_best_federation_of_any_horizon() -> None:
    results = [_run("fsdp_b4_lr0p0025", s, 4.7) for s in (0, 1)]
    results += [_run("paper_fed4_fedavg", s, 4.9) for s in (0, 1)] + [
        _run("paper_fed4_fedavg_h2", s, 4.8) for s in (0, 1)
    ]
    row = _row(results, "paper-regime")
    assert (row["recipe"], row["against"]) == ("paper_fed4_fedavg_h2", "fsdp_b4_lr0p0025") and not row["met"]
    assert "not reached by every seed" in row["note"]


def test_the_critical_batch_table_shows_every_seed_of_a_cell_and_a_dash_where_none_ran() -> None:
    results = [_run("fsdp", 0, 4.156), _run("fsdp", 1, 4.151), _run("fsdp_b16_lr0p0025", 0, 5.72)]
    table = tuning.critical_batch_table(results)
    assert "| 16 windows (1x) | 1200 | - | 4.156 / 4.151 | - |" in table
    assert "| 256 windows (16x) | 75 | 5.720 | - | - |" in table
