"""The collectives of a sync over the fed ring: a large sum in parts, and a failure that skips the rest.

No torchft here: the ring is a stand-in whose other group holds the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.elastic.collectives import RingCollectives
from lightning_fedshard.elastic.connection import ManagerConnection


class _Ring:
    """A fed ring of two groups whose other group holds the same values; ``fail_at``: that part's collective fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.parts = fail_at, []

    def allreduce(self, tensors: list[Tensor], options: object) -> object:
        (tensor,) = tensors
        index, fail = len(self.parts), self.fail_at
        self.parts.append(tensor.numel())

        class Work:
            def wait(self) -> None:
                if index == fail:
                    raise RuntimeError("peer gone")
                tensor.mul_(2)

        return Work()


class _Manager:
    def report_error(self, error: BaseException) -> None:
        self.error = error


def _collectives(ring: _Ring, manager: _Manager | None = None) -> RingCollectives:
    connection = ManagerConnection(Elastic(group=0), 0, None, dict, lambda state: None)
    connection.rings, connection.manager = ring, manager or _Manager()
    return RingCollectives(connection)


def test_a_large_sum_over_the_elastic_ring_runs_in_parts_in_flight_together():
    """One gloo ring over a large tensor leaves a slow link idle part of the time: the sum is cut as in one job."""
    ring = _Ring()
    collectives = _collectives(ring)
    values = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB: 4 parts of 256 KiB
    tensor = values.clone()
    collectives.sum(tensor)
    assert ring.parts == [65536] * 4 and torch.equal(tensor, 2 * values)
    small = torch.ones(8)
    collectives.sum(small)  # one all-reduce
    assert ring.parts[4:] == [8] and torch.equal(small, torch.full((8,), 2.0))


def test_a_failed_part_leaves_zeros_and_skips_the_rest_of_the_sync():
    ring, manager = _Ring(fail_at=1), _Manager()
    collectives = _collectives(ring, manager)
    tensor = torch.ones(256 * 1024)
    collectives.sum(tensor)
    assert not tensor.any() and collectives.failed and isinstance(manager.error, RuntimeError)
    later = torch.ones(4)
    collectives.sum(later)  # the sync's first failure ends its collectives: zeros, nothing sent
    assert not later.any() and len(ring.parts) == 4
