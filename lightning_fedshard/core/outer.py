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
the healthy groups only and the broken ones restart from the new anchor like everyone else.

This module knows nothing about Lightning or FSDP: it takes tensors and a :class:`Communicator`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]

#: What the outer step does with a group whose pseudo-gradient holds NaN or Inf.
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip_group")


class NonFiniteOuterGradientError(FloatingPointError):
    """A federation group's pseudo-gradient holds NaN or Inf; the anchor and the outer optimizer are untouched.

    Attributes:
        groups: Indices of the broken groups.
        num_syncs: Outer steps completed before this one.
        step: The optimizer step of the failed sync, when known.
    """

    def __init__(self, groups: Sequence[int], num_syncs: int, step: int | None = None) -> None:
        self.groups = tuple(groups)
        self.num_syncs = num_syncs
        self.step = step
        where = f" at optimizer step {step}" if step is not None else ""
        super().__init__(
            f"Non-finite outer gradient (NaN/Inf pseudo-gradient) in federation group(s) {list(self.groups)}{where},"
            f" sync {num_syncs + 1} (after {num_syncs} successful sync(s)). The anchor was left untouched and no"
            " checkpoint is written from this state: resume from the last checkpoint (e.g. with a lower learning"
            " rate), or pass `on_nonfinite='skip_group'` to average over the healthy groups only."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.groups, self.num_syncs, self.step)


