"""Eager updates in an elastic federation: sums in flight when groups join, die, and when a sync is lost.

The groups are threads of one process (:mod:`tests.core.rounds.ring_world`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from tests.core.rounds.ring_world import PLANNED, World, equal, run_groups, update


def _config(fragments: int, **options: Any) -> FederationConfig:
    return FederationConfig(
        num_groups=PLANNED, reduce_dtype="float32", sync_every=4, fragments=fragments, eager_updates=True, **options
    )


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_joining_group_lands_the_sums_in_flight_as_its_peers(fragments):
    # Groups 0 and 1 from the start; group 2 heals at the peers' sync after step 6 (fragment 0's with two fragments,
    # while fragment 1's sum, started at step 4, is in flight) and adds nothing to the sum that starts there.
    join = 6 if fragments == 2 else 8
    world = World({0: (0, 1), join: (0, 1, 2)})
    runs = run_groups(world, _config(fragments, outer_optimizer="nesterov"), 16, {0: 0, 1: 0, 2: join})
    assert world.waited_in_heal == [False]  # every sum was complete before the quorum
    healed = world.heals[join]["round"]["eager"]
    assert sorted(healed) == ([1] if fragments == 2 else [])  # fragment 1's sum in flight, completed
    peers, joiner = runs[0], runs[2]
    for step, anchors in joiner["anchors"].items():
        assert equal(anchors, peers["anchors"][step]) and equal(anchors, runs[1]["anchors"][step]), step
    assert len(joiner["anchors"]) == (16 - join) * fragments // 4
    assert equal(joiner["final"], peers["final"]) and equal(joiner["anchor"], peers["anchor"])
    assert equal(peers["final"], peers["anchor"])  # the end of training puts every group on the anchor
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
                update(g, step, weights)
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
    world = World({0: (0, 1, 2), 8: (0, 1)})
    runs = run_groups(world, _config(1), 16, {0: 0, 1: 0, 2: 0}, dies={2: 6})
    expected = _reference({0: (0, 1, 2), 8: (0, 1)}, lost={8}, steps=16)
    for g in (0, 1):
        assert runs[g]["lost"] == 1
        assert equal(runs[g]["anchors"][8], runs[g]["anchors"][4])  # nothing landed at step 8
        for step, anchor in expected.items():
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(runs[g]["anchors"][step], anchor)), step
    assert equal(runs[0]["anchor"], runs[1]["anchor"])


def test_a_failed_vote_drops_every_sum_in_flight():
    # Two fragments: group 2 dies before step 5; at step 6 fragment 0's landing (its sum of step 2, with group 2) is
    # lost and fragment 1's sum of step 4 is dropped with it: at step 8 fragment 1 lands nothing.
    world = World({0: (0, 1, 2), 6: (0, 1)})
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
        runs = run_groups(world, config, 12, {0: 0, 1: 0, 2: 0}, dies={2: 5})
    finally:
        Federation.maybe_sync = original  # type: ignore[method-assign]
    stats, sums = steps[6]
    assert stats.lost and sums == {0: (0, 1)}  # fragment 1's sum of step 4 (groups 0, 1, 2) is gone
    stats, sums = steps[8]
    assert stats is None and sums == {0: (0, 1), 1: (0, 1)}  # nothing landed; a new sum started
    assert runs[0]["lost"] == runs[1]["lost"] == 2
    assert equal(runs[0]["anchor"], runs[1]["anchor"]) and equal(runs[0]["final"], runs[1]["final"])


@pytest.mark.parametrize("stop_at", [7, 9])
def test_a_federation_whose_groups_changed_resumes_exactly_with_sums_in_flight(stop_at):
    # Group 2 joined at step 6; the federation stops after step 7 or 9 with both fragments' sums in flight, one of them
    # started without group 2, and resumes from what each group saved.
    quorums = {0: (0, 1), 6: (0, 1, 2)}
    config = _config(2, outer_optimizer="nesterov")
    straight = run_groups(World(quorums), config, 14, {0: 0, 1: 0, 2: 6})
    saved = run_groups(World(quorums), config, 14, {0: 0, 1: 0, 2: 6}, stop_at=stop_at)
    in_flight = {int(f): s["participants"] for f, s in saved[0]["state"]["eager"].items()}
    assert in_flight == ({0: [0, 1, 2], 1: [0, 1]} if stop_at == 7 else {0: [0, 1, 2], 1: [0, 1, 2]})
    resumed = run_groups(World({0: (0, 1, 2)}), config, 14, {0: 0, 1: 0, 2: 0}, resume=saved)
    for g in range(3):
        for step in range(stop_at + 1, 15):
            assert equal(straight[g]["history"][step], resumed[g]["history"][step]), (g, step)
        assert equal(straight[g]["final"], resumed[g]["final"]) and equal(straight[g]["anchor"], resumed[g]["anchor"])
