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
(:meth:`OuterStep.average_in_site`, :meth:`OuterStep.mix`) check the groups' weights the same way before they write.

This module knows nothing about Lightning or FSDP: it takes tensors and a :class:`Communicator`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fedshard.core.codecs import FloatCodec
from lightning_fedshard.core.comm import Communicator, sum_over_model
from lightning_fedshard.core.reducers import AllReduceSum, Reducer

OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]

#: What the outer step does with a group whose pseudo-gradient holds NaN or Inf.
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip_group")


class NonFiniteOuterGradientError(FloatingPointError):
    """A federation group's pseudo-gradient (or, at a site sync or a mix, its weights) holds NaN or Inf.

    Raised before anything changed: the anchor, the outer optimizer and every group's weights are as they were.

    Attributes:
        groups: Indices of the broken groups.
        num_syncs: Outer steps completed before this one.
        step: The optimizer step of the failed sync, when known.
        sync: Which kind of sync found them: ``"outer step"``, ``"site sync"`` or ``"mix"``.
        policy: The ``on_nonfinite`` policy in force: under ``"skip_group"`` the sync raises only when a broken group
            has no healthy group to take weights from.
    """

    def __init__(
        self,
        groups: Sequence[int],
        num_syncs: int,
        step: int | None = None,
        sync: str = "outer step",
        policy: str = "raise",
    ) -> None:
        self.groups = tuple(groups)
        self.num_syncs = num_syncs
        self.step = step
        self.sync = sync
        self.policy = policy
        where = f" at optimizer step {step}" if step is not None else ""
        if sync == "outer step":
            head = (
                "Non-finite outer gradient (NaN/Inf pseudo-gradient) in federation group(s)"
                f" {list(self.groups)}{where}, sync {num_syncs + 1} (after {num_syncs} successful sync(s)). The anchor"
                " was left untouched"
            )
        else:
            head = (
                f"Non-finite weights (NaN/Inf) in federation group(s) {list(self.groups)}{where}, at a {sync} (after"
                f" {num_syncs} outer step(s)). No group's weights were changed"
            )
        if policy == "skip_group":
            hint = (
                ". Under `on_nonfinite='skip_group'` a broken group needs a healthy group to take weights from, and"
                " these had none at this sync."
            )
        else:
            hint = ", or pass `on_nonfinite='skip_group'` to average over the healthy groups only."
        super().__init__(
            f"{head} and no checkpoint is written from this state: resume from the last checkpoint (e.g. with a lower"
            f" learning rate){hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.groups, self.num_syncs, self.step, self.sync, self.policy)


@dataclass(frozen=True)
class SyncStats:
    """What one outer step did, for logging.

    Attributes:
        outer_grad_norm: L2 norm of the averaged pseudo-gradient over the whole model. At a site sync or a mix (no
            outer step) the root mean square, over groups, of the norm of ``anchor - theta_g'``, with ``theta_g'`` the
            weights the sync gave group ``g``: the averaged pseudo-gradient each group holds since the last outer step
            (with ``"fedavg"`` an outer step's norm is the same quantity).
        drift: Root mean square, over groups, of the L2 distance between a group's weights just before the sync and
            the mean weights the sync applies (0 when all groups hold the same weights). With a float all-reduce the
            applied mean is the groups' mean; with int8/int4 it is a quantized estimate of it, and the drift is then
            ``sqrt(exact_drift**2 + |estimate - mean|**2)``: above the exact value by at most the estimate's error. At
            a site sync the applied mean is the group's site mean, at a mix the group's row of the mix. Skipped
            groups are left out of it.
        bytes_sent: Bytes this rank sends in the outer all-reduce, assuming a ring all-reduce
            (``2 (G-1)/G`` times the payload).
        seconds: Wall time of the whole outer step on this rank.
        num_syncs: Number of outer steps done so far, including this one (site syncs and mixes are counted in
            ``site_syncs``).
        skipped_groups: Groups left out of the mean because their pseudo-gradient (at a site sync or a mix: their
            weights) was not finite (``on_nonfinite="skip_group"``); they restart from what the sync applied.
        fragment: The fragment that synced (0 with one fragment).
        exposed_seconds: Seconds the training loop was blocked by this sync (taking the pseudo-gradient, waiting for
            the sum, the outer optimizer step); less than ``seconds`` when the sum overlapped with training.
        compute_utilization: Over the round that this sync closes: compute time / (compute time + exposed sync
            time), where compute time is the round's wall time minus the exposed sync time. Set by the runtime.
        num_fragments: How many fragments the model is cut into (the fragment index is logged when > 1).
        lost: Whether the communicator refused to commit this sync: every group went back to the anchor.
        syncs_lost: Syncs lost so far, this one included (logged once there is one).
        discarded_fraction: The share of the round's inner-step progress that this landing threw away: with
            ``sync_delay = d`` and ``merge_alpha = a`` a landing replaces the ``d`` steps trained since its snapshot
            by the anchor, keeping only ``a`` of them, so ``(1 - a) d / sync_every`` (0 without a delay and with
            eager updates, which keep everything). Set by the federation.
        effective_utilization: ``compute_utilization * (1 - discarded_fraction)``: the share of the round's time
            spent on compute whose progress survives. Set by the runtime.
        site_size: With a hierarchical outer topology, the number of consecutive groups that averaged their weights
            at this sync (no outer step); 0 when the whole federation took the outer step.
        mixing_partners: With a mixing topology, the groups this group sent its weights to at this sync (no outer
            step); 0 otherwise.
        joined_groups: Groups that took the federation's state from a peer at this sync (an elastic federation's
            joining or lagging groups); they added nothing to the mean.
        groups: With an elastic federation, the groups that took part in this sync (0 otherwise).
        heal_seconds: With an elastic federation, the seconds this group spent receiving and loading a peer's state
            at this sync (``None`` if it healed nothing).
        site_syncs: Syncs done so far, including this one, that averaged or mixed the groups' weights without an
            outer step: a hierarchical topology's site syncs and a mixing topology's mixes.
        kind: ``"outer step"``, ``"site sync"`` (a hierarchical topology's level below the federation) or ``"mix"``.
    """

    outer_grad_norm: float
    drift: float
    bytes_sent: int
    seconds: float
    num_syncs: int
    skipped_groups: tuple[int, ...] = ()
    fragment: int = 0
    exposed_seconds: float = 0.0
    compute_utilization: float | None = None
    num_fragments: int = 1
    lost: bool = False
    syncs_lost: int = 0
    discarded_fraction: float = 0.0
    effective_utilization: float | None = None
    site_size: int = 0
    mixing_partners: int = 0
    joined_groups: tuple[int, ...] = ()
    groups: int = 0
    heal_seconds: float | None = None
    site_syncs: int = 0
    kind: str = "outer step"

    @property
    def total_syncs(self) -> int:
        """Syncs of every kind done so far: outer steps plus site syncs and mixes (the progress bar's ``syncs``)."""
        return self.num_syncs + self.site_syncs

    def as_dict(self, prefix: str = "fedshard/") -> dict[str, float]:
        """The statistics as a flat ``{name: value}`` dict for loggers."""
        stats = {
            f"{prefix}outer_grad_norm": self.outer_grad_norm,
            f"{prefix}drift": self.drift,
            f"{prefix}sync_bytes": float(self.bytes_sent),
            f"{prefix}sync_seconds": self.seconds,
            f"{prefix}num_syncs": float(self.num_syncs),
        }
        stats[f"{prefix}sync_exposed_seconds"] = self.exposed_seconds
        if self.compute_utilization is not None:
            stats[f"{prefix}compute_utilization"] = self.compute_utilization
        if self.effective_utilization is not None:
            stats[f"{prefix}effective_utilization"] = self.effective_utilization
        if self.num_fragments > 1:
            stats[f"{prefix}fragment"] = float(self.fragment)
        if self.skipped_groups:
            stats[f"{prefix}skipped_groups"] = float(len(self.skipped_groups))
        if self.syncs_lost:
            stats[f"{prefix}syncs_lost"] = float(self.syncs_lost)
        if self.site_size:
            stats[f"{prefix}site_size"] = float(self.site_size)
        if self.mixing_partners:
            stats[f"{prefix}mixing_partners"] = float(self.mixing_partners)
        if self.groups:
            stats[f"{prefix}groups"] = float(self.groups)
        if self.joined_groups:
            stats[f"{prefix}joined_groups"] = float(len(self.joined_groups))
        if self.heal_seconds is not None:
            stats[f"{prefix}heal_seconds"] = self.heal_seconds
        if self.site_syncs:
            stats[f"{prefix}site_syncs"] = float(self.site_syncs)
        return stats


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
    _future: Future[Tensor] | None = field(default=None, repr=False)
    _part: Tensor | None = field(default=None, repr=False)
    _result: Tensor | None = field(default=None, repr=False)
    _own: Tensor | None = field(default=None, repr=False)
    _finish: Callable[[Tensor], Tensor] | None = field(default=None, repr=False)

    @property
    def contributors(self) -> int:
        """Groups whose pseudo-gradient enters the mean: the participants less the broken and the joined ones."""
        return len(self.participants) - len(self.broken) - len(self.joined)

    def absent(self, group: int) -> bool:
        """Whether ``group`` adds nothing to this sync's sum (broken or joined)."""
        return group in self.broken or group in self.joined

    def result(self) -> Tensor:
        """The pseudo-gradient summed over the groups (waits for the reduction if it still runs).

        The sum travels in its wire form; the first call decodes it. With replicas (FL+HSDP) each one summed its part
        of the shard over the groups, and the first call also gathers the parts (still encoded) over the replicas, a
        collective among them: every rank of the sync makes it at the same point.
        """
        if self._result is None:
            if self._part is None:
                assert self._future is not None
                self._part, self._future = self._future.result(), None
            self._result = self._finish(self._part) if self._finish is not None else self._part
            self._part = None
            if self._own is not None:  # a reducer that left this rank's own pseudo-gradient intact
                self.own_dot_sum = _dot(self._own, self._result)
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
            own_sq=float(state["own_sq"]),
            bytes_sent=int(state["bytes_sent"]),
            clock=time.perf_counter(),
            own_dot_sum=state.get("own_dot_sum"),
            _result=state["result"].to(device),
        )


