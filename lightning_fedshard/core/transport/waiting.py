"""Waits of one thread on others, which a scheduler running federation groups as threads must know about.

The in-process simulator (:mod:`lightning_fedshard.core.transport.inprocess`) lets one group's training thread run at a
time. A thread that waits for other groups (at a collective, or for a sum running in the background) must let the others
run meanwhile; it marks such a wait with :func:`waiting`. Outside the simulator this costs one attribute lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

_local = threading.local()


@contextmanager
def waiting() -> Iterator[None]:
    """Mark a wait on other threads: the scheduler of this thread (if any) lets others run until it ends."""
    release: Callable[[], AbstractContextManager[None]] | None = getattr(_local, "release", None)
    if release is None:
        yield
        return
    with release():
        yield


@contextmanager
def scheduled(release: Callable[[], AbstractContextManager[None]]) -> Iterator[None]:
    """Within the block, every :func:`waiting` of this thread runs inside ``release()``."""
    _local.release = release
    try:
        yield
    finally:
        _local.release = None
