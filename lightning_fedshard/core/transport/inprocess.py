"""Federation groups as threads of one process: a communicator without a network.

The :class:`~lightning_fedshard.core.transport.comm.Communicator` of this module meets at barriers, not on sockets.

Each group is one thread holding one whole copy of the model (a group of one rank). Collectives meet at barriers and
combine what every group posted in group order, so their results do not depend on which thread arrives first. The
simulator (:mod:`lightning_fedshard.simulate`) runs a federation's learning this way on one device, with the same
federation core as the strategies; the tests of the core use it too.

With a :class:`Baton`, one group's thread runs at a time, each with random number generators of its own, as if every
group were a process: results do not depend on the threads' timing even when training draws random numbers
(dropout, data loader seeds). A thread gives the baton up only while it waits for others (see
:mod:`~lightning_fedshard.core.transport.waiting`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedshard.core.transport.comm import weighted_sum
from lightning_fedshard.core.transport.waiting import scheduled, waiting

#: Threads of :func:`run_threads` are named this, followed by their index.
GROUP_THREAD_PREFIX = "fedshard-group-"


class InProcessGroups:
    """The meeting point of ``num_groups`` groups running as threads of this process.

    Sums over groups, statistics, site sums and the host's own collectives (a strategy's barriers, broadcasts and
    metric reductions) meet at barriers of their own, as they would on process groups of their own: a sum running in
    a background thread never blocks the training thread's statistics.

    Args:
        num_groups: Groups (threads) that take part in every collective.
        site_blocks: By block size, the blocks of groups of a hierarchical outer topology (default: consecutive).
    """

    def __init__(self, num_groups: int, site_blocks: dict[int, Any] | None = None, _channel: str = "sums") -> None:
        if num_groups < 1:
            raise ValueError(f"`num_groups={num_groups}` must be at least 1.")
        self.num_groups = num_groups
        self.site_blocks = site_blocks or {}
        self._barrier = threading.Barrier(num_groups)
        self._slots: list[Any] = [None] * num_groups
        top = _channel == "sums"
        self.stats = InProcessGroups(num_groups, _channel="stats") if top else self
        self.sites = InProcessGroups(num_groups, self.site_blocks, "sites") if top else self
        self.host = InProcessGroups(num_groups, _channel="host") if top else self

    def communicator(self, group: int) -> InProcessCommunicator:
        """Group ``group``'s communicator."""
        return InProcessCommunicator(self, group)

    def run(self, fn: Callable[[int, InProcessCommunicator], Any], baton: Baton | None = None) -> list[Any]:
        """Run ``fn(group, communicator)`` for every group in a thread of its own; the results in group order.

        Args:
            fn: One group's work.
            baton: Let one group's thread run at a time (see :class:`Baton`); default: all at once.

        Raises:
            BaseException: The first error of any group (the others' collectives are aborted).
        """

        def work(g: int) -> Any:
            if baton is None:
                return fn(g, self.communicator(g))
            with baton.held(g):
                return fn(g, self.communicator(g))

        return run_threads(self.num_groups, work, on_error=self.abort)

    def abort(self) -> None:
        """Break every barrier: threads waiting in a collective raise ``threading.BrokenBarrierError``."""
        for channel in {id(c): c for c in (self, self.stats, self.sites, self.host)}.values():
            channel._barrier.abort()

    def _wait(self) -> None:
        with waiting():
            self._barrier.wait()

    def exchange(self, g: int, posted: Any, combine: Callable[[list[Any]], Any]) -> Any:
        """Every group posts ``posted``; each gets ``combine(all posted, in group order)`` once all have read them."""
        self._slots[g] = posted
        self._wait()
        result = combine(list(self._slots))
        self._wait()
        return result

    def _all_reduce_sum(self, g: int, tensor: Tensor) -> None:
        tensor.copy_(self.exchange(g, tensor.clone(), lambda posted: torch.stack(posted).sum(0)))

    def _site_sum(self, g: int, tensor: Tensor, size: int) -> None:
        blocks = self.site_blocks.get(size) or [range(s, s + size) for s in range(0, self.num_groups, size)]
        (block,) = [b for b in blocks if g in b]
        total = self.exchange(g, tensor.clone(), lambda posted: torch.stack([posted[j] for j in sorted(block)]).sum(0))
        tensor.copy_(total)

    def _all_to_all(self, g: int, output: Tensor, input: Tensor) -> None:
        parts = self.exchange(g, input.clone(), lambda posted: torch.cat([p.chunk(self.num_groups)[g] for p in posted]))
        output.copy_(parts)

    def _all_gather(self, g: int, output: Tensor, input: Tensor) -> None:
        output.copy_(self.exchange(g, input.clone(), torch.cat))


