"""What an outer step keeps between syncs, and how it is saved: anchor, outer optimizers, residuals.

:class:`~lightning_fedshard.core.step.outer.OuterStep` takes these methods; they read and write its attributes only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fedshard.core.transport.comm import Communicator
from lightning_fedshard.core.wire.norms import nbytes
from lightning_fedshard.core.wire.reducers import Reducer

OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]


class OuterState:
    """The state of an outer step: ``anchor`` (float32 shards), one outer optimizer and one reducer per fragment."""

    shards: list[Tensor]
    anchor: list[Tensor]
    fragments: list[list[int]]
    optimizers: list[Optimizer]
    reducers: list[Reducer]
    communicator: Communicator
    num_syncs: int
    site_syncs: int

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the anchor, the outer optimizers' state and the error-feedback residuals."""
        optimizer_state = [v for o in self.optimizers for state in o.state.values() for v in state.values()]
        residuals = [v for r in self.reducers for v in r.state_dict().values()]
        return {
            "anchor": nbytes(self.anchor),
            "outer_optimizer": nbytes(optimizer_state),
            "residuals": nbytes(residuals),
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
        self.site_syncs = int(state["site_syncs"])

    def group_state_dict(self) -> dict[str, Any]:
        """State that differs between the groups: the error-feedback residuals, per fragment."""
        return {"reducers": [r.state_dict() for r in self.reducers]}

    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`group_state_dict` on the same rank of the same topology.

        A residual of another size than this rank's part of its fragment (written before the replicas of a shard
        split its sum) cannot be carried on and is dropped: that sync's rounding errors are then lost, not delayed.
        """
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


def build_outer_optimizer(factory: OuterOptimizerFactory, params: list[Tensor]) -> Optimizer:
    """Call an outer optimizer factory and check that it returned an optimizer."""
    optimizer = factory(params)
    if not isinstance(optimizer, Optimizer):
        raise ValueError(
            f"The outer optimizer factory {factory!r} returned {type(optimizer).__name__}, expected a"
            " `torch.optim.Optimizer`."
        )
    return optimizer


def new_anchor(shard: Tensor, device: torch.device | str | None) -> Tensor:
    """A float32 copy of ``shard`` that takes gradients, on ``device`` (pinned on the CPU for a CUDA shard)."""
    anchor = shard.detach().to(device=device or shard.device, dtype=torch.float32, copy=True)
    if anchor.device.type == "cpu" and shard.device.type == "cuda":
        anchor = anchor.pin_memory()
    return anchor.requires_grad_(True)
