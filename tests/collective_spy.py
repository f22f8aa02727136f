"""Sees every collective a process issues, from any caller, and which ranks its process group spans.

``install`` wraps the methods of torch's ``ProcessGroup`` class, through which every collective of
``torch.distributed`` passes whatever module imported it and however (Lightning's loops, its callbacks, FSDP1/FSDP2,
this package), and the functional collectives of ``torch.distributed._functional_collectives`` that DTensor uses
(those reach the process group in C++, not through its Python methods). Each call is recorded as a
:class:`Collective` with the phase the caller set with :func:`phase` or :func:`set_phase`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed import ProcessGroup

#: Methods of ``ProcessGroup`` that move data or wait for peers (the admin ones - size, rank, names - are left out).
_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "broadcast", "barrier",
    "monitored_barrier", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "gather", "scatter", "send", "recv", "recv_anysource",
)  # fmt: skip
#: Functional collectives (DTensor's redistribution, ``full_tensor``, DTensor norms).
_FUNCTIONAL = (
    "broadcast", "all_reduce", "all_gather_single", "all_gather_single_autograd", "reduce_scatter_single",
    "reduce_scatter_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_reduce_coalesced", "all_gather_single_coalesced",
    "reduce_scatter_single_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
)  # fmt: skip


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it."""

    op: str
    ranks: tuple[int, ...]
    phase: str
    step: int


RECORDS: list[Collective] = []
_STATE = threading.local()
_SHARED = {"phase": "outside", "step": -1}
_RANKS: dict[int, tuple[int, ...]] = {}


def install() -> None:
    """Wrap every collective entry point (idempotent)."""
    for name in _GROUP_METHODS:
        if hasattr(ProcessGroup, name):
            _wrap(ProcessGroup, name, _group_method(name))
    for name in _FUNCTIONAL:
        if hasattr(funcol, name):
            _wrap(funcol, name, _functional(name))


def set_phase(name: str, step: int | None = None) -> None:
    """From now on, record collectives under ``name`` (and the optimizer step ``step`` if given)."""
    _SHARED["phase"] = name
    if step is not None:
        _SHARED["step"] = step


def current_phase() -> str:
    return _SHARED["phase"]


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Record the collectives of the block under ``name``, then go back to the phase before."""
    before = _SHARED["phase"]
    _SHARED["phase"] = name
    try:
        yield
    finally:
        _SHARED["phase"] = before


def take() -> list[Collective]:
    """The collectives recorded since the last call."""
    records = list(RECORDS)
    RECORDS.clear()
    return records


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    key = id(group)
    if key not in _RANKS:
        _RANKS[key] = tuple(dist.get_process_group_ranks(group))
    return _RANKS[key]


def _record(op: str, ranks: tuple[int, ...]) -> None:
    if getattr(_STATE, "depth", 0):
        return  # a collective inside another one (a functional collective reaching a wrapped method)
    # A sum in flight travels on a thread of its own while training goes on (overlapped and eager syncs).
    label = _SHARED["phase"] if threading.current_thread() is threading.main_thread() else "background"
    RECORDS.append(Collective(op, ranks, label, _SHARED["step"]))


def label_runtime_calls() -> None:
    """Label what the federated runtime issues: ``sync`` inside a call that landed a sync or started one (a sum that
    travels while training goes on), then ``boundary`` until the caller marks the next training step
    (``set_phase("between")``); any other call keeps the phase it found.
    """
    from lightning_fedshard.runtime import FederatedRuntime

    for name in ("after_optimizer_step", "finish"):
        original = getattr(FederatedRuntime, name)
        if getattr(original, "_collective_spy", False):
            continue

        def labelled(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            first, before, in_flight = len(RECORDS), current_phase(), _in_flight(self)
            stats = _original(self, *args, **kwargs)
            synced = stats is not None or bool(_in_flight(self) - in_flight)
            if synced:
                RECORDS[first:] = [
                    Collective(c.op, c.ranks, "sync" if c.phase == before else c.phase, c.step) for c in RECORDS[first:]
                ]
            set_phase("boundary" if synced else before, self.step)
            return stats

        labelled._collective_spy = True  # type: ignore[attr-defined]
        setattr(FederatedRuntime, name, labelled)


def _in_flight(runtime: Any) -> set[int]:
    """The sums the runtime's federation has in flight (by identity)."""
    federation = getattr(runtime, "_federation", None)
    if federation is None or not federation.started:
        return set()
    return {id(pending) for pending in federation.round.in_flight()}


def _wrap(owner: Any, name: str, make: Any) -> None:
    original = getattr(owner, name)
    if not getattr(original, "_collective_spy", False):
        wrapped = functools.wraps(original)(make(original))
        wrapped._collective_spy = True
        setattr(owner, name, wrapped)


def _group_method(name: str) -> Any:
    def make(original: Any) -> Any:
        def spied(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            ranks = _ranks(self)
            if name in ("send", "recv") and len(args) >= 2 and isinstance(args[1], int):
                ranks = tuple(sorted({dist.get_rank(), ranks[args[1]]}))  # a pair: this rank and its peer
            _record(name, ranks)
            return _nested(original, self, *args, **kwargs)

        return spied

    return make


def _functional(name: str) -> Any:
    def make(original: Any) -> Any:
        signature = inspect.signature(original)

        def spied(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            group, tag = bound.get("group"), bound.get("tag", "")
            _record(f"functional.{name}", _ranks(c10d._resolve_process_group(funcol._resolve_group_name(group, tag))))
            return _nested(original, *args, **kwargs)

        return spied

    return make


def _nested(original: Any, *args: Any, **kwargs: Any) -> Any:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        return original(*args, **kwargs)
    finally:
        _STATE.depth -= 1