class Communicator(Protocol):
    """Collectives the outer step needs; the real one wraps process groups, tests may pass a fake."""

    @property
    def num_groups(self) -> int:
        """Number of federation groups ``G`` taking part in the mean."""

    @property
    def group_index(self) -> int:
        """This rank's federation group."""

    def sum_across_groups(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its sum over the ranks at the same in-group position of every group."""

    def sum_across_model(self, tensor: Tensor) -> None:
        """Replace a small statistics vector in place by its sum over all distinct shards of all groups.

        Ranks that hold identical data (HSDP replicas) must be counted once.
        """


@dataclass(frozen=True)
class SyncStats:
    """What one outer step did, for logging.

    Attributes:
        outer_grad_norm: L2 norm of the averaged pseudo-gradient over the whole model.
        drift: Root mean square, over groups, of the L2 distance between a group's weights and the groups' mean
            weights just before the sync (0 when all groups hold the same weights).
        bytes_sent: Bytes this rank sends in the outer all-reduce, assuming a ring all-reduce
            (``2 (G-1)/G`` times the payload).
        seconds: Wall time of the whole outer step on this rank.
        num_syncs: Number of outer steps done so far, including this one.
        skipped_groups: Groups left out of the mean because their pseudo-gradient was not finite
            (``on_nonfinite="skip_group"``); they restart from the new anchor.
    """

    outer_grad_norm: float
    drift: float
    bytes_sent: int
    seconds: float
    num_syncs: int
    skipped_groups: tuple[int, ...] = ()

    def as_dict(self, prefix: str = "fedshard/") -> dict[str, float]:
        """The statistics as a flat ``{name: value}`` dict for loggers."""
        stats = {
            f"{prefix}outer_grad_norm": self.outer_grad_norm,
            f"{prefix}drift": self.drift,
            f"{prefix}sync_bytes": float(self.bytes_sent),
            f"{prefix}sync_seconds": self.seconds,
            f"{prefix}num_syncs": float(self.num_syncs),
        }
        if self.skipped_groups:
            stats[f"{prefix}skipped_groups"] = float(len(self.skipped_groups))
        return stats


class OuterStep:
    """Keeps the anchor and the outer optimizer for a list of local shards, and performs the outer step.

    Args:
        shards: This rank's local shards of the model parameters (the tensors training updates in place). They
            must have the same shapes, in the same order, on every rank at the same in-group position.
        outer_optimizer: Builds the outer optimizer from the anchor tensors, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``.
        communicator: Collectives over the federation (see :class:`Communicator`).
        reduce_dtype: Data type of the pseudo-gradient on the wire.
        anchor_device: Where the anchor and the outer optimizer state live. ``"cpu"`` (default) costs the
            accelerator no memory; ``None`` keeps them next to the shards.
        on_nonfinite: ``"raise"`` (default) or ``"skip_group"``; see :meth:`step`.

    Raises:
        ValueError: If ``outer_optimizer`` does not return a ``torch.optim.Optimizer``, or for an unknown
            ``on_nonfinite``.
    """

    def __init__(
        self,
        shards: Sequence[Tensor],
        outer_optimizer: OuterOptimizerFactory,
        communicator: Communicator,
        reduce_dtype: torch.dtype = torch.float32,
        anchor_device: torch.device | str | None = "cpu",
        on_nonfinite: str = "raise",
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"`on_nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {on_nonfinite!r}.")
        self.on_nonfinite = on_nonfinite
        self.shards = list(shards)
        self.communicator = communicator
        self.reduce_dtype = reduce_dtype
        self.num_syncs = 0
        self.anchor = [_new_anchor(s, anchor_device) for s in self.shards]
        self.optimizer = build_outer_optimizer(outer_optimizer, self.anchor)

    @torch.no_grad()
    def step(self, step: int | None = None) -> SyncStats:
        """Average the pseudo-gradients over groups, step the outer optimizer and reset every shard to the anchor.

        Collective: every rank of the job must call it at the same point.

        Args:
            step: The optimizer step this sync follows; only used in error messages.

        Raises:
            NonFiniteOuterGradientError: If a group's pseudo-gradient holds NaN/Inf and ``on_nonfinite="raise"``, or
                every group's does. Nothing was changed then.
        """
        start = time.perf_counter()
        with torch.profiler.record_function("fedshard::pseudogradient"):
            local, finite = self._pseudogradient()
        broken = self._nonfinite_groups(finite, local.device)
        groups = self.communicator.num_groups
        if broken and (self.on_nonfinite == "raise" or len(broken) == groups):
            raise NonFiniteOuterGradientError(broken, self.num_syncs, step)
        if self.communicator.group_index in broken:
            local.zero_()  # a broken group adds nothing to the sum; the mean divides by the healthy groups
        healthy = groups - len(broken)
        own_sq = _squared_norm(local)
        payload = local.numel() * local.element_size()
        with torch.profiler.record_function("fedshard::outer_all_reduce"):
            if groups > 1:
                self.communicator.sum_across_groups(local)
            local.div_(healthy)
        mean_sq = _squared_norm(local)
        norm, drift = self._global_norms(own_sq, mean_sq, local.device, healthy)
        with torch.profiler.record_function("fedshard::outer_optimizer_step"):
            self._set_grads(local)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.copy_anchor_to_shards()
        self.num_syncs += 1
        return SyncStats(
            outer_grad_norm=norm,
            drift=drift,
            bytes_sent=int(2 * (groups - 1) / groups * payload),
            seconds=time.perf_counter() - start,
            num_syncs=self.num_syncs,
            skipped_groups=tuple(broken),
        )

    @torch.no_grad()
    def copy_anchor_to_shards(self) -> None:
        """Overwrite every local shard with the anchor (the last consensus)."""
        for shard, anchor in zip(self.shards, self.anchor):
            shard.copy_(anchor, non_blocking=True)

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the current shards as the anchor, e.g. after weights were loaded from elsewhere."""
        for shard, anchor in zip(self.shards, self.anchor):
            anchor.copy_(shard)

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state: anchor shards, outer optimizer state and the sync counter."""
        return {
            "anchor": [a.detach().clone() for a in self.anchor],
            "optimizer": self.optimizer.state_dict(),
            "num_syncs": self.num_syncs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of the same topology."""
        anchors = state["anchor"]
        if len(anchors) != len(self.anchor):
            raise ValueError(f"The saved outer state holds {len(anchors)} shards, this rank has {len(self.anchor)}.")
        with torch.no_grad():
            for mine, saved in zip(self.anchor, anchors):
                if mine.shape != saved.shape:
                    raise ValueError(f"Saved anchor shard of shape {tuple(saved.shape)} != {tuple(mine.shape)}.")
                mine.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_syncs = int(state["num_syncs"])

    def _pseudogradient(self) -> tuple[Tensor, bool]:
        """``anchor - shard`` for every shard, written into one flat buffer of ``reduce_dtype`` on the shards' device.

        One shard (an FSDP unit) at a time, so the device holds the buffer plus one unit's temporaries, not a copy of
        every shard in every dtype on the way. Also returns whether every value was finite, checked unit by unit.
        """
        if not self.shards:
            return torch.empty(0, dtype=self.reduce_dtype), True
        device = self.shards[0].device
        flat = torch.empty(sum(s.numel() for s in self.shards), dtype=self.reduce_dtype, device=device)
        finite = True
        offset = 0
        for anchor, shard in zip(self.anchor, self.shards):
            n = shard.numel()
            part = flat[offset : offset + n]
            part.copy_((anchor.to(device, non_blocking=True) - shard).reshape(-1))
            finite = finite and bool(torch.isfinite(part).all())  # after the cast: float16 may overflow
            offset += n
        return flat, finite

    def _nonfinite_groups(self, finite: bool, device: torch.device) -> list[int]:
        """Groups whose pseudo-gradient holds NaN/Inf anywhere, known to every rank (one tiny all-reduce)."""
        flags = torch.zeros(self.communicator.num_groups, dtype=torch.float64, device=device)
        if not finite:
            flags[self.communicator.group_index] = 1.0
        self.communicator.sum_across_model(flags)
        return [g for g, flag in enumerate(flags.tolist()) if flag > 0]

    def _set_grads(self, flat: Tensor) -> None:
        offset = 0
        for anchor in self.anchor:
            n = anchor.numel()
            grad = flat[offset : offset + n].view_as(anchor)
            anchor.grad = grad.to(anchor.device, anchor.dtype, copy=True)
            offset += n

    def _global_norms(self, own_sq: float, mean_sq: float, device: torch.device, healthy: int) -> tuple[float, float]:
        """Whole-model norm of the mean pseudo-gradient, and the healthy groups' RMS distance from their mean.

        Since the mean pseudo-gradient is the mean of the groups' ones,
        ``mean_g |d_g - d|^2 = mean_g |d_g|^2 - |d|^2``: one tiny all-reduce gives both. Skipped groups contribute
        ``own_sq = 0`` and are left out of the mean over groups.
        """
        sums = torch.tensor([own_sq, mean_sq], dtype=torch.float64, device=device)
        self.communicator.sum_across_model(sums)
        groups = self.communicator.num_groups
        mean_own_sq, mean_sq_total = sums[0].item() / healthy, sums[1].item() / groups
        return math.sqrt(max(mean_sq_total, 0.0)), math.sqrt(max(mean_own_sq - mean_sq_total, 0.0))


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
