"""Groups of an elastic federation as threads of one process, whose rings fail when a group dies.

Each group is a thread; a quorum schedule names the live groups from a step on. Collectives meet over the groups of
the caller's last quorum; one over a group that died fails on every survivor (zeros, and the sync's vote fails), as
torchft's ring does. A group that joins heals from a peer through :class:`ElasticMembership`, the peer's state taken on
a thread of its own while the peer waits in its quorum (as torchft's).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard import Elastic
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.elastic.membership import ElasticMembership

#: The groups the federation is planned for.
PLANNED = 4


class World:
    """The groups' threads: the quorums' schedule, who died, the heals handed over, and the rings' meeting points."""

    def __init__(self, quorums: dict[int, tuple[int, ...]]) -> None:
        self.quorums = quorums  # first step -> live groups in ring order
        self.dead: set[int] = set()
        self.heals: dict[int, dict[str, Any]] = {}
        self.healed = {step: threading.Event() for step in quorums}
        self.waited_in_heal: list[bool] = []  # whether taking a peer's state found a sum still running
        self._lock = threading.Lock()
        self._barriers: dict[tuple[str, tuple[int, ...]], threading.Barrier] = {}
        self._slots: dict[tuple[str, tuple[int, ...]], dict[int, Tensor]] = {}

    def members(self, step: int) -> tuple[int, ...]:
        return [live for first, live in sorted(self.quorums.items()) if first <= step][-1]

    def sum(self, channel: str, ring: tuple[int, ...], group: int, tensor: Tensor) -> bool:
        """Sum ``tensor`` over ``ring``; ``False`` (nothing summed) if a group of it died."""
        key = (channel, ring)
        with self._lock:
            if self.dead & set(ring):
                return False
            barrier = self._barriers.setdefault(key, threading.Barrier(len(ring)))
            slots = self._slots.setdefault(key, {})
        slots[group] = tensor.clone()
        try:
            barrier.wait(timeout=60)
            total = torch.zeros_like(tensor)
            for g in ring:
                total += slots[g]
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            return False
        tensor.copy_(total)
        return True

    def die(self, group: int) -> None:
        with self._lock:
            self.dead.add(group)
            for (_, ring), barrier in self._barriers.items():
                if group in ring:
                    threading.Thread(target=_abort_once_released, args=(barrier,), daemon=True).start()


def _abort_once_released(barrier: threading.Barrier) -> None:
    """Abort ``barrier`` once it has released the collective it may be finishing.

    A barrier still releasing the threads of a collective the dead group finished (``threading.Barrier``'s draining
    state) would fail that finished collective on the threads not yet awake; aborted after it, it fails every later
    collective over the dead group's ring, also of a thread that entered it just before the group died.
    """
    while getattr(barrier, "_state", 0) == 1:
        time.sleep(0.001)
    barrier.abort()


