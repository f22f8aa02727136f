import ctypes
import multiprocessing.process
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

# Tests never reach a model hub, and each rank gets one thread (several ranks share 2 cores).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Processes orphaned inside the suite (a rank of a killed launcher) become ours, not init's, so we can end them."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


_become_subreaper()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """End every process the suite left behind: a leftover rank holding the output pipes would keep CI waiting."""
    if sys.platform != "linux":
        return
    leftovers = _descendants(os.getpid())
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in leftovers:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not our direct child: its own parent (also killed) or we, as subreaper, reap it


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _single_process_unless_slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts a process must be marked `slow`, so that `pytest -m "not slow"` stays single-process."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it `@pytest.mark.slow`")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
