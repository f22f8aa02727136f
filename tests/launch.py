"""Start several ranks the way a cluster launcher would, and never leave one behind.

``launch`` runs a script once per rank (env vars set). Lightning's own launcher re-executes ``sys.argv``, which inside
pytest would re-run pytest; with LOCAL_RANK and friends set, Lightning treats the processes as externally launched
instead. ``run_ranks`` runs a function of this test suite once per rank. ``start`` runs one process of a script, as
``python script args`` would, but forked from a server that has imported torch and the package already: a fresh
interpreter spends seconds of CPU on those imports, and the suite starts dozens of ranks on two cores.
"""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Workers are forked from a fresh server process, never from pytest's: a fork of a process whose threads (gloo's,
# Lightning's, a previous test's) hold a lock can deadlock in the child. The server imports torch and the package
# once, so each worker starts in well under a second.
_WORKERS = mp.get_context("forkserver")
_WORKERS.set_forkserver_preload(["torch", "torch.distributed", "lightning_fedshard"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(script: str, args: list[str], env: dict[str, str], log: str, new_session: bool) -> None:
    """In the forked process: what ``python script *args`` with ``env`` and its output to ``log`` would do."""
    if new_session:
        os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[:0] = [os.path.dirname(script), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a forked process ends with os._exit: run what the interpreter would at its exit


class Process:
    """A process started by :func:`start`, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, ``-signal`` if a signal ended it, ``None`` while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self._process.name), timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def start(script: Path, args: list[str], env: dict[str, str], log: Path, new_session: bool = False) -> Process:
    """Run ``python script *args`` with exactly ``env``, its stdout and stderr going to ``log``.

    ``new_session`` puts it in a session of its own (``start_new_session`` of ``subprocess.Popen``).
    """
    process = _WORKERS.Process(target=_run_script, args=(str(script), args, env, str(log), new_session))
    process.start()
    return Process(process)


def launch(script: Path, args: list[str], num_nodes: int, devices: int, log_dir: Path, timeout: float = 300.0) -> None:
    """Run ``num_nodes * devices`` ranks of ``script``; raise with the logs of failed ranks."""
    port = free_port()
    world = num_nodes * devices
    procs = []
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "NODE_RANK": str(rank // devices),
            "LOCAL_RANK": str(rank % devices),
            "RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "NUM_NODES": str(num_nodes),
            "DEVICES": str(devices),
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(start(script, args, env, log_dir / f"rank{rank}.log"))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (log_dir / f"rank{failed[0]}.log").read_text()[-4000:]
        raise RuntimeError(f"ranks {failed} failed (exit codes {[procs[r].returncode for r in failed]}):\n{tail}")


def run_ranks(worker: Callable[..., None], nprocs: int, args: tuple[Any, ...] = (), timeout: float = 120.0) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes; raise on a failed rank or after ``timeout`` seconds.

    On a failure or a timeout every rank still running is killed, so a hung collective costs ``timeout``, not the
    suite's run, and no process outlives the test holding its output pipes.
    """
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} ranks of {worker.__name__} still running after {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
