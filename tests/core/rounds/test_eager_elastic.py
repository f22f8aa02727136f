"""Eager updates in an elastic federation: sums in flight when groups join, die, and when a sync is lost.

Each group is a thread; a quorum schedule names the live groups from a step on. Collectives meet over the groups of
the caller's last quorum; one over a group that died fails on every survivor (zeros, and the sync's vote fails), as
torchft's ring does. A group that joins heals from a peer through :class:`ElasticMembership`, the peer's state taken on
a thread of its own while the peer waits in its quorum (as torchft's).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard import Elastic
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.options.config import FederationConfig
from lightning_fedshard.elastic.membership import ElasticMembership

PLANNED = 4


class _World:
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
                    barrier.abort()


class _Group:
    """One group's elastic communicator (the parts a federation and :class:`ElasticMembership` use)."""

    num_replicas = 1
    replica_index = 0

    def __init__(self, world: _World, group: int) -> None:
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


def _config(fragments: int, **options: Any) -> FederationConfig:
    return FederationConfig(
        num_groups=PLANNED, reduce_dtype="float32", sync_every=4, fragments=fragments, eager_updates=True, **options
    )


def _update(g: int, step: int, shards: list[Tensor]) -> None:
    """Training that depends on where a round starts (each group pulls towards targets of its own)."""
    for u, shard in enumerate(shards):
        shard.sub_(0.3 * (shard - (g + 1) * (u + 1)) - 0.05 * float(torch.tensor(step + g).sin()))


def _run(
    world: _World,
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
        view = _Group(world, g)
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
            _update(g, step, shards)
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
            "sums": {f: (p.participants, p.joined) for f, p in fed.round.sums.items()},  # type: ignore[attr-defined]
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


def _equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_joining_group_lands_the_sums_in_flight_as_its_peers(fragments):
    # Groups 0 and 1 from the start; group 2 heals at the peers' sync after step 6 (fragment 0's with two fragments,
    # while fragment 1's sum, started at step 4, is in flight) and adds nothing to the sum that starts there.
    join = 6 if fragments == 2 else 8
    world = _World({0: (0, 1), join: (0, 1, 2)})
    runs = _run(world, _config(fragments, outer_optimizer="nesterov"), 16, {0: 0, 1: 0, 2: join})
    assert world.waited_in_heal == [False]  # every sum was complete before the quorum
    healed = world.heals[join]["round"]["eager"]
    assert sorted(healed) == ([1] if fragments == 2 else [])  # fragment 1's sum in flight, completed
    peers, joiner = runs[0], runs[2]
    for step, anchors in joiner["anchors"].items():
        assert _equal(anchors, peers["anchors"][step]) and _equal(anchors, runs[1]["anchors"][step]), step
    assert len(joiner["anchors"]) == (16 - join) * fragments // 4
    assert _equal(joiner["final"], peers["final"]) and _equal(joiner["anchor"], peers["anchor"])
    assert _equal(peers["final"], peers["anchor"])  # the end of training puts every group on the anchor
    assert all(run["lost"] == 0 for run in runs.values())


def _reference(quorums: dict[int, tuple[int, ...]], lost: set[int], steps: int) -> dict[int, list[Tensor]]:
    """One fragment, FedAvg, the share rule, by hand: the anchor after each sync (syncs every 4 steps)."""
    anchor = [torch.full((2,), float(u)) for u in range(3)]
    starts = {g: [a.clone() for a in anchor] for g in quorums[0]}
    in_flight: list[Tensor] | None = None
    anchors = {}
    for sync in range(4, steps + 1, 4):
        members = [live for first, live in sorted(quorums.items()) if first <= sync][-1]
        own = {}
        for g in members:
            weights = [s.clone() for s in starts[g]]
            for step in range(sync - 3, sync + 1):
                _update(g, step, weights)
            own[g] = [s - w for s, w in zip(starts[g], weights)]
        if in_flight is not None and sync not in lost:
            anchor = [a - m for a, m in zip(anchor, in_flight)]
        in_flight = [sum(d[u] for d in own.values()) / len(own) for u in range(3)]
        starts = {g: [a - d / len(own) for a, d in zip(anchor, own[g])] for g in members}
        anchors[sync] = anchor
    return anchors


def test_the_survivors_lose_the_landing_whose_sum_a_dead_group_was_in_and_go_on():
    # Group 2 dies before step 6 (its sum of step 4 complete): the survivors' vote at step 8 fails (the ring of the
    # sum that lands then holds it), the anchor stays, and the sum they start at step 8 lands at step 12 without it.
    world = _World({0: (0, 1, 2), 8: (0, 1)})
    runs = _run(world, _config(1), 16, {0: 0, 1: 0, 2: 0}, dies={2: 6})
    expected = _reference({0: (0, 1, 2), 8: (0, 1)}, lost={8}, steps=16)
    for g in (0, 1):
        assert runs[g]["lost"] == 1
        assert _equal(runs[g]["anchors"][8], runs[g]["anchors"][4])  # nothing landed at step 8
        for step, anchor in expected.items():
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(runs[g]["anchors"][step], anchor)), step
    assert _equal(runs[0]["anchor"], runs[1]["anchor"])


