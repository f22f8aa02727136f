"""An elastic group's membership of its federation: it joins, heals from a peer, and follows the groups of each sync.

The federation exposes its state for healing (:meth:`~lightning_fedshard.core.federation.Federation.heal_state`,
:meth:`~lightning_fedshard.core.federation.Federation.load_heal_state`); :class:`ElasticMembership` registers it
with the communicator the way torchft's algorithms register theirs (a save and a load function), adds this group's
step and the host's state (e.g. the Trainer's loops), and ties the federation's hooks to the elastic communicator:
the statistics of each sync name its groups and the time spent healing, checkpoints keep the groups and torchft's
counters, and a change of groups resets the error-feedback residuals (their chunks are laid out over the ring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.options.elastic import FederationError
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind
from lightning_fedshard.elastic.communicator import ElasticCommunicator
from lightning_fedshard.elastic.heal import cloned


class ElasticMembership:
    """Joins ``federation`` to the other groups through ``communicator``, and heals it when it falls behind.

    Args:
        federation: This rank's federation, over ``communicator``.
        communicator: This rank's elastic communicator.
    """

    def __init__(self, federation: Federation, communicator: ElasticCommunicator) -> None:
        self.federation = federation
        self.communicator = communicator
        #: The groups of the last sync, in ring order.
        self.members: tuple[int, ...] = ()
        #: What the host (the strategy) adds to the state a joining group receives, and how it applies it (with the
        #: peer's optimizer step).
        self.host_state: Callable[[], Any] | None = None
        self.load_host_state: Callable[[int, Any], None] | None = None
        #: The sync the peers were in when this group last healed (``(fragment, step)``), if any.
        self.peer_sync: tuple[SyncKind, int] | None = None
        self._joining_at: int | None = None
        communicator.set_heal(self._heal_state, self._apply_heal)
        communicator.on_new_members = self._on_new_members
        federation.annotate_stats = self.annotate
        federation.groups_may_join = True
        federation.extra_state["members"] = (self._save_members, self._load_members)
        federation.extra_state["membership"] = (communicator.state_dict, communicator.load_state_dict)

    def join(self, step: int) -> tuple[int, SyncStats | None]:
        """Enter the federation at optimizer step ``step``; collective with the groups of the quorum.

        Takes the next quorum as a joining group. If a peer was ahead, this group heals (its anchor, outer state,
        schedule and the host's state become the peer's, its shards the anchor) and then does what the peers do at
        that point: the sync they are in, to which it adds nothing. If every group is joining (a new federation, or
        all of one restarting from checkpoints) the quorum is only a change of members: nothing is summed and every
        group keeps its weights. A join that is not committed is tried again at the next quorum.

        Returns:
            The optimizer step training continues from (the peers' when this group healed) and the statistics of the
            sync this group took part in, if any.

        Raises:
            FederationError: If ``max_failures`` joins in a row were not committed, or as
                :meth:`ElasticCommunicator.quorum` raises.
        """
        communicator = self.communicator
        for _ in range(communicator.options.max_failures):
            self._joining_at, self.peer_sync = step, None
            try:
                communicator.quorum(joining=True)
            finally:
                self._joining_at = None
            stats = self.federation.take_part(step, self.peer_sync)
            if self.peer_sync is not None:
                step = self.peer_sync[1]
            if stats is None or not stats.lost:
                return step, None if stats is None else self.annotate(stats)
        attempts = communicator.options.max_failures
        raise FederationError(
            f"Elastic group {communicator.group_index} could not join the federation: {attempts} attempts in a row"
            " were not committed."
        )

    def annotate(self, stats: SyncStats) -> SyncStats:
        """``stats`` with the groups of the sync and the time spent healing."""
        extra = {**stats.extra, "groups": float(len(self.members))}
        if self.communicator.last_heal_seconds is not None:
            extra["heal_seconds"] = self.communicator.last_heal_seconds
        return replace(stats, extra=extra)

    def _heal_state(self) -> dict[str, Any]:
        """What a joining or lagging peer receives from this rank (torchft's thread; this rank waits in a quorum)."""
        state = self.federation.heal_state()
        sync = state["sync"]  # a marker of the sync this rank waits in: (kind, fragment, step)
        step = sync[2] if sync is not None else self._joining_at
        host = self.host_state() if self.host_state is not None else None
        return cloned({**state, "step": step, "host": host})

    def _apply_heal(self, state: dict[str, Any]) -> None:
        """Take a peer's state (training thread, inside a quorum): every shard becomes the healed anchor."""
        self.peer_sync = self.federation.load_heal_state(state)
        self._reset_residuals()
        if self.load_host_state is not None:
            self.load_host_state(int(state["step"]), state["host"])

    def _on_new_members(self, members: tuple[int, ...]) -> None:
        """The groups of a sync changed: residuals laid out over the old ring cannot be carried on."""
        if self.members and members != self.members:
            self._reset_residuals()
        self.members = members

    def _reset_residuals(self) -> None:
        if self.federation.started:
            for reducer in self.federation.outer.reducers:
                reducer.reset_residual()

    def _save_members(self) -> list[int]:
        return list(self.members)

    def _load_members(self, members: list[int]) -> None:
        self.members = tuple(int(g) for g in members)


__all__ = ["ElasticMembership"]
