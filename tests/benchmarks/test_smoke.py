"""Smoke test of the emulated-cluster benchmark: two throttled nodes, a few FL+FSDP steps, results and plots.

Needs root and network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cluster import namespaces_available
from benchmarks.report import summarize

REPO = Path(__file__).resolve().parents[2]
_UNAVAILABLE = namespaces_available()


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"cannot emulate a cluster here: {_UNAVAILABLE}")
@pytest.mark.timeout(180)
def test_smoke_run_measures_links_and_cleans_up(tmp_path: Path) -> None:
    prefix = f"fst{os.getpid() % 100000}"
    results = tmp_path / "results" / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "benchmarks.run", "--preset", "smoke", "--work", str(tmp_path / "work")]
    proc = subprocess.run(
        [*command, "--results", str(results), "--prefix", prefix],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in namespaces, "the emulated cluster was not torn down"

    data = json.loads(results.read_text())
    assert not data["failed"]
    (run,) = data["runs"]
    assert run["world_size"] == 2 and run["driver"]["link_mbit"] == 20.0
    assert [s["step"] for s in run["syncs"]] == [2, 4]
    assert run["vals"] and run["vals"][-1]["val_ppl"] > 1
    assert len(run["cpu_seconds"]) == 2 and all(c > 0 for c in run["cpu_seconds"])
    state = run["model_state_bytes"][0]  # rank 0's tensors: its shard of the weights, gradients, AdamW, the anchor
    assert state["parameters"] > 0 and state["gradients"] == state["parameters"] == state["anchor"]
    assert state["inner_optimizer"] >= 2 * state["parameters"]  # AdamW: two moments (and a step count)
    assert state["outer_optimizer"] == state["parameters"]  # the smoke run's Nesterov: one momentum buffer
    summary = summarize(run)
    # Everything an outer step sends crosses the link: the counters must see about the analytic minimum.
    assert 0.95 < summary.sync_ratio < 1.25, summary
    assert summary.tokens_per_s > 0 and summary.peak_rss_mib > 0
    assert (run["driver"]["link_tx_total"]) >= run["link_tx_train"] > 0
    plots = sorted(p.name for p in (results.parent / "smoke").glob("*.png"))
    assert plots == ["bytes_per_step.png", "ppl_vs_time.png", "ppl_vs_tokens.png", "throughput_vs_bandwidth.png"]
