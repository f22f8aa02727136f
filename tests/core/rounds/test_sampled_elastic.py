"""Sampled participation in an elastic federation: the sample is drawn among the sync's live groups.

Each group is a thread (``core/transport/inprocess.py``) that an elastic communicator's view relabels: thread ``t`` runs
the live group ``labels[t]`` of the planned ones, and the participants of a sync are the live groups in ring order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Elastic, Gossip, Mixing, Sampled
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.live import Live, assert_resumed_exactly, run_live, update

PLANNED = 4


def _config(topology: Sampled, **options: Any) -> FederationConfig:
    return FederationConfig(num_groups=PLANNED, reduce_dtype="float32", outer_topology=topology, **options)


RING = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]


def test_an_elastic_federation_takes_sampled_participation_sampled_mixes_and_a_fixed_matrix():
    for topology in (Sampled(2, outer_step=True), Sampled(2), Gossip(peers=1), Mixing(RING)):
        assert _config(topology, elastic=Elastic(group=1)).elastic is not None


def _replay_ring(labels: list[tuple[int, tuple[int, ...]]], joined_at: dict[int, int], steps: int) -> dict[str, Any]:
    """Independently: every live group's weights after every step under the ring of the planned groups, its gone and
    joining groups' columns left out and each row renormalized (float64); the end: the plain mean of the last ones."""
    ring = torch.tensor(RING, dtype=torch.float64)
    held = {g: [torch.full((2,), float(u)) for u in range(3)] for g in range(PLANNED)}
    anchor = [torch.full((2,), float(u)) for u in range(3)]
    history: dict[int, dict[int, list[Tensor]]] = {}
    live: tuple[int, ...] = ()
    starts = {first for first, _ in labels}
    for step in range(1, steps + 1):
        live = [groups for first, groups in labels if first <= step][-1]
        for g in live:
            if step in starts and g not in labels[0][1]:
                held[g] = [a.clone() for a in anchor]  # a new group took the federation's state
            update(g, step, held[g])
        if step % 4 == 0:
            adding = [g for g in live if joined_at.get(g) != step]
            mixed = {}
            for g in live:
                row = {h: float(ring[g, h]) for h in adding}
                mass = sum(row.values())
                mixed[g] = held[g] if mass == 0 else [
                    sum(w / mass * held[h][u].double() for h, w in row.items()).float() for u in range(3)
                ]  # fmt: skip
            held.update(mixed)
        history[step] = {g: [s.clone() for s in held[g]] for g in live}
    final = [torch.stack([held[g][u] for g in live]).mean(0) for u in range(3)]
    return {"history": history, "final": final, "live": live}


def test_a_fixed_matrix_mixes_the_live_groups_by_their_planned_rows_and_columns():
    """Group 1 of four planned is gone before step 6 and group 3 takes its thread, joining the mix after step 8: each
    live group takes its row of the ring over the live groups that add, renormalized (the gone group's column left
    out), as an independent replay computes it."""
    labels, joined_at = [(0, (0, 1, 2)), (6, (0, 3, 2))], {3: 8}
    config = _config(Mixing(RING), sync_every=4)
    results = run_live(config, labels, joined_at, 12)
    replay = _replay_ring(labels, joined_at, 12)
    for t, result in enumerate(results):
        for step, weights in result["history"].items():
            group = [live for first, live in labels if first <= step][-1][t]
            assert_close(torch.cat(weights), torch.cat(replay["history"][step][group]), rtol=0, atol=1e-6)
        assert_close(torch.cat(result["final"]), torch.cat(replay["final"]), rtol=0, atol=1e-6)
    assert not torch.equal(results[0]["history"][8][0], results[2]["history"][8][0])  # the groups differ between syncs


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
