"""The fed rings of an elastic group: torchft's reconfigurable process groups, rebuilt at every change of groups.

Each rank meets the ranks at its in-group position in every group of a quorum on two rings: one for the sums of a
sync, and one beside it for the training thread's statistics (so that they never queue behind a sum in flight).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_fedshard.elastic.torchft_api import process_group_gloo_class


def sum_options() -> Any:
    """Options of an all-reduce that sums (torchft's process groups take the options object)."""
    from torch.distributed.distributed_c10d import AllreduceOptions

    options = AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs type the field as ReduceOp
    return options


def gather_options() -> Any:
    """Options of an all-gather."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    return AllgatherOptions()


def _quorum_groups(
    global_ranks: list[int] | None, group_rank: int | None, group_world_size: int | None
) -> tuple[int, ...]:
    """The groups of a quorum in ring order, from the global ranks of one in-group position's ring.

    torchft numbers the ranks of a quorum (group index) * (ranks per group) + (rank in the group), in ring order, from
    the trailing digits of each replica id ("<federation>_<group>").
    """
    size, position = group_world_size or 1, group_rank or 0
    return tuple((r - position) // size for r in (global_ranks or [0]))


def _held_back(
    built: tuple[int | None, tuple[int, ...]] | None, quorum_id: int | None, members: tuple[int, ...]
) -> bool:
    """Whether a quorum from a restarted lighthouse lacks groups of the ring built last, which is then kept.

    A restarted lighthouse counts quorum ids from the start: a lower id than the built ring's, with fewer groups, is
    an answer given before every group of that ring reconnected.
    """
    if built is None or built[0] is None or quorum_id is None:
        return False
    return quorum_id < built[0] and set(members) < set(built[1])


def fed_rings(timeout: timedelta) -> Any:
    """Torchft's reconfigurable gloo group for the sums, with a second ring for statistics configured beside it."""
    base = process_group_gloo_class()

    class FedRings(_FedRings, base):  # type: ignore[misc,valid-type]  # torchft's class, imported on first use
        """The fed ring of one in-group position, on torchft's ``ProcessGroupGloo`` (see :class:`_FedRings`)."""

    return FedRings(timeout, base(timeout=timeout))


class _FedRings:
    """What the fed ring of one in-group position adds to torchft's process group.

    ``stats`` is the same ring for the training thread's statistics. Mixed into torchft's class by :func:`fed_rings`
    (its methods call that class's).
    """

    def __init__(self, timeout: timedelta, stats: Any) -> None:
        super().__init__(timeout=timeout)  # type: ignore[call-arg]
        self.stats = stats
        self.members: tuple[int, ...] = ()
        self.member_ids: tuple[str, ...] = ()  # the replica ids (``<federation>_<group>:<uuid>``) of the quorum
        self.quorum_id: int | None = None
        self.max_step = 0  # of the last quorum (set by QuorumRecorder)
        self.heal_source: int | None = None  # the group this rank heals from at the last quorum, if it does
        self._built: tuple[int | None, tuple[int, ...]] | None = None  # the quorum id and groups of the ring
        self._deferred: tuple[str, tuple[Any, ...]] | None = None
        self.given_up = GivenUp()

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
        """Build this quorum's ring (torchft calls it at each new quorum), unless it is built or held back."""
        args = (replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)
        members = _quorum_groups(global_ranks, group_rank, group_world_size)
        self.members, self.quorum_id = members, quorum_id
        # Every member of a quorum sees the same step: the rendezvous differs from an earlier ring's with the same
        # id (a restarted lighthouse counts ids from the start).
        build = (f"{store_addr}/{self.max_step}", args)
        if self._built == (quorum_id, members):
            return  # this quorum's ring is built already (a restarted lighthouse gave out its id again)
        if _held_back(self._built, quorum_id, members):
            # A restarted lighthouse answered before every group of the last ring reconnected: keep that ring
            # until they are back (the communicator asks again) or given up for (build_deferred).
            self._deferred = build
            return
        self._build(*build)

    def keep_given_up(self, work: Any, buffers: tuple[Any, ...]) -> None:
        """Hold a collective given up on with its buffers and this ring's process groups (see :class:`GivenUp`)."""
        self.given_up.keep(work, (self._pg, self.stats._pg, *buffers))  # type: ignore[attr-defined]

    def _build(self, prefix: str, args: tuple[Any, ...]) -> None:
        self.given_up.let_go()
        super().configure(f"{prefix}/sums", *args)  # type: ignore[misc]
        self.stats.configure(f"{prefix}/stats", *args)
        self._built, self._deferred = (args[3], self.members), None

    def build_deferred(self) -> None:
        """Build the ring of the last quorum, if it was held back."""
        if self._deferred is not None:
            self._build(*self._deferred)

    def errored(self) -> Exception | None:
        """The error of the sums' ring or of the statistics' ring, if either saw one."""
        return super().errored() or self.stats.errored()  # type: ignore[misc]


class GivenUp:
    """Collectives given up on, each held with what it uses until it ends.

    Gloo cannot abort a collective: dropping the process group that runs one blocks until gloo's timeout (its worker
    thread is joined), and the collective may still write into its buffers. Held here, the next quorum's ring is built
    at once; each is let go once its collective ended (at the latest at the timeout).
    """

    def __init__(self) -> None:
        self.held: list[tuple[Any, tuple[Any, ...]]] = []

    def keep(self, work: Any, uses: tuple[Any, ...]) -> None:
        """Hold ``work`` and what it ``uses`` (process groups, buffers)."""
        self.let_go()
        self.held.append((work, uses))

    def let_go(self) -> None:
        """Drop the collectives that ended."""
        self.held = [(work, uses) for work, uses in self.held if not _ended(work)]


def _ended(work: Any) -> bool:
    """Whether a collective (or every part of one) ended."""
    return all(part.is_completed() for part in getattr(work, "works", [work]))


def _heal_source(quorum: Any) -> int | None:
    """The group a rank heals from in torchft's answer to its quorum, if it heals.

    The answer lists the quorum's replica ids in replica-rank order (torchft sorts them); the source is one of them.
    """
    source, replicas = getattr(quorum, "recover_src_replica_rank", None), getattr(quorum, "replica_ids", None)
    if not getattr(quorum, "heal", False) or source is None or not replicas or not 0 <= source < len(replicas):
        return None
    match = re.search(r"(\d+)$", str(replicas[source]).split(":")[0])
    return int(match.group(1)) if match else None


class QuorumRecorder:
    """torchft's manager client, recording each quorum's step on the rings before they are built."""

    def __init__(self, client: Any, rings: Any) -> None:
        self._client, self._rings = client, rings

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._rings.max_step = int(result.max_step)
        self._rings.heal_source = _heal_source(result)
        self._rings.member_ids = tuple(str(r) for r in getattr(result, "replica_ids", None) or ())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


__all__ = ["GivenUp", "QuorumRecorder", "fed_rings", "gather_options", "sum_options"]
