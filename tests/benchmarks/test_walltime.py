"""Wall time to FSDP's final loss: the study's tokens to it over the cluster's tokens/s (synthetic runs)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.reports import walltime


def _study(recipe: str, seed: int, losses: list[float], tokens_per_step: float = 100.0) -> dict[str, Any]:
    return {"recipe": recipe, "seed": seed, "tokens_per_step": tokens_per_step,
            "curve": [[99 + 100 * i, loss] for i, loss in enumerate(losses)]}  # fmt: skip


def _cluster(configuration: str, link: float | None, tokens_per_s: float) -> dict[str, Any]:
    steps = [{"step": s, "clock": s * 100.0 / tokens_per_s} for s in range(1, 33)]
    return {"identity": {"preset": "walltime", "configuration": configuration, "repeat": 0, "link_mbit": link,
                         "seed": 0}, "config": {"max_steps": 32, "federation": {"sync_every": 8}},
            "tokens_per_step": 100.0, "steps": steps}  # fmt: skip


def test_the_wall_time_joins_tokens_to_fsdps_final_loss_with_the_clusters_pace(tmp_path):
    # FSDP ends at 3.0 after 30,000 tokens; the federation reaches 3.0 at 50,000 tokens (3x run), the defaults never
    study = [
        _study("fsdp", 0, [5.0, 4.0, 3.0]),
        _study("fedavg_f32_x3", 0, [5.5, 4.5, 3.5, 3.25, 3.0, 2.9]),
        _study("int4ef", 0, [5.5, 4.5, 3.5]),
    ]
    results = {"runs": [_cluster("walltime-fsdp", 20.0, 10.0), _cluster("walltime-fedavg-f32", 20.0, 100.0),
                        _cluster("walltime-defaults", 20.0, 150.0)]}  # fmt: skip
    walls = walltime.wall_seconds(study, walltime.cluster_tokens_per_s(results))
    assert walls["fsdp"][20.0] == {0: pytest.approx(300 * 100 / 10.0)}
    assert walls["fedavg_f32_x3"][20.0] == {0: pytest.approx(500 * 100 / 100.0)}
    assert walls["int4ef"][20.0] == {0: None}
    row = walltime.target(study, results)
    assert row["recipe"] == "fedavg_f32_x3" and row["measured"] == pytest.approx(500 / 3000) and row["met"]
    assert "| `int4ef` | - | - | not reached | - |" in walltime.table(study, results)
    assert walltime.plot(study, results, tmp_path / "walltime.png").stat().st_size > 0  # a recipe without bars too


def test_without_the_cluster_runs_the_target_is_not_run():
    row = walltime.target([], None)
    assert row["measured"] is None and not row["met"] and "walltime.json is missing" in row["note"]
