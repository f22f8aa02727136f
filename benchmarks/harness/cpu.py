"""Nodes of different speeds on one machine: a fixed CPU quota per emulated node (cgroup v1 ``cpu`` controller).

A node's processes (its launcher and every rank it starts) join the node's cgroup, whose ``cpu.cfs_quota_us`` caps
the CPU time they get per period. Every node gets a quota, so a slow node's unused share is not handed to the others
(a sleep would be): with quotas of 0.45 core for three nodes and 0.225 for the fourth, the fourth trains at half the
others' pace whatever they do. Needs root and the cgroup v1 ``cpu`` hierarchy (``/sys/fs/cgroup/cpu``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def quotas_available() -> str | None:
    """``None`` if per-node CPU quotas can be set here, else why not."""
    if os.geteuid() != 0:
        return "CPU quotas per node need root"
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    return None


class CpuQuotas:
    """One cgroup per node with its quota (cores); a context manager that removes them.

    Args:
        cores: The CPU cores each node may use (e.g. ``(0.45, 0.45, 0.45, 0.225)``).
        prefix: Name prefix of the cgroups.
    """

    def __init__(self, cores: Sequence[float], prefix: str = "fedshard") -> None:
        if not cores or any(c <= 0 for c in cores):
            raise ValueError(f"`cpu_quota={tuple(cores)!r}` must give every node a positive number of cores.")
        self.cores = tuple(cores)
        self.paths = [CPU_ROOT / f"{prefix}-node{i}" for i in range(len(cores))]

    def __enter__(self) -> CpuQuotas:
        for path, cores in zip(self.paths, self.cores):
            path.mkdir(exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for path in self.paths:
            try:
                path.rmdir()  # the nodes' processes were killed: the cgroup is empty
            except OSError:
                pass

    def wrap(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` started inside node ``node``'s cgroup (its children stay in it)."""
        procs = self.paths[node] / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]
