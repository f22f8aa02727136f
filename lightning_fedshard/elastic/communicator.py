"""One rank's collectives in an elastic group: the communicator on torchft.

It implements :class:`~lightning_fedshard.core.transport.comm.Communicator` with torchft's Manager and process groups.

Per sync:

1. :meth:`ElasticCommunicator.participants` asks for a quorum (a group that is behind receives the state registered
   with :meth:`ElasticCommunicator.set_heal` from a peer), then the groups exchange a small description of themselves
   (federation name, model layout, sync options): a job that does not belong is refused before any pseudo-gradient
   moves, and the others ask again without it;
2. the sum over the fed ring runs on torchft's process group; a group that healed at this sync (or is still joining)
   sends zeros and is left out of the mean (:attr:`~lightning_fedshard.core.step.outer.PendingSync.joined`); a failed
   collective is recorded, not raised, and every later collective of the sync is skipped;
3. :meth:`ElasticCommunicator.should_commit` is torchft's vote: a group that saw an error does not apply the sync and
   goes back to the anchor; at its next quorum it is behind and heals.

torchft is imported when the communicator connects, so this module imports without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.core.options.elastic import Elastic, FederationError
from lightning_fedshard.core.transport.comm import ProcessGroupCommunicator, weighted_sum
from lightning_fedshard.elastic.admission import Admission
from lightning_fedshard.elastic.collectives import RingCollectives
from lightning_fedshard.elastic.connection import ManagerConnection
from lightning_fedshard.elastic.lighthouse import reachable
from lightning_fedshard.elastic.quorum import MembershipChange, membership_change
from lightning_fedshard.elastic.standby import wait_for_place

log = logging.getLogger(__name__)

HealSave = Callable[[], dict[str, Any]]
HealLoad = Callable[[dict[str, Any]], None]


class ElasticCommunicator:
    """The :class:`~lightning_fedshard.core.transport.comm.Communicator` of one rank of an elastic group, on torchft.

    Collectives inside the group (``sum_in_group``, the replicas' gather) run on the job's own mesh; the fed ring is
    torchft's reconfigurable gloo process group, rebuilt by the manager whenever the groups of a quorum change, with
    a second ring beside it for the training thread's statistics.

    Args:
        options: The elastic options.
        group: This group's index; ``None`` for a standby until :meth:`stand_by` took a place.
        local: The job's own communicator (one group: the in-group collectives).
        describe: This rank's description for the admission check: a JSON-able dict of what must be equal in every
            group at this in-group position (model layout, sync options); called once per new quorum.
        site_blocks: By block size, the sites of a hierarchical outer topology: the planned groups of each (see
            :meth:`~lightning_fedshard.core.options.outer_topology.Hierarchical.site_blocks`); empty without one.
        num_groups: The groups the federation is planned for: a lighthouse that waits for more per quorum is refused.
    """

    #: Sites sum over the whole fed ring, a row per site (see :meth:`sum_over_site`), not over process groups of their
    #: own: the statistics count their bytes so.
    sums_sites_on_fed_ring = True
    #: A mix's messages travel by one all-gather over the live ring (see :meth:`mix_over_groups`), to every group.
    mixes_by_all_gather = True

    def __init__(
        self,
        options: Elastic,
        group: int | None,
        local: ProcessGroupCommunicator,
        describe: Callable[[], Mapping[str, Any]],
        site_blocks: Mapping[int, Sequence[Sequence[int]]] | None = None,
        num_groups: int | None = None,
    ) -> None:
        self.options = options
        self.num_groups = num_groups
        self.site_blocks = {size: tuple(tuple(b) for b in blocks) for size, blocks in (site_blocks or {}).items()}
        self._local = local
        self._connection = ManagerConnection(options, group, num_groups, self._send, self._receive)
        self._collectives = RingCollectives(self._connection)
        self._admission = Admission(self._connection, self._collectives, describe)
        self._ring: tuple[int, ...] = ()
        self._taken = False  # a quorum taken by `quorum()` that the next `participants()` uses
        self._joined = False
        self._last_quorum_id: int | None = None
        self._restart_grace: float | None = None
        self._save: HealSave | None = None
        self._load: HealLoad | None = None
        self._healed: dict[str, Any] | None = None
        #: Called with the new groups whenever the groups of a sync differ from the previous sync's.
        self.on_new_members: Callable[[tuple[int, ...]], None] | None = None
        #: Called with what changed whenever a group joined, healed or left at a quorum (for the log).
        self.on_membership: Callable[[MembershipChange], None] | None = None
        #: Seconds the last heal took (receiving and loading the state), ``None`` if the last quorum healed nothing.
        self.last_heal_seconds: float | None = None
        #: The seam for fault injection and tracing: each is called with the collective's name (``"sum_over_groups"``
        #: or ``"all_to_all"``) as a sum over the groups starts, in the thread that runs it (the benchmarks stop a
        #: group inside a sum through it).
        self.on_sum: list[Callable[[str], None]] = []

    # -- the seam ---------------------------------------------------------------------------------------------

    @property
    def group_index(self) -> int:
        """This group's index (the ring lists groups by index).

        Raises:
            FederationError: For a standby that has not taken a place yet.
        """
        return self._connection.group_index

    @property
    def heal_address(self) -> str | None:
        """Where this rank's heal server is reached (``http://host:port/checkpoint/``), while connected."""
        return self._connection.heal_address

    @property
    def heal_server(self) -> Any:
        """This rank's heal server while connected (an ``http.server`` server), for fault injection and tracing."""
        return self._connection.heal_server

    @property
    def place(self) -> int | None:
        """This group's index, or ``None`` for a standby that has not taken a place yet."""
        return self._connection.group

    @property
    def num_replicas(self) -> int:
        """The replicas of this rank's shard inside its group."""
        return self._local.num_replicas

    @property
    def replica_index(self) -> int:
        """This rank's place among them."""
        return self._local.replica_index

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        """Inside the job: the replicas' all-gather."""
        self._local.gather_replicas(output, input)

    def sum_in_group(self, tensor: Tensor) -> None:
        """Inside the job: the all-reduce over this replica's shards."""
        self._local.sum_in_group(tensor)

    def participants(self) -> tuple[int, ...]:
        """The groups of this sync, in ring order: the quorum taken by :meth:`quorum`, or a new one."""
        if not self._taken:
            self.quorum()
        self._taken = False
        return self._ring

    def joined(self) -> bool:
        """Whether this group healed at the last quorum, or took it to join the federation."""
        return self._joined

    def sum_over_groups(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the fed ring, a large tensor in parts in flight together; zeros after a failure."""
        for hook in self.on_sum:
            hook("sum_over_groups")
        self._collectives.sum(tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the statistics ring; zeros after a failure."""
        self._collectives.sum_stats(tensor)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """``alltoall_base`` over the fed ring (equal parts); zeros after a failure."""
        for hook in self.on_sum:
            hook("all_to_all")
        if len(self._ring) == 1:
            output.copy_(input)
            return
        self._collectives.all_to_all(output, input)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the fed ring; zeros after a failure."""
        if len(self._ring) == 1:
            output.copy_(input)
            return
        self._collectives.all_gather(output, input)

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """Sum over this group's site of ``size`` planned groups, on the fed ring; zeros after a failure.

        The fed ring changes with every quorum, so sites have no process groups of their own: each group writes its
        tensor into its site's row of a ``[sites, numel]`` zero tensor, one all-reduce over the ring adds every row,
        and the group keeps its site's. A group that is gone adds nothing to its row.

        Raises:
            ValueError: If the outer topology has no sites of ``size`` groups.
        """
        blocks = self.site_blocks.get(size)
        if blocks is None:
            raise ValueError(
                f"The elastic federation has no sites of {size} groups (it has {sorted(self.site_blocks)})."
            )
        (row,) = [i for i, block in enumerate(blocks) if self.group_index in block]
        rows = torch.zeros(len(blocks), tensor.numel(), dtype=tensor.dtype, device=tensor.device)  # (sites, numel)
        rows[row].copy_(tensor.reshape(-1))
        self.sum_over_groups(rows.view(-1))
        tensor.copy_(rows[row].view_as(tensor))

    def mix_over_groups(
        self, tensor: Tensor, matrix: Tensor, decode: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """``sum_j matrix[p, j] decode(tensor_j)`` over the live groups, ``p`` this group's position in ring order.

        The ring changes with every quorum, so every group's message travels by one all-gather over it (each group
        sends its message to every other; the terms are added in ring order). After a failure the result is garbage
        and the sync's vote fails.
        """
        me = self._ring.index(self.group_index)
        gathered = torch.empty((len(self._ring), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self.all_gather(gathered.view(-1), tensor.reshape(-1))
        terms = {j: gathered[j] for j in range(len(self._ring)) if j == me or matrix[me, j] > 0}
        return weighted_sum(terms, matrix[me], decode)

    def should_commit(self) -> bool:
        """Torchft's vote: ``False`` on every rank of this group if any of them saw an error in this sync.

        Raises:
            FederationError: After ``max_failures`` syncs in a row that did not commit.
        """
        try:
            manager = self._connection.manager
            committed = bool(manager.should_commit(timeout=timedelta(seconds=self.options.timeout)))
        except RuntimeError as error:
            few = len(self._ring) < self.options.min_groups
            reason = (
                f"only {len(self._ring)} group(s) took part, fewer than `min_groups={self.options.min_groups}`"
                if few
                else f"the last error: {self._error_text()}"
            )
            raise FederationError(
                f"Elastic group {self.place} could not commit {self.options.max_failures + 1} syncs in a row"
                f" ({reason}); it stops instead of retrying forever. Restart it to join again."
            ) from error
        if not committed:
            log.warning(f"Elastic group {self.place}: the sync was not committed ({self._error_text()}).")
        return committed

    # -- elastic ----------------------------------------------------------------------------------------------

    def set_heal(self, save: HealSave, load: HealLoad) -> None:
        """What a peer sends this group when it heals (``save`` runs on torchft's thread), and how it is applied.

        ``save`` must return tensors that nothing changes later (copies) and run no collective; ``load`` runs in the
        training thread, inside :meth:`participants` (or :meth:`quorum`).
        """
        self._save, self._load = save, load

    def stand_by(self, num_groups: int, poll: float = 0.5) -> int | None:
        """A standby's wait until a planned group of the running federation is gone, then take its place; collective.

        See :func:`~lightning_fedshard.elastic.standby.wait_for_place`.

        Returns:
            The index taken, or ``None`` if the federation ended (it trained, and none of its groups is alive) while
            this standby waited.
        """
        if self.place is not None:
            return self.place
        return wait_for_place(self, num_groups, poll)

    def take_place(self, place: int) -> None:
        """Take group ``place`` and start its manager, which heartbeats under the group's name (a standby).

        Raises:
            FederationEnded: If the federation ended as this job took the place.
        """
        self._connection.group = place
        self._connection.connect()

    def give_up_place(self, why: str) -> None:
        """Leave the place just taken (another standby took it too), saying ``why`` on rank 0; the manager stops."""
        if dist.get_rank() == 0:
            log.warning(why)
        self._connection.leave_place()
        self._admission.forget()

    def manager_uuid(self) -> str:
        """The uuid torchft appended to this group's replica id (this manager's, among a place's claimants)."""
        return self._connection.manager_uuid()

    def rank0(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on this group's rank 0, the same answer on every rank of the group; collective."""
        return self._rank0(decide)

    def _rank0(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on this group's rank 0, the same answer on every rank of the group."""
        answer = [decide() if dist.get_rank() == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        return answer[0]

    def quorum(self, joining: bool = False) -> tuple[int, ...]:
        """Ask the lighthouse for this sync's groups (the next :meth:`participants` returns them); collective.

        A group that is behind receives the federation's state from a peer and applies it before this returns.
        With ``joining=True`` this group presents itself one commit behind the state it holds, so that a peer that
        holds as much hands it the federation's current position, and it adds nothing to the sync it takes part in.

        Raises:
            FederationError: If the lighthouse cannot be reached, no quorum forms in ``quorum_timeout`` (fewer than
                ``min_groups`` groups), or this job does not belong to the federation it reached.
        """
        manager = self._connection.connect()
        if joining and manager.current_step() > 0:
            state = manager.state_dict()
            manager.load_state_dict({**state, "step": state["step"] - 1})
        deadline = time.monotonic() + self.options.quorum_timeout
        healed, self.last_heal_seconds = False, None
        while True:
            self._healed, self._collectives.failed = None, False
            started = time.perf_counter()
            try:
                manager.start_quorum(timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
            except Exception as error:  # torchft raises what its RPC raised: timeouts, connection errors
                raise FederationError(self._quorum_failure(error)) from error
            ring = self._connection.rings.members
            if self._lighthouse_restarted(ring, deadline):
                continue  # let the groups that were in the last quorum reach the new lighthouse first
            # Every member exchanges descriptions, a failed heal or not.
            if not self._admission.admits(ring, joining, healing=self._healed is not None):
                continue  # a job that does not belong was in this quorum: ask again without it
            if self._healed is not None:
                assert self._load is not None
                self._load(self._healed)
                healed, self.last_heal_seconds = True, time.perf_counter() - started
                self._healed = None
            if manager.errored() is not None or len(ring) >= self._enough(joining):
                break
            if time.monotonic() > deadline:
                raise FederationError(
                    f"Elastic group {self.place} waited {self.options.quorum_timeout:g} s for at least"
                    f" {self._enough(joining)} group(s), and only {len(ring)} took part: {list(ring)}."
                )
            time.sleep(0.5)  # too few groups (`min_groups`, `start_groups`): ask again
        self._joined = joining or healed or manager.errored() is not None
        if ring != self._ring and self.on_new_members is not None:
            self.on_new_members(ring)
        descriptions = self._admission.descriptions
        change = membership_change(self.options.federation, self.group_index, self._ring, ring, descriptions)
        if change is not None and self.on_membership is not None:
            self.on_membership(change)
        self._ring = ring
        self._taken = True
        return ring

    def _lighthouse_restarted(self, ring: tuple[int, ...], deadline: float) -> bool:
        """Whether to ask again because a restarted lighthouse left out groups of the previous quorum.

        A lighthouse keeps its state in memory: a new one (its quorum ids start again) answers the first groups that
        reach it, and groups that are alive but still reconnecting would be left out and fall behind. For up to
        ``timeout`` seconds after a restart, a quorum that misses a member of the previous one is asked again.
        """
        quorum_id, previous = self._connection.rings.quorum_id, self._last_quorum_id
        self._last_quorum_id = quorum_id
        if previous is None or quorum_id is None or quorum_id >= previous or set(self._ring) <= set(ring):
            self._restart_grace = None
            return False
        if self._restart_grace is None:
            self._restart_grace = min(deadline, time.monotonic() + self.options.timeout)
            missing = sorted(set(self._ring) - set(ring))
            log.warning(
                f"Elastic group {self.place}: the lighthouse restarted and the groups {missing} of the last sync are"
                " not back yet; waiting for them."
            )
        if time.monotonic() > self._restart_grace:
            self._restart_grace = None
            self._connection.rings.build_deferred()  # they did not come back: go on without them
            return False
        self._last_quorum_id = previous  # compare the next answer with the quorum before the restart
        time.sleep(0.5)
        return True

    def _enough(self, joining: bool) -> int:
        """The groups a quorum needs: ``min_groups``, or ``start_groups`` while every group of it is joining."""
        if joining and self._admission.all_joining:
            return max(self.options.min_groups, self.options.start_groups or 0)
        return self.options.min_groups

    @property
    def step(self) -> int:
        """Syncs (and changes of members) this group committed, as torchft counts them."""
        return self._connection.step

    def state_dict(self) -> dict[str, int]:
        """Torchft's counters of this group (kept in checkpoints, so a restarted federation agrees on its step)."""
        return self._connection.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict` (applied when the manager connects, if it has not yet)."""
        self._connection.load_state_dict(state)

    def close(self) -> None:
        """Leave the federation: stop the manager (its heartbeats end, the others stop waiting for it)."""
        self._connection.close()
        self._admission.forget()

    # -- internals --------------------------------------------------------------------------------------------

    def _send(self) -> dict[str, Any]:
        """What a peer receives from this rank when it heals (torchft's thread; this rank waits in its quorum)."""
        if self._save is None:
            raise FederationError(f"Elastic group {self.place} was asked for its state before it started.")
        return self._save()

    def _receive(self, state: dict[str, Any]) -> None:
        """Keep a peer's state: it is applied once the quorum is known to hold only this federation's groups."""
        self._healed = state

    def _quorum_failure(self, error: BaseException) -> str:
        address = self.options.lighthouse_address()
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if not reachable(address):
            return (
                f"Elastic group {self.place} lost the lighthouse at {address}: it did not answer within"
                f" {self.options.quorum_timeout:g} s and {self.options.quorum_retries} retries ({cause})."
            )
        return (
            f"Elastic group {self.place} got no quorum within {self.options.quorum_timeout:g} s: fewer groups are"
            f" running than the lighthouse at {address} waits for (its `--min_replicas`), or the others stopped"
            f" ({cause})."
        )

    def _error_text(self) -> str:
        manager = self._connection.manager
        error = manager.errored() if manager is not None else None
        if error is None:
            return "too few groups or a peer's failed vote"
        original = getattr(error, "original_exception", error)
        return f"{type(original).__name__}: {str(original).splitlines()[0] if str(original) else ''}"


__all__ = ["ElasticCommunicator", "HealLoad", "HealSave"]
