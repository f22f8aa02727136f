"""The side-by-side report with torchft: pace, blocking, bytes and perplexity per configuration and link, paired."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.reports import torchft


def _run(configuration: str, link: float | None, seed: int, step_s: float, sync_s: float, ppl: float) -> dict[str, Any]:
    """64 steps of ``step_s`` seconds, those after a sync (every 8) ``sync_s`` longer; 1 MB per sync on the links."""
    clock, steps = 0.0, []
    for step in range(1, 65):
        clock += step_s + (sync_s if step % 8 == 0 else 0.0)
        steps.append({"step": step, "clock": clock})
    return {
        "identity": {"preset": "torchft", "configuration": configuration, "repeat": seed, "link_mbit": link,
                     "seed": seed},
        "config": {"max_steps": 64, "seed": seed, "federation": {"sync_every": 8}},
        "tokens_per_step": 1000,
        "steps": steps,
        "syncs": [{"step": s} for s in range(8, 65, 8)],
        "vals": [{"step": 64, "val_ppl": ppl}],
        "link_tx_train": 8_000_000,
        "driver": {"link_tx_total": 9_000_000},
    }  # fmt: skip


def test_each_configuration_is_paired_by_seed_with_its_torchft_counterpart():
    runs = [
        _run("torchft-diloco", 20.0, 0, 0.1, 1.0, 400.0),
        _run("torchft-diloco", 20.0, 1, 0.1, 1.0, 500.0),
        _run("fl_fsdp-torchft-same", 20.0, 0, 0.1, 0.5, 404.0),
        _run("fl_fsdp-torchft-same", 20.0, 1, 0.1, 0.5, 495.0),
        _run("fl_fsdp-defaults", 20.0, 0, 0.1, 0.1, 380.0),
    ]
    rows = {r["configuration"]: r for r in torchft.rows(runs)}
    same = rows["fl_fsdp-torchft-same"]
    assert same["blocking_s"] == pytest.approx(0.5) and rows["torchft-diloco"]["blocking_s"] == pytest.approx(1.0)
    assert same["link_mb_per_sync"] == pytest.approx(1.0)
    # 64 steps of 0.1 s, 7 syncs in the pace window (steps 9-64): 6.1 s against 9.6 s
    assert same["pace_vs_torchft"] == pytest.approx((5.6 + 7 * 1.0) / (5.6 + 7 * 0.5))
    assert same["ppl_vs_torchft"] == pytest.approx((0.01 - 0.01) / 2)  # +1% and -1%, the median of the two
    assert "pace_vs_torchft" not in rows["torchft-diloco"]
    targets = {r["id"]: r for r in torchft.targets({"runs": runs})}
    assert list(targets) == list(torchft.TARGET_IDS)
    assert targets["torchft-pace-same"]["met"] and targets["torchft-ppl-same"]["measured"] == pytest.approx(0.0)
    assert targets["torchft-kill-stall"]["measured"] is None and not targets["torchft-kill-stall"]["met"]
    assert (
        "| fl_fsdp-torchft-same | one job (a failure ends it; resume from a checkpoint) | 20 Mbit/s |"
        in torchft.table(torchft.rows(runs))
    )


def test_the_step_overhead_pairs_our_rank_0_with_torchfts_node_0_unthrottled():
    runs = []
    for seed, (ours, theirs) in enumerate(((10.6, 10.0), (10.2, 10.0), (11.0, 10.0))):
        runs += [
            {**_run("fl_fsdp-torchft-same", None, seed, 0.1, 0.5, 400.0), "cpu_seconds": [ours, 99.0]},
            {**_run("torchft-diloco", None, seed, 0.1, 1.0, 400.0), "cpu_seconds": [theirs]},
            {
                **_run("fl_fsdp-torchft-same", 20.0, seed, 0.1, 0.5, 400.0),
                "cpu_seconds": [50.0],
            },  # a slow link: left out
        ]
    row = torchft.overhead_row(runs)
    assert row["per_repeat"] == [pytest.approx(1.06), pytest.approx(1.02), pytest.approx(1.10)]
    assert row["measured"] == pytest.approx(1.06) and not row["met"] and row["runs"] == 6
