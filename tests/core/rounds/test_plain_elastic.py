"""The plain round in an elastic federation: a sync lost to a group that died inside it carries the round on.

The groups are threads of one process (:mod:`tests.core.rounds.ring_world`); the expected weights are computed by
hand here from the same training rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard.core.config import FederationConfig
from tests.core.rounds.ring_world import PLANNED, World, equal, run_groups, update


def _config(**options: Any) -> FederationConfig:
    return FederationConfig(num_groups=PLANNED, reduce_dtype="float32", sync_every=4, **options)


def _trained(g: int, start: list[Tensor], steps: range) -> list[Tensor]:
    weights = [s.clone() for s in start]
    for step in steps:
        update(g, step, weights)
    return weights


def _fedavg(anchor: list[Tensor], trained: list[list[Tensor]]) -> list[Tensor]:
    return [a - sum(a - w[u] for w in trained) / len(trained) for u, a in enumerate(anchor)]


@pytest.mark.parametrize("sync_delay", [0, 1])
def test_a_sync_lost_to_a_dead_group_keeps_every_survivors_round_for_the_next_sync(sync_delay):
    # Group 2 dies before step 6; the ring of the sync at step 8 still holds it, so that sync fails on the survivors
    # and is lost. Their weights are not sent back to the anchor: the sync at step 12 sums 8 steps of training (its
    # pseudo-gradient taken `sync_delay` steps before it lands, when the next quorum has formed).
    d = sync_delay
    world = World({0: (0, 1, 2), 12 - d: (0, 1)})
    runs = run_groups(world, _config(sync_delay=d), 16, {0: 0, 1: 0, 2: 0}, dies={2: 6})
    initial = [torch.full((2,), float(u)) for u in range(3)]
    anchor_4 = _fedavg(initial, [_trained(g, initial, range(1, 5 - d)) for g in (0, 1, 2)])
    anchor_12 = _fedavg(anchor_4, [_trained(g, anchor_4, range(5, 13 - d)) for g in (0, 1)])
    anchor_16 = _fedavg(anchor_12, [_trained(g, anchor_12, range(13, 17 - d)) for g in (0, 1)])
    for g in (0, 1):
        run = runs[g]
        assert run["lost"] == 1
        assert equal(run["anchors"][8], run["anchors"][4])  # nothing landed at step 8
        close = lambda a, b: all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))  # noqa: E731
        assert close(run["anchors"][4], anchor_4)
        assert close(run["history"][8], _trained(g, anchor_4, range(5, 9)))  # the round goes on from where it was
        assert close(run["anchors"][12], anchor_12) and close(run["anchors"][16], anchor_16)
        assert equal(run["final"], run["anchor"])  # the end of training puts every group on the anchor
    assert equal(runs[0]["anchor"], runs[1]["anchor"])


def test_a_last_sync_that_is_lost_ends_every_group_on_the_anchor_it_kept():
    # Group 2 dies before step 14: the final sync's ring holds it, the sync is lost, and no sync follows to carry the
    # round: every survivor ends on the anchor of step 12.
    world = World({0: (0, 1, 2)})
    runs = run_groups(world, _config(), 16, {0: 0, 1: 0, 2: 0}, dies={2: 14})
    for g in (0, 1):
        assert runs[g]["lost"] == 1 and equal(runs[g]["final"], runs[g]["anchors"][12])
        assert equal(runs[g]["anchor"], runs[g]["anchors"][12])