class OuterStep:
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
        reducer: Builds the reducer of a fragment (see :mod:`~lightning_fedshard.core.reducers`), called once per
            fragment; ``None`` (default): an all-reduce in ``reduce_dtype``.
        eager_rule: What :meth:`eager_step` applies at once: ``"share"`` (``lr * d_g / G``, this group's share of
            the mean in flight) or ``"local"`` (``lr * d_g``, its own pseudo-gradient for the whole mean).
        feedback_in_weights: At every landing, move this group's error-feedback residual (what its encoding of the
            pseudo-gradient dropped) from the reducer into its weights: the shards become ``anchor - residual``
            instead of the anchor (``error_feedback="weights"``).

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
        eager_rule: str = "share",
        feedback_in_weights: bool = False,
    ) -> None:
        self.feedback_in_weights = feedback_in_weights
        if eager_rule not in ("share", "local"):
            raise ValueError(f"`eager_rule` must be 'share' or 'local', got {eager_rule!r}.")
        self.eager_rule = eager_rule
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"`on_nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {on_nonfinite!r}.")
        self.on_nonfinite = on_nonfinite
        self.shards = list(shards)
        self.fragments = [list(f) for f in fragments] if fragments is not None else [list(range(len(self.shards)))]
        if sorted(i for f in self.fragments for i in f) != list(range(len(self.shards))) or not all(self.fragments):
            raise ValueError(f"Fragments {self.fragments} must cover the {len(self.shards)} shards exactly once.")
        self.communicator = communicator
        self.num_syncs = 0
        #: Site syncs and mixes done so far (syncs that move no anchor; see :meth:`average_in_site`, :meth:`mix`).
        self.site_syncs = 0
        self.syncs_lost = 0
        self.anchor = [_new_anchor(s, anchor_device) for s in self.shards]
        self._flat_buffers: dict[int, Tensor] = {}  # one pseudo-gradient buffer per fragment, reused by every sync
        # Eager updates: per fragment, how far this group's start of the round lies below the anchor (flat, float32).
        self.offsets: list[Tensor | None] = [None] * len(self.fragments)
        self._eager_blocked = 0.0  # seconds eager steps blocked the loop since the last one that landed a sum
        self.optimizers = [build_outer_optimizer(outer_optimizer, [self.anchor[i] for i in f]) for f in self.fragments]
        build = reducer or (lambda: AllReduceSum(FloatCodec(reduce_dtype)))
        self.reducers: list[Reducer] = [build() for _ in self.fragments]
        self.reduce_dtype = self.reducers[0].input_dtype  # the pseudo-gradient buffer's dtype
        self._executor: ThreadPoolExecutor | None = None
        #: ``(fragment, step)`` while :meth:`begin` waits for the groups of that sync (elastic: a peer may then read
        #: this rank's state to heal), else ``None``.
        self.syncing: tuple[int, int | None] | None = None

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
        return self.complete(self.begin(fragment, step, background=False), step=step)

    @torch.no_grad()
    def begin(
        self,
        fragment: int,
        step: int | None = None,
        background: bool = True,
        taken: tuple[Tensor, bool] | None = None,
    ) -> PendingSync:
        """Take the fragment's pseudo-gradient now and start summing it over the groups; collective.

        The communicator is asked for the participants of this sync once, here; the pending sync keeps them for every
        divisor and flag of the sync. The NaN/Inf check (two tiny all-reduces: the fed ring, then the group) runs here,
        in the caller's thread, so that only the fed ring is used from the background thread.

        Args:
            fragment: Which fragment.
            step: The optimizer step after which the pseudo-gradient is taken (for messages and statistics).
            background: Sum in a background thread (training may go on) instead of before returning.
            taken: The pseudo-gradient and its finiteness, when the caller took it already (:meth:`eager_step`).

        Raises:
            NonFiniteOuterGradientError: As for :meth:`step`; nothing was changed then.
        """
        start = time.perf_counter()
        with torch.profiler.record_function("fedshard::pseudogradient"):
            local, finite = taken if taken is not None else self._pseudogradient(fragment)
        self.syncing = (fragment, step)
        try:
            participants = self.communicator.participants()
        finally:
            self.syncing = None
        joined_now = self.communicator.joined()
        broken, joined = self._absent_groups(finite or joined_now, joined_now, local.device, participants)
        if broken and (self.on_nonfinite == "raise" or len(broken) + len(joined) == len(participants)):
            raise NonFiniteOuterGradientError(broken, self.num_syncs, step, policy=self.on_nonfinite)
        if self.communicator.group_index in broken or joined_now:
            local.zero_()  # an absent group adds nothing to the sum; the mean divides by the contributing groups
        reducer, members = self.reducers[fragment], len(participants)
        part, finish = self._replica_part(fragment, local, members)
        pending = PendingSync(
            fragment=fragment,
            participants=participants,
            started_at=step,
            broken=tuple(broken),
            joined=tuple(joined),
            own_sq=_squared_norm(local),
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
        self, pending: PendingSync, step: int | None = None, merge_alpha: float = 0.0, write: bool = True
    ) -> SyncStats:
        """Wait for the sum of :meth:`begin`, step the fragment's outer optimizer and write the new anchor.

        Every shard of the fragment becomes ``anchor + merge_alpha * (shard - anchor)`` with the new anchor: with
        ``merge_alpha=0`` every group restarts the fragment from the anchor. With ``write=False`` only the anchor
        and the outer optimizer change (:meth:`eager_step` writes the shards itself).
        """
        start = time.perf_counter()
        with torch.profiler.record_function("fedshard::outer_all_reduce_wait"):
            local = pending.result()
        healthy = pending.contributors
        if healthy == 0:  # only a change of members: the weights, the anchor and the outer state stay as they are
            committed = self.communicator.should_commit()
            if not committed:
                self.syncs_lost += 1
            return self._stats(pending, start, outer_grad_norm=0.0, drift=0.0, lost=not committed)
        local.div_(healthy)
        mean_sq = _squared_norm(local)
        if pending.own_dot_sum is not None:
            own_dot_mean = pending.own_dot_sum / healthy
        else:  # summed exactly in place: the mean is the groups' mean, <d_g, d> averages to |d|^2
            own_dot_mean = 0.0 if pending.absent(self.communicator.group_index) else mean_sq
        # Before the vote: groups may vote differently (elastic), and every collective must be made by all of them.
        norm, drift = self._global_norms(pending, own_dot_mean, mean_sq, local.device)
        if not self.communicator.should_commit():
            return self._drop_lost(pending, start, write)
        with torch.profiler.record_function("fedshard::outer_optimizer_step"):
            self._set_grads(local, pending.fragment)
            optimizer = self.optimizers[pending.fragment]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if write:
                self._write_anchor(pending.fragment, merge_alpha)
                self.offsets[pending.fragment] = None
                if self.feedback_in_weights:
                    self._residual_into_weights(pending.fragment)
        self.num_syncs += 1
        return self._stats(pending, start, outer_grad_norm=norm, drift=drift)

    @torch.no_grad()
    def eager_step(
        self, fragment: int, pending: PendingSync | None, step: int | None = None, final: bool = False
    ) -> tuple[SyncStats | None, PendingSync | None]:
        """One eager update of a fragment: land the previous round's sum, start this round's; collective.

        With ``d_g`` this group's pseudo-gradient of the round that just ended (from where the group started it),
        ``m`` the mean over the groups of the previous round's, landing now, ``G`` the healthy groups and ``lr`` the
        fragment's outer learning rate::

            anchor = outer_optimizer.step(anchor, grad=m)      # every group alike: the anchor is the consensus
            start  = anchor - lr * d_g / G                     # this group's own share of the sum now in flight
            shards = start                                     # the next round starts there

        (``start = anchor - lr * d_g`` with ``eager_rule="local"``), and the mean of the ``d_g`` is summed in the
        background until the fragment's next sync. With ``final=True``
        (the end of training) that sum is made and applied at once and every group ends on the anchor.

        Args:
            fragment: Which fragment.
            pending: The fragment's sum started at its previous sync (``None`` at its first).
            step: The optimizer step after which this runs.
            final: Land everything now (no sum left in flight).

        Returns:
            The statistics of the sum that landed (``None`` if none did) and the sum now in flight (``None`` when
            ``final``).

        Raises:
            NonFiniteOuterGradientError: As for :meth:`step`, after the previous round's sum landed on the anchor
                (the shards are left as they are).
        """
        clock = time.perf_counter()
        if pending is not None:
            self._detach_result(pending)  # the fragment's buffer is free again
        taken = self._pseudogradient(fragment)
        own = None if final else self._own_copy(fragment, taken[0])  # before a sum in place overwrites the buffer
        landed = self.complete(pending, step=step, write=False) if pending is not None else None
        started = self.begin(fragment, step, background=not final, taken=taken)
        if own is None:
            final_stats = self.complete(started, step=step)
            return final_stats if landed is None else _combined_stats(landed, final_stats), None
        self._start_from_own_share(fragment, own, started)
        # The loop was blocked for all of this call; a call that landed nothing hands its time to the next landing.
        self._eager_blocked += time.perf_counter() - clock
        if landed is None:
            return None, started
        blocked, self._eager_blocked = self._eager_blocked, 0.0
        return replace(landed, exposed_seconds=blocked), started

    def settle(self, fragment: int, pending: PendingSync | None, step: int | None = None) -> SyncStats | None:
        """Land an eager sum in flight and put every group on the anchor, with nothing trained since it started."""
        stats = self.complete(pending, step=step, write=False) if pending is not None else None
        self.copy_anchor_to_shards(fragment)
        self.offsets[fragment] = None
        return stats

    @torch.no_grad()
    def projected_anchor(self, pending: PendingSync) -> list[Tensor]:
        """The fragment's anchor once ``pending``'s sum has landed, computed on copies (nothing changes here).

        Waits for the sum. The fragment's outer optimizer steps a copy of the anchor from a copy of its state, so an
        eager run validates the consensus of every round trained so far, not of the rounds landed so far.
        """
        mean = pending.result() / pending.contributors
        indices = self.fragments[pending.fragment]
        anchors = [self.anchor[i].detach().clone().requires_grad_(True) for i in indices]
        optimizer = self.optimizers[pending.fragment]
        trial = type(optimizer)(anchors, **optimizer.defaults)
        trial.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        offset = 0
        for anchor in anchors:
            anchor.grad = mean[offset : offset + anchor.numel()].view_as(anchor).to(anchor.device, anchor.dtype)
            offset += anchor.numel()
        trial.step()
        return [a.detach() for a in anchors]

    def _detach_result(self, pending: PendingSync) -> None:
        """Wait for ``pending``'s sum and make sure it does not live in the fragment's buffer (summed in place)."""
        result = pending.result()
        buffer = self._flat_buffers.get(pending.fragment)
        if buffer is not None and result.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            pending._result = result.clone()

    def _own_copy(self, fragment: int, local: Tensor) -> Tensor:
        """A float32 copy of this group's pseudo-gradient, where the anchor lives."""
        device = self.anchor[self.fragments[fragment][0]].device
        return local.to(device=device, dtype=torch.float32, copy=True)

    def _start_from_own_share(self, fragment: int, offset: Tensor, pending: PendingSync) -> None:
        """Write ``anchor - lr * d_g / G`` (or ``lr * d_g``) into the fragment's shards and keep the offset.

        ``offset`` holds ``d_g`` on the way in.
        """
        healthy = pending.contributors
        if pending.absent(self.communicator.group_index):
            offset.zero_()  # a skipped group adds nothing to the sum and restarts from the anchor
        weight = 1.0 / healthy if self.eager_rule == "share" else 1.0
        offset.mul_(float(self.optimizers[fragment].param_groups[0]["lr"]) * weight)
        self.offsets[fragment] = offset
        indices = self.fragments[fragment]
        start = 0
        for i in indices:
            shard, anchor = self.shards[i], self.anchor[i]
            part = offset[start : start + anchor.numel()].view_as(anchor)
            shard.copy_((anchor - part).to(shard.device, non_blocking=True))
            start += anchor.numel()

    @torch.no_grad()
    def average_in_site(
        self, size: int, blocks: Sequence[Sequence[int]] | None = None, step: int | None = None
    ) -> SyncStats:
        """Replace every shard by its plain mean over this group's block of ``size`` groups; collective.

        A hierarchical topology's level below the whole federation: float32, one all-reduce over the block, no outer
        step (the anchor and the outer optimizer are the whole federation's and do not change). Before anything is
        written every group learns which groups hold NaN/Inf weights, over the fed ring as the outer step does:
        ``on_nonfinite="raise"`` then raises in every group; ``"skip_group"`` leaves a broken group out of its
        site's mean (the site divides by its healthy groups), and the broken group takes that mean too.

        Args:
            size: Groups per block.
            blocks: Every block of ``size`` groups (the communicator's sites); default: consecutive groups.
            step: The optimizer step this sync follows (for messages).

        Raises:
            NonFiniteOuterGradientError: If a group's weights hold NaN/Inf and ``on_nonfinite="raise"``, or every
                group of a site's do. No group's weights were changed then.
        """
        start = time.perf_counter()
        groups = self.communicator.participants()
        if blocks is None:
            blocks = [groups[i : i + size] for i in range(0, len(groups), size)]
        flat = self._flat_weights()
        broken = self._nonfinite_groups(flat, groups, step, "site sync")
        stranded = [g for block in blocks if set(block) <= set(broken) for g in block]
        if stranded:
            raise NonFiniteOuterGradientError(stranded, self.num_syncs, step, "site sync", self.on_nonfinite)
        (site,) = [block for block in blocks if self.communicator.group_index in block]
        if self.communicator.group_index in broken:
            flat.zero_()  # adds nothing to its site's sum
        self.communicator.sum_over_site(flat, size)
        flat.div_(sum(1 for g in site if g not in broken))
        norm, drift = self._apply_weights(flat, broken, len(groups))
        seconds = time.perf_counter() - start
        sent = 2 * (size - 1) * flat.numel() * flat.element_size() // size
        return self._site_stats(norm, drift, sent, seconds, broken, kind="site sync", site_size=size)

    @torch.no_grad()
    def mix(self, matrix: Tensor, step: int | None = None) -> SyncStats:
        """Replace every shard by ``sum_j W_ij theta_j`` (this group ``i``, float32); collective over the fed ring.

        A mixing topology's sync: no outer step (the anchor and the outer optimizer do not change). Broken groups
        (NaN/Inf weights) are found before anything is written, as in :meth:`average_in_site`. With
        ``on_nonfinite="skip_group"`` they send nothing, and every row's weights are renormalized over the healthy
        groups: ``W'_ij = W_ij / sum_k W_ik`` over healthy ``j`` and ``k`` (see :func:`healthy_mix`).

        Raises:
            NonFiniteOuterGradientError: If a group's weights hold NaN/Inf and ``on_nonfinite="raise"``, or a broken
                group's row gives no weight to a healthy group. No group's weights were changed then.
        """
        start = time.perf_counter()
        groups = self.communicator.participants()  # asked once per sync
        flat = self._flat_weights()
        broken = self._nonfinite_groups(flat, groups, step, "mix")
        if broken:
            matrix, stranded = healthy_mix(matrix, broken)
            if stranded:
                raise NonFiniteOuterGradientError(stranded, self.num_syncs, step, "mix", self.on_nonfinite)
            if self.communicator.group_index in broken:
                flat.zero_()  # its column is zero: nobody takes from it, and its own NaN must not meet a 0 weight
        self.communicator.mix_over_groups(flat, matrix)
        norm, drift = self._apply_weights(flat, broken, len(groups))
        seconds = time.perf_counter() - start
        i = self.communicator.group_index
        partners = sum(1 for j in range(matrix.shape[0]) if j != i and matrix[j, i] > 0)
        sent = partners * flat.numel() * flat.element_size()
        return self._site_stats(norm, drift, sent, seconds, broken, kind="mix", mixing_partners=partners)

    def _nonfinite_groups(self, flat: Tensor, groups: tuple[int, ...], step: int | None, sync: str) -> tuple[int, ...]:
        """Those of the sync's ``groups`` whose weights hold NaN/Inf, known to every group (the outer step's flags).

        Raises:
            NonFiniteOuterGradientError: If there is one and ``on_nonfinite="raise"``.
        """
        finite = bool(torch.isfinite(flat).all())
        broken, _ = self._absent_groups(finite, False, flat.device, groups)
        if broken and self.on_nonfinite == "raise":
            raise NonFiniteOuterGradientError(broken, self.num_syncs, step, sync)
        return tuple(broken)

    def _apply_weights(self, flat: Tensor, broken: tuple[int, ...], num_groups: int) -> tuple[float, float]:
        """Write the weights a site sync or a mix gave this group; returns its ``outer_grad_norm`` and ``drift``.

        ``drift``: the RMS over the healthy groups of ``|theta_g - theta_g'|`` (before and after); the norm: the RMS
        over all groups of ``|anchor - theta_g'|`` (see :class:`SyncStats`). One tiny sum over the model.
        """
        sums = torch.zeros(2, dtype=torch.float64)
        offset = 0
        for shard, anchor in zip(self.shards, self.anchor):
            new = flat[offset : offset + shard.numel()].view_as(shard)
            sums[0] += _squared_norm(shard.float() - new)
            sums[1] += _squared_norm(anchor.to(new.device, non_blocking=True) - new)
            offset += shard.numel()
        if self.communicator.group_index in broken:
            sums[0] = 0.0  # its NaN distance is not a drift
        self._write_weights(flat)
        sums = sums.to(flat.device)
        sum_over_model(self.communicator, sums)
        drift_sq, away_sq = sums.tolist()
        return math.sqrt(away_sq / num_groups), math.sqrt(drift_sq / (num_groups - len(broken)))

    def _site_stats(
        self, norm: float, drift: float, sent: int, seconds: float, broken: tuple[int, ...], **extra: Any
    ) -> SyncStats:
        """Count a site sync or a mix that landed, and its statistics."""
        self.site_syncs += 1
        return SyncStats(
            norm,
            drift,
            sent,
            seconds,
            self.num_syncs,
            skipped_groups=broken,
            exposed_seconds=seconds,
            site_syncs=self.site_syncs,
            **extra,
        )

    @torch.no_grad()
    def mean_over_groups(self) -> list[Tensor]:
        """The exact float32 mean of every shard over all groups (for a consensus when groups differ); collective."""
        return list(self._mean_weights().split([s.numel() for s in self.shards]))

    def _mean_weights(self) -> Tensor:
        """:meth:`_flat_weights` averaged over all groups (a float32 sum over the fed ring); collective."""
        flat = self._flat_weights()
        self.communicator.sum_over_groups(flat)
        return flat.div_(len(self.communicator.participants()))

    def _flat_weights(self) -> Tensor:
        """This rank's shards, concatenated into one float32 vector on their device."""
        return torch.cat([s.detach().reshape(-1).to(torch.float32) for s in self.shards])

    def _write_weights(self, flat: Tensor) -> None:
        """Write a vector of :meth:`_flat_weights`' layout back into the shards."""
        for shard, part in zip(self.shards, flat.split([s.numel() for s in self.shards])):
            shard.copy_(part.view_as(shard))

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

        Nothing of the sum is applied, so every group holds the anchor again (the anchor and the outer optimizer are
        untouched) and the next round starts from it; the error-feedback residuals of the lost sum were never applied
        either, so they are reset rather than carried. With ``write=False`` the caller writes the shards.
        """
        if write:
            self.copy_anchor_to_shards(pending.fragment)
            self.offsets[pending.fragment] = None
        feedback = getattr(self.reducers[pending.fragment], "feedback", None)
        if feedback is not None:
            feedback.reset()
        self.syncs_lost += 1
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
    def _residual_into_weights(self, fragment: int) -> None:
        """This group keeps what its encoding dropped: the fragment's shards become ``anchor - residual``.

        The residual leaves the reducer (its next sync adds nothing): the next pseudo-gradient ``anchor - shard``
        already holds it. With ``R`` replicas each kept the residual of the part it encoded; the parts are gathered
        inside the group (float32, the replicate axis only).
        """
        feedback = getattr(self.reducers[fragment], "feedback", None)
        residual = feedback.take("residual") if feedback is not None else None
        if residual is None:  # nothing was encoded (a single group)
            return
        indices = self.fragments[fragment]
        flat = residual.reshape(-1).to(self.shards[indices[0]].device)
        replicas = self.communicator.num_replicas
        if replicas > 1:
            parts = torch.empty(replicas * flat.numel(), dtype=flat.dtype, device=flat.device)
            self.communicator.gather_replicas(parts, flat)
            flat = parts
        offset = 0
        for i in indices:
            shard = self.shards[i]
            n = shard.numel()
            shard.sub_(flat[offset : offset + n].view_as(shard).to(shard.dtype))
            offset += n

    @torch.no_grad()
    def agree_on_mean(self) -> SyncStats:
        """Every group's shards and the anchor become the exact float32 mean of the groups' weights; collective.

        The end of training with ``error_feedback="weights"``: the groups differ by what they have not sent, their mean
        is the consensus. No outer step (the outer optimizer does not change).
        """
        start = time.perf_counter()
        groups = len(self.communicator.participants())
        flat = self._mean_weights()
        self._write_weights(flat)
        for anchor, shard in zip(self.anchor, self.shards):
            anchor.copy_(shard.detach().reshape(anchor.shape))
        seconds = time.perf_counter() - start
        sent = 2 * (groups - 1) * flat.numel() * flat.element_size() // groups
        return SyncStats(0.0, 0.0, sent, seconds, self.num_syncs, exposed_seconds=seconds, site_syncs=self.site_syncs)

    @torch.no_grad()
    def copy_anchor_to_shards(self, fragment: int | None = None) -> None:
        """Overwrite the local shards (of one fragment, or all) with the anchor (the last consensus)."""
        indices = range(len(self.shards)) if fragment is None else self.fragments[fragment]
        for i in indices:
            self.shards[i].copy_(self.anchor[i], non_blocking=True)

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the anchor, the outer optimizers' state, the error-feedback residuals and the eager offsets."""
        optimizer_state = [v for o in self.optimizers for state in o.state.values() for v in state.values()]
        residuals = [v for r in self.reducers for v in r.state_dict().values()]
        return {
            "anchor": _nbytes(self.anchor),
            "outer_optimizer": _nbytes(optimizer_state),
            "residuals": _nbytes(residuals),
            "eager_offsets": _nbytes(self.offsets),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state: anchor shards, outer optimizer states (one per fragment) and the sync counter."""
        return {
            "anchor": [a.detach().clone() for a in self.anchor],
            "optimizers": [o.state_dict() for o in self.optimizers],
            "num_syncs": self.num_syncs,
            "site_syncs": self.site_syncs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of the same topology."""
        anchors = state["anchor"]
        if len(anchors) != len(self.anchor):
            raise ValueError(f"The saved outer state holds {len(anchors)} shards, this rank has {len(self.anchor)}.")
        optimizers = state.get("optimizers", [state.get("optimizer")])  # one "optimizer" before fragments existed
        if len(optimizers) != len(self.optimizers):
            raise ValueError(
                f"The saved outer state has {len(optimizers)} fragment optimizer(s), this run {len(self.optimizers)}."
            )
        with torch.no_grad():
            for mine, saved in zip(self.anchor, anchors):
                if mine.shape != saved.shape:
                    raise ValueError(f"Saved anchor shard of shape {tuple(saved.shape)} != {tuple(mine.shape)}.")
                mine.copy_(saved)
        for optimizer, saved_state in zip(self.optimizers, optimizers):
            optimizer.load_state_dict(saved_state)
        self.num_syncs = int(state["num_syncs"])
        self.site_syncs = int(state.get("site_syncs", 0))  # written before site syncs were counted: none

    def group_state_dict(self) -> dict[str, Any]:
        """State that differs between the groups: the error-feedback residuals and the eager offsets, per fragment."""
        offsets = [None if o is None else o.detach().clone() for o in self.offsets]
        return {"reducers": [r.state_dict() for r in self.reducers], "offsets": offsets}

    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`group_state_dict` on the same rank of the same topology.

        A residual of another size than this rank's part of its fragment (written before the replicas of a shard
        split its sum) cannot be carried on and is dropped: that sync's rounding errors are then lost, not delayed.
        """
        for fragment, offset in enumerate(state.get("offsets", [None] * len(self.offsets))):
            device = self.anchor[self.fragments[fragment][0]].device
            self.offsets[fragment] = None if offset is None else offset.to(device, torch.float32, copy=True)
        for fragment, (reducer, saved) in enumerate(zip(self.reducers, state.get("reducers", []))):
            if saved is None:
                continue
            residual = saved.get("residual")
            if residual is not None and residual.numel() != self._part_numel(fragment):
                continue
            reducer.load_state_dict(saved)

    def _part_numel(self, fragment: int) -> int:
        """Values of the part of a fragment this rank sums over the groups (see :meth:`_replica_part`)."""
        numel = sum(self.shards[i].numel() for i in self.fragments[fragment])
        replicas = self.communicator.num_replicas
        return numel if replicas == 1 else -(-numel // replicas)

    def _pseudogradient(self, fragment: int) -> tuple[Tensor, bool]:
        """``anchor - shard`` for a fragment's shards, in one flat buffer of ``reduce_dtype`` on the shards' device.

        With eager updates the group started the round below the anchor, at ``anchor - offset``, and the
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
        eager = self.offsets[fragment]
        offset = 0
        for i in indices:
            anchor, shard = self.anchor[i], self.shards[i]
            n = shard.numel()
            part = flat[offset : offset + n]
            part.copy_((anchor.to(device, non_blocking=True) - shard).reshape(-1))
            if eager is not None:  # from where the group started the round: anchor - offset
                part -= eager[offset : offset + n].to(device, non_blocking=True).to(part.dtype)
            finite &= torch.isfinite(part).all()  # after the cast: float16 may overflow
            offset += n
        return flat, bool(finite)

    def _absent_groups(
        self, finite: bool, joined: bool, device: torch.device, participants: tuple[int, ...]
    ) -> tuple[list[int], list[int]]:
        """Taking-part groups whose pseudo-gradient holds NaN/Inf anywhere, and those that joined at this sync.

        Known to every rank of the sync: two flags per participant, summed over the fed ring and then inside the group
        (two tiny all-reduces).
        """
        flags = torch.zeros(2, len(participants), dtype=torch.float64, device=device)
        mine = participants.index(self.communicator.group_index)
        flags[0, mine] = 0.0 if finite else 1.0
        flags[1, mine] = 1.0 if joined else 0.0
        sum_over_model(self.communicator, flags.view(-1))
        nonfinite, joining = flags.tolist()
        return [g for g, f in zip(participants, nonfinite) if f > 0], [
            g for g, f in zip(participants, joining) if f > 0
        ]

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


