"""Start one benchmark run on an emulated cluster: one Lightning launcher per node, inside the node's namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from benchmarks.cluster import NODE_IFACE, EmulatedCluster
from benchmarks.train import RunConfig

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "benchmarks" / "train.py"


class RunFailed(RuntimeError):
    """A benchmark run exited with an error or ran past its timeout."""


def node_env(cluster: EmulatedCluster, node: int, port: int, out: Path) -> dict[str, str]:
    """Environment of node ``node``'s launcher: Lightning's multi-node variables plus the emulated interface."""
    return {
        "NODE_RANK": str(node),
        "MASTER_ADDR": cluster.address(0),
        "MASTER_PORT": str(port),
        # Gloo picks its interface from the host name otherwise; each node must use its own link.
        "GLOO_SOCKET_IFNAME": NODE_IFACE,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(out / "hf_home"),
        "PYTHONUNBUFFERED": "1",
    }


def launch(cluster: EmulatedCluster, cfg: RunConfig, port: int, timeout: float) -> dict[str, Any]:
    """Run ``cfg`` on every node of ``cluster``; return rank 0's ``run.json`` plus what the driver measured.

    Raises:
        RunFailed: With the tail of the first failing node's log.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(TRAIN_SCRIPT), "--config", json.dumps(asdict(cfg))]
    tx_before = cluster.tx_bytes()
    start = time.perf_counter()
    procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
    try:
        for node in range(cluster.num_nodes):
            log = open(out / f"node{node}.log", "wb")
            command = cluster.command(node, argv, node_env(cluster, node, port, out))
            # A session per node launcher, so that it and the local ranks Lightning spawns can be killed together.
            procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
        _wait(procs, out, timeout)
    finally:
        for proc, node_log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            node_log.close()
    wall = time.perf_counter() - start
    result = json.loads((out / "run.json").read_text())
    result["driver"] = {
        "wall_seconds": wall,
        "link_mbit": cluster.rate_mbit,
        "link_tx_total": sum(b - a for a, b in zip(tx_before, cluster.tx_bytes())),
    }
    return result


def _wait(procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc, _ in procs]
        failed = [node for node, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            raise RunFailed(f"node {failed[0]} exited with {codes[failed[0]]}:\n{_tail(out, failed[0])}")
        if all(code == 0 for code in codes):
            return
        time.sleep(0.2)
    raise RunFailed(f"the run did not finish within {timeout:.0f} s:\n{_tail(out, 0)}")


def _tail(out: Path, node: int, chars: int = 3000) -> str:
    return (out / f"node{node}.log").read_text(errors="replace")[-chars:]
