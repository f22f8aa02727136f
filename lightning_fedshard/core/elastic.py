"""Elastic federations: every group is a job of its own, and the groups meet through torchft.

In one job a federation's groups share one ``torch.distributed`` world: if any rank of any group fails, every group
stops. In an elastic federation each group is an ordinary job (its own launch, its own default process group, FSDP or
HSDP inside), and the sync between groups runs through `torchft <https://github.com/pytorch/torchft>`_: a *lighthouse*
decides which groups take part in each sync (the *quorum*), every rank joins a reconfigurable process group with the
ranks at its in-group position in the other groups (its fed ring), and a group that starts late or fell behind takes
the federation's state from a peer (it *heals*).

:class:`Elastic` holds the options; :class:`ElasticCommunicator` implements the
:class:`~lightning_fedshard.core.comm.Communicator` seam on torchft's ``Manager``. Per sync:

1. :meth:`ElasticCommunicator.participants` asks for a quorum (a group that is behind receives the anchor shards,
   the outer optimizer states, the schedule and the host's loop state from a peer), then the groups exchange a small
   description of themselves (federation name, model layout, sync options): a job that does not belong is refused
   before any pseudo-gradient moves, and the others ask again without it;
2. the sum over the fed ring runs on torchft's process group; a group that healed at this sync (or is still joining)
   sends zeros and is left out of the mean (:attr:`~lightning_fedshard.core.outer.PendingSync.joined`); a failed
   collective is recorded, not raised, and every later collective of the sync is skipped;
3. :meth:`ElasticCommunicator.should_commit` is torchft's vote: a group that saw an error does not apply the sync and
   goes back to the anchor; at its next quorum it is behind and heals.

The error-feedback residuals of int8/int4/sparse traffic are reset whenever the groups of a sync differ from the
previous sync's (their chunks are laid out over the ring).

This module knows nothing about Lightning. torchft is imported when a communicator connects, so the package imports
without it (``pip install lightning-fedshard[elastic]`` installs it).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.core.comm import ProcessGroupCommunicator
from lightning_fedshard.core.quiet import quiet_torchft

log = logging.getLogger(__name__)

#: Environment variables read when :class:`Elastic` leaves a value unset.
GROUP_ENV = "FEDSHARD_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

#: The torchft release the elastic mode is tested with (``pip install lightning-fedshard[elastic]`` pins it).
TORCHFT_VERSION = "0.2.0"

#: Bytes of one group's description on the wire (JSON, zero padded).
_DESCRIPTION_BYTES = 2048


class FederationError(RuntimeError):
    """An elastic federation cannot go on: the lighthouse is gone, too few groups, a refused join, a failing heal."""


@dataclass(frozen=True)
class Elastic:
    """Run each federation group as a job of its own, joined to the others through a torchft lighthouse.

    Every group job gets the same options except ``group`` (or sets ``FEDSHARD_GROUP`` in its environment). The
    strategy's ``num_groups`` is then the number of groups the federation is planned for: the training data is split
    into that many parts and group ``g`` trains on part ``g``, whichever groups are running.

    Args:
        lighthouse: The lighthouse's address, e.g. ``"http://10.0.0.1:29510"``; default: ``$TORCHFT_LIGHTHOUSE``.
        group: This group's index in ``[0, num_groups)``; default: ``$FEDSHARD_GROUP``. A group that replaces a failed
            one takes its index (and its data).
        federation: The federation's name; a job of another federation is refused by the running groups.
        min_groups: A sync runs only with at least this many groups; with fewer, the groups wait for more (up to
            ``quorum_timeout``) and then stop with an error.
        start_groups: A new federation (every group joining at once) starts training only once this many groups
            joined, so that groups whose jobs start a little later do not find the others ahead of them; default:
            ``min_groups``.
        timeout: Seconds a collective between groups, a heal's transfer or a commit vote may take: a hung group costs
            the others at most this much (then it is left out).
        quorum_timeout: Seconds to wait for a quorum; longer than a round (a joining group waits for the others'
            next sync).
        connect_timeout: Seconds to reach the lighthouse and the managers when connecting.
        quorum_retries: Times a group retries a quorum the lighthouse did not answer (rides out a short lighthouse
            outage; a long one ends every group with an error).
        max_failures: Syncs in a row that a group may fail to commit (e.g. a heal that keeps failing) before it stops
            with an error.
        group_timeout: Seconds without a sign of life from another rank of this group before this rank ends the
            group (a group fails as a unit; a half-dead group would stall the federation at every quorum).
        hostname: The address other groups reach this group's manager at; default: the machine's host name.
        manager_port: Port of this group's manager (rank 0); default: a free one.
    """

    lighthouse: str | None = None
    group: int | None = None
    federation: str = "fedshard"
    min_groups: int = 1
    start_groups: int | None = None
    timeout: float = 60.0
    quorum_timeout: float = 900.0
    connect_timeout: float = 60.0
    quorum_retries: int = 10
    max_failures: int = 3
    group_timeout: float = 30.0
    hostname: str | None = None
    manager_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("min_groups", "max_failures"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`Elastic({name}=...)` must be a positive integer, got {value!r}.")
        if self.start_groups is not None and (
            not isinstance(self.start_groups, int) or isinstance(self.start_groups, bool) or self.start_groups < 1
        ):
            raise ValueError(
                f"`Elastic(start_groups=...)` must be a positive integer or None, got {self.start_groups!r}."
            )
        if not isinstance(self.quorum_retries, int) or self.quorum_retries < 0:
            raise ValueError(
                f"`Elastic(quorum_retries=...)` must be a non-negative integer, got {self.quorum_retries!r}."
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout", "group_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"`Elastic({name}=...)` must be a positive number of seconds, got {value!r}.")
        if not self.federation or not all(c.isalnum() or c in "-." for c in self.federation):
            raise ValueError(
                f"`Elastic(federation={self.federation!r})` must be a non-empty name of letters, digits, '-' and '.'."
            )
        if self.group is not None and (not isinstance(self.group, int) or isinstance(self.group, bool)):
            raise ValueError(f"`Elastic(group=...)` must be an integer, got {self.group!r}.")
        if self.start_groups is not None and self.start_groups < self.min_groups:
            raise ValueError(
                f"`Elastic(start_groups={self.start_groups})` is smaller than `min_groups={self.min_groups}`: a new"
                " federation cannot start with fewer groups than every sync needs. Set `start_groups` >= `min_groups`"
                " (or leave it None)."
            )
        if self.lighthouse is not None:
            _check_lighthouse_address(self.lighthouse, f"`Elastic(lighthouse={self.lighthouse!r})`")
        if self.manager_port is not None and (
            not isinstance(self.manager_port, int) or isinstance(self.manager_port, bool)
            or not 0 <= self.manager_port <= 65535
        ):  # fmt: skip
            raise ValueError(
                f"`Elastic(manager_port={self.manager_port!r})` must be a port number in [0, 65535] (0 or None: a free"
                " one)."
            )
        if self.hostname is not None and (not isinstance(self.hostname, str) or not self.hostname.strip()):
            raise ValueError(
                f"`Elastic(hostname={self.hostname!r})` must be a non-empty address the other groups reach this group"
                " at (or None: the machine's host name)."
            )

    def group_index(self, num_groups: int) -> int:
        """This group's index: ``group``, or ``$FEDSHARD_GROUP``; checked against ``num_groups``.

        Raises:
            ValueError: If neither is set, or the index is outside ``[0, num_groups)``.
        """
        group: object = self.group
        if group is None:
            value = os.environ.get(GROUP_ENV)
            if value is None:
                raise ValueError(
                    f"An elastic group needs its index: pass `Elastic(group=...)` or set ${GROUP_ENV} in the job's"
                    " environment."
                )
            try:
                group = int(value)
            except ValueError:
                raise ValueError(f"${GROUP_ENV}={value!r} is not a group index.") from None
        assert isinstance(group, int)
        if not 0 <= group < num_groups:
            raise ValueError(f"The elastic group index {group} is outside [0, num_groups={num_groups}).")
        return group

    def lighthouse_address(self) -> str:
        """``lighthouse``, or ``$TORCHFT_LIGHTHOUSE``.

        Raises:
            ValueError: If neither is set.
        """
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"An elastic group needs the lighthouse's address: pass `Elastic(lighthouse='http://host:29510')` or"
                f" set ${LIGHTHOUSE_ENV}."
            )
        source = f"`Elastic(lighthouse={address!r})`" if self.lighthouse else f"${LIGHTHOUSE_ENV}={address!r}"
        _check_lighthouse_address(address, source)
        return address

    def describe(self, group: int, num_groups: int) -> str:
        """One line for the log at the start of training."""
        return (
            f"elastic group {group} of {num_groups} in federation {self.federation!r} (lighthouse"
            f" {self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, '?')}, at least {self.min_groups} group(s) per sync)"
        )


def _check_lighthouse_address(address: object, source: str) -> None:
    """Refuse a lighthouse address torchft cannot connect to (it would fail only after ``connect_timeout``).

    Raises:
        ValueError: Naming ``source`` (where the address came from, with its value), unless it is
            ``http(s)://host[:port]``.
    """
    parsed = urlparse(address) if isinstance(address, str) else None
    try:
        valid = parsed is not None and parsed.scheme in ("http", "https") and bool(parsed.hostname)
        valid = valid and (parsed is not None and (parsed.port is None or parsed.port > 0))
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise ValueError(
            f"{source} is not a lighthouse address: it must read like 'http://10.0.0.1:29510'"
            " (`http://`, the host, the port)."
        )


@dataclass(frozen=True)
class MembershipChange:
    """Groups that joined, healed or left at one quorum, as one group saw them.

    Args:
        federation: The federation's name.
        group: The group that saw it (this job).
        groups: The groups of the quorum, in ring order.
        joined: Groups that entered the federation (a new job, or every group of a new federation).
        healed: Groups of the previous quorum that were behind and took a peer's state.
        left: Groups of the previous quorum that are gone (they failed, hung or ended).
        healed_from: For the groups that took a peer's state, that peer's group (rank 0's source: the ranks of one
            group may heal from different peers).
    """

    federation: str
    group: int
    groups: tuple[int, ...]
    joined: tuple[int, ...] = ()
    healed: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    healed_from: Mapping[int, int] = field(default_factory=dict)

    def lines(self, step: int) -> list[str]:
        """One line per group that joined, healed or left, at optimizer step ``step``."""
        where, now = f"Elastic federation {self.federation!r} at step {step}", f"groups now {list(self.groups)}"

        def who(g: int) -> str:
            return f"group {g} (this job)" if g == self.group else f"group {g}"

        def source(g: int) -> str:
            return f" from group {self.healed_from[g]}" if g in self.healed_from else ""

        return (
            [f"{where}: {who(g)} joined{', healed' + source(g) if source(g) else ''}; {now}." for g in self.joined]
            + [f"{where}: {who(g)} was behind and healed{source(g)}; {now}." for g in self.healed]
            + [f"{where}: {who(g)} left; {now}." for g in self.left]
        )


def membership_change(
    federation: str,
    group: int,
    previous: tuple[int, ...],
    groups: tuple[int, ...],
    descriptions: list[dict[str, Any]],
) -> MembershipChange | None:
    """What changed between two quorums, from their groups and the descriptions exchanged at the second one.

    A group that was not in ``previous`` joined (for a job's first quorum, ``previous`` is empty: only the groups
    joining with it joined), and so did a new job that took the index of a group of ``previous`` (it replaced a
    failed one before the others noticed); another group of ``previous`` that describes itself as joining was behind
    and healed.

    Returns:
        ``None`` if no group joined, healed or left.
    """
    described = {int(d["group"]): d for d in descriptions if isinstance(d.get("group"), int) and d["group"] >= 0}
    joining = {g for g, d in described.items() if d.get("joining")}
    new = {g for g, d in described.items() if d.get("new")}
    joined = tuple(
        g
        for g in groups
        if (g in previous and g in new) or (g not in previous and (previous or g in joining or g == group))
    )
    healed = tuple(g for g in groups if g in previous and g in joining and g not in new)
    left = tuple(g for g in previous if g not in groups)
    if not (joined or healed or left):
        return None
    sources = {g: int(d["healed_from"]) for g, d in described.items() if d.get("healed_from") is not None}
    return MembershipChange(federation, group, groups, joined, healed, left, sources)


HealSave = Callable[[], dict[str, Any]]
HealLoad = Callable[[dict[str, Any]], None]


class ElasticCommunicator:
    """The :class:`~lightning_fedshard.core.comm.Communicator` of one rank of an elastic group, on torchft.

    Collectives inside the group (``sum_in_group``, the replicas' gather) run on the job's own mesh; the fed ring is
    torchft's reconfigurable gloo process group, rebuilt by the manager whenever the groups of a quorum change, with
    a second ring beside it for the training thread's statistics.

    Args:
        options: The elastic options.
        group: This group's index.
        local: The job's own communicator (one group: the in-group collectives).
        describe: This rank's description for the admission check: a JSON-able dict of what must be equal in every
            group at this in-group position (model layout, sync options); called once per new quorum.
    """

    def __init__(
        self,
        options: Elastic,
        group: int,
        local: ProcessGroupCommunicator,
        describe: Callable[[], Mapping[str, Any]],
    ) -> None:
        self.options = options
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
        self._trained: _TrainedFederation | None = None  # this federation as the lighthouse showed it, if it trained
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
        """This group's index (the ring lists groups by index)."""
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
        """All-reduce (sum) over the fed ring; zeros after a failure."""
        self._collective(lambda: self._rings.allreduce([tensor], _sum_options()), tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the statistics ring; zeros after a failure."""
        self._collective(lambda: self._rings.stats.allreduce([tensor], _sum_options()), tensor)

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
        """Not in an elastic federation: its groups change, so it has no fixed sites."""
        raise NotImplementedError("An elastic federation averages all its groups; it has no sites.")

    def mix_over_groups(self, tensor: Tensor, matrix: Tensor) -> None:
        """Not in an elastic federation: a mixing matrix needs a fixed set of groups."""
        raise NotImplementedError("An elastic federation averages all its groups; it does not mix them.")

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
        change = membership_change(self.options.federation, self._group, self._ring, ring, self._descriptions)
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
        self._rings = _fed_rings(timeout)
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
            replica_id=f"{options.federation}_{self._group}",
            port=options.manager_port,
            hostname=options.hostname or _hostname(),
            checkpoint_transport=_heal_transport(HTTPTransport, timeout, options.hostname),
            max_retries=options.max_failures,
            quorum_retries=options.quorum_retries,
        )
        manager.register_state_dict_fn("fedshard", self._receive, self._send)
        # torchft rebuilds its process groups when the quorum id changes, and a restarted lighthouse counts ids from
        # the start again: the quorum's step, recorded here, keeps the rendezvous of every rebuilt ring apart from an
        # earlier one of the same id (FedRings.configure).
        manager._client = _QuorumRecorder(manager._client, self._rings)
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
        page = [_status_page(address) if dist.get_rank() == 0 else ""]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(page, src=0)
        self._trained = None if self.step > 0 else _trained_federation(page[0], self.options.federation)
        if self._trained is not None and not self._trained.alive:
            self.close()
            raise FederationError(_second_start(self._trained, self._group, address, "none of its groups is running"))
        running = _federations_on(page[0])
        others = {name: groups for name, groups in running.items() if name != self.options.federation}
        if others:
            listed = "; ".join(f"{name!r} (groups {sorted(groups)})" for name, groups in sorted(others.items()))
            self.close()
            raise FederationError(
                f"This job (elastic group {self._group}) was refused: the lighthouse at {address} serves another"
                f" federation: {listed}, and this job belongs to federation {self.options.federation!r}. Give each"
                " federation a lighthouse of its own, or the same `Elastic(federation=...)` to every group of one."
            )

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
        encoded = json.dumps(description, sort_keys=True, default=str).encode()
        if len(encoded) > _DESCRIPTION_BYTES:
            raise FederationError(f"This group's description is too long to exchange ({len(encoded)} bytes).")
        mine = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
        mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        everyone = torch.zeros(len(ring) * _DESCRIPTION_BYTES, dtype=torch.uint8)
        if len(ring) > 1:
            self._collective(
                lambda: self._rings.stats.allgather_into_tensor_coalesced([everyone], [mine], _gather_options()),
                everyone,
            )
        else:
            everyone.copy_(mine)
        verdict: str | None = None
        if not self._ring_failed:  # else the sync fails anyway, is not committed, and the next quorum checks again
            descriptions = [_decode(row) for row in everyone.view(len(ring), _DESCRIPTION_BYTES)]
            verdict = _check_members(descriptions, int(self._manager.participating_rank() or 0))
            self._all_joining = all(d["joining"] for d in descriptions)
            self._descriptions = descriptions
            if verdict is None and self._trained is not None and self._rings.max_step == 0:
                # The federation's groups were alive when this job looked, and ended before it reached them.
                when = "its groups ended before this job could join them"
                verdict = _second_start(self._trained, self._group, self.options.lighthouse_address(), when)
        # One decision for the whole group (its ranks sit on different rings): refused anywhere, retry anywhere, or go.
        code = torch.tensor([{None: 0, "retry": 1}.get(verdict, 2)], dtype=torch.int64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if int(code) == 2:
            reason = verdict if verdict not in (None, "retry") else "another rank of this group was refused"
            self.close()
            if reason.startswith("This job"):
                raise FederationError(reason)
            raise FederationError(f"This job (elastic group {self._group}) was refused: {reason}.")
        return int(code) == 0

    def _quorum_failure(self, error: BaseException) -> str:
        address = self.options.lighthouse_address()
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if not _reachable(address):
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


def _check_members(descriptions: list[dict[str, Any]], position: int) -> str | None:
    """Whether every group of a quorum belongs to one federation.

    Returns ``None`` if so, ``"retry"`` if another group does not, or the reason this rank's group (at ring
    ``position``) is refused.

    The groups already training (not joining) define the federation; when every group is joining, the most common
    description does (the first in ring order among equally common ones). A group whose description differs is refused;
    so is a joining group whose index a running group already has (or, among joining groups, a later one in ring order).
    """
    comparable = [_comparable(d) for d in descriptions]
    keys = [json.dumps(c, sort_keys=True) for c in comparable]
    running = [k for k, d in zip(keys, descriptions) if not d["joining"]]
    if running:
        pool = running
    else:  # everyone is joining: the most common federation name first, then the most common description under it
        names = [d["federation"] for d in descriptions]
        name = max(names, key=lambda n: (names.count(n), -names.index(n)))
        pool = [k for k, d in zip(keys, descriptions) if d["federation"] == name]
    reference_key = max(pool, key=lambda k: (pool.count(k), -pool.index(k)))
    reference, mine = json.loads(reference_key), comparable[position]
    if keys[position] != reference_key:
        differences = [
            f"{name} {mine.get(name)!r} here, {reference.get(name)!r} in the federation"
            for name in sorted(set(reference) | set(mine))
            if mine.get(name) != reference.get(name)
        ]
        return f"it does not belong to the federation it reached ({'; '.join(differences)})"
    group = descriptions[position]["group"]
    holders = [i for i, d in enumerate(descriptions) if d["group"] == group]
    keeper = next((i for i in holders if not descriptions[i]["joining"]), holders[0])
    if position != keeper:
        return f"group {group} is already running in federation {mine['federation']!r}"
    if any(k != reference_key for k in keys) or len({d["group"] for d in descriptions}) < len(descriptions):
        return "retry"
    return None


def _comparable(description: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in description.items() if k not in ("group", "joining", "new", "healed_from")}


def _decode(row: Tensor) -> dict[str, Any]:
    data = bytes(row.tolist()).rstrip(b"\0")
    return json.loads(data.decode()) if data else {"federation": None, "group": -1, "joining": True}


#: A heartbeat line of the lighthouse's status page: ``<federation>_<group>:<uuid>: seen <seconds>s ago``.
_HEARTBEAT = re.compile(r"^\s*([A-Za-z0-9.\-]+)_(\d+):[0-9a-f\-]{36}: seen ([0-9.e\-]+)s ago", re.MULTILINE)
#: A heartbeat entry with the lighthouse's own verdict: ``old`` once it is older than its heartbeat timeout.
_HEARTBEAT_ENTRY = re.compile(r'class="heartbeat\s*(old)?\s*">\s*([A-Za-z0-9.\-]+)_(\d+):[0-9a-f\-]{36}: seen')
#: A member of the lighthouse's last quorum: its replica id and its step (the syncs it had committed).
_QUORUM_MEMBER = re.compile(r"<b>\s*([A-Za-z0-9.\-]+)_(\d+):[0-9a-f\-]{36}\s*</b>\s*<br/>\s*Step:\s*(\d+)")


def _status_page(address: str, timeout: float = 5.0) -> str:
    """The lighthouse's status page (torchft has no other way to list its replicas); empty if it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as response:
            return str(response.read().decode(errors="replace"))
    except (OSError, ValueError):
        return ""


def _federations_on(page: str, recent: float = 10.0) -> dict[str, set[int]]:
    """The federations whose groups heartbeat to the lighthouse (seen in the last ``recent`` s), from its page."""
    found: dict[str, set[int]] = {}
    for name, group, age in _HEARTBEAT.findall(page):
        if float(age) <= recent:
            found.setdefault(name, set()).add(int(group))
    return found


@dataclass(frozen=True)
class _TrainedFederation:
    """A federation that committed syncs on a lighthouse, as its status page shows it (the lighthouse's memory)."""

    name: str
    #: The syncs its groups had committed at the lighthouse's last quorum (torchft's step).
    syncs: int
    #: The groups of that quorum.
    groups: tuple[int, ...]
    #: Its groups that still heartbeat (the lighthouse does not count them as gone).
    alive: tuple[int, ...]


def _trained_federation(page: str, federation: str) -> _TrainedFederation | None:
    """``federation`` if the last quorum on the lighthouse (its status ``page``) had its groups past step 0."""
    members = [(int(group), int(step)) for name, group, step in _QUORUM_MEMBER.findall(page) if name == federation]
    syncs = max((step for _, step in members), default=0)
    if syncs == 0:
        return None
    alive = {int(group) for old, name, group in _HEARTBEAT_ENTRY.findall(page) if name == federation and not old}
    return _TrainedFederation(federation, syncs, tuple(sorted({g for g, _ in members})), tuple(sorted(alive)))


def _second_start(trained: _TrainedFederation, group: int, address: str, when: str) -> str:
    """Why a job that holds no state of ``trained`` must not start it again from step 0 on the same lighthouse."""
    return (
        f"This job (elastic group {group}) was refused: federation {trained.name!r} already trained on the lighthouse"
        f" at {address} (groups {list(trained.groups)} had committed {trained.syncs} sync(s) at its last quorum) and"
        f" {when}: this job would silently start a second federation {trained.name!r} from step 0 on fresh weights."
        " To train a new federation, start a new lighthouse or give it another name (`Elastic(federation=...)`);"
        " to go on with this one, restart its groups from their checkpoints."
    )


def _heal_transport(base: type, timeout: timedelta, hostname: str | None) -> Any:
    """The HTTP transport of torchft for heals, advertised at ``hostname`` (torchft advertises the host name).

    On a cluster the host name may not be what the other groups reach (a node's cluster interface, a container):
    the heal server then answers at the address the manager is advertised at. Its access log (one line on stderr per
    request of a healing peer, from Python's ``http.server``) is silenced.
    """
    if hostname is None:
        return _quiet_access_log(base(timeout=timeout, num_chunks=0))

    class AddressedHTTPTransport(base):  # type: ignore[misc, valid-type]
        def address(self) -> str:
            url = urlparse(super().address())
            return url._replace(netloc=f"{hostname}:{url.port}").geturl()

    return _quiet_access_log(AddressedHTTPTransport(timeout=timeout, num_chunks=0))


def _quiet_access_log(transport: Any) -> Any:
    """Route the access log of ``transport``'s HTTP server to this module's logger at DEBUG, off the console.

    torchft's ``HTTPTransport`` serves through a ``http.server`` handler class of its own (``_server``, private),
    whose ``log_message`` writes every request to stderr; the server builds a handler per request, so replacing its
    class takes effect at the next one. Errors are still logged by torchft itself.
    """
    server = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if server is None or handler is None:
        return transport

    class QuietHandler(handler):  # type: ignore[misc, valid-type]
        def log_message(self, format: str, *args: Any) -> None:
            log.debug(f"heal server: {format % args}")

    server.RequestHandlerClass = QuietHandler
    return transport


def _reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at ``address`` (``http://host:port``)."""
    import socket

    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parsed.hostname or "localhost", parsed.port or 29510), timeout=timeout):
            return True
    except OSError:
        return False


