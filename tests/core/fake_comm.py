"""An in-process communicator: each federation group is a thread, collectives meet at a barrier."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class ThreadGroups:
    """Runs ``fn(group_index, communicator)`` for every group in its own thread and returns the results."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self._barrier = threading.Barrier(num_groups)
        self._slots: list[Tensor | None] = [None] * num_groups

    def run(self, fn: Callable[[int, Any], Any]) -> list[Any]:
        results: list[Any] = [None] * self.num_groups
        errors: list[BaseException] = []

        def target(g: int) -> None:
            try:
                results[g] = fn(g, _ThreadCommunicator(self, g))
            except BaseException as e:  # surfaced in the main thread
                errors.append(e)
                self._barrier.abort()

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


class _ThreadCommunicator:
    def __init__(self, groups: ThreadGroups, g: int) -> None:
        self._groups = groups
        self._g = g
        self.num_groups = groups.num_groups
        self.group_index = g

    def sum_across_groups(self, tensor: Tensor) -> None:
        self._groups._all_reduce_sum(self._g, tensor)

    def average_across_groups(self, tensor: Tensor) -> None:
        self._groups._all_reduce_sum(self._g, tensor)
        tensor.div_(self.num_groups)

    def sum_across_model(self, tensor: Tensor) -> None:
        self._groups._all_reduce_sum(self._g, tensor)
