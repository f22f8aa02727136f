"""Sampled participation in an elastic federation: the sample is drawn among the sync's live groups.

Each group is a thread (``core/transport/inprocess.py``) that an elastic communicator's view relabels: thread ``t`` runs
the live group ``labels[t]`` of the planned ones, and the participants of a sync are the live groups in ring order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard import Elastic, Gossip, Mixing, Sampled
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.options.config import FederationConfig
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.live import Live, assert_resumed_exactly, run_live

PLANNED = 4


def _config(topology: Sampled, **options: Any) -> FederationConfig:
    return FederationConfig(num_groups=PLANNED, reduce_dtype="float32", outer_topology=topology, **options)


def test_an_elastic_federation_takes_sampled_participation_and_sampled_mixes_but_not_a_fixed_matrix():
    for topology in (Sampled(2, outer_step=True), Sampled(2), Gossip(peers=1)):  # drawn among the live groups
        assert _config(topology, elastic=Elastic(group=1)).elastic is not None
    with pytest.raises(ValueError, match=r"`elastic=Elastic\(\.\.\.\)` and `outer_topology=Mixing\("):
        _config(Mixing([[0.5, 0.5], [0.5, 0.5]]), elastic=Elastic(group=1))  # a matrix of the planned groups


@pytest.mark.parametrize(("live", "per_round"), [((0, 2, 3), 2), ((1, 3), 3)])
def test_the_sample_is_drawn_by_position_among_the_live_groups(live, per_round):
    """Each landing's mean runs over ``sample(round, len(live))`` positions of the live groups, asked once per sync;
    with fewer live groups than ``groups_per_round`` every one of them adds."""
    topology = Sampled(per_round, seed=5, outer_step=True)
    config = _config(topology, sync_every=1)
    rounds = 4

    def work(t: int, comm: Any) -> tuple[list[Tensor], list[Tensor], dict[int, int]]:
        view = Live(comm, t, [(0, live)])
        fed = Federation(config, view)
        shard = torch.zeros(3)
        fed.start([shard], step=0)
        anchors, shards = [], []
        for step in range(1, rounds + 1):
            view.step = step
            shard.add_(float(view.group_index + 1) * step)  # group g moves by (g + 1) * step from the anchor
            fed.maybe_sync(step)
            anchors.append(fed.outer.anchor[0].detach().clone())
            shards.append(shard.clone())
        return anchors, shards, view.asked

    expected, anchor = [], 0.0
    for r in range(rounds):
        chosen = [live[p] for p in topology.sample(r, len(live))]
        anchor += sum(float(g + 1) * (r + 1) for g in chosen) / len(chosen)
        expected.append(anchor)
    samples = {tuple(topology.sample(r, len(live))) for r in range(rounds)}
    assert len(samples) > 1 or per_round >= len(live)  # the sample changes between rounds
    for anchors, shards, asked in InProcessGroups(len(live)).run(work):
        assert asked == {step: 1 for step in range(1, rounds + 1)}  # no quorum of its own for the sample
        for r in range(rounds):
            assert anchors[r] == pytest.approx(torch.full((3,), expected[r]), abs=1e-5)
            assert torch.equal(shards[r], anchors[r])  # every group, sampled or idle, restarts from the anchor


def test_a_sample_of_only_a_joining_group_moves_no_anchor_and_every_group_restarts_from_it():
    topology = Sampled(1, seed=5, outer_step=True)
    assert topology.sample(0, 2) == [1] and topology.sample(1, 2) == [0]
    config = _config(topology, sync_every=2)

    def work(t: int, comm: Any) -> list[tuple[int, Tensor, Tensor]]:
        view = Live(comm, t, [(0, (0, 1)), (2, (0, 3))], {3: 2})  # group 3 replaces group 1 before step 2
        fed = Federation(config, view)
        shard = torch.zeros(2)
        fed.start([shard], step=0)
        seen = []
        for step in range(1, 5):
            view.step = step
            if step == 2 and t == 1:
                fed.outer.copy_anchor_to_shards()
            shard.add_(float(view.group_index + 1))
            stats = fed.maybe_sync(step)
            if stats is not None:
                seen.append((stats.num_syncs, fed.outer.anchor[0].detach().clone(), shard.clone()))
        return seen

    for first, second in InProcessGroups(2).run(work):
        assert first[0] == 0 and torch.equal(first[1], torch.zeros(2))  # the sample was the joining group 3 alone
        assert torch.equal(first[2], first[1])  # group 0 trained, and restarts from the anchor all the same
        assert second[0] == 1 and torch.equal(second[1], torch.full((2,), 2.0))  # round 1: group 0's two steps
        assert torch.equal(second[2], second[1])


def _run(
    sync_delay: int, stop_at: int | None = None, resume: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Three live groups of four, Nesterov: groups (0, 1, 2) until group 1 is gone before step 6 and group 3 takes its
    thread (healed: the anchor), joining the sync that lands at step 8. Every group's weights after every step."""
    config = _config(
        Sampled(2, seed=2, outer_step=True), sync_every=4, outer_optimizer="nesterov", sync_delay=sync_delay
    )
    labels = [(0, (0, 1, 2)), (6, (0, 3, 2))]
    return run_live(config, labels, {3: 8 - sync_delay}, 14, stop_at=stop_at, resume=resume)


@pytest.mark.parametrize(("sync_delay", "stop_at"), [(0, 6), (1, 7), (1, 10)])
def test_a_federation_whose_live_groups_changed_resumes_exactly(sync_delay, stop_at):
    straight = _run(sync_delay)
    assert straight[0]["landed"][8].joined_groups == (3,)  # the new group joined the sync at step 8
    saved = _run(sync_delay, stop_at=stop_at)
    if stop_at == 7:
        assert all(s["state"]["pending"]["participants"] == [0, 3, 2] for s in saved)  # a sum in flight
    assert_resumed_exactly(straight, _run(sync_delay, resume=saved), stop_at)
