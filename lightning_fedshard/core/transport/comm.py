"""The communicator: every collective a sync issues, scoped to this rank's fed ring or to its own group.

A sync moves each in-group position's shard across the groups over its *fed ring* (the ranks at the same in-group
position of every taking-part group) and adds up a few statistics *inside the group* (over its shards). Nothing a sync
issues spans more ranks than one ring or one group: groups never wait for the slowest rank of another group's other
positions, and groups that run as separate jobs (with no world of their own) implement the same protocol.

:class:`Communicator` is the seam; :class:`ProcessGroupCommunicator` implements it on the federation mesh's process
groups (one job). Tests use an in-process fake with threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class Communicator(Protocol):
    """Collectives of one rank's syncs.

    The fed-ring operations (:meth:`sum_over_groups`, :meth:`all_to_all`, :meth:`all_gather`) run over the ranks at
    this rank's in-group position of every group that takes part in the sync, in the order of :meth:`participants`;
    :meth:`sum_in_group` runs over the distinct shards of this rank's own group.
    """

    @property
    def group_index(self) -> int:
        """This rank's federation group."""

    def participants(self) -> tuple[int, ...]:
        """The groups that take part in the next sync, in fed-ring order; asked once per sync, when it begins."""

    def joined(self) -> bool:
        """Whether this group took the federation's state from a peer when :meth:`participants` was last asked.

        A group that joins an elastic federation (or fell behind it) holds no round of its own at that sync: it adds
        nothing to the sum and takes the mean of the others. Always ``False`` in one job.
        """

    def sum_over_groups(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its sum over the fed ring."""

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """The same for a small statistics vector, from the training thread.

        It never queues behind a sum that a background thread is running over the ring (with eager updates and
        fragments, other fragments' sums are in flight whenever one lands).
        """

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """Replace ``tensor`` in place by its sum over this rank's block of ``size`` consecutive groups (fed ring)."""

    def mix_over_groups(
        self, tensor: Tensor, matrix: Tensor, decode: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """``sum_j matrix[i, j] decode(tensor_j)`` (``i`` this group) over the fed ring, a new float32 tensor.

        ``tensor`` is what this group sends (its wire form, e.g. int4 pieces); ``decode`` (default: as it is) turns
        each group's into float32 values. Only the partners travel: this rank receives from every ``j`` with
        ``matrix[i, j] > 0`` and sends to every ``j`` with ``matrix[j, i] > 0``. The terms are added in group order,
        this group's own at its place, so groups that receive the same terms with the same weights get the same bits.
        """

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Exchange equal parts over the fed ring: part ``j`` of ``input`` goes to ring rank ``j``.

        ``input`` and ``output`` are 1-D, of the same length, divisible by the ring size; ``output`` part ``j`` is what
        ring rank ``j`` sent to this rank.
        """

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """Fill the 1-D ``output`` (ring size times ``input``'s length) with every ring rank's ``input``, in order."""

    def sum_in_group(self, tensor: Tensor) -> None:
        """Replace a small statistics vector in place by its sum over the distinct shards of this rank's group.

        Replicas of a shard (FL+HSDP) hold identical values and are not added again.
        """

    @property
    def num_replicas(self) -> int:
        """Ranks of this rank's group that hold the same shard (FL+HSDP's replicas; 1 for FL+FSDP)."""

    @property
    def replica_index(self) -> int:
        """This rank's place among them."""

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        """Fill the 1-D ``output`` (``num_replicas`` times ``input``'s length) with every replica's ``input``, in order.

        Inside the group: the replicas of a shard split its sum over the groups and put the parts back together.
        """

    def should_commit(self) -> bool:
        """Whether the sync whose sum just completed may be applied; the same answer on every rank of the sync."""


@dataclass
class ProcessGroupCommunicator:
    """:class:`Communicator` over the process groups of one job's federation mesh.

    Every group takes part in every sync and every sync commits.

    Args:
        num_groups: Groups of the job.
        fed_group: This rank's fed ring (its rank along the ``"fed"`` axis is its group index).
        shard_group: The ranks that shard this rank's replica (``None`` when a replica is one rank).
        replicate_group: The replicas of this rank's shard inside its group (``None`` with one replica).
        stats_group: Another process group over the same fed ring, for the training thread's statistics while sums
            run over ``fed_group`` in the background (default: ``fed_group``).
        site_groups: By block size, this rank's block of consecutive groups on its fed ring (hierarchical topology).
    """

    num_groups: int
    fed_group: ProcessGroup | None
    shard_group: ProcessGroup | None
    replicate_group: ProcessGroup | None = None
    stats_group: ProcessGroup | None = None
    site_groups: dict[int, ProcessGroup] = field(default_factory=dict)

    @property
    def num_replicas(self) -> int:
        """The size of the replicate group."""
        return dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1

    @property
    def replica_index(self) -> int:
        """This rank's rank in the replicate group."""
        return dist.get_rank(self.replicate_group) if self.replicate_group is not None else 0

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the replicate group."""
        _gather_into(output, input, self.replicate_group)

    @property
    def group_index(self) -> int:
        """This rank's federation group (groups are in order along the ``"fed"`` axis)."""
        return dist.get_rank(self.fed_group) if self.fed_group is not None else 0

    def participants(self) -> tuple[int, ...]:
        """Every group of the job."""
        return tuple(range(self.num_groups))

    def joined(self) -> bool:
        """Never: the groups of one job start together from the same weights."""
        return False

    def sum_over_groups(self, tensor: Tensor) -> None:
        """All-reduce over the fed ring (on gloo, a large tensor in parts in flight together: :func:`all_reduce`)."""
        if self.fed_group is not None:
            all_reduce(tensor, self.fed_group)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """All-reduce over the fed ring's statistics group."""
        group = self.stats_group or self.fed_group
        if group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """All-reduce over this rank's block of ``size`` groups (the whole ring when it spans every group)."""
        if size >= self.num_groups:
            self.sum_over_groups(tensor)
        elif size > 1:
            all_reduce(tensor, self.site_groups[size])

    def mix_over_groups(
        self, tensor: Tensor, matrix: Tensor, decode: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """Point-to-point exchanges with the partners over the fed ring, then the weighted sum in group order."""
        i = self.group_index
        ranks = dist.get_process_group_ranks(self.fed_group) if self.fed_group is not None else [dist.get_rank()]
        sources = [j for j in range(len(ranks)) if j != i and matrix[i, j] > 0]
        received = {j: torch.empty_like(tensor) for j in sources}
        ops = [
            dist.P2POp(dist.isend, tensor, ranks[j], self.fed_group)
            for j in range(len(ranks))
            if j != i and matrix[j, i] > 0
        ]
        ops += [dist.P2POp(dist.irecv, received[j], ranks[j], self.fed_group) for j in sources]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        received[i] = tensor
        return weighted_sum(received, matrix[i], decode)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """``all_to_all_single`` over the fed ring."""
        if self.fed_group is None:
            output.copy_(input)
            return
        dist.all_to_all_single(output, input, group=self.fed_group)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """All-gather into one tensor over the fed ring."""
        _gather_into(output, input, self.fed_group)

    def sum_in_group(self, tensor: Tensor) -> None:
        """All-reduce over the ranks that shard this rank's replica."""
        if self.shard_group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.shard_group)

    def should_commit(self) -> bool:
        """Always: in one job a failed collective raises instead of returning."""
        return True


#: On gloo, an all-reduce of more than this many bytes goes as several all-reduces in flight at once, each of about
#: this size and at most :data:`GLOO_SUM_PARTS` of them. One gloo ring over a large tensor leaves a slow link idle part
#: of the time: a 5.5 MB float32 sum over 4 nodes at 5 Mbit/s each took 15.8 s as one all-reduce (median of 5; the
#: link's bound is 13.2 s) and 13.85 s as 16 in flight (3 runs; 40 parts: 13.9 s). See docs/benchmarks/torchft.md.
GLOO_SUM_PART_BYTES = 256 * 1024
GLOO_SUM_PARTS = 16


def sum_parts(tensor: Tensor) -> int:
    """How many parts a sum of ``tensor`` over a gloo ring runs in, in flight together (1: one all-reduce)."""
    if not tensor.is_contiguous():
        return 1
    return max(1, min(GLOO_SUM_PARTS, tensor.numel() * tensor.element_size() // GLOO_SUM_PART_BYTES))


def all_reduce(tensor: Tensor, group: ProcessGroup) -> None:
    """Sum ``tensor`` in place over ``group``; on gloo, a large contiguous tensor in parts in flight together.

    Every rank cuts the tensor the same way, so all of them get the same bits; those may differ in the last place from
    a single all-reduce's (the order of the additions depends on the cut).
    """
    parts = sum_parts(tensor)
    if parts < 2 or dist.get_backend(group) != dist.Backend.GLOO:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return
    works = [
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group, async_op=True) for part in tensor.view(-1).chunk(parts)
    ]
    for work in works:
        assert work is not None
        work.wait()


def _gather_into(output: Tensor, input: Tensor, group: ProcessGroup | None) -> None:
    """All-gather ``input`` of every rank of ``group`` into ``output``, in rank order; a copy without a group."""
    if group is None:
        output.copy_(input)
        return
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; both work on gloo and NCCL.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def weighted_sum(terms: dict[int, Tensor], weights: Tensor, decode: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``sum_j weights[j] decode(terms[j])`` over the groups ``j`` in ``terms``, added in group order (float32)."""
    total: Tensor | None = None
    for j in sorted(terms):
        term = (decode(terms[j]) if decode is not None else terms[j]).to(torch.float32) * float(weights[j])
        total = term if total is None else total.add_(term)
    assert total is not None
    return total


def sum_over_model(communicator: Communicator, tensor: Tensor) -> None:
    """Sum a statistics vector over every distinct shard of every taking-part group: over the ring, then the group.

    Each fed ring adds one in-group position over the groups; the group then adds its positions. Two small
    collectives, neither wider than a ring or a group.
    """
    communicator.sum_stats_over_groups(tensor)
    communicator.sum_in_group(tensor)


__all__ = ["Communicator", "ProcessGroupCommunicator", "all_reduce", "sum_over_model"]
