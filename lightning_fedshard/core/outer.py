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


class Communicator(Protocol):
    """Collectives the outer step needs; the real one wraps process groups, tests may pass a fake."""

    @property
    def num_groups(self) -> int:
        """Number of federation groups ``G`` taking part in the mean."""

    def average_across_groups(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its mean over the ranks at the same in-group position of every group."""

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
    """

    outer_grad_norm: float
    drift: float
    bytes_sent: int
    seconds: float
    num_syncs: int

    def as_dict(self, prefix: str = "fedshard/") -> dict[str, float]:
        """The statistics as a flat ``{name: value}`` dict for loggers."""
        return {
            f"{prefix}outer_grad_norm": self.outer_grad_norm,
            f"{prefix}drift": self.drift,
            f"{prefix}sync_bytes": float(self.bytes_sent),
            f"{prefix}sync_seconds": self.seconds,
            f"{prefix}num_syncs": float(self.num_syncs),
        }


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

    Raises:
        ValueError: If ``outer_optimizer`` does not return a ``torch.optim.Optimizer``.
    """

    def __init__(
        self,
        shards: Sequence[Tensor],
        outer_optimizer: OuterOptimizerFactory,
        communicator: Communicator,
        reduce_dtype: torch.dtype = torch.float32,
        anchor_device: torch.device | str | None = "cpu",
    ) -> None:
        self.shards = list(shards)
        self.communicator = communicator
        self.reduce_dtype = reduce_dtype
        self.num_syncs = 0
        self.anchor = [_new_anchor(s, anchor_device) for s in self.shards]
        self.optimizer = build_outer_optimizer(outer_optimizer, self.anchor)

    @torch.no_grad()
    def step(self) -> SyncStats:
        """Average the pseudo-gradients over groups, step the outer optimizer and reset every shard to the anchor.

        Collective: every rank of the job must call it at the same point.
        """
        start = time.perf_counter()
        with torch.profiler.record_function("fedshard::pseudogradient"):
            local = self._pseudogradient()
        own_sq = float(local.double().square().sum()) if local.numel() else 0.0
        payload = local.numel() * local.element_size()
        with torch.profiler.record_function("fedshard::outer_all_reduce"):
            self.communicator.average_across_groups(local)
        mean_sq = float(local.double().square().sum()) if local.numel() else 0.0
        norm, drift = self._global_norms(own_sq, mean_sq, local.device)
        with torch.profiler.record_function("fedshard::outer_optimizer_step"):
            self._set_grads(local)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.copy_anchor_to_shards()
        self.num_syncs += 1
        groups = self.communicator.num_groups
        return SyncStats(
            outer_grad_norm=norm,
            drift=drift,
            bytes_sent=int(2 * (groups - 1) / groups * payload),
            seconds=time.perf_counter() - start,
            num_syncs=self.num_syncs,
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

    def _pseudogradient(self) -> Tensor:
        """``anchor - shard`` for every shard, flattened into one buffer on the shards' device."""
        if not self.shards:
            return torch.empty(0, dtype=self.reduce_dtype)
        device = self.shards[0].device
        parts = [(a.to(device, non_blocking=True) - s).reshape(-1) for a, s in zip(self.anchor, self.shards)]
        return torch.cat(parts).to(self.reduce_dtype)

    def _set_grads(self, flat: Tensor) -> None:
        offset = 0
        for anchor in self.anchor:
            n = anchor.numel()
            grad = flat[offset : offset + n].view_as(anchor)
            anchor.grad = grad.to(anchor.device, anchor.dtype, copy=True)
            offset += n

    def _global_norms(self, own_sq: float, mean_sq: float, device: torch.device) -> tuple[float, float]:
        """Whole-model norm of the mean pseudo-gradient, and the groups' RMS distance from their mean.

        Since the mean pseudo-gradient is the mean of the groups' ones,
        ``mean_g |d_g - d|^2 = mean_g |d_g|^2 - |d|^2``: one tiny all-reduce gives both.
        """
        sums = torch.tensor([own_sq, mean_sq], dtype=torch.float64, device=device)
        self.communicator.sum_across_model(sums)
        groups = self.communicator.num_groups
        mean_own_sq, mean_sq_total = sums[0].item() / groups, sums[1].item() / groups
        return math.sqrt(max(mean_sq_total, 0.0)), math.sqrt(max(mean_own_sq - mean_sq_total, 0.0))


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
