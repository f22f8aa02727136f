"""A sum over the groups that starts after one optimizer step and lands after a later one, with its transaction."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.step.transaction import OuterStep, SyncKind, SyncTransaction
from lightning_fedshard.core.transport.waiting import waiting
from lightning_fedshard.core.wire.norms import dot


@dataclass
class PendingSync:
    """A sync's reduction (an outer step's sum, a mix's messages) that starts after one step and lands after another.

    :meth:`OuterStep.begin` takes the fragment's pseudo-gradient (the snapshot) and starts summing it over the groups,
    in a background thread when asked to; :meth:`OuterStep.complete` waits for the sum and applies the outer step. The
    sync's :class:`~lightning_fedshard.core.step.transaction.SyncTransaction`, opened when it began, travels with it:
    who took part and who added nothing are its, and so is the vote that commits the sync when it lands.

    Attributes:
        transaction: The sync's transaction (opened; its participants and absent groups are known to every rank).
        own_sq: Squared L2 norm of this rank's own pseudo-gradient of the fragment (for the drift statistic).
        own_dot_sum: Inner product of this rank's own pseudo-gradient with the summed one (for the drift statistic),
            once the sum is known and only when the reduction left the own pseudo-gradient intact (quantized
            reducers do; the float all-reduce sums in place, and its mean is then exact).
        bytes_sent: Bytes this rank sends for the sum (ring collectives; quantization scales included).
        clock: ``time.perf_counter()`` when the snapshot was taken.
        exposed: Seconds the caller was blocked by :meth:`OuterStep.begin`.
    """

    transaction: SyncTransaction
    own_sq: float
    bytes_sent: int
    clock: float
    exposed: float = 0.0
    own_dot_sum: float | None = None
    _future: Future[Tensor] | None = field(default=None, repr=False)
    _part: Tensor | None = field(default=None, repr=False)
    _result: Tensor | None = field(default=None, repr=False)
    _own: Tensor | None = field(default=None, repr=False)
    _finish: Callable[[Tensor], Tensor] | None = field(default=None, repr=False)

    @property
    def fragment(self) -> int:
        """The fragment the sync moves."""
        fragment = self.transaction.kind.fragment
        assert fragment is not None, "a sync in flight moves one fragment"
        return fragment

    @property
    def started_at(self) -> int | None:
        """The optimizer step after which the values were taken (``None`` if unknown)."""
        return self.transaction.step

    @property
    def participants(self) -> tuple[int, ...]:
        """The groups taking part, in fed-ring order (the transaction's, asked once when the sync began)."""
        return self.transaction.participants

    @property
    def broken(self) -> tuple[int, ...]:
        """Groups whose values held NaN/Inf (``on_nonfinite="skip_group"``); known to every rank."""
        return self.transaction.broken

    @property
    def joined(self) -> tuple[int, ...]:
        """Groups that took the federation's state from a peer at this sync: they add nothing."""
        return self.transaction.joined

    @property
    def idle(self) -> tuple[int, ...]:
        """Groups a participation rule left out of this sync: they take part with zeros."""
        return self.transaction.idle

    @property
    def contributors(self) -> int:
        """Groups whose values enter the mean: the participants less the broken, joined and idle ones."""
        return len(self.transaction.contributors)

    def absent(self, group: int) -> bool:
        """Whether ``group`` adds nothing to this sync's sum (broken, joined or idle)."""
        return group in self.transaction.absent

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
        transaction = self.transaction
        return {
            "kind": transaction.kind.name,
            "fragment": self.fragment,
            "participants": list(transaction.participants),
            "started_at": transaction.step,
            "broken": list(transaction.broken),
            "joined": list(transaction.joined),
            "idle": list(transaction.idle),
            "own_sq": self.own_sq,
            "bytes_sent": self.bytes_sent,
            "result": self.result().detach().to("cpu", copy=True),
            "own_dot_sum": self.own_dot_sum,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device, outer: OuterStep) -> PendingSync:
        """Rebuild a completed :class:`PendingSync` from :meth:`state_dict`, its transaction on ``outer``.

        Older formats are upgraded before (:mod:`lightning_fedshard.checkpoint.upgrades`).
        """
        transaction = SyncTransaction.restored(
            outer,
            SyncKind(str(state["kind"]), int(state["fragment"])),
            state["started_at"],
            participants=tuple(state["participants"]),
            broken=tuple(state["broken"]),
            joined=tuple(state["joined"]),
            idle=tuple(state["idle"]),
        )
        return cls(
            transaction=transaction,
            own_sq=float(state["own_sq"]),
            bytes_sent=int(state["bytes_sent"]),
            clock=time.perf_counter(),
            own_dot_sum=state.get("own_dot_sum"),
            _result=state["result"].to(device),
        )