class InProcessCommunicator:
    """One group's :class:`~lightning_fedshard.core.transport.comm.Communicator` in :class:`InProcessGroups`.

    Each group is one rank, so a fed ring is all groups and a group has one shard (:meth:`sum_in_group` does nothing).
    """

    def __init__(self, groups: InProcessGroups, g: int) -> None:
        self._groups = groups
        self._g = g
        self.num_groups = groups.num_groups
        self.group_index = g
        #: Bytes this group sent through :meth:`all_to_all`, :meth:`all_gather` and :meth:`mix_over_groups`, as ring
        #: and point-to-point collectives would send them.
        self.bytes_sent = 0
        #: What :meth:`should_commit` answers (a test may set it to make every rank vote no).
        self.commit = True

    num_replicas = 1
    replica_index = 0

    def participants(self) -> tuple[int, ...]:
        """Every group, in group order."""
        return tuple(range(self.num_groups))

    def joined(self) -> bool:
        """Never: every group takes part from the start."""
        return False

    def sum_over_groups(self, tensor: Tensor) -> None:
        """Replace ``tensor`` by its sum over the groups."""
        self._groups._all_reduce_sum(self._g, tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        """The same, at a barrier of its own."""
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

        return self._groups.exchange(i, tensor.clone(), combine)

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """Every group calls it; each gets the sum over its block of ``size`` groups."""
        self._groups.sites._site_sum(self._g, tensor, size)

    def sum_in_group(self, tensor: Tensor) -> None:
        """Nothing to do: one rank per group."""

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        """Copy ``input``: one replica."""
        output.copy_(input)

    def should_commit(self) -> bool:
        """What :attr:`commit` says."""
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


class Baton:
    """Lets one group's thread run at a time, each group with its own random number generators.

    Every group starts from the generators' state when the baton is made (as processes seeded alike would); a thread
    that gives the baton up saves its group's state, one that takes it restores it. A thread gives it up only while it
    waits for other groups (:func:`~lightning_fedshard.core.transport.waiting.waiting`), so each group draws the same
    numbers in the same order whatever the threads' timing. Torch's CPU and CUDA generators, Python's and NumPy's are
    kept.

    Args:
        num_groups: Groups that take turns.
    """

    def __init__(self, num_groups: int) -> None:
        self._lock = threading.Lock()
        state = _rng_state()
        self._states: list[tuple[Any, ...]] = [state] * num_groups

    @contextmanager
    def held(self, group: int) -> Iterator[None]:
        """Hold the baton for ``group`` in this thread, giving it up during every wait on other groups."""
        self._take(group)
        try:
            with scheduled(lambda: self._given_up(group)):
                yield
        finally:
            self._give(group)

    @contextmanager
    def _given_up(self, group: int) -> Iterator[None]:
        self._give(group)
        try:
            yield
        finally:
            self._take(group)

    def _take(self, group: int) -> None:
        self._lock.acquire()
        _set_rng_state(self._states[group])

    def _give(self, group: int) -> None:
        self._states[group] = _rng_state()
        self._lock.release()

    def current_state(self) -> tuple[Any, ...]:
        """The generator states of the group whose thread holds the baton (call it from that thread).

        Made of tensors and plain Python values only, so a checkpoint holding them loads with ``weights_only=True``.
        """
        cpu, cuda, python, (name, keys, position, has_gauss, gauss) = _rng_state()
        return cpu, cuda, python, (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)

    def restore_state(self, state: Sequence[Any]) -> None:
        """Set the generator states of the group whose thread holds the baton (call it from that thread)."""
        cpu, cuda, python, (name, keys, *rest) = state
        keys = keys.numpy().astype(np.uint32) if isinstance(keys, Tensor) else keys
        _set_rng_state((cpu, cuda, python, (name, keys, *rest)))


def _rng_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _set_rng_state(state: Sequence[Any]) -> None:
    cpu, cuda, python, numpy = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy)


def run_threads(num: int, work: Callable[[int], Any], on_error: Callable[[], None] | None = None) -> list[Any]:
    """Run ``work(i)`` for ``i < num`` in threads of their own; the results in order, or the first error raised.

    ``on_error`` runs as soon as any thread fails (e.g. to abort the barriers the others wait at).
    """
    results: list[Any] = [None] * num
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as e:  # surfaced in the calling thread
            errors.append(e)
            if on_error is not None:
                on_error()

    threads = [threading.Thread(target=target, args=(i,), name=f"{GROUP_THREAD_PREFIX}{i}") for i in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        primary = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (primary or errors)[0]
    return results
