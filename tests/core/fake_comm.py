"""An in-process communicator: each federation group is a thread, collectives meet at a barrier."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.comm import weighted_sum


class ThreadGroups:
    """Runs ``fn(group_index, communicator)`` for every group in its own thread and returns the results."""

    def __init__(self, num_groups: int, _channel: str = "sums", site_blocks: dict[int, Any] | None = None) -> None:
        self.num_groups = num_groups
        self.site_blocks = site_blocks or {}  # by block size, the blocks of a hierarchical topology (else consecutive)
        self._barrier = threading.Barrier(num_groups)
        self._slots: list[Tensor | None] = [None] * num_groups
        # The statistics meet at a barrier of their own, as they do on a process group of their own; so do the site
        # sums (the sites' process groups), which may run while a background sum is on the fed ring.
        self.stats = ThreadGroups(num_groups, "stats") if _channel == "sums" else self
        self.sites = ThreadGroups(num_groups, "sites", self.site_blocks) if _channel == "sums" else self

    def run(self, fn: Callable[[int, Any], Any]) -> list[Any]:
        results: list[Any] = [None] * self.num_groups
        errors: list[BaseException] = []

        def target(g: int) -> None:
            try:
                results[g] = fn(g, _ThreadCommunicator(self, g))
            except BaseException as e:  # surfaced in the main thread
                errors.append(e)
                self._barrier.abort()
                self.stats._barrier.abort()
                self.sites._barrier.abort()

        threads = [threading.Thread(target=target, args=(g,)) for g in range(self.num_groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def _all_reduce_sum(self, g: int, tensor: Tensor) -> None:
        self._slots[g] = tensor.clone()
        self._barrier.wait()
        total = torch.stack([s for s in self._slots]).sum(0)  # type: ignore[misc]
        self._barrier.wait()
        tensor.copy_(total)

    def _site_sum(self, g: int, tensor: Tensor, size: int) -> None:
        blocks = self.site_blocks.get(size) or [range(s, s + size) for s in range(0, self.num_groups, size)]
        (block,) = [b for b in blocks if g in b]
        tensor.copy_(self._exchange(g, tensor, lambda posted: torch.stack([posted[j] for j in sorted(block)]).sum(0)))

    def _exchange(self, g: int, input: Tensor, combine: Callable[[list[Tensor]], Tensor]) -> Tensor:
        """Every group posts ``input``; each gets ``combine(all posted tensors)`` once all have read them."""
        self._slots[g] = input.clone()
        self._barrier.wait()
        result = combine([s for s in self._slots])  # type: ignore[misc]
        self._barrier.wait()
        return result

    def _all_to_all(self, g: int, output: Tensor, input: Tensor) -> None:
        output.copy_(self._exchange(g, input, lambda posted: torch.cat([p.chunk(self.num_groups)[g] for p in posted])))

    def _all_gather(self, g: int, output: Tensor, input: Tensor) -> None:
        output.copy_(self._exchange(g, input, lambda posted: torch.cat(posted)))


class _ThreadCommunicator:
    """One group's :class:`~lightning_fedshard.core.comm.Communicator`: each group is one rank, so a fed ring is all
    groups and a group has one shard (``sum_in_group`` does nothing)."""

    # Bytes this group sent through `all_to_all` / `all_gather`, as ring collectives send them.
    bytes_sent: int = 0

    def __init__(self, groups: ThreadGroups, g: int) -> None:
        self._groups = groups
        self._g = g
        self.num_groups = groups.num_groups
        self.group_index = g
        #: What :meth:`should_commit` answers (a test may set it to make every rank vote no).
        self.commit = True

    def participants(self) -> tuple[int, ...]:
        return tuple(range(self.num_groups))

    def joined(self) -> bool:
        return False

    def sum_over_groups(self, tensor: Tensor) -> None:
        self._groups._all_reduce_sum(self._g, tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        self._groups.stats._all_reduce_sum(self._g, tensor)

    def mix_over_groups(
        self, tensor: Tensor, matrix: Tensor, decode: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """Every group calls it; group ``i`` gets ``sum_j matrix[i, j] decode(tensor_j)``, the terms in group order."""
        i = self._g
        sent = [j for j in range(self.num_groups) if j != i and matrix[j, i] > 0]
        self.bytes_sent += len(sent) * tensor.numel() * tensor.element_size()

        def combine(posted: list[Tensor]) -> Tensor:
            terms = {j: posted[j] for j in range(self.num_groups) if j == i or matrix[i, j] > 0}
            return weighted_sum(terms, matrix[i], decode)

        return self._groups._exchange(i, tensor, combine)

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """Every group calls it; each gets the sum over its block of ``size`` groups."""
        self._groups.sites._site_sum(self._g, tensor, size)

    def sum_in_group(self, tensor: Tensor) -> None:
        pass  # one rank per group

    num_replicas = 1
    replica_index = 0

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        output.copy_(input)  # one replica

    def should_commit(self) -> bool:
        return self.commit

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Equal parts of ``input`` go to each group; ``output`` part ``j`` comes from group ``j``."""
        nbytes = input.numel() * input.element_size()
        assert nbytes % self.num_groups == 0 and output.shape == input.shape
        self.bytes_sent += nbytes * (self.num_groups - 1) // self.num_groups  # its own part stays home
        self._groups._all_to_all(self._g, output, input)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """``output`` = every group's ``input`` concatenated in group order."""
        assert output.numel() == input.numel() * self.num_groups
        self.bytes_sent += input.numel() * input.element_size() * (self.num_groups - 1)  # a ring forwards G - 1
        self._groups._all_gather(self._g, output, input)
