"""One rank's connection to an elastic federation: its place, its torchft manager and the fed rings the manager builds.

The manager starts only after the lighthouse's status page showed that this job may join (:meth:`check_lighthouse`),
heartbeats under the group's name while it runs, and keeps torchft's counters (the federation's step) across a stop
and a restart, and in checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_fedshard.core.options.elastic import Elastic, FederationEnded, FederationError
from lightning_fedshard.elastic.heal import heal_transport
from lightning_fedshard.elastic.lighthouse import (
    TrainedFederation,
    gone_from,
    managers_of,
    refusal_on,
    second_start,
    status_page,
    trained_federation,
)
from lightning_fedshard.elastic.quiet import quiet_torchft
from lightning_fedshard.elastic.rings import QuorumRecorder, fed_rings
from lightning_fedshard.elastic.torchft_api import heal_server, http_transport_class, manager_class, wrap_quorum_client
from lightning_fedshard.elastic.watchdog import GroupWatchdog

__all__ = ["ManagerConnection"]


class ManagerConnection:
    """This rank's torchft manager and fed rings, under this group's place in the federation.

    Args:
        options: The elastic options.
        group: This group's index; ``None`` for a standby until it takes a place.
        num_groups: The groups the federation is planned for: a lighthouse that waits for more per quorum is refused.
        send: What this rank sends a peer that heals (called on torchft's thread).
        receive: Called with what a peer sent when this group heals.
    """

    def __init__(
        self,
        options: Elastic,
        group: int | None,
        num_groups: int | None,
        send: Callable[[], dict[str, Any]],
        receive: Callable[[dict[str, Any]], None],
    ) -> None:
        self.options = options
        self.num_groups = num_groups
        #: This group's index, ``None`` for a standby without a place.
        self.group = group
        #: torchft's manager while connected, else ``None``.
        self.manager: Any = None
        #: The fed rings of the last manager started (see :func:`~lightning_fedshard.elastic.rings.fed_rings`).
        self.rings: Any = None
        #: This federation as the lighthouse showed it before the manager started, if it trained already.
        self.trained: TrainedFederation | None = None
        self._send, self._receive = send, receive
        self._watchdog: GroupWatchdog | None = None
        self._manager_state: dict[str, int] | None = None
        self._transport: Any = None

    @property
    def group_index(self) -> int:
        """This group's index.

        Raises:
            FederationError: For a standby that has not taken a place yet.
        """
        if self.group is None:
            raise FederationError(
                "This standby group has no index yet: it takes one when a group of the federation is gone (`stand_by`)."
            )
        return self.group

    def connect(self) -> Any:
        """Start this rank's torchft manager (rank 0 of the group also hosts the group's manager server)."""
        if self.manager is not None:
            return self.manager
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's native side logs every quorum at INFO otherwise
        quiet_torchft()
        options = self.options
        self.check_lighthouse()
        timeout = timedelta(seconds=options.timeout)
        self.rings = fed_rings(timeout)
        transport = http_transport_class()
        self._transport = heal_transport(transport, timeout, options.hostname, options.federation_secret())
        manager = manager_class()(
            pg=self.rings,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=options.min_groups,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timedelta(seconds=options.connect_timeout),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            lighthouse_addr=options.lighthouse_address(),
            replica_id=f"{options.federation}_{self.group_index}",
            port=options.manager_port,
            hostname=options.hostname or _hostname(),
            checkpoint_transport=self._transport,
            max_retries=options.max_failures,
            quorum_retries=options.quorum_retries,
        )
        manager.register_state_dict_fn("fedshard", self._receive, self._send)
        # torchft rebuilds its process groups when the quorum id changes, and a restarted lighthouse counts ids from
        # the start again: the quorum's step, recorded here, keeps the rendezvous of every rebuilt ring apart from an
        # earlier one of the same id (FedRings.configure).
        wrap_quorum_client(manager, lambda client: QuorumRecorder(client, self.rings))
        if self._manager_state is not None:
            manager.load_state_dict(self._manager_state)
        self.manager = manager
        if dist.get_world_size() > 1:
            self._watchdog = GroupWatchdog(options.group_timeout)
            self._watchdog.start()
        return manager

    def check_lighthouse(self) -> None:
        """Refuse to join a lighthouse that serves another federation, or whose federation of this name is over.

        Read from the lighthouse's status page before any quorum (rank 0 reads it for the whole group, so that the
        group decides as a unit). Groups of two federations on one lighthouse would otherwise take turns in its
        quorums, each group syncing with whoever asked at the same moment. A job that holds no state of its
        federation (step 0: no checkpoint) and finds that federation trained on this lighthouse, none of its groups
        alive, would otherwise start it again from step 0 on its own; if some are alive it joins and heals, and the
        admission check refuses it if they ended before it reached them.

        Raises:
            FederationEnded: For a standby whose federation is over.
            FederationError: For a federation that is over or a lighthouse that refuses this job.
        """
        address = self.options.lighthouse_address()
        page = [status_page(address) if dist.get_rank() == 0 else ""]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(page, src=0)
        self.trained = None if self.step > 0 else trained_federation(page[0], self.options.federation)
        if self.trained is not None and not self.trained.alive:
            self.close()
            if self.options.standby:
                self.group = None
                raise FederationEnded("the federation ended as this standby took a place in it")
            when = "none of its groups is running"
            raise FederationError(second_start(self.trained, self.group_index, address, when))
        refused = refusal_on(page[0], address, self.options.federation, self.group, self.num_groups)
        if refused is not None:
            self.close()
            raise FederationError(refused)

    @property
    def step(self) -> int:
        """Syncs (and changes of members) this group committed, as torchft counts them."""
        if self.manager is not None:
            return int(self.manager.current_step())
        return int((self._manager_state or {}).get("step", 0))

    def state_dict(self) -> dict[str, int]:
        """Torchft's counters of this group (kept in checkpoints, so a restarted federation agrees on its step)."""
        if self.manager is not None:
            return dict(self.manager.state_dict())
        return dict(self._manager_state or {"step": 0, "batches_committed": 0})

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict` (applied when the manager connects, if it has not yet)."""
        self._manager_state = {"step": int(state["step"]), "batches_committed": int(state.get("batches_committed", 0))}
        if self.manager is not None:
            self.manager.load_state_dict(self._manager_state)

    def gone_groups(self) -> tuple[int, ...]:
        """The other groups of the current ring that the lighthouse counts as gone (their heartbeats stopped).

        Read from the lighthouse's status page; an unreadable page counts nobody as gone.
        """
        members, federation = getattr(self.rings, "members", ()), self.options.federation
        managers = managers_of(getattr(self.rings, "member_ids", ()), federation)
        page = status_page(self.options.lighthouse_address(), timeout=max(1.0, self.options.peer_check))
        return tuple(g for g in gone_from(page, federation, members, managers) if g != self.group)

    @property
    def heal_server(self) -> Any:
        """This rank's heal server (the transport's ``http.server`` server) while connected, else ``None``."""
        return None if self.manager is None or self._transport is None else heal_server(self._transport)

    @property
    def heal_address(self) -> str | None:
        """Where this rank's heal server is reached (``http://host:port/checkpoint/``), while connected."""
        return None if self.manager is None or self._transport is None else str(self._transport.address())

    def close(self) -> None:
        """Stop the manager (its heartbeats end, the others stop waiting for it), keeping its counters."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.manager is not None:
            self._manager_state = dict(self.manager.state_dict())
            self.manager.shutdown(wait=False)
            self.manager = None

    def leave_place(self) -> None:
        """Stop the manager and give up this group's place and counters (a standby that lost a contested place).

        Rank 0 first removes what it published about the manager in the group's store: the next manager's ranks must
        not find this one's address.
        """
        if dist.get_rank() == 0:
            _forget_manager(self.manager)
        self.close()
        self.group, self._manager_state = None, None

    def manager_uuid(self) -> str:
        """The uuid torchft appended to this group's replica id (this manager's, among a place's claimants)."""
        return _manager_uuid(self.manager)


def _forget_manager(manager: Any) -> None:
    """Remove what torchft 0.2.0's rank 0 published about its manager in the group's store (its address and id).

    A new manager of the same job publishes them again; until it has, the other ranks wait for the keys instead of
    reading the old manager's address and failing to connect to a server that is gone.
    """
    for key in ("manager_addr", "replica_id"):
        manager._store.delete_key(key)


def _manager_uuid(manager: Any) -> str:
    """The uuid torchft 0.2.0 appended to this group's replica id (rank 0 publishes the id in the group's store)."""
    return str(manager._store.get("replica_id").decode()).rpartition(":")[2]


def _hostname() -> str:
    import socket

    return socket.gethostname()
