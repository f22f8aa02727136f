"""The recipe study's bookkeeping and evidence: runs to do, tokens to target, pairing by seed, targets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import benchmarks.recipes as study
from benchmarks.reports import recipes as report


def _run(recipe: str, seed: int, curve: list[list[float]], tokens_per_step: int = 100) -> dict[str, Any]:
    return {
        "recipe": recipe,
        "seed": seed,
        "curve": curve,
        "tokens_per_step": tokens_per_step,
        "settings": study.RECIPES[recipe].settings(),
        "wall_seconds": 10.0,
        "finished_at": 100.0 + seed,
        "resumed": False,
    }


def test_tokens_to_target_interpolates_between_validations_and_counts_steps_done() -> None:
    curve = [[9, 5.0], [19, 4.0], [29, 3.0]]  # logged steps: 10, 20 and 30 steps done
    assert report.tokens_to(curve, 3.5, 100) == pytest.approx(2500.0)
    assert report.tokens_to(curve, 5.0, 100) == 1000.0
    assert report.tokens_to(curve, 2.9, 100) is None


def test_ratios_pair_runs_by_seed_against_the_references_own_tokens() -> None:
    runs = report.by_recipe(
        [
            _run("fedavg_f32", 0, [[9, 5.0], [19, 4.0], [29, 3.0]]),
            _run("int4ef", 0, [[9, 4.0], [19, 3.0], [29, 2.5]]),  # reaches 3.0 after 20 steps: 2/3 of the tokens
            _run("int4ef", 1, [[9, 1.0]]),  # no reference of seed 1: not paired
            _run("sparse", 0, [[9, 5.0], [19, 4.5], [29, 3.5]]),
        ]
    )
    assert report.ratios(runs, "int4ef", "fedavg_f32") == {0: pytest.approx(2 / 3)}
    assert report.ratios(runs, "sparse", "fedavg_f32") == {0: None}
    # it ends at 3.5, above the reference's 3.0; the reference reached 3.5 after 25 steps, the recipe after 30
    assert report.at_own_final(runs, "sparse", "fedavg_f32") == {0: pytest.approx(30 / 25)}
    assert report.at_own_final(runs, "int4ef", "fedavg_f32") == {}


def test_targets_are_met_or_missed_by_their_bounds() -> None:
    results = [
        _run("fedavg_f32", 0, [[9, 5.0], [19, 4.0], [29, 3.0]]),
        _run("nesterov_f32", 0, [[9, 4.0], [19, 3.0], [29, 2.0]]),
        _run("int4ef", 0, [[9, 5.0], [19, 4.0], [29, 3.0]]),
        _run("sparse", 0, [[9, 5.0], [19, 4.5], [29, 3.5]]),
        _run("sparseloco_selected", 0, [[9, 5.0], [19, 4.5], [29, 3.2]]),
    ]
    rows = {row["id"]: row for row in report.targets(results, exactness=3e-8)}
    assert rows["sim-exact"]["met"]
    assert rows["ttt-int4"]["measured"] == pytest.approx(1.0) and rows["ttt-int4"]["met"]
    assert rows["ttt-sparse"]["measured"] is None and not rows["ttt-sparse"]["met"]
    assert "(sparseloco_selected," in rows["ttt-sparse"]["target"]  # the best of the sparse recipes by final loss
    assert rows["ttt-sparse"]["at_own_final"] == {"0": pytest.approx(30 / 28)}  # 3.2 reached after 30 and 28 steps
    # the default (fedavg) reaches Nesterov's final loss never: missed
    assert "nesterov_f32" in rows["ttt-outer"]["target"] and not rows["ttt-outer"]["met"]
    assert rows["sim-speed"]["measured"] == pytest.approx(
        (5 * 30 * 100) / (100.0 - 90.0) / report.CLUSTER_NOSYNC_TOKENS_PER_S  # 5 runs from 90 s to 100 s
    )


def test_runs_on_record_are_not_run_again_and_other_settings_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    study.result_path("int4ef", 0).write_text(json.dumps(_run("int4ef", 0, [[9, 1.0]])))
    assert study.pending(["int4ef", "sparse"], [0, 1]) == [("sparse", 0), ("int4ef", 1), ("sparse", 1)]
    other = {**_run("sparse", 0, [[9, 1.0]]), "settings": {"steps": 64}}
    study.result_path("sparse", 0).write_text(json.dumps(other))
    with pytest.raises(ValueError, match="holds a run with other settings than recipe 'sparse'"):
        study.pending(["sparse"], [0])
    assert [r["recipe"] for r in study.load_results()] == ["int4ef"]  # the other settings' result is not evidence


def test_a_paced_run_is_held_against_the_all_fast_run_at_equal_committed_tokens() -> None:
    fast = {**_run("int4ef", 0, [[9, 5.0], [19, 4.0], [29, 3.0]]), "tokens_per_step": 100}
    paced = {**_run("paced_int4ef", 0, [[9, 5.0], [19, 4.5], [29, 3.6]]), "tokens_per_step": 75}
    # 30 paced steps commit 2,250 tokens: the all-fast run had 3.75 there (between 2,000 and 3,000 tokens)
    assert report.loss_at(fast["curve"], 2250, 100) == pytest.approx(3.75)
    ratios = report.paced_perplexity_ratios(report.by_recipe([fast, paced]))
    assert ratios == {0: pytest.approx(math.exp(3.6 - 3.75))}
    rows = {row["id"]: row for row in report.targets([fast, paced])}
    assert rows["hetero-ppl"]["measured"] == pytest.approx(math.exp(-0.15)) and rows["hetero-ppl"]["met"]


def test_the_study_pace_counts_the_time_runs_ran_not_the_days_between() -> None:
    first = {**_run("fedavg_f32", 0, [[9, 5.0]]), "finished_at": 100.0, "wall_seconds": 10.0}
    later = {**_run("int4ef", 0, [[9, 5.0]]), "finished_at": 86_400.0, "wall_seconds": 20.0}
    speed = report.study_speed([first, later])
    assert speed is not None and speed["hours"] == pytest.approx(30.0 / 3600)
    assert speed["tokens_per_s"] == pytest.approx(2 * 10 * 100 / 30.0)


def test_the_planners_factors_are_tokens_to_fsdps_final_loss_from_the_longest_run_that_reached_it() -> None:
    """FSDP is 1; a federation that missed FSDP's loss in the study's tokens but reached it in a 3x run gets the 3x
    run's factor (at the real target), not the short run's looser one."""
    fsdp = [[9, 5.0], [19, 4.0], [29, 3.0]]  # 3,000 tokens to 3.0
    results = [
        _run("fsdp", seed, fsdp) for seed in (0, 1)
    ] + [
        _run("fedavg_f32", seed, [[9, 5.0], [19, 4.0], [29, 3.5]]) for seed in (0, 1)  # 3.5 at 3,000: looser
    ] + [
        _run("fedavg_f32_x3", 0, [[9, 5.0], [19, 4.0], [29, 3.5], [59, 3.25], [89, 3.0]]),  # 3.0 after 9,000 tokens
        _run("int4ef", 0, [[9, 5.0], [19, 4.0], [29, 3.5]]),
    ]  # fmt: skip
    factors = report.planner_factors(results)
    assert factors[("fsdp",)] == (1.0, "fsdp", (1.0, 1.0), False)
    assert factors[(8, 1, "float32", 0, None, "fedavg")] == (3.0, "fedavg_f32_x3", (3.0,), False)
    # int4 + error feedback never reached 3.0: its factor at its own final loss, 3.5 (FSDP reached it at 2,500)
    assert factors[(8, 1, "int4", 0, None, "fedavg")] == (pytest.approx(1.2), "int4ef", (1.2,), True)
