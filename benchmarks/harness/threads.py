"""CPU seconds of one process, split by thread: the training thread, the federation's background sum, the rest.

The kernel keeps each thread's user and system time in ``/proc/self/task/<tid>/stat``; Python knows which native
thread is which of its own threads. A thread that ends takes its counters with it, so :class:`ThreadClock` samples
every live thread whenever asked and keeps each thread's last reading: sampled once per optimizer step, a background
thread that ends between two samples loses at most one step of its time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

#: Python's name prefix of the federation's background thread (the sum over the groups in flight).
BACKGROUND_PREFIX = "fedshard-outer"
#: The categories a process's CPU seconds are split into.
CATEGORIES = ("training", "background_sum", "other")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TASKS = Path("/proc/self/task")


def _thread_seconds(tid: int) -> float | None:
    """User plus system CPU seconds of native thread ``tid`` of this process; ``None`` once it has ended."""
    try:
        stat = (_TASKS / str(tid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of the line


def _category(tid: int, main: int | None, background: set[int]) -> str:
    if tid == main:
        return "training"
    return "background_sum" if tid in background else "other"


class ThreadClock:
    """This process's CPU seconds by category (:data:`CATEGORIES`) since :meth:`start`, on Linux; empty elsewhere."""

    def __init__(self) -> None:
        self._start: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._kind: dict[int, str] = {}

    @property
    def available(self) -> bool:
        """Whether the kernel exposes per-thread counters here."""
        return _TASKS.is_dir()

    def start(self) -> None:
        """Take every live thread's counters as zero."""
        self._start, self._last, self._kind = {}, {}, {}
        self.sample()
        self._start = dict(self._last)

    def sample(self) -> None:
        """Read every live thread's counters (cheap: one small file per thread)."""
        if not self.available:
            return
        main = threading.main_thread().native_id
        background = {t.native_id for t in threading.enumerate() if t.name.startswith(BACKGROUND_PREFIX)}
        for entry in _TASKS.iterdir():
            tid = int(entry.name)
            seconds = _thread_seconds(tid)
            if seconds is not None:
                self._last[tid] = seconds
                self._kind.setdefault(tid, _category(tid, main, {b for b in background if b is not None}))

    def seconds(self) -> dict[str, float]:
        """CPU seconds per category since :meth:`start`, as of the last :meth:`sample`."""
        totals = dict.fromkeys(CATEGORIES, 0.0)
        if not self.available:
            return {}
        for tid, seconds in self._last.items():
            totals[self._kind[tid]] += seconds - self._start.get(tid, 0.0)
        return totals