def healthy_mix(matrix: Tensor, broken: Sequence[int]) -> tuple[Tensor, list[int]]:
    """A mixing matrix without the ``broken`` groups' weights, each row renormalized over the healthy groups.

    ``W'_ij = W_ij / sum_k W_ik`` over healthy ``j`` and ``k``, and 0 for a broken ``j``: a healthy group takes the
    same mix of the healthy groups it took from before, a broken one the mix of its healthy partners. The columns
    then no longer sum to 1, so such a mix does not keep the groups' mean. A healthy row with no healthy weight left
    (only a matrix with a zero diagonal has one) keeps its own weights.

    Returns:
        The matrix, and the broken groups whose row gives no weight to a healthy group (they cannot be restarted).
    """
    kept = matrix.clone()
    kept[:, list(broken)] = 0.0
    mass = kept.sum(dim=1)
    stranded = [i for i in broken if mass[i] <= 0]
    for i in range(matrix.shape[0]):
        if mass[i] <= 0 and i not in broken:
            kept[i, i], mass[i] = 1.0, 1.0
    return kept / mass.clamp_min(1e-300)[:, None], stranded


def _combined_stats(first: SyncStats, second: SyncStats) -> SyncStats:
    """One record for two syncs of a fragment in a row: the second's norms, both's bytes and seconds."""
    return replace(
        second,
        bytes_sent=first.bytes_sent + second.bytes_sent,
        exposed_seconds=first.exposed_seconds + second.exposed_seconds,
    )