def _sum_options() -> Any:
    from torch.distributed.distributed_c10d import AllreduceOptions

    options = AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs type the field as ReduceOp
    return options


def _gather_options() -> Any:
    from torch.distributed.distributed_c10d import AllgatherOptions

    return AllgatherOptions()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _fed_rings(timeout: timedelta) -> Any:
    """Torchft's reconfigurable gloo group for the sums, with a second ring for statistics configured beside it."""
    from torchft.process_group import ProcessGroupGloo

    class FedRings(ProcessGroupGloo):
        """The fed ring of one in-group position; ``stats`` is the same ring for the training thread's statistics."""

        def __init__(self) -> None:
            super().__init__(timeout=timeout)
            self.stats = ProcessGroupGloo(timeout=timeout)
            self.members: tuple[int, ...] = ()
            self.quorum_id: int | None = None
            self.max_step = 0  # of the last quorum (set by _QuorumRecorder)
            self.heal_source: int | None = None  # the group this rank heals from at the last quorum, if it does
            self._built: tuple[int | None, tuple[int, ...]] | None = None  # the quorum id and groups of the ring
            self._deferred: tuple[str, tuple[Any, ...]] | None = None

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            args = (replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)
            # torchft numbers the ranks of a quorum (group index) * (ranks per group) + (rank in the group), in ring
            # order, from the trailing digits of each replica id ("<federation>_<group>").
            size, position = group_world_size or 1, group_rank or 0
            members = tuple((r - position) // size for r in (global_ranks or [0]))
            self.members, self.quorum_id = members, quorum_id
            # Every member of a quorum sees the same step: the rendezvous differs from an earlier ring's with the same
            # id (a restarted lighthouse counts ids from the start).
            build = (f"{store_addr}/{self.max_step}", args)
            if self._built == (quorum_id, members):
                return  # this quorum's ring is built already (a restarted lighthouse gave out its id again)
            built_id = self._built[0] if self._built is not None else None
            if built_id is not None and quorum_id is not None and quorum_id < built_id:
                if set(members) < set(self._built[1]):  # type: ignore[index]
                    # A restarted lighthouse answered before every group of the last ring reconnected: keep that
                    # ring until they are back (the communicator asks again) or given up for (build_deferred).
                    self._deferred = build
                    return
            self._build(*build)

        def _build(self, prefix: str, args: tuple[Any, ...]) -> None:
            super().configure(f"{prefix}/sums", *args)
            self.stats.configure(f"{prefix}/stats", *args)
            self._built, self._deferred = (args[3], self.members), None

        def build_deferred(self) -> None:
            """Build the ring of the last quorum, if it was held back."""
            if self._deferred is not None:
                self._build(*self._deferred)

        def errored(self) -> Exception | None:
            return super().errored() or self.stats.errored()

    return FedRings()


def _heal_source(quorum: Any) -> int | None:
    """The group a rank heals from in torchft's answer to its quorum, if it heals.

    The answer lists the quorum's replica ids in replica-rank order (torchft sorts them); the source is one of them.
    """
    source, replicas = getattr(quorum, "recover_src_replica_rank", None), getattr(quorum, "replica_ids", None)
    if not getattr(quorum, "heal", False) or source is None or not replicas or not 0 <= source < len(replicas):
        return None
    match = re.search(r"(\d+)$", str(replicas[source]).split(":")[0])
    return int(match.group(1)) if match else None


class _QuorumRecorder:
    """torchft's manager client, recording each quorum's step on the rings before they are built."""

    def __init__(self, client: Any, rings: Any) -> None:
        self._client, self._rings = client, rings

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._rings.max_step = int(result.max_step)
        self._rings.heal_source = _heal_source(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class GroupWatchdog:
    """Ends this process when another rank of its group stops showing signs of life.

    Every rank writes a heartbeat into the job's TCP store and reads the others'; a rank silent for ``timeout``
    seconds (dead, or stopped) makes every other rank of the group exit, so that the group fails as a unit and its
    manager stops heartbeating to the lighthouse. Without it a half-dead group keeps the federation waiting at every
    quorum.

    Args:
        timeout: Seconds of silence before the group ends.
        interval: Seconds between two heartbeats.
    """

    def __init__(self, timeout: float, interval: float = 1.0) -> None:
        self.timeout = timeout
        self.interval = min(interval, timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedshard-group-watchdog", daemon=True)

    def start(self) -> None:
        """Start watching (in a daemon thread)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
            )
            rank, world = dist.get_rank(), dist.get_world_size()
        except Exception as error:  # no store to watch through: say so, the group is then not watched
            log.warning(f"The elastic group watchdog could not reach the job's store and is off: {error}")
            return
        last_seen = {r: time.monotonic() for r in range(world) if r != rank}
        beats = dict.fromkeys(last_seen, -1)
        while not self._stop.wait(self.interval):
            try:
                store.add(f"fedshard/alive/{rank}", 1)  # a counter: `add` never waits for a key to exist
                values = [store.add(f"fedshard/alive/{r}", 0) for r in last_seen]
            except Exception as error:  # the store lives with rank 0: it is gone
                self._end(f"the group's store is gone ({error})")
                return
            now = time.monotonic()
            for r, value in zip(list(last_seen), values):
                if value != beats[r]:
                    beats[r], last_seen[r] = value, now
                elif now - last_seen[r] > self.timeout:
                    self._end(f"rank {r} of this group has shown no sign of life for {self.timeout:g} s")
                    return

    @staticmethod
    def _end(reason: str) -> None:
        log.error(f"Ending this elastic group: {reason}. A group fails as a unit; restart it to rejoin.")
        logging.shutdown()
        os._exit(75)


def cloned(state: Any) -> Any:
    """A copy of ``state`` whose tensors are detached CPU copies (what a heal may send while training goes on)."""
    if isinstance(state, Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(v) for v in state)
    return copy.deepcopy(state)


__all__ = [
    "Elastic",
    "ElasticCommunicator",
    "FederationError",
    "GroupWatchdog",
    "MembershipChange",
    "cloned",
    "membership_change",
]
