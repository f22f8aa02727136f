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

from benchmarks.harness.cluster import NODE_IFACE, EmulatedCluster
from benchmarks.harness.config import TORCHFT, RunConfig, RunIdentity
from benchmarks.harness.cpu import CpuQuotas

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "benchmarks" / "harness" / "train.py"
#: The node script of torchft's own DiLoCo (a run of strategy ``"torchft"``), and the port of its lighthouse.
TORCHFT_SCRIPT = REPO / "benchmarks" / "harness" / "torchft_train.py"
LIGHTHOUSE_PORT = 29510
LOG_TAIL_CHARS = 3000

Node = tuple[subprocess.Popen[bytes], IO[bytes]]


class RunFailed(RuntimeError):
    """A benchmark run exited with an error, ran past its timeout or wrote no results."""


def node_env(
    cluster: EmulatedCluster, node: int, port: int, out: Path, torchft: bool = False, elastic: bool = False
) -> dict[str, str]:
    """Environment of node ``node``'s launcher: Lightning's multi-node variables plus the emulated interface.

    A torchft run also gets the node's own address and the lighthouse in the switch; an elastic one too, and each node
    is the first (and only) node of a job of its own: its group.
    """
    extra = {}
    if torchft or elastic:
        extra = {
            "FEDSHARD_NODE_ADDR": cluster.address(node),
            "TORCHFT_LIGHTHOUSE": f"http://{cluster.service_address}:{LIGHTHOUSE_PORT}",
            "RUST_LOG": "warn",
        }
    if elastic:
        extra["FEDSHARD_GROUP"] = str(node)
    return {
        **extra,
        "NODE_RANK": "0" if elastic else str(node),
        "MASTER_ADDR": cluster.address(node if elastic else 0),
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


def launch(
    cluster: EmulatedCluster, cfg: RunConfig, identity: RunIdentity, port: int, timeout: float
) -> dict[str, Any]:
    """Run ``cfg`` on every node of ``cluster``; return rank 0's ``run.json`` plus its identity and the driver's view.

    Raises:
        RunFailed: Naming the first node that failed, its exit code and the tail of its log.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "run.json", *out.glob("link_tx*.json")):  # left by an earlier attempt: not this run's
        stale.unlink(missing_ok=True)
    torchft, elastic = cfg.strategy == TORCHFT, cfg.elastic_groups
    argv = [sys.executable, str(TORCHFT_SCRIPT if torchft else TRAIN_SCRIPT), "--config", cfg.to_json()]
    lighthouse = _start_lighthouse(cluster) if torchft or elastic else None
    tx_before, sites_before = cluster.tx_bytes(), cluster.site_tx_bytes()
    start = time.perf_counter()
    nodes: list[Node] = []
    quotas = CpuQuotas(cfg.cpu_quota) if cfg.cpu_quota is not None else None
    try:
        if quotas is not None:
            quotas.__enter__()
        for index in range(cluster.num_nodes):
            env = node_env(cluster, index, port, out, torchft, elastic)
            nodes.append(start_node(cluster, index, argv, env, out, quotas))
        _wait(nodes, out, timeout)
    finally:
        for proc, log in nodes:
            kill_session(proc)
            log.close()
        if lighthouse is not None:
            kill_session(lighthouse)
        if quotas is not None:
            quotas.__exit__(None, None, None)
    result = _read_result(out)
    if torchft or elastic:  # each node counted its own link over training; node 0 wrote the rest
        result["link_tx_train"] = sum(json.loads(p.read_text())["train"] for p in out.glob("link_tx*.json"))
        result["link_tx_val"] = 0
    result["identity"] = asdict(identity)
    result["driver"] = {
        "wall_seconds": time.perf_counter() - start,
        "link_mbit": cluster.rate_mbit,
        "link_tx_total": sum(b - a for a, b in zip(tx_before, cluster.tx_bytes())),
    }
    if cluster.sites > 1:
        result["driver"]["between_sites_mbit"] = cluster.between_sites_mbit
        result["driver"]["site_tx_total"] = [b - a for a, b in zip(sites_before, cluster.site_tx_bytes())]
    return result


def _start_lighthouse(cluster: EmulatedCluster) -> subprocess.Popen[bytes]:
    """torchft's lighthouse in the switch, outside every node's link, waiting for every node's replica group."""
    argv = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{LIGHTHOUSE_PORT}"]
    argv += ["--min_replicas", str(cluster.num_nodes), "--quorum_tick_ms", "100"]
    proc = subprocess.Popen(
        cluster.service_command(argv),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
        start_new_session=True,
    )
    time.sleep(1.0)  # listening before the first node asks
    return proc


def start_node(
    cluster: EmulatedCluster,
    index: int,
    argv: list[str],
    env: dict[str, str],
    out: Path,
    quotas: CpuQuotas | None = None,
) -> Node:
    """Start ``argv`` in node ``index``'s namespace with ``env``, its output in ``<out>/node<index>.log``.

    With ``quotas`` the node's processes run under its CPU quota.
    """
    log = open(out / f"node{index}.log", "wb")
    command = cluster.command(index, argv, env)
    if quotas is not None:
        command = quotas.wrap(index, command)
    # A session per node launcher, so that it and the local ranks Lightning spawns can be killed together.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill whatever is left of a node's session (its launcher, and local ranks still exiting)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait(nodes: list[Node], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc, _ in nodes]
        failed = [node for node, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            node = failed[0]
            raise RunFailed(f"node {node} exited with {describe_exit(codes[node])}:\n{log_tail(out, node)}")
        if all(code == 0 for code in codes):
            return
        time.sleep(0.2)
    raise RunFailed(f"the run did not finish within {timeout:.0f} s:\n{log_tail(out, 0)}")


def _read_result(out: Path) -> dict[str, Any]:
    path = out / "run.json"
    if not path.exists():
        raise RunFailed(f"every node exited with 0, but global rank 0 wrote no {path}:\n{log_tail(out, 0)}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def describe_exit(code: int | None) -> str:
    """``-6`` -> ``"-6 (SIGABRT)"``; a positive code as it is."""
    if code is None or code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def log_tail(out: Path, node: int, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of node ``node``'s log."""
    path = out / f"node{node}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no log at {path})"