def test_a_failed_vote_drops_every_sum_in_flight():
    # Two fragments: group 2 dies before step 5; at step 6 fragment 0's landing (its sum of step 2, with group 2) is
    # lost and fragment 1's sum of step 4 is dropped with it: at step 8 fragment 1 lands nothing.
    world = _World({0: (0, 1, 2), 6: (0, 1)})
    config = _config(2)
    steps: dict[int, Any] = {}

    original = Federation.maybe_sync

    def recording(self: Federation, step: int) -> Any:
        stats = original(self, step)
        if self.communicator.group_index == 0 and step in (6, 8):
            sums = self.round.sums  # type: ignore[attr-defined]
            steps[step] = (stats, {f: p.participants for f, p in sums.items()})
        return stats

    Federation.maybe_sync = recording  # type: ignore[method-assign]
    try:
        runs = _run(world, config, 12, {0: 0, 1: 0, 2: 0}, dies={2: 5})
    finally:
        Federation.maybe_sync = original  # type: ignore[method-assign]
    stats, sums = steps[6]
    assert stats.lost and sums == {0: (0, 1)}  # fragment 1's sum of step 4 (groups 0, 1, 2) is gone
    stats, sums = steps[8]
    assert stats is None and sums == {0: (0, 1), 1: (0, 1)}  # nothing landed; a new sum started
    assert runs[0]["lost"] == runs[1]["lost"] == 2
    assert _equal(runs[0]["anchor"], runs[1]["anchor"]) and _equal(runs[0]["final"], runs[1]["final"])


@pytest.mark.parametrize("stop_at", [7, 9])
def test_a_federation_whose_groups_changed_resumes_exactly_with_sums_in_flight(stop_at):
    # Group 2 joined at step 6; the federation stops after step 7 or 9 with both fragments' sums in flight, one of them
    # started without group 2, and resumes from what each group saved.
    quorums = {0: (0, 1), 6: (0, 1, 2)}
    config = _config(2, outer_optimizer="nesterov")
    straight = _run(_World(quorums), config, 14, {0: 0, 1: 0, 2: 6})
    saved = _run(_World(quorums), config, 14, {0: 0, 1: 0, 2: 6}, stop_at=stop_at)
    in_flight = {int(f): s["participants"] for f, s in saved[0]["state"]["eager"].items()}
    assert in_flight == ({0: [0, 1, 2], 1: [0, 1]} if stop_at == 7 else {0: [0, 1, 2], 1: [0, 1, 2]})
    resumed = _run(_World({0: (0, 1, 2)}), config, 14, {0: 0, 1: 0, 2: 0}, resume=saved)
    for g in range(3):
        for step in range(stop_at + 1, 15):
            assert _equal(straight[g]["history"][step], resumed[g]["history"][step]), (g, step)
        assert _equal(straight[g]["final"], resumed[g]["final"]) and _equal(straight[g]["anchor"], resumed[g]["anchor"])