def _nbytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors among ``values``."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, Tensor))


def _dot(a: Tensor, b: Tensor, chunk: int = 1 << 24) -> float:
    """Inner product of two float tensors of the same size, in float32 chunks (for logging)."""
    x, y = a.reshape(-1), b.reshape(-1)
    return sum(
        float(torch.dot(x[i : i + chunk].float(), y[i : i + chunk].to(x.device, torch.float32)))
        for i in range(0, x.numel(), chunk)
    )


def _squared_norm(tensor: Tensor, chunk: int = 1 << 24) -> float:
    """Squared L2 norm for logging, in float32 chunks so a low-precision buffer is never copied whole."""
    flat = tensor.reshape(-1)
    return sum(
        float(torch.linalg.vector_norm(flat[i : i + chunk], dtype=torch.float32)) ** 2
        for i in range(0, flat.numel(), chunk)
    )


def build_outer_optimizer(factory: OuterOptimizerFactory, params: list[Tensor]) -> Optimizer:
    """Call an outer optimizer factory and check that it returned an optimizer."""
    optimizer = factory(params)
    if not isinstance(optimizer, Optimizer):
        raise ValueError(
            f"The outer optimizer factory {factory!r} returned {type(optimizer).__name__}, expected a"
            " `torch.optim.Optimizer`."
        )
    return optimizer


def _new_anchor(shard: Tensor, device: torch.device | str | None) -> Tensor:
    anchor = shard.detach().to(device=device or shard.device, dtype=torch.float32, copy=True)
    if anchor.device.type == "cpu" and shard.device.type == "cuda":
        anchor = anchor.pin_memory()
    return anchor.requires_grad_(True)
