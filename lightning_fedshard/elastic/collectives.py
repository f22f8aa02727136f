"""The collectives of one sync over the fed rings: a failed one is recorded, not raised, and skips the rest.

A group that saw a failure sends and receives zeros for the rest of the sync and votes against committing it (torchft's
``should_commit``); at its next quorum it is behind and heals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_fedshard.core.transport.comm import sum_parts
from lightning_fedshard.elastic.connection import ManagerConnection
from lightning_fedshard.elastic.rings import gather_options, sum_options

log = logging.getLogger(__name__)

__all__ = ["RingCollectives"]


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
            self.run(lambda: rings.allreduce([tensor], sum_options()), tensor)
            return
        self.run(lambda: _AllWorks([rings.allreduce([p], sum_options()) for p in tensor.view(-1).chunk(parts)]), tensor)

    def sum_stats(self, tensor: Tensor) -> None:
        """All-reduce (sum) over the statistics ring."""
        self.run(lambda: self._connection.rings.stats.allreduce([tensor], sum_options()), tensor)

    def gather_stats(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the statistics ring."""
        rings = self._connection.rings
        self.run(lambda: rings.stats.allgather_into_tensor_coalesced([output], [input], gather_options()), output)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """``alltoall_base`` over the fed ring (equal parts)."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        self.run(lambda: self._connection.rings.alltoall_base(output, input, [], [], AllToAllOptions()), output)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the fed ring."""
        rings = self._connection.rings
        self.run(lambda: rings.allgather_into_tensor_coalesced([output], [input], gather_options()), output)

    def run(self, work: Callable[[], Any], output: Tensor) -> None:
        """Run one collective over a ring; after this sync's first failed one, skip it and leave zeros instead.

        Only a failed collective stops the others: a group whose heal failed still takes part (adding nothing), so
        that the other groups' sync goes through; it is not committed on this group alone.
        """
        if not self.failed:
            try:
                work().wait()
                return
            except Exception as error:  # gloo raises RuntimeError on a dead or timed-out peer
                log.warning(f"Elastic group {self._connection.group}: a collective between groups failed: {error}")
                self.failed = True
                self._connection.manager.report_error(error)
        output.zero_()


class _AllWorks:
    """Several collectives issued together, waited for as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
