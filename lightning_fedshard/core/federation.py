"""One rank's view of a running federation: when to sync, the outer step, and the consensus weights.

The Trainer callback and the Fabric strategy both drive this class, so the schedule (every ``sync_every`` real
optimizer steps, once more at the end) lives in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.outer import Communicator, OuterStep, SyncStats


class Federation:
    """Schedules outer steps over the local shards of one rank.

    Args:
        config: Validated federation options (``sync_every``, outer optimizer, dtype, anchor device).
        communicator: Collectives over the federation groups.
    """

    def __init__(self, config: FederationConfig, communicator: Communicator) -> None:
        self.config = config
        self.communicator = communicator
        self._outer: OuterStep | None = None
        self._on_write: Callable[[], None] = _nothing
        self.last_synced_step = 0

    @property
    def started(self) -> bool:
        """Whether :meth:`start` attached the model's shards."""
        return self._outer is not None

    @property
    def outer(self) -> OuterStep:
        """The outer step; raises before :meth:`start`."""
        if self._outer is None:
            raise RuntimeError("The federation has not started: call `start(shards, step)` first.")
        return self._outer

    def start(self, shards: Sequence[Tensor], step: int, on_write: Callable[[], None] | None = None) -> None:
        """Take the current shards as the anchor (all groups must hold the same weights) at optimizer step ``step``.

        Calling it again with the same shards keeps everything (anchor, outer optimizer state, schedule), e.g. after
        :meth:`load_state_dict` restored them from a checkpoint; only ``on_write`` is replaced.

        Args:
            shards: This rank's local shards, updated in place by training.
            step: The optimizer step training starts from.
            on_write: Called after the shards were overwritten in place, e.g. to drop caches of gathered weights.
        """
        self._on_write = on_write or _nothing
        if self._outer is not None and _same_tensors(self._outer.shards, shards):
            return
        anchor_device = "cpu" if self.config.anchor_device == "cpu" else None
        self._outer = OuterStep(
            shards,
            self.config.outer_optimizer_factory,
            self.communicator,
            reduce_dtype=self.config.reduce_torch_dtype,
            anchor_device=anchor_device,
            on_nonfinite=self.config.on_nonfinite,
        )
        self.last_synced_step = step

    def is_due(self, step: int) -> bool:
        """Whether an outer step is due after optimizer step ``step`` (a multiple of ``sync_every`` not synced yet).

        ``step`` counts real optimizer steps, so gradient accumulation and repeated hook calls for the same step
        never trigger twice.
        """
        return step > self.last_synced_step and step % self.config.sync_every == 0

    def maybe_sync(self, step: int) -> SyncStats | None:
        """Run the outer step if one is due after optimizer step ``step``; collective."""
        return self.sync(step) if self.is_due(step) else None

    def finish(self, step: int) -> SyncStats | None:
        """Sync once more if training stopped between two syncs, so every group ends with the consensus."""
        return self.sync(step) if self.started and step > self.last_synced_step else None

    def sync(self, step: int) -> SyncStats:
        """Run the outer step now; collective.

        Raises:
            NonFiniteOuterGradientError: See :class:`~lightning_fedshard.core.outer.OuterStep`.
        """
        stats = self.outer.step(step=step)
        self._on_write()
        self.last_synced_step = step
        return stats

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Temporarily load the consensus (the anchor) into the shards, e.g. for validation between syncs.

        With a single group there is nothing to agree on: its current weights are the consensus and stay in place
        (so a one-group run validates and saves what plain FSDP would).
        """
        if self._outer is None or self.communicator.num_groups == 1:
            yield
            return
        saved = [s.detach().clone() for s in self._outer.shards]
        self._outer.copy_anchor_to_shards()
        self._on_write()
        try:
            yield
        finally:
            with torch.no_grad():
                for shard, local in zip(self._outer.shards, saved):
                    shard.copy_(local)
            self._on_write()

    def state_dict(self) -> dict[str, Any]:
        """This rank's federation state (outer step and schedule)."""
        return {"outer": self.outer.state_dict() if self._outer else None, "last_synced_step": self.last_synced_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the federation must already be started on the same shards layout."""
        if state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
        self.last_synced_step = int(state["last_synced_step"])


def _nothing() -> None:
    pass


def _same_tensors(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
