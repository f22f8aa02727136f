"""A fragment's sum over the groups that started after one optimizer step and lands after a later one."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.transport.waiting import waiting
from lightning_fedshard.core.wire.norms import dot


@dataclass
class PendingSync:
    """A fragment's outer reduction that started after one optimizer step and lands after a later one.

    :meth:`OuterStep.begin` takes the fragment's pseudo-gradient (the snapshot) and starts summing it over the groups,
    in a background thread when asked to; :meth:`OuterStep.complete` waits for the sum and applies the outer step.

    Attributes:
        fragment: Index of the fragment.
        participants: The groups taking part in this sync, in fed-ring order (asked once, when it began).
        started_at: Optimizer step after which the pseudo-gradient was taken (``None`` if unknown).
        broken: Groups whose pseudo-gradient held NaN/Inf (``on_nonfinite="skip_group"``); known to every rank.
        joined: Groups that took the federation's state from a peer at this sync (an elastic group that joined, or
            fell behind): their pseudo-gradient is not a round of theirs, so they add nothing; known to every rank.
        idle: Groups that take part in the collective but were not asked to contribute (those a sampled round left
            out): they send zeros and restart from the new anchor like everyone else; the same on every rank.
        own_sq: Squared L2 norm of this rank's own pseudo-gradient of the fragment (for the drift statistic).
        own_dot_sum: Inner product of this rank's own pseudo-gradient with the summed one (for the drift statistic),
            once the sum is known and only when the reduction left the own pseudo-gradient intact (quantized
            reducers do; the float all-reduce sums in place, and its mean is then exact).
        bytes_sent: Bytes this rank sends for the sum (ring collectives; quantization scales included).
        clock: ``time.perf_counter()`` when the snapshot was taken.
        exposed: Seconds the caller was blocked by :meth:`OuterStep.begin`.
    """

    fragment: int
    participants: tuple[int, ...]
    started_at: int | None
    broken: tuple[int, ...]
    own_sq: float
    bytes_sent: int
    clock: float
    exposed: float = 0.0
    own_dot_sum: float | None = None
    joined: tuple[int, ...] = ()
    idle: tuple[int, ...] = ()
    _future: Future[Tensor] | None = field(default=None, repr=False)
    _part: Tensor | None = field(default=None, repr=False)
    _result: Tensor | None = field(default=None, repr=False)
    _own: Tensor | None = field(default=None, repr=False)
    _finish: Callable[[Tensor], Tensor] | None = field(default=None, repr=False)

    @property
    def contributors(self) -> int:
        """Groups whose pseudo-gradient enters the mean: the participants less the broken, joined and idle ones."""
        return sum(1 for group in self.participants if not self.absent(group))

    def absent(self, group: int) -> bool:
        """Whether ``group`` adds nothing to this sync's sum (broken, joined or idle)."""
        return group in self.broken or group in self.joined or group in self.idle

    def result(self) -> Tensor:
        """The pseudo-gradient summed over the groups (waits for the reduction if it still runs).

        The sum travels in its wire form; the first call decodes it. With replicas (FL+HSDP) each one summed its part
        of the shard over the groups, and the first call also gathers the parts (still encoded) over the replicas, a
        collective among them: every rank of the sync makes it at the same point.
        """
        if self._result is None:
            if self._part is None:
                assert self._future is not None
                with waiting():  # the sum may wait for groups that run in this process (the simulator)
                    self._part, self._future = self._future.result(), None
            self._result = self._finish(self._part) if self._finish is not None else self._part
            self._part = None
            if self._own is not None:  # a reducer that left this rank's own pseudo-gradient intact
                self.own_dot_sum = dot(self._own, self._result)
                self._own = None  # the buffer is the fragment's, and its next sync reuses it
        return self._result

    @property
    def done(self) -> bool:
        """Whether the sum over the groups is available without waiting."""
        return self._result is not None or self._part is not None or (self._future is not None and self._future.done())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to land this sync later, e.g. after a resume: the reduction is completed first."""
        return {
            "fragment": self.fragment,
            "participants": list(self.participants),
            "started_at": self.started_at,
            "broken": list(self.broken),
            "joined": list(self.joined),
            "idle": list(self.idle),
            "own_sq": self.own_sq,
            "bytes_sent": self.bytes_sent,
            "result": self.result().detach().to("cpu", copy=True),
            "own_dot_sum": self.own_dot_sum,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> PendingSync:
        """Rebuild a completed :class:`PendingSync` from :meth:`state_dict`."""
        return cls(
            fragment=int(state["fragment"]),
            participants=tuple(state.get("participants", ())),  # filled in by the federation for older checkpoints
            started_at=state["started_at"],
            broken=tuple(state["broken"]),
            joined=tuple(state.get("joined", ())),
            idle=tuple(state.get("idle", ())),
            own_sq=float(state["own_sq"]),
            bytes_sent=int(state["bytes_sent"]),
            clock=time.perf_counter(),
            own_dot_sum=state.get("own_dot_sum"),
            _result=state["result"].to(device),
        )
