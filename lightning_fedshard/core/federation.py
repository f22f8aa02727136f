"""One rank's view of a running federation: when to sync, the outer step, and the consensus weights.

The Trainer callback and the Fabric strategy both drive this class, so the schedule (every ``sync_every`` real
optimizer steps, once more at the end) lives in one place. What a sync does is the business of the one round the
federation runs for its options (see :mod:`~lightning_fedshard.core.rounds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.lazy import required
from lightning_fedshard.core.rounds import Round, build_round
from lightning_fedshard.core.rounds.base import combined
from lightning_fedshard.core.step.fragments import cut_fragments
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.step.participation import (
    Participation,
    build_participation,
    load_rules_state,
    rules_state,
)
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind
from lightning_fedshard.core.transport.comm import Communicator


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
        #: The groups' distance from their mean at the last consensus of a topology whose groups differ
        #: (hierarchical, mixing; ``None`` before one, and with ``"all"``).
        self.consensus_distance: float | None = None
        self.last_synced_step = 0
        self.last_step = 0
        self.landed_at: list[int] = [0] * config.fragments
        #: Adds to the statistics of every sync that lands during training (e.g. the groups of an elastic sync).
        self.annotate_stats: Callable[[SyncStats], SyncStats] | None = None
        #: Whether other groups may join while this one trains: even a lone group's consensus is then the anchor.
        self.groups_may_join = False
        #: State that others attached to this federation keep in its checkpoints, as ``name: (save, load)``.
        self.extra_state: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        #: Who adds to a sync, with what weight (a per-group pace weighs by the steps trained; an elastic federation's
        #: probation leaves out groups that joined recently); set by :meth:`start`. ``None``: every participant,
        #: alike (a round may add its own rule, e.g. a sample).
        self.participation: Participation | None = None
        #: What a sync does: the one round for these options.
        self.round: Round = build_round(self)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` attached the model's shards."""
        return self._outer is not None

    @property
    def outer(self) -> OuterStep:
        """The outer step; raises before :meth:`start`."""
        return required(self._outer, "The federation has not started: call `start(shards, step)` first.")

    @property
    def pending(self) -> PendingSync | None:
        """The sum in flight (started, not landed yet) that started first, if any."""
        in_flight = self.round.in_flight()
        return in_flight[0] if in_flight else None

    def written(self) -> None:
        """Tell the host that the shards were overwritten in place (e.g. to drop caches of gathered weights)."""
        self._on_write()

    def start(
        self,
        shards: Sequence[Tensor],
        step: int,
        on_write: Callable[[], None] | None = None,
        unit_sizes: Sequence[int] | None = None,
    ) -> None:
        """Take the current shards as the anchor (all groups must hold the same weights) at optimizer step ``step``.

        Calling it again with shards of the same layout (the same model's) keeps everything (anchor, outer optimizer
        state, schedule), e.g. after :meth:`load_state_dict` restored them from a checkpoint; only the tensors written
        by later syncs and ``on_write`` are replaced. The shards (FSDP units, in module order) are cut into
        ``config.fragments`` fragments (see :func:`cut_fragments`).

        Args:
            shards: This rank's local shards, updated in place by training.
            step: The optimizer step training starts from.
            on_write: Called after the shards were overwritten in place, e.g. to drop caches of gathered weights.
            unit_sizes: What the fragments are balanced by, one size per shard; default: the shards' numels. Give the
                whole parameters' sizes when local shards are uneven (FSDP2), so that every in-group position cuts
                the model at the same parameters.

        Raises:
            ValueError: If the model has fewer FSDP units than ``config.fragments``.
        """
        self._on_write = on_write or _nothing
        if self._outer is not None and _same_layout(self._outer.shards, shards):
            # The same parameters: FSDP2 hands out new `to_local()` views, and loading a state dict may move its
            # shards to new memory, so the outer step writes to the tensors given last.
            self._outer.shards = list(shards)
            return
        anchor_device = "cpu" if self.config.anchor_device == "cpu" else None
        self._outer = OuterStep(
            shards,
            self.config.outer_optimizer_factory,
            self.communicator,
            anchor_device=anchor_device,
            on_nonfinite=self.config.on_nonfinite,
            fragments=cut_fragments(unit_sizes or [s.numel() for s in shards], self.config.fragments),
            reducer=self.config.reducer,
        )
        self.last_synced_step = self.last_step = step
        self.landed_at = [step] * self.config.fragments
        self.participation = build_participation(self.config, self.communicator, self._landed)

    def restart(
        self,
        shards: Sequence[Tensor],
        step: int,
        on_write: Callable[[], None] | None = None,
        unit_sizes: Sequence[int] | None = None,
    ) -> None:
        """Start afresh from the current shards: a new anchor, a fresh outer optimizer state, a schedule from ``step``.

        For weights that did not come out of this federation (a model loaded from a file, a checkpoint of another
        layout): every group must hold them. Sums in flight are awaited and dropped first (collective), so no round
        lands a pseudo-gradient of the weights that were replaced. Before :meth:`start` this is :meth:`start`.
        """
        if self._outer is not None:
            self.finish_pending()
            self._outer = None
            self.consensus_distance = None
            self.round = build_round(self)
        self.start(shards, step, on_write=on_write, unit_sizes=unit_sizes)

    def trains(self, step: int) -> bool:
        """Whether this group trains optimizer step ``step`` (1-based); the participation rule decides (a pace)."""
        rule = self.participation
        return rule is None or rule.trains(self.communicator.group_index, step)

    def is_due(self, step: int) -> bool:
        """Whether a sync lands after optimizer step ``step`` (not handled yet).

        ``step`` counts real optimizer steps, so gradient accumulation and repeated hook calls for the same step
        never trigger twice.
        """
        return step > self.last_step and self.round.is_due(step)

    def maybe_sync(self, step: int) -> SyncStats | None:
        """Everything the schedule asks for after optimizer step ``step``; collective.

        Lands what is due (waits for its sum, outer step, merge) and starts what the round overlaps with training
        (with ``sync_delay > 0`` the sum of the fragment that lands ``sync_delay`` steps later). A step already handled
        is ignored.

        Returns:
            The statistics of the sync that landed, or ``None``.

        Raises:
            NonFiniteOuterGradientError: See :class:`~lightning_fedshard.core.step.outer.OuterStep`.
        """
        if step <= self.last_step:
            return None
        stats = self.round.after_step(step)
        self.last_step = step
        if self.participation is not None:
            self.participation.after_step(step, self.trains(step))
        return stats if stats is None or self.annotate_stats is None else self.annotate_stats(stats)

    def _landed(self, fragment: int) -> int:
        return self.landed_at[fragment]

    def heal_state(self) -> dict[str, Any]:
        """This rank's federation state for a group that joins or fell behind: outer state, schedule, sync, round.

        The round's state holds e.g. the sums in flight with eager updates (completed before the quorum). Safe to call
        from another thread while this rank waits for the other groups (no collective); the tensors are the
        federation's own: copy them before sending.
        """
        outer = self.outer
        return {
            "outer": outer.state_dict(),
            "schedule": {
                "last_synced_step": self.last_synced_step,
                "last_step": self.last_step,
                "landed_at": list(self.landed_at),
            },
            "sync": outer.syncing,
            "round": self.round.state_dict(),
            "participation": rules_state(self.participation),
        }

    @torch.no_grad()
    def load_heal_state(self, state: dict[str, Any]) -> tuple[SyncKind, int] | None:
        """Take a peer's :meth:`heal_state`: its anchor, outer state and schedule; every shard becomes the anchor.

        The round takes the peer's state (e.g. its sums in flight) and starts from the anchor. This group's
        error-feedback residuals are left as they are.

        Returns:
            The sync the peer was in (its kind and step), if any: :meth:`take_part` joins it.
        """
        outer = self.outer
        outer.load_state_dict(state["outer"])
        schedule = state["schedule"]
        self.last_synced_step, self.last_step = int(schedule["last_synced_step"]), int(schedule["last_step"])
        self.landed_at = [int(s) for s in schedule["landed_at"]]
        self.round.load_state_dict(state.get("round", {}))
        load_rules_state(self.participation, state.get("participation"))
        outer.copy_anchor_to_shards()
        self.round.restart_from_anchor()
        self._on_write()
        sync = state["sync"]
        return None if sync is None else SyncKind.from_marker(sync)

    def take_part(self, step: int, sync: tuple[SyncKind, int] | None) -> SyncStats | None:
        """Take part in the sync the other groups are in, adding nothing to it (a group that just joined); collective.

        Args:
            step: This group's optimizer step.
            sync: The peers' sync (its kind and step, from :meth:`load_heal_state`); ``None`` if every group is
                joining: the sync is then only a change of members (nothing is summed, every group keeps its weights).

        Returns:
            The statistics of the sync, or ``None`` if it lands later (``sync_delay > 0``).
        """
        if sync is None:
            return self.outer.step(step)
        kind, step = sync
        stats = self.round.take_part(kind, step)
        self.last_step = step
        return stats

    def finish(self, step: int) -> SyncStats | None:
        """End of training after optimizer step ``step``: every group ends with the consensus; collective.

        What that takes is the round's (see its ``finish``): e.g. a sum still in flight is dropped and every fragment
        that did not land at ``step`` takes one synchronous outer step; with eager updates every fragment lands its
        sum in flight and syncs what it trained since.

        Returns:
            The statistics of the last of these syncs, or ``None`` if none was needed.
        """
        if not self.started:
            return None
        synced = self.round.finish(step)
        self.last_step = max(self.last_step, step)
        return combined(synced, self.config.fragments)

    def finish_pending(self) -> None:
        """Await the sums in flight, if any, and forget them; collective (every rank started them)."""
        self.round.forget_in_flight()

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Temporarily load the consensus into the shards, e.g. for validation between syncs.

        The consensus is the round's: the anchor; with eager updates the anchor each fragment will have once its sum
        in flight has landed; with a hierarchical or mixing outer topology the exact mean over all groups of their
        current weights (a float32 all-reduce over the fed ring).

        With a single group there is nothing to agree on: its current weights are the consensus and stay in place
        (so a one-group run validates and saves what plain FSDP would).
        """
        if self._outer is None or (not self.groups_may_join and len(self.communicator.participants()) == 1):
            yield
            return
        saved = [s.detach().clone() for s in self._outer.shards]
        self.round.load_consensus()
        self._on_write()
        try:
            yield
        finally:
            with torch.no_grad():
                for shard, local in zip(self._outer.shards, saved):
                    shard.copy_(local)
            self._on_write()

    def state_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds for the federation: anchor, outer optimizer state, error-feedback residuals.

        All zero before :meth:`start`.
        """
        if self._outer is None:
            return {"anchor": 0, "outer_optimizer": 0, "residuals": 0}
        return {"eager_offsets": 0, **self._outer.state_nbytes(), **self.round.state_nbytes()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's federation state: outer step, schedule and the sums in flight (completed)."""
        return {
            "outer": self.outer.state_dict() if self._outer else None,
            "last_synced_step": self.last_synced_step,
            "last_step": self.last_step,
            "landed_at": list(self.landed_at),
            "pending": None,
            "eager": {},
            "participation": rules_state(self.participation),
            **self.round.state_dict(),
            **{name: save() for name, (save, _) in self.extra_state.items()},
        }

    def group_state_dict(self) -> dict[str, Any]:
        """This rank's state that differs between groups (error-feedback residuals, eager offsets).

        Sums in flight update the residuals from the background thread, so they are completed first.
        """
        self.round.await_in_flight()
        if self._outer is None:
            return {}
        return {
            "offsets": [None] * len(self._outer.fragments),
            **self._outer.group_state_dict(),
            **self.round.group_state_dict(),
        }

    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`group_state_dict`."""
        if self._outer is not None:
            self._outer.load_group_state_dict(state)
            self.round.load_group_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the federation must already be started on the same shards layout.

        A state written by an older version is upgraded first (:mod:`lightning_fedshard.checkpoint.upgrades`).
        """
        if state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
        self.last_synced_step = int(state["last_synced_step"])
        self.last_step = int(state["last_step"])
        self.landed_at = [int(s) for s in state["landed_at"]]
        for name, (_, load) in self.extra_state.items():
            if state.get(name) is not None:
                load(state[name])
        load_rules_state(self.participation, state.get("participation"))
        self.round.load_state_dict(state)


def _nothing() -> None:
    pass


def _same_layout(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """As many tensors, pairwise of the same shape, dtype and device (the local shards of the same model)."""

    def key(t: Tensor) -> tuple:
        return t.shape, t.dtype, t.device

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))
