"""Counts what goes through the federated runtime's entry points, so tests can prove no adapter goes around them.

Installed in a worker process before training: every call of ``FederatedRuntime.after_optimizer_step``, ``start``
and ``finish`` is counted, and every outer step that completes (``OuterStep.complete``) is counted as ``routed_syncs``
when it runs inside one of those entry points and as ``bypassed_syncs`` otherwise. Every collective that a sync issues
(from ``OuterStep.begin``, ``OuterStep.complete`` and the background sum) records how many ranks its process group
spans, as ``sync_collective_max_ranks``.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import Any

import torch.distributed as dist

from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.runtime import FederatedRuntime

CALLS: Counter[str] = Counter()
_DEPTH = [0]
_IN_SYNC = threading.local()
#: The collectives torch.distributed offers that a sync could issue.
_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "broadcast",
                "barrier", "all_gather", "all_gather_object", "reduce_scatter_tensor")  # fmt: skip


def install() -> None:
    """Wrap the runtime's entry points and the outer step (idempotent)."""
    for name in ("after_optimizer_step", "start", "finish"):
        _wrap(FederatedRuntime, name, _entry_point(name))
    _wrap(OuterStep, "complete", _completion)
    for name in ("begin", "complete", "_sum_across_groups"):
        _wrap(OuterStep, name, _in_sync)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            _wrap(dist, name, _collective)


def take() -> dict[str, int]:
    """The counts since the last call, then start counting afresh."""
    counts = dict(CALLS)
    CALLS.clear()
    return counts


def _wrap(cls: Any, name: str, make: Any) -> None:
    original = getattr(cls, name)
    if not getattr(original, "_spied", False):
        wrapped = functools.wraps(original)(make(original))
        wrapped._spied = True
        setattr(cls, name, wrapped)


def _entry_point(name: str) -> Any:
    def make(original: Any) -> Any:
        def counted(self: FederatedRuntime, *args: Any, **kwargs: Any) -> Any:
            CALLS[name] += 1
            _DEPTH[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _DEPTH[0] -= 1

        return counted

    return make


def _completion(original: Any) -> Any:
    def counted(self: OuterStep, *args: Any, **kwargs: Any) -> Any:
        CALLS["routed_syncs" if _DEPTH[0] else "bypassed_syncs"] += 1
        return original(self, *args, **kwargs)

    return counted


def _in_sync(original: Any) -> Any:
    def marked(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_IN_SYNC, "depth", 0)
        _IN_SYNC.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _IN_SYNC.depth = depth

    return marked


def _collective(original: Any) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_SYNC, "depth", 0):
            group = kwargs.get("group")
            ranks = dist.get_world_size(group) if group is not None else dist.get_world_size()
            CALLS["sync_collective_max_ranks"] = max(CALLS["sync_collective_max_ranks"], ranks)
            CALLS["sync_collectives"] += 1
        return original(*args, **kwargs)

    return recorded
