"""Counts what goes through the federated runtime's entry points, so tests can prove no adapter goes around them.

Installed in a worker process before training: every call of ``FederatedRuntime.after_optimizer_step``, ``start``
and ``finish`` is counted, and every outer step that completes (``OuterStep.complete``) is counted as ``routed_syncs``
when it runs inside one of those entry points and as ``bypassed_syncs`` otherwise.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from lightning_fedshard.core.outer import OuterStep
from lightning_fedshard.runtime import FederatedRuntime

CALLS: Counter[str] = Counter()
_DEPTH = [0]


def install() -> None:
    """Wrap the runtime's entry points and the outer step (idempotent)."""
    for name in ("after_optimizer_step", "start", "finish"):
        _wrap(FederatedRuntime, name, _entry_point(name))
    _wrap(OuterStep, "complete", _completion)


def take() -> dict[str, int]:
    """The counts since the last call, then start counting afresh."""
    counts = dict(CALLS)
    CALLS.clear()
    return counts


def _wrap(cls: type, name: str, make: Any) -> None:
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
