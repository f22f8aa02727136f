"""Smoke test of the emulated-cluster benchmark: two throttled nodes, a few FL+FSDP steps with the default sync.

Needs root and network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import metrics
from benchmarks.harness.cluster import namespaces_available
from lightning_fedshard.core.config import FederationConfig

pytestmark = pytest.mark.slow  # launches processes

REPO = Path(__file__).resolve().parents[2]
_UNAVAILABLE = namespaces_available()


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"cannot emulate a cluster here: {_UNAVAILABLE}")
@pytest.mark.timeout(180)
def test_smoke_run_measures_links_and_cleans_up(tmp_path: Path) -> None:
    prefix = f"fst{os.getpid() % 100000}"
    results = tmp_path / "results" / "smoke.json"
    command = [sys.executable, "-m", "benchmarks.run", "--preset", "smoke", "--work", str(tmp_path / "work")]
    proc = subprocess.run(
        [*command, "--results", str(results), "--prefix", prefix],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
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
    assert run["identity"] == {
        "preset": "smoke", "configuration": "smoke", "repeat": 0, "link_mbit": 20.0, "seed": 0, "rtt_ms": 0.0
    }  # fmt: skip
    assert run["invocation"] == 0 and data["invocations"][0]["machine"] == data["machine"]
    # The package's defaults, but for what the preset changes; as the strategy received them.
    federation = run["config"]["federation"]
    assert FederationConfig(**federation) == FederationConfig(sync_every=2)
    assert run["world_size"] == 2 and run["driver"]["link_mbit"] == 20.0
    assert [s["step"] for s in run["syncs"]] == [2, 4]
    assert run["vals"] and metrics.final_ppl(run) > 1
    assert len(run["cpu_seconds"]) == 2 and all(c > 0 for c in run["cpu_seconds"])
    # Rank 0's tensors: its shard of the weights, gradients, AdamW's moments, the federation's state.
    state = run["model_state_bytes"][0]
    assert state["parameters"] > 0 and state["gradients"] == state["parameters"] == state["anchor"]
    assert state["inner_optimizer"] >= 2 * state["parameters"]
    assert state["outer_optimizer"] == 0  # "fedavg" is SGD without momentum: no state
    assert state["residuals"] > 0  # int4 with error feedback keeps each rank's quantization residual
    # Everything an outer step sends crosses the link: the counters see about what the strategy says it sent.
    logged = sum(s["sync_bytes"] for rank in run["strategy_syncs"] for s in rank if s["when"] == "train")
    counted = sum(s["tx_bytes"] for s in run["syncs"])
    assert 0.9 < counted / logged < 1.5, (counted, logged)
    assert metrics.tokens_per_second(run) > 0 and max(run["maxrss_mib"]) > 0
    assert run["driver"]["link_tx_total"] >= run["link_tx_train"] > 0
