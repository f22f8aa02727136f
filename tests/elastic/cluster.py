"""An elastic federation on one machine for tests: an in-process lighthouse and group jobs as subprocesses.

Every group job is ``tests/elastic/worker.py`` once per rank (started by ``tests.launch.start``), with the group's own
rendezvous (its MASTER_PORT) and ``FEDSHARD_GROUP``, in a session of its own so that a test can kill or stop the
whole group. Whatever a test starts is ended when the ``Cluster`` closes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.launch import Process, free_port, start

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).parents[2]


@dataclass
class Job:
    """One group job: its ranks' processes and where they write."""

    group: int
    out: Path
    procs: list[Process] = field(default_factory=list)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def signal(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def progress(self) -> int:
        """The optimizer step of this group's last sync (-1 before its first)."""
        path = self.out / "progress"
        return int(path.read_text() or -1) if path.exists() else -1

    def result(self, rank: int = 0) -> dict[str, Any]:
        return torch.load(self.out / f"rank{rank}.pt", weights_only=False)

    def log(self, rank: int = 0) -> str:
        return (self.out / f"rank{rank}.log").read_text()


class Cluster:
    """A lighthouse and the group jobs a test starts."""

    def __init__(self, root: Path, min_groups: int = 1, heartbeat_ms: int = 2000, join_ms: int = 10000) -> None:
        os.environ.setdefault(
            "RUST_LOG", os.environ.get("LIGHTHOUSE_LOG", "warn")
        )  # before torchft's native side starts logging
        from torchft.coordination import LighthouseServer

        self.root = root
        self.min_groups, self.heartbeat_ms, self.join_ms = min_groups, heartbeat_ms, join_ms
        self.port = free_port()
        self.lighthouse: Any = LighthouseServer(
            bind=f"[::]:{self.port}",
            min_replicas=min_groups,
            join_timeout_ms=join_ms,
            heartbeat_timeout_ms=heartbeat_ms,
        )
        self.address = self.lighthouse.address()
        self.jobs: list[Job] = []

    def restart_lighthouse(self, down_seconds: float) -> None:
        """Take the lighthouse down for ``down_seconds``, then bring up a new one on the same address."""
        from torchft.coordination import LighthouseServer

        self.lighthouse.shutdown()
        time.sleep(down_seconds)
        self.lighthouse = LighthouseServer(
            bind=f"[::]:{self.port}",
            min_replicas=self.min_groups,
            join_timeout_ms=self.join_ms,
            heartbeat_timeout_ms=self.heartbeat_ms,
        )

    def stop_lighthouse(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None

    def start(self, group: int, spec: dict[str, Any], ranks: int = 1, name: str | None = None) -> Job:
        """Start group ``group`` with ``ranks`` ranks running ``spec``."""
        out = self.root / (name or f"group{group}_{sum(j.group == group for j in self.jobs)}")
        out.mkdir(parents=True, exist_ok=True)
        job = Job(group, out)
        port = free_port()
        for rank in range(ranks):
            env = {
                # Lightning's seed of an earlier test in this process would reach the jobs' samplers.
                **{k: v for k, v in os.environ.items() if not k.startswith("PL_")},
                "PL_GLOBAL_SEED": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(ranks),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "NODE_RANK": "0",
                "DEVICES": str(ranks),
                "OMP_NUM_THREADS": "1",
                "FEDSHARD_GROUP": str(group),
                "TORCHFT_LIGHTHOUSE": self.address,
                "RUST_LOG": os.environ.get("LIGHTHOUSE_LOG", "warn"),
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
            job.procs.append(
                start(WORKER, [json.dumps(spec), str(out)], env, out / f"rank{rank}.log", new_session=True)
            )
        self.jobs.append(job)
        return job

    def close(self) -> None:
        for job in self.jobs:
            job.signal(signal.SIGCONT)
            job.kill()
        self.stop_lighthouse()


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.1)