class Group:
    """One group's elastic communicator (the parts a federation and :class:`ElasticMembership` use)."""

    num_replicas = 1
    replica_index = 0

    def __init__(self, world: World, group: int) -> None:
        self.world, self.group_index = world, group
        self.options = Elastic(group=group)
        self.step = 0
        self.on_new_members: Any = None
        self.last_heal_seconds: float | None = None
        self._ring: tuple[int, ...] = ()
        self._taken = self._joined = self._failed = False
        self._save: Any = None
        self._load: Any = None
        self._fed: Any = None  # the group's federation, whose sums the test checks at a heal

    def set_heal(self, save: Any, load: Any) -> None:
        self._save, self._load = save, load

    def quorum(self, joining: bool = False) -> tuple[int, ...]:
        world, step = self.world, self.step
        ring = world.members(step)
        self._failed, self._joined = False, joining
        if joining:
            assert world.healed[step].wait(60)
            self._load(world.heals[step])
        elif step > 0 and step in world.quorums and any(g not in world.members(step - 1) for g in ring):
            if self.group_index == min(g for g in ring if g in world.members(step - 1)):  # the heal source
                world.waited_in_heal.append(any(not p.done for p in self._fed.round.in_flight()))
                source = threading.Thread(target=lambda: world.heals.__setitem__(step, self._save()))
                source.start()  # torchft's thread, while this group waits in its quorum
                source.join(timeout=60)
                assert not source.is_alive(), "taking this group's state blocked"
                world.healed[step].set()
        if ring != self._ring and self.on_new_members is not None:
            self.on_new_members(ring)
        self._ring, self._taken = ring, True
        return ring

    def participants(self) -> tuple[int, ...]:
        if not self._taken:
            self.quorum()
        self._taken = False
        return self._ring

    def joined(self) -> bool:
        return self._joined

    def _collective(self, channel: str, tensor: Tensor) -> None:
        if self._failed or not self.world.sum(channel, self._ring, self.group_index, tensor):
            self._failed = True
            tensor.zero_()

    def sum_over_groups(self, tensor: Tensor) -> None:
        self._collective("sums", tensor)

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        self._collective("stats", tensor)

    def sum_in_group(self, tensor: Tensor) -> None:
        pass

    def gather_replicas(self, output: Tensor, input: Tensor) -> None:
        output.copy_(input)

    def should_commit(self) -> bool:
        return not self._failed

    def state_dict(self) -> dict[str, int]:
        return {"step": 0, "batches_committed": 0}

    def load_state_dict(self, state: Any) -> None:
        pass


def update(g: int, step: int, shards: list[Tensor]) -> None:
    """Training that depends on where a round starts (each group pulls towards targets of its own)."""
    for u, shard in enumerate(shards):
        shard.sub_(0.3 * (shard - (g + 1) * (u + 1)) - 0.05 * float(torch.tensor(step + g).sin()))


def run_groups(
    world: World,
    config: FederationConfig,
    steps: int,
    starts: dict[int, int],
    dies: dict[int, int] | None = None,
    stop_at: int | None = None,
    resume: dict[int, dict[str, Any]] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every group's anchors after each of its syncs, its weights after each step and its final anchor.

    ``starts``: the step each group enters at (0: the federation's start; later: it joins and heals); ``dies``: the
    step before whose training a group dies (it completes its sums in flight first).
    """
    dies = dies or {}
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def work(g: int) -> None:
        view = Group(world, g)
        shards = [torch.full((2,), float(u)) for u in range(3)]
        fed = Federation(config, view)  # type: ignore[arg-type]
        view._fed = fed
        membership = ElasticMembership(fed, view)  # type: ignore[arg-type]
        fed.start(shards, step=0)
        first = starts[g] + 1
        if resume is not None:
            for shard, saved in zip(shards, resume[g]["shards"]):
                shard.copy_(saved)
            fed.load_state_dict(resume[g]["state"])
            fed.load_group_state_dict(resume[g]["group"])
            first = resume[g]["step"] + 1
            view._ring = world.members(first)  # the quorum the groups restarted with
        elif starts[g] > 0:
            view.step = starts[g]
            step, _ = membership.join(starts[g])
            assert step == starts[g]
        anchors, history = {}, {}
        for step in range(first, steps + 1):
            view.step = step
            if dies.get(g) == step:
                for pending in fed.round.in_flight():
                    pending.result()
                world.die(g)
                return
            update(g, step, shards)
            fed.maybe_sync(step)
            if step == fed.last_synced_step:
                anchors[step] = [a.detach().clone() for a in fed.outer.anchor]
            history[step] = [s.clone() for s in shards]
            if step == stop_at:
                state = {"state": fed.state_dict(), "group": fed.group_state_dict(), "step": step}
                results[g] = {**state, "shards": history[step]}
                return
        fed.finish(steps)
        results[g] = {
            "anchors": anchors,
            "history": history,
            "final": [s.clone() for s in shards],
            "anchor": [a.detach().clone() for a in fed.outer.anchor],
            "lost": fed.outer.syncs_lost,
            "sums": {f: (p.participants, p.joined) for f, p in getattr(fed.round, "sums", {}).items()},  # eager
        }

    def target(g: int) -> None:
        try:
            work(g)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)
            world.die(g)

    threads = [threading.Thread(target=target, args=(g,)) for g in starts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    return results


def equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
