"""A run that fails on a node ends with that node's exit code and the tail of its log (no cluster needed)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks.harness.config import RunConfig, RunIdentity
from benchmarks.harness.launch import RunFailed, describe_exit, launch

NODE = """
import json, os, sys, time
node, out, behaviour = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")[int(sys.argv[1])]
print(f"node {node}: trained", flush=True)
if behaviour == "abort":
    time.sleep(0.3)
    os.abort()
if behaviour == "write":
    open(os.path.join(out, "run.json"), "w").write(json.dumps({"train_seconds": 1.0}))
"""


class FakeCluster:
    """Nodes as plain processes, each doing what ``behaviours`` says: "write" run.json, "abort", or "exit"."""

    rate_mbit = None
    sites = 1

    def __init__(self, behaviours: Sequence[str], out: Path) -> None:
        self.num_nodes = len(behaviours)
        self.behaviours = ",".join(behaviours)
        self.out = out

    def address(self, index: int) -> str:
        return "127.0.0.1"

    def tx_bytes(self) -> list[int]:
        return [0] * self.num_nodes

    def site_tx_bytes(self) -> list[int]:
        return []

    def command(self, index: int, argv: Sequence[str], env: dict[str, str]) -> list[str]:
        return [sys.executable, "-c", NODE, str(index), str(self.out), self.behaviours]


def _launch(tmp_path: Path, *behaviours: str) -> dict:
    cfg = RunConfig("fl_fsdp", num_nodes=len(behaviours), devices=1, out=str(tmp_path), cache_dir=str(tmp_path))
    identity = RunIdentity("smoke", "smoke", 0, None, 0)
    return launch(FakeCluster(behaviours, tmp_path), cfg, identity, port=0, timeout=60)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_rank_that_aborts_after_training_fails_the_run_with_its_exit_code_and_log(tmp_path: Path):
    with pytest.raises(RunFailed, match=r"node 1 exited with -6 \(SIGABRT\):\n.*node 1: trained"):
        _launch(tmp_path, "write", "abort")


@pytest.mark.slow
def test_a_run_without_results_fails_with_its_own_message(tmp_path: Path):
    with pytest.raises(RunFailed, match=r"every node exited with 0, but global rank 0 wrote no .*run\.json"):
        _launch(tmp_path, "exit", "exit")


@pytest.mark.slow
def test_a_result_left_by_an_earlier_attempt_does_not_count(tmp_path: Path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(RunFailed, match="wrote no"):
        _launch(tmp_path, "exit", "exit")


@pytest.mark.slow
def test_a_successful_run_returns_rank_0s_record_with_its_identity(tmp_path: Path):
    result = _launch(tmp_path, "write", "exit")
    assert result["train_seconds"] == 1.0
    assert result["identity"] == {
        "preset": "smoke",
        "configuration": "smoke",
        "repeat": 0,
        "link_mbit": None,
        "seed": 0,
        "rtt_ms": 0.0,
    }
    assert result["driver"]["link_mbit"] is None and json.loads((tmp_path / "run.json").read_text())


def test_exit_codes_name_their_signal():
    assert describe_exit(-6) == "-6 (SIGABRT)" and describe_exit(1) == "1"


def test_an_elastic_run_is_a_job_per_node_meeting_at_the_lighthouse(tmp_path: Path):
    from benchmarks.harness.launch import node_env
    from benchmarks.harness.train import elastic_group

    class Cluster:
        service_address = "10.77.0.254"

        def address(self, node: int) -> str:
            return f"10.77.0.{node + 1}"

    env = node_env(Cluster(), 2, 29500, tmp_path, elastic=True)  # type: ignore[arg-type]
    assert (env["NODE_RANK"], env["MASTER_ADDR"], env["FEDSHARD_GROUP"]) == ("0", "10.77.0.3", "2")
    assert env["TORCHFT_LIGHTHOUSE"] == "http://10.77.0.254:29510" and env["FEDSHARD_NODE_ADDR"] == "10.77.0.3"
    one_job = node_env(Cluster(), 2, 29500, tmp_path)  # type: ignore[arg-type]
    assert (one_job["NODE_RANK"], one_job["MASTER_ADDR"]) == ("2", "10.77.0.1") and "FEDSHARD_GROUP" not in one_job
    cfg = RunConfig(strategy="fl_fsdp", num_nodes=4, devices=1, out="o", cache_dir="c", elastic_groups=True)
    group = elastic_group_from(env, cfg, elastic_group)
    assert (group.group, group.min_groups, group.start_groups, group.hostname) == (2, 4, 4, "10.77.0.3")
    assert RunConfig.from_record(cfg.record()) == cfg
    with pytest.raises(ValueError, match="`elastic_groups` runs FL\\+FSDP with a group per node, not 'fsdp'"):
        RunConfig(strategy="fsdp", num_nodes=4, devices=1, out="o", cache_dir="c", elastic_groups=True)


def elastic_group_from(env: dict[str, str], cfg: RunConfig, build):  # type: ignore[no-untyped-def]
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        return build(cfg)
