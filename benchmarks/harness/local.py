"""A torchft baseline run on this machine alone: every node a process on the loopback, no emulated links.

For a quick check of the run kind (the suite's smoke test); the comparison itself runs on the emulated cluster
(``python -m benchmarks.run --preset torchft``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness.config import TORCHFT, RunConfig
from benchmarks.harness.launch import REPO, TORCHFT_SCRIPT, RunFailed


def launch_torchft_locally(cfg: RunConfig, timeout: float) -> dict[str, Any]:
    """Run ``cfg`` (strategy ``"torchft"``) with its nodes as local processes and an in-process lighthouse.

    Returns:
        Node 0's ``run.json``.

    Raises:
        ValueError: If ``cfg`` is not a torchft run.
        RunFailed: If a node exits with an error or runs past ``timeout`` seconds.
    """
    if cfg.strategy != TORCHFT:
        raise ValueError(f"`strategy={cfg.strategy!r}` is not a torchft run; use the emulated cluster for it.")
    os.environ.setdefault("RUST_LOG", "warn")  # before the lighthouse starts: it logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.num_nodes)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": "1",
        "FEDSHARD_NODE_ADDR": "127.0.0.1",
        "TORCHFT_LIGHTHOUSE": lighthouse.address(),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    argv = [sys.executable, str(TORCHFT_SCRIPT), "--config", cfg.to_json()]
    nodes = []
    try:
        for node in range(cfg.num_nodes):
            log = open(out / f"node{node}.log", "wb")
            nodes.append((subprocess.Popen(argv, env={**env, "NODE_RANK": str(node)}, stdout=log, stderr=log), log))
        for node, (proc, _) in enumerate(nodes):
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired as error:
                raise RunFailed(f"node {node} did not finish within {timeout:.0f} s") from error
            if code != 0:
                tail = (out / f"node{node}.log").read_text(errors="replace")[-3000:]
                raise RunFailed(f"node {node} exited with {code}:\n{tail}")
    finally:
        for proc, log in nodes:
            proc.kill()
            proc.wait()
            log.close()
        lighthouse.shutdown()
    result: dict[str, Any] = json.loads((out / "run.json").read_text())
    return result
