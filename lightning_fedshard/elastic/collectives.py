"""The collectives of one sync over the fed rings: a failed one is recorded, not raised, and skips the rest.

A group that saw a failure sends and receives zeros for the rest of the sync and votes against committing it (torchft's
``should_commit``); at its next quorum it is behind and heals.

A collective that waits on a group the lighthouse counts as gone (its heartbeats stopped: dead, or hung inside the
sum) is given up on after the lighthouse's heartbeat timeout, not after the elastic ``timeout``: while a collective
waits, this rank reads the lighthouse's status page every ``Elastic(peer_check=...)`` seconds. Gloo cannot abort a
collective, so every collective runs on private copies of its tensors: one given up on may still end later (when the
hung group wakes up) and write, but only into buffers nobody reads any more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_fedshard.core.transport.comm import sum_parts
from lightning_fedshard.elastic.connection import ManagerConnection
from lightning_fedshard.elastic.rings import gather_options, sum_options

log = logging.getLogger(__name__)

__all__ = ["GroupsGone", "RingCollectives"]

#: Starts a collective on private copies of its tensors: ``(output, input) -> work`` (``input is output`` in place).
Start = Callable[[Tensor, Tensor], Any]


class GroupsGone(RuntimeError):
    """A collective between groups was given up on: the lighthouse counts groups it waits on as gone."""

    def __init__(self, groups: Sequence[int]) -> None:
        super().__init__(
            f"the lighthouse counts group(s) {list(groups)} of this collective as gone (no heartbeat for its heartbeat"
            " timeout: dead or hung); this sync is left out"
        )
        self.groups = tuple(groups)


class RingCollectives:
    """The collectives over a connection's fed rings, for the sync under way.

    Args:
        connection: The connection whose rings carry them, and whose manager hears of a failure.
    """

    def __init__(self, connection: ManagerConnection) -> None:
        self._connection = connection
        #: Whether a collective of the current sync failed: the rest are skipped, leaving zeros.
        self.failed = False

    def sum(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the fed ring, a large tensor in parts in flight together.

        As over one job's process groups (:func:`~lightning_fedshard.core.transport.comm.all_reduce`): one gloo ring
        over a large tensor leaves a slow link idle part of the time.
        """
        rings, parts = self._connection.rings, sum_parts(tensor)
        if parts < 2:
            self.run(lambda out, _: rings.allreduce([out], sum_options()), tensor)
            return
        self.run(
            lambda out, _: _AllWorks([rings.allreduce([p], sum_options()) for p in out.view(-1).chunk(parts)]), tensor
        )

    def sum_stats(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the statistics ring."""
        self.run(lambda out, _: self._connection.rings.stats.allreduce([out], sum_options()), tensor)

    def gather_stats(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the statistics ring."""
        rings = self._connection.rings
        self.run(
            lambda out, in_: rings.stats.allgather_into_tensor_coalesced([out], [in_], gather_options()), output, input
        )

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """``alltoall_base`` over the fed ring (equal parts)."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        rings = self._connection.rings
        self.run(lambda out, in_: rings.alltoall_base(out, in_, [], [], AllToAllOptions()), output, input)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the fed ring."""
        rings = self._connection.rings
        self.run(lambda out, in_: rings.allgather_into_tensor_coalesced([out], [in_], gather_options()), output, input)

    def run(self, start: Start, output: Tensor, input: Tensor | None = None) -> None:
        """Run one collective over a ring; after this sync's first failed one, skip it and leave zeros instead.

        The collective runs on private copies of ``output`` and ``input`` (``None``: in place, on ``output``), copied
        back once it ended: one given up on keeps its copies (see :meth:`wait`). Only a failed collective stops the
        others: a group whose heal failed still takes part (adding nothing), so that the other groups' sync goes
        through; it is not committed on this group alone.
        """
        if not self.failed:
            out = output.clone()
            in_ = out if input is None else input.clone()
            work = None
            try:
                work = start(out, in_)
                self.wait(work)
                output.copy_(out)
                return
            except Exception as error:  # gloo raises RuntimeError on a dead or timed-out peer
                log.warning(f"Elastic group {self._connection.group}: a collective between groups failed: {error}")
                self.failed = True
                self._connection.manager.report_error(error)
                if work is not None and isinstance(error, GroupsGone):
                    self._connection.rings.keep_given_up(work, (out, in_))
        output.zero_()

    def wait(self, work: Any) -> None:
        """Wait for ``work`` to end; give up on it once the lighthouse counts a group of the ring as gone.

        Raises:
            GroupsGone: Naming the groups; the work may still be running.
        """
        interval = self._connection.options.peer_check
        for part in getattr(work, "works", [work]):
            ended = threading.Event()
            part.get_future().add_done_callback(lambda _, ended=ended: ended.set())
            while interval > 0 and not ended.wait(interval):
                if gone := self._connection.gone_groups():
                    raise GroupsGone(gone)
            part.wait()


class _AllWorks:
    """Several collectives issued together, waited for as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
