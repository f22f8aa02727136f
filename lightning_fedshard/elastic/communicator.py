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
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.core.options.elastic import Elastic, FederationEnded, FederationError
from lightning_fedshard.core.transport.comm import ProcessGroupCommunicator, sum_parts, weighted_sum
from lightning_fedshard.elastic.heal import heal_transport
from lightning_fedshard.elastic.lighthouse import (
    TrainedFederation,
    reachable,
    refusal_on,
    second_start,
    status_page,
    trained_federation,
)
from lightning_fedshard.elastic.quiet import quiet_torchft
from lightning_fedshard.elastic.quorum import (
    DESCRIPTION_BYTES,
    MembershipChange,
    check_members,
    decode_description,
    encode_description,
    membership_change,
)
from lightning_fedshard.elastic.rings import QuorumRecorder, fed_rings, gather_options, sum_options
from lightning_fedshard.elastic.standby import wait_for_place
from lightning_fedshard.elastic.watchdog import GroupWatchdog

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
        self._group = group
        self._local = local
        self._describe = describe
        self._manager: Any = None
        self._rings: Any = None
        self._watchdog: GroupWatchdog | None = None
        self._ring: tuple[int, ...] = ()
        self._checked_quorum: int | None = None
        self._taken = False  # a quorum taken by `quorum()` that the next `participants()` uses
        self._joining = False
        self._joined = False
        self._all_joining = False  # whether every group of the last checked quorum was joining
        self._last_quorum_id: int | None = None
        self._restart_grace: float | None = None
        self._ring_failed = False  # a collective of the current sync failed: skip the rest
        self._save: HealSave | None = None
        self._load: HealLoad | None = None
        self._healed: dict[str, Any] | None = None
        self._manager_state: dict[str, int] | None = None
        self._trained: TrainedFederation | None = None  # this federation as the lighthouse showed it, if it trained
        self._descriptions: list[dict[str, Any]] = []  # of the groups of this quorum (admission check)
        #: Called with the new groups whenever the groups of a sync differ from the previous sync's.
        self.on_new_members: Callable[[tuple[int, ...]], None] | None = None
        #: Called with what changed whenever a group joined, healed or left at a quorum (for the log).
        self.on_membership: Callable[[MembershipChange], None] | None = None
        #: Seconds the last heal took (receiving and loading the state), ``None`` if the last quorum healed nothing.
        self.last_heal_seconds: float | None = None

    # -- the seam ---------------------------------------------------------------------------------------------

    @property
    def group_index(self) -> int:
        """This group's index (the ring lists groups by index).

        Raises:
            FederationError: For a standby that has not taken a place yet.
        """
        if self._group is None:
            raise FederationError("This standby group has no index yet: it takes one when a group of the federation"
                                  " is gone (`stand_by`).")  # fmt: skip
        return self._group

    @property
    def place(self) -> int | None:
        """This group's index, or ``None`` for a standby that has not taken a place yet."""
        return self._group

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
        """All-reduce (sum) over the fed ring, a large tensor in parts in flight together; zeros after a failure.

        As over one job's process groups (:func:`~lightning_fedshard.core.transport.comm.all_reduce`): one gloo ring
        over a large tensor leaves a slow link idle part of the time.
        """
        parts = sum_parts(tensor)
        if parts < 2:
            self._collective(lambda: self._rings.allreduce([tensor], sum_options()), tensor)
            return

        def in_parts() -> _AllWorks:
            return _AllWorks([self._rings.allreduce([part], sum_options()) for part in tensor.view(-1).chunk(parts)])

        self._collective(in_parts, tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the statistics ring; zeros after a failure."""
        self._collective(lambda: self._rings.stats.allreduce([tensor], sum_options()), tensor)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """``alltoall_base`` over the fed ring (equal parts); zeros after a failure."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        if len(self._ring) == 1:
            output.copy_(input)
            return
        self._collective(lambda: self._rings.alltoall_base(output, input, [], [], AllToAllOptions()), output)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the fed ring; zeros after a failure."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if len(self._ring) == 1:
            output.copy_(input)
            return
        work = lambda: self._rings.allgather_into_tensor_coalesced([output], [input], AllgatherOptions())  # noqa: E731
        self._collective(work, output)

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
            committed = bool(self._manager.should_commit(timeout=timedelta(seconds=self.options.timeout)))
        except RuntimeError as error:
            few = len(self._ring) < self.options.min_groups
            reason = (
                f"only {len(self._ring)} group(s) took part, fewer than `min_groups={self.options.min_groups}`"
                if few
                else f"the last error: {self._error_text()}"
            )
            raise FederationError(
                f"Elastic group {self._group} could not commit {self.options.max_failures + 1} syncs in a row"
                f" ({reason}); it stops instead of retrying forever. Restart it to join again."
            ) from error
        if not committed:
            log.warning(f"Elastic group {self._group}: the sync was not committed ({self._error_text()}).")
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
        if self._group is not None:
            return self._group
        return wait_for_place(self, num_groups, poll)

    def take_place(self, place: int) -> None:
        """Take group ``place`` and start its manager, which heartbeats under the group's name (a standby).

        Raises:
            FederationEnded: If the federation ended as this job took the place.
        """
        self._group = place
        self._connect()

    def give_up_place(self, why: str) -> None:
        """Leave the place just taken (another standby took it too), saying ``why`` on rank 0; the manager stops."""
        if dist.get_rank() == 0:
            log.warning(why)
            _forget_manager(self._manager)  # the next manager's ranks must not find this one's address
        self.close()
        self._group, self._manager_state = None, None

    def manager_uuid(self) -> str:
        """The uuid torchft appended to this group's replica id (this manager's, among a place's claimants)."""
        return _manager_uuid(self._manager)

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
        manager = self._connect()
        if joining and manager.current_step() > 0:
            state = manager.state_dict()
            manager.load_state_dict({**state, "step": state["step"] - 1})
        self._joining = joining
        deadline = time.monotonic() + self.options.quorum_timeout
        healed, self.last_heal_seconds = False, None
        while True:
            self._healed, self._ring_failed, self._descriptions = None, False, []
            started = time.perf_counter()
            try:
                manager.start_quorum(timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
            except Exception as error:  # torchft raises what its RPC raised: timeouts, connection errors
                raise FederationError(self._quorum_failure(error)) from error
            ring = self._rings.members
            if self._lighthouse_restarted(ring, deadline):
                continue  # let the groups that were in the last quorum reach the new lighthouse first
            if self._rings.quorum_id != self._checked_quorum:  # every member exchanges, a failed heal or not
                if not self._admitted(ring):
                    continue  # a job that does not belong was in this quorum: ask again without it
                if not self._ring_failed:
                    self._checked_quorum = self._rings.quorum_id
            if self._healed is not None:
                assert self._load is not None
                self._load(self._healed)
                healed, self.last_heal_seconds = True, time.perf_counter() - started
                self._healed = None
            if manager.errored() is not None or len(ring) >= self._enough(joining):
                break
            if time.monotonic() > deadline:
                raise FederationError(
                    f"Elastic group {self._group} waited {self.options.quorum_timeout:g} s for at least"
                    f" {self._enough(joining)} group(s), and only {len(ring)} took part: {list(ring)}."
                )
            time.sleep(0.5)  # too few groups (`min_groups`, `start_groups`): ask again
        self._joined = joining or healed or manager.errored() is not None
        if ring != self._ring and self.on_new_members is not None:
            self.on_new_members(ring)
        change = membership_change(self.options.federation, self.group_index, self._ring, ring, self._descriptions)
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
        quorum_id, previous = self._rings.quorum_id, self._last_quorum_id
        self._last_quorum_id = quorum_id
        if previous is None or quorum_id is None or quorum_id >= previous or set(self._ring) <= set(ring):
            self._restart_grace = None
            return False
        if self._restart_grace is None:
            self._restart_grace = min(deadline, time.monotonic() + self.options.timeout)
            missing = sorted(set(self._ring) - set(ring))
            log.warning(
                f"Elastic group {self._group}: the lighthouse restarted and the groups {missing} of the last sync are"
                " not back yet; waiting for them."
            )
        if time.monotonic() > self._restart_grace:
            self._restart_grace = None
            self._rings.build_deferred()  # they did not come back: go on without them
            return False
        self._last_quorum_id = previous  # compare the next answer with the quorum before the restart
        time.sleep(0.5)
        return True

    def _enough(self, joining: bool) -> int:
        """The groups a quorum needs: ``min_groups``, or ``start_groups`` while every group of it is joining."""
        if joining and self._all_joining:
            return max(self.options.min_groups, self.options.start_groups or 0)
        return self.options.min_groups

    @property
    def step(self) -> int:
        """Syncs (and changes of members) this group committed, as torchft counts them."""
        if self._manager is not None:
            return int(self._manager.current_step())
        return int((self._manager_state or {}).get("step", 0))

    def state_dict(self) -> dict[str, int]:
        """Torchft's counters of this group (kept in checkpoints, so a restarted federation agrees on its step)."""
        if self._manager is not None:
            return dict(self._manager.state_dict())
        return dict(self._manager_state or {"step": 0, "batches_committed": 0})

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict` (applied when the manager connects, if it has not yet)."""
        self._manager_state = {"step": int(state["step"]), "batches_committed": int(state.get("batches_committed", 0))}
        if self._manager is not None:
            self._manager.load_state_dict(self._manager_state)

    def close(self) -> None:
        """Leave the federation: stop the manager (its heartbeats end, the others stop waiting for it)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._manager is not None:
            self._manager_state = dict(self._manager.state_dict())
            self._manager.shutdown(wait=False)
            self._manager = None
            self._checked_quorum = None

    # -- internals --------------------------------------------------------------------------------------------

    def _connect(self) -> Any:
        """Start this rank's torchft manager (rank 0 of the group also hosts the group's manager server)."""
        if self._manager is not None:
            return self._manager
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's native side logs every quorum at INFO otherwise
        from torchft.checkpointing import HTTPTransport
        from torchft.manager import Manager

        quiet_torchft()
        options = self.options
        self._check_lighthouse()
        timeout = timedelta(seconds=options.timeout)
        self._rings = fed_rings(timeout)
        manager = Manager(
            pg=self._rings,
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
            checkpoint_transport=heal_transport(HTTPTransport, timeout, options.hostname),
            max_retries=options.max_failures,
            quorum_retries=options.quorum_retries,
        )
        manager.register_state_dict_fn("fedshard", self._receive, self._send)
        # torchft rebuilds its process groups when the quorum id changes, and a restarted lighthouse counts ids from
        # the start again: the quorum's step, recorded here, keeps the rendezvous of every rebuilt ring apart from an
        # earlier one of the same id (FedRings.configure).
        manager._client = QuorumRecorder(manager._client, self._rings)
        if self._manager_state is not None:
            manager.load_state_dict(self._manager_state)
        self._manager = manager
        if dist.get_world_size() > 1:
            self._watchdog = GroupWatchdog(options.group_timeout)
            self._watchdog.start()
        return manager

    def _check_lighthouse(self) -> None:
        """Refuse to join a lighthouse that serves another federation, or whose federation of this name is over.

        Read from the lighthouse's status page before any quorum (rank 0 reads it for the whole group, so that the
        group decides as a unit). Groups of two federations on one lighthouse would otherwise take turns in its
        quorums, each group syncing with whoever asked at the same moment. A job that holds no state of its
        federation (step 0: no checkpoint) and finds that federation trained on this lighthouse, none of its groups
        alive, would otherwise start it again from step 0 on its own; if some are alive it joins and heals, and
        :meth:`_admitted` refuses it if they ended before it reached them.
        """
        address = self.options.lighthouse_address()
        page = [status_page(address) if dist.get_rank() == 0 else ""]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(page, src=0)
        self._trained = None if self.step > 0 else trained_federation(page[0], self.options.federation)
        if self._trained is not None and not self._trained.alive:
            self.close()
            if self.options.standby:
                self._group = None
                raise FederationEnded("the federation ended as this standby took a place in it")
            when = "none of its groups is running"
            raise FederationError(second_start(self._trained, self.group_index, address, when))
        refused = refusal_on(page[0], address, self.options.federation, self._group, self.num_groups)
        if refused is not None:
            self.close()
            raise FederationError(refused)

    def _send(self) -> dict[str, Any]:
        """What a peer receives from this rank when it heals (torchft's thread; this rank waits in its quorum)."""
        if self._save is None:
            raise FederationError(f"Elastic group {self._group} was asked for its state before it started.")
        return self._save()

    def _receive(self, state: dict[str, Any]) -> None:
        """Keep a peer's state: it is applied once the quorum is known to hold only this federation's groups."""
        self._healed = state

    def _collective(self, work: Callable[[], Any], output: Tensor) -> None:
        """Run one collective over a ring; after this sync's first failed one, skip it and leave zeros instead.

        Only a failed collective stops the others: a group whose heal failed still takes part (adding nothing), so
        that the other groups' sync goes through; it is not committed on this group alone.
        """
        if not self._ring_failed:
            try:
                work().wait()
                return
            except Exception as error:  # gloo raises RuntimeError on a dead or timed-out peer
                log.warning(f"Elastic group {self._group}: a collective between groups failed: {error}")
                self._ring_failed = True
                self._manager.report_error(error)
        output.zero_()

    def _admitted(self, ring: tuple[int, ...]) -> bool:
        """Exchange descriptions over the ring; raise if this job does not belong, else tell whether all groups do.

        Raises:
            FederationError: Naming what differs, with both values.
        """
        description = {
            "federation": self.options.federation,
            "group": self._group,
            "joining": self._joining or self._healed is not None,
            "new": self._joining,  # a job joining the federation (not a group that fell behind)
            "healed_from": self._rings.heal_source,
            **self._describe(),
        }
        mine = encode_description(description)
        everyone = torch.zeros(len(ring) * DESCRIPTION_BYTES, dtype=torch.uint8)
        if len(ring) > 1:
            self._collective(
                lambda: self._rings.stats.allgather_into_tensor_coalesced([everyone], [mine], gather_options()),
                everyone,
            )
        else:
            everyone.copy_(mine)
        verdict: str | None = None
        if not self._ring_failed:  # else the sync fails anyway, is not committed, and the next quorum checks again
            descriptions = [decode_description(row) for row in everyone.view(len(ring), DESCRIPTION_BYTES)]
            verdict = check_members(descriptions, int(self._manager.participating_rank() or 0))
            self._all_joining = all(d["joining"] for d in descriptions)
            self._descriptions = descriptions
            if verdict is None and self._trained is not None and self._rings.max_step == 0:
                # The federation's groups were alive when this job looked, and ended before it reached them.
                when = "its groups ended before this job could join them"
                verdict = second_start(self._trained, self.group_index, self.options.lighthouse_address(), when)
        # One decision for the whole group (its ranks sit on different rings): refused anywhere, retry anywhere, or go.
        code = torch.tensor([{None: 0, "retry": 1}.get(verdict, 2)], dtype=torch.int64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if int(code) == 2:
            reason = verdict if verdict not in (None, "retry") else "another rank of this group was refused"
            self.close()
            if self.options.standby and self._trained is not None and self._rings.max_step == 0:
                self._group = None  # a standby that took a place just as its federation ended: it stands down
                raise FederationEnded(reason)
            if reason.startswith("This job"):
                raise FederationError(reason)
            raise FederationError(f"This job (elastic group {self._group}) was refused: {reason}.")
        return int(code) == 0

    def _quorum_failure(self, error: BaseException) -> str:
        address = self.options.lighthouse_address()
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if not reachable(address):
            return (
                f"Elastic group {self._group} lost the lighthouse at {address}: it did not answer within"
                f" {self.options.quorum_timeout:g} s and {self.options.quorum_retries} retries ({cause})."
            )
        return (
            f"Elastic group {self._group} got no quorum within {self.options.quorum_timeout:g} s: fewer groups are"
            f" running than the lighthouse at {address} waits for (its `--min_replicas`), or the others stopped"
            f" ({cause})."
        )

    def _error_text(self) -> str:
        error = self._manager.errored() if self._manager is not None else None
        if error is None:
            return "too few groups or a peer's failed vote"
        original = getattr(error, "original_exception", error)
        return f"{type(original).__name__}: {str(original).splitlines()[0] if str(original) else ''}"


class _AllWorks:
    """Several collectives issued together, waited for as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


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


__all__ = ["ElasticCommunicator", "HealLoad", "HealSave"]
