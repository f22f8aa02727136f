"""The outer step of FL+FSDP / FL+HSDP, computed on local shards only.

Every ``sync_every`` inner optimizer steps, each federation group ``g`` holds weights ``theta_g`` that drifted
from the ``anchor`` all groups shared after the previous sync. The outer step (DiLoCo, arXiv 2311.08105; with
``SGD(lr=1.0)`` it is plain federated averaging) is::

    pseudogradient_g = anchor - theta_g
    pseudogradient   = mean over groups of pseudogradient_g       # all-reduce over the "fed" axis
    anchor           = outer_optimizer.step(anchor, grad=pseudogradient)
    theta_g          = anchor                                     # every group restarts from the new anchor

Every group shards the model identically, so the rank at one in-group position holds the same slice of every
parameter in every group: the all-reduce runs on local shards and nothing is ever gathered. Element-wise outer
optimizers (SGD, Nesterov, Adam without clipping) are therefore exact on shards. The inner optimizer state is
never touched.

Before the mean, every group's pseudo-gradient is checked for NaN/Inf: by default a non-finite one raises
:class:`NonFiniteOuterGradientError` with the anchor untouched; with ``on_nonfinite="skip_group"`` the mean runs over
the healthy groups only and the broken ones restart from the new anchor like everyone else. Site syncs and mixes
(see :mod:`~lightning_fedshard.core.rounds`) check the groups' weights the same way before they write: every sync
runs as a :class:`~lightning_fedshard.core.step.transaction.SyncTransaction`.

This module knows nothing about Lightning or FSDP: it takes tensors and a :class:`Communicator`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fedshard.core.step.nonfinite import NONFINITE_POLICIES
from lightning_fedshard.core.step.outer_state import (
    OuterOptimizerFactory,
    OuterState,
    build_outer_optimizer,
    new_anchor,
)
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction
from lightning_fedshard.core.transport.comm import Communicator, sum_over_model
from lightning_fedshard.core.wire.codecs import FloatCodec
from lightning_fedshard.core.wire.norms import squared_norm
from lightning_fedshard.core.wire.reducers import AllReduceSum, Reducer

__all__ = ["OuterOptimizerFactory", "OuterStep", "build_outer_optimizer"]


class OuterStep(OuterState):
    """Keeps the anchor and the outer optimizers for a list of local shards, and performs outer steps.

    The shards may be cut into *fragments* (contiguous lists of shard indices), each with its own outer optimizer, that
    sync at different optimizer steps (streaming DiLoCo). An outer step of a fragment has two halves:
    :meth:`begin` takes its pseudo-gradient and starts the sum over the groups, optionally in a background thread so
    that training goes on meanwhile, and :meth:`complete` waits for the sum, steps the fragment's outer optimizer and
    writes the new anchor (merged with the current local weights by ``merge_alpha``) into the shards. :meth:`step`
    does both at once.

    Args:
        shards: This rank's local shards of the model parameters (the tensors training updates in place). They
            must have the same shapes, in the same order, on every rank at the same in-group position.
        outer_optimizer: Builds an outer optimizer from anchor tensors, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``; one per fragment.
        communicator: Collectives over the federation (see :class:`Communicator`).
        reduce_dtype: Data type of the pseudo-gradient on the wire when no ``reducer`` is given.
        anchor_device: Where the anchor and the outer optimizer state live. ``"cpu"`` (default) costs the
            accelerator no memory; ``None`` keeps them next to the shards.
        on_nonfinite: ``"raise"`` (default) or ``"skip_group"``; see :meth:`step`.
        fragments: Shard indices of each fragment, covering every shard exactly once; default: one fragment.
        reducer: Builds the reducer of a fragment (see :mod:`~lightning_fedshard.core.wire.reducers`), called once per
            fragment; ``None`` (default): an all-reduce in ``reduce_dtype``.

    Raises:
        ValueError: If ``outer_optimizer`` does not return a ``torch.optim.Optimizer``, for an unknown
            ``on_nonfinite``, or fragments that do not cover the shards exactly once.
    """

    def __init__(
        self,
        shards: Sequence[Tensor],
        outer_optimizer: OuterOptimizerFactory,
        communicator: Communicator,
        reduce_dtype: torch.dtype = torch.float32,
        anchor_device: torch.device | str | None = "cpu",
        on_nonfinite: str = "raise",
        fragments: Sequence[Sequence[int]] | None = None,
        reducer: Callable[[], Reducer] | None = None,
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"`on_nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {on_nonfinite!r}.")
        self.on_nonfinite = on_nonfinite
        self.shards = list(shards)
        self.fragments = [list(f) for f in fragments] if fragments is not None else [list(range(len(self.shards)))]
        if sorted(i for f in self.fragments for i in f) != list(range(len(self.shards))) or not all(self.fragments):
            raise ValueError(f"Fragments {self.fragments} must cover the {len(self.shards)} shards exactly once.")
        self.communicator = communicator
        self.num_syncs = 0
        #: Site syncs and mixes done so far (syncs that move no anchor; see :mod:`~lightning_fedshard.core.rounds`).
        self.site_syncs = 0
        self.syncs_lost = 0
        self.anchor = [new_anchor(s, anchor_device) for s in self.shards]
        self._flat_buffers: dict[int, Tensor] = {}  # one pseudo-gradient buffer per fragment, reused by every sync
        self.optimizers = [build_outer_optimizer(outer_optimizer, [self.anchor[i] for i in f]) for f in self.fragments]
        build = reducer or (lambda: AllReduceSum(FloatCodec(reduce_dtype)))
        self.reducers: list[Reducer] = [build() for _ in self.fragments]
        self.reduce_dtype = self.reducers[0].input_dtype  # the pseudo-gradient buffer's dtype
        self._executor: ThreadPoolExecutor | None = None
        #: The sync this rank waits in for its groups (:meth:`SyncKind.marker`; elastic: a peer may then read this
        #: rank's state to heal and take part in it), else ``None``.
        self.syncing: tuple[str, int | None, int | None] | None = None

    @property
    def optimizer(self) -> Optimizer:
        """The outer optimizer of the first (with one fragment: the only) fragment."""
        return self.optimizers[0]

    @torch.no_grad()
    def step(self, step: int | None = None, fragment: int = 0) -> SyncStats:
        """Average the pseudo-gradients over groups, step the outer optimizer and reset the shards to the anchor.

        Collective: every rank of the job must call it at the same point. Acts on one fragment (default: the first,
        with one fragment the whole model).

        Args:
            step: The optimizer step this sync follows; only used in error messages.
            fragment: Which fragment syncs.

        Raises:
            NonFiniteOuterGradientError: If a group's pseudo-gradient holds NaN/Inf and ``on_nonfinite="raise"``, or
                every group's does. Nothing was changed then.
        """
        transaction = SyncTransaction(self, SyncKind.outer_step(fragment), step)
        return self.complete(self.begin(transaction, background=False), step=step)

    @torch.no_grad()
    def begin(
        self, transaction: SyncTransaction, background: bool = True, taken: tuple[Tensor, bool] | None = None
    ) -> PendingSync:
        """Take the fragment's pseudo-gradient now and start summing it over the groups; collective.

        The transaction (:mod:`~lightning_fedshard.core.step.transaction`) is opened here, after the pseudo-gradient
        is taken: it asks the communicator for the participants once, learns the absent groups (two tiny all-reduces:
        the fed ring, then the group) in the caller's thread, so that only the fed ring is used from the background
        thread, and gives this group's weight in the merge. The pending sync keeps the participants for every divisor
        and flag of the sync.

        Args:
            transaction: The sync (an outer step of a fragment), not opened yet.
            background: Sum in a background thread (training may go on) instead of before returning.
            taken: The pseudo-gradient and its finiteness, when the caller took it already (eager updates).

        Raises:
            NonFiniteOuterGradientError: As for :meth:`step`; nothing was changed then.
        """
        start = time.perf_counter()
        fragment = transaction.kind.fragment
        assert fragment is not None, "an outer step moves one fragment"
        with torch.profiler.record_function("fedshard::pseudogradient"):
            local, finite = taken if taken is not None else self.pseudogradient(fragment)
        transaction.open()
        transaction.exchange(finite, local.device)
        if transaction.broken and not transaction.contributors:
            transaction.fail(transaction.broken)
        if not transaction.adds:
            local.zero_()  # an absent group adds nothing to the sum; the mean divides by the contributing groups
        else:
            weight = transaction.weight()
            if weight is not None:
                local.mul_(weight)
        participants = transaction.participants
        reducer, members = self.reducers[fragment], len(participants)
        part, finish = self._replica_part(fragment, local, members)
        pending = PendingSync(
            transaction=transaction,
            own_sq=squared_norm(local),
            bytes_sent=reducer.wire_bytes(part.numel(), members),
            clock=start,
            _own=None if reducer.sums_in_place else local,
            _finish=finish,
        )
        if pending.contributors == 0:
            # Every group joined (a fresh federation, or all of it restarting): a change of members, nothing to sum.
            pending.bytes_sent, pending._result, pending._own = 0, local, None
        elif background:
            pending._future = self._background().submit(self._sum_across_groups, part, fragment, members)
        else:
            pending._part = self._sum_across_groups(part, fragment, members)
        pending.exposed = time.perf_counter() - start
        return pending

    @torch.no_grad()
    def complete(
        self,
        pending: PendingSync,
        step: int | None = None,
        merge_alpha: float = 0.0,
        write: bool = True,
        carry_lost: bool = False,
    ) -> SyncStats:
        """Wait for the sum of :meth:`begin`, step the fragment's outer optimizer and write the new anchor.

        Every shard of the fragment becomes ``anchor + merge_alpha * (shard - anchor)`` with the new anchor: with
        ``merge_alpha=0`` every group restarts the fragment from the anchor. With ``write=False`` only the anchor
        and the outer optimizer change (eager updates write the shards themselves). With ``carry_lost`` a sync the
        communicator does not commit leaves the shards as they are: the group's training since the anchor is kept,
        and the next sync's pseudo-gradient (``anchor - shards``) carries it; without, the shards go back to the
        anchor.
        """
        start = time.perf_counter()
        with torch.profiler.record_function("fedshard::outer_all_reduce_wait"):
            local = pending.result()
        healthy = pending.contributors
        if healthy == 0:  # only a change of members: the weights, the anchor and the outer state stay as they are
            committed = pending.transaction.commit()
            return self._stats(pending, start, outer_grad_norm=0.0, drift=0.0, lost=not committed)
        local.div_(healthy)
        mean_sq = squared_norm(local)
        if pending.own_dot_sum is not None:
            own_dot_mean = pending.own_dot_sum / healthy
        else:  # summed exactly in place: the mean is the groups' mean, <d_g, d> averages to |d|^2
            own_dot_mean = 0.0 if pending.absent(self.communicator.group_index) else mean_sq
        # Before the vote: groups may vote differently (elastic), and every collective must be made by all of them.
        norm, drift = self._global_norms(pending, own_dot_mean, mean_sq, local.device)
        if not pending.transaction.commit():
            lost = self._drop_lost(pending, start, write and not carry_lost)
            return replace(lost, extra={**lost.extra, "carried": 1.0}) if carry_lost else lost
        with torch.profiler.record_function("fedshard::outer_optimizer_step"):
            self._set_grads(local, pending.fragment)
            optimizer = self.optimizers[pending.fragment]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if write:
                self._write_anchor(pending.fragment, merge_alpha)
        self.num_syncs += 1
        return self._stats(pending, start, outer_grad_norm=norm, drift=drift)

    def _stats(self, pending: PendingSync, start: float, **measured: Any) -> SyncStats:
        """The statistics of ``pending``'s sync, whose completion started at ``start``."""
        now = time.perf_counter()
        return SyncStats(
            bytes_sent=pending.bytes_sent,
            seconds=now - pending.clock,
            num_syncs=self.num_syncs,
            skipped_groups=pending.broken,
            joined_groups=pending.joined,
            fragment=pending.fragment,
            exposed_seconds=pending.exposed + (now - start),
            syncs_lost=self.syncs_lost,
            site_syncs=self.site_syncs,
            **measured,
        )

    def _drop_lost(self, pending: PendingSync, start: float, write: bool = True) -> SyncStats:
        """A sync the communicator did not commit: the fragment goes back to the anchor, its residuals are dropped.

        Nothing of the sum is applied (the anchor and the outer optimizer are untouched); with ``write`` every group
        holds the anchor again and the next round starts from it. The error-feedback residuals of the lost sum were
        never applied either, so they are reset rather than carried. With ``write=False`` the shards stay as they are
        (the caller writes them, or the round carries them to the next sync).
        """
        if write:
            self.copy_anchor_to_shards(pending.fragment)
        self.reducers[pending.fragment].reset_residual()
        return self._stats(pending, start, outer_grad_norm=0.0, drift=0.0, lost=True)

    def _replica_part(self, fragment: int, local: Tensor, members: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """The part of ``local`` this replica sums over the groups, and how its encoded sum becomes the whole result.

        The ``R`` replicas of a shard (FL+HSDP) hold the same pseudo-gradient: each sums ``1 / R`` of it over the
        groups (so the shard crosses the groups' links once, not ``R`` times); the summed parts, still in their wire
        form (int4 codes and scales, or the float dtype), are gathered over the replicas inside the group and decoded.
        The fragment's buffer is padded to ``R`` equal parts. One replica: the whole shard, only decoded.
        """
        reducer, numel = self.reducers[fragment], local.numel()
        replicas = self.communicator.num_replicas
        if replicas == 1:
            return local, lambda encoded: reducer.decode(encoded, numel, members)
        buffer = self._flat_buffers[fragment]
        part_size = buffer.numel() // replicas
        start = self.communicator.replica_index * part_size

        def gather_and_decode(encoded: Tensor) -> Tensor:
            pieces = torch.empty(replicas * encoded.numel(), dtype=encoded.dtype, device=encoded.device)
            with torch.profiler.record_function("fedshard::gather_replicas"):
                self.communicator.gather_replicas(pieces, encoded)
            parts = [reducer.decode(piece, part_size, members) for piece in pieces.view(replicas, -1)]
            return torch.cat(parts)[:numel]

        return buffer[start : start + part_size], gather_and_decode

    def _sum_across_groups(self, local: Tensor, fragment: int, members: int) -> Tensor:
        return self.reducers[fragment].sum_encoded(local, self.communicator, members)

    def in_background(self, fn: Callable[..., Tensor], *args: Any) -> Future[Tensor]:
        """Run ``fn(*args)`` (a collective over the fed ring) in the thread where sums in flight run, in order."""
        return self._background().submit(fn, *args)

    def _background(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedshard-outer")
        return self._executor

    @torch.no_grad()
    def _write_anchor(self, fragment: int, merge_alpha: float) -> None:
        for i in self.fragments[fragment]:
            shard, anchor = self.shards[i], self.anchor[i]
            if merge_alpha == 0.0:
                shard.copy_(anchor, non_blocking=True)
            else:
                new = anchor.to(shard.device, non_blocking=True)
                shard.copy_(torch.lerp(new, shard.to(new.dtype), merge_alpha))

    @torch.no_grad()
    def copy_anchor_to_shards(self, fragment: int | None = None) -> None:
        """Overwrite the local shards (of one fragment, or all) with the anchor (the last consensus)."""
        indices = range(len(self.shards)) if fragment is None else self.fragments[fragment]
        for i in indices:
            self.shards[i].copy_(self.anchor[i], non_blocking=True)

    def flat_buffer(self, fragment: int) -> Tensor | None:
        """The fragment's pseudo-gradient buffer, once a sync took one."""
        return self._flat_buffers.get(fragment)

    def pseudogradient(self, fragment: int, offset: Tensor | None = None) -> tuple[Tensor, bool]:
        """``anchor - shard`` for a fragment's shards, in one flat buffer of ``reduce_dtype`` on the shards' device.

        With ``offset`` (eager updates: the group started the round below the anchor, at ``anchor - offset``) the
        pseudo-gradient is taken from there: ``(anchor - shard) - offset``.

        One shard (an FSDP1 unit or an FSDP2 parameter) at a time, so the device holds the buffer plus one shard's
        temporaries, not a copy of every shard in every dtype on the way. The buffer is allocated once per fragment and
        reused by its later syncs (a fragment's next sync starts only after its previous one landed). Also returns
        whether every value was finite, checked on the device and read back once.
        """
        indices = self.fragments[fragment]
        device = self.shards[indices[0]].device
        numel = sum(self.shards[i].numel() for i in indices)
        replicas = self.communicator.num_replicas
        padded = -(-numel // replicas) * replicas  # R equal parts (see `_replica_part`)
        buffer = self._flat_buffers.get(fragment)
        if buffer is None or (buffer.numel(), buffer.dtype, buffer.device) != (padded, self.reduce_dtype, device):
            buffer = self._flat_buffers[fragment] = torch.zeros(padded, dtype=self.reduce_dtype, device=device)
        buffer[numel:].zero_()  # an in-place sum of the last part writes its padding
        flat = buffer[:numel]
        finite = torch.ones((), dtype=torch.bool, device=device)
        eager, position = offset, 0
        for i in indices:
            anchor, shard = self.anchor[i], self.shards[i]
            n = shard.numel()
            part = flat[position : position + n]
            part.copy_((anchor.to(device, non_blocking=True) - shard).reshape(-1))
            if eager is not None:  # from where the group started the round: anchor - offset
                part -= eager[position : position + n].to(device, non_blocking=True).to(part.dtype)
            finite &= torch.isfinite(part).all()  # after the cast: float16 may overflow
            position += n
        return flat, bool(finite)

    def _set_grads(self, flat: Tensor, fragment: int) -> None:
        offset = 0
        for i in self.fragments[fragment]:
            anchor = self.anchor[i]
            n = anchor.numel()
            grad = flat[offset : offset + n].view_as(anchor)
            anchor.grad = grad.to(anchor.device, anchor.dtype, copy=True)
            offset += n

    def _global_norms(
        self, pending: PendingSync, own_dot_mean: float, mean_sq: float, device: torch.device
    ) -> tuple[float, float]:
        """Whole-fragment norm of the applied mean pseudo-gradient ``d``, and the healthy groups' RMS distance from it.

        The distance of group ``g``'s weights from the weights the sync applies is ``|d_g - d|``, and
        ``mean_g |d_g - d|^2 = mean_g |d_g|^2 - 2 mean_g <d_g, d> + |d|^2``: one tiny sum of three numbers over the
        model (the fed ring, then the group) gives it for any reducer. When ``d`` is a quantized estimate of the
        groups' mean, this is the drift from the exact mean plus the (squared) error of the estimate, never a negative
        number. Skipped groups contribute ``own_sq = 0`` and ``<d_g, d> = 0`` and are left out of the mean over groups.
        """
        sums = torch.tensor([pending.own_sq, own_dot_mean, mean_sq], dtype=torch.float64, device=device)
        sum_over_model(self.communicator, sums)
        total_own_sq, total_dot, total_mean_sq = sums.tolist()
        healthy = pending.contributors
        mean_sq_all = total_mean_sq / len(pending.participants)  # every group holds the same mean
        drift_sq = (total_own_sq - 2.0 * total_dot) / healthy + mean_sq_all
        return math.sqrt(max(mean_sq_all, 0.0)), math.sqrt(max(drift_sq, 0.0))
