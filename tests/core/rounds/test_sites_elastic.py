"""Sites in an elastic federation: a site is its live groups, a joining group adds nothing and takes its site's mean.

Each group is a thread (``core/transport/inprocess.py``) that an elastic communicator's view relabels: thread ``t`` runs
the live group ``labels[t]`` of the planned ones, the participants of a sync are the live groups in ring order, and a
site sums over the whole ring, one row per planned site, as an elastic communicator sums it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard import Elastic, Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.rounds.averaging import mean_bytes
from lightning_fedshard.core.step.transaction import SyncKind
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.live import Live, assert_resumed_exactly, run_live

PLANNED = 4
SITES = [[0, 2], [1, 3]]


def _config(**options: Any) -> FederationConfig:
    topology = Hierarchical(options.pop("levels", {1: 2, 4: 4}), sites=SITES)
    return FederationConfig(num_groups=PLANNED, reduce_dtype="float32", outer_topology=topology, **options)


def _one_site_sync(live: tuple[int, ...], joined: tuple[int, ...] = ()) -> list[tuple[Tensor, Any]]:
    """Group ``g`` of ``live`` moves to ``g + 1``; a joining group holds the anchor (0). One site sync after step 1."""
    config = _config(sync_every=1, elastic=Elastic(group=0))

    def work(t: int, comm: Any) -> tuple[Tensor, Any]:
        view = Live(comm, t, [(0, live)], {g: 1 for g in joined}, sites=SITES)
        fed = Federation(config, view)
        fed.groups_may_join = True
        shard = torch.zeros(3)
        fed.start([shard], step=0)
        view.step = 1
        if view.group_index not in joined:
            shard.fill_(float(view.group_index + 1))
        stats = fed.maybe_sync(1)
        return shard.clone(), stats

    return InProcessGroups(len(live)).run(work)


def test_a_gone_group_leaves_its_sites_mean():
    results = _one_site_sync(live=(0, 1, 2))  # group 3 is gone: site [1, 3] is group 1 alone
    shards = {g: shard for g, (shard, _) in zip((0, 1, 2), results)}
    assert torch.equal(shards[0], torch.full((3,), 2.0)) and torch.equal(shards[2], shards[0])  # (1 + 3) / 2
    assert torch.equal(shards[1], torch.full((3,), 2.0))  # its own weights
    stats = results[0][1]
    assert stats.kind == "site sync" and stats.extra["site_size"] == 2 and not stats.lost
    assert stats.bytes_sent == mean_bytes(2 * 3, 3)  # a [sites, numel] sum over the ring of three live groups


def test_a_joining_group_adds_nothing_and_takes_its_sites_mean():
    results = _one_site_sync(live=(0, 1, 2, 3), joined=(2,))
    shards = [shard for shard, _ in results]
    assert torch.equal(shards[0], torch.full((3,), 1.0)) and torch.equal(shards[2], shards[0])  # group 0 alone adds
    assert torch.equal(shards[1], torch.full((3,), 3.0)) and torch.equal(shards[3], shards[1])  # (2 + 4) / 2
    assert all(stats.joined_groups == (2,) for _, stats in results)


def test_a_joining_group_whose_site_has_no_other_live_group_keeps_the_anchor():
    results = _one_site_sync(live=(0, 2, 3), joined=(3,))  # group 1 is gone, group 3 replaces it
    shards = {g: shard for g, (shard, _) in zip((0, 2, 3), results)}
    assert torch.equal(shards[0], torch.full((3,), 2.0)) and torch.equal(shards[2], shards[0])
    assert torch.equal(shards[3], torch.zeros(3))


def test_a_site_whose_groups_are_all_gone_leaves_the_federations_outer_step():
    """Site [1, 3] is gone: the outer step after step 4 is the mean of site [0, 2] alone, asked once per sync."""
    config = _config(sync_every=1, elastic=Elastic(group=0))

    def work(t: int, comm: Any) -> tuple[Tensor, Tensor, dict[int, int]]:
        view = Live(comm, t, [(0, (0, 2))], {}, sites=SITES)
        fed = Federation(config, view)
        shard = torch.zeros(2)
        fed.start([shard], step=0)
        for step in range(1, 5):
            view.step = step
            shard.add_(float(view.group_index + 1))  # group g moves by g + 1 per step
            fed.maybe_sync(step)
        return shard.clone(), fed.outer.anchor[0].detach().clone(), view.asked

    for shard, anchor, asked in InProcessGroups(2).run(work):
        # The site mean moves by (1 + 3) / 2 = 2 per step: 6 after step 3, then the groups reach 7 and 9.
        assert torch.equal(anchor, torch.full((2,), 8.0)) and torch.equal(shard, anchor)
        assert asked == {1: 1, 2: 1, 3: 1, 4: 1}


def test_a_group_that_heals_while_the_peers_are_in_a_site_sync_takes_part_in_it():
    """Group 3 joins at the site sync after step 2: a peer's heal state names it, and the joiner takes its site's
    mean at the same step as the others."""
    config = _config(levels={2: 2, 4: 4}, sync_every=2, elastic=Elastic(group=0))

    def work(t: int, comm: Any) -> tuple[Tensor, Any, int]:
        view = Live(comm, t, [(0, (0, 1, 2, 3))], {3: 2}, sites=SITES)
        fed = Federation(config, view)
        fed.groups_may_join = True
        shard = torch.zeros(2)
        fed.start([shard], step=0)
        marks: list[Any] = []
        view.on_participants = lambda: marks.append(fed.heal_state()["sync"])
        view.step = 2
        if view.group_index == 3:
            stats = fed.take_part(2, (SyncKind.site_sync(), 2))
        else:
            shard.fill_(float(view.group_index + 1))
            stats = fed.maybe_sync(2)
        return shard.clone(), (stats, marks), fed.last_step

    results = InProcessGroups(PLANNED).run(work)
    shards = [shard for shard, _, _ in results]
    assert torch.equal(shards[0], torch.full((2,), 2.0)) and torch.equal(shards[2], shards[0])  # (1 + 3) / 2
    assert torch.equal(shards[1], torch.full((2,), 2.0)) and torch.equal(shards[3], shards[1])  # group 1 alone adds
    for _, (stats, marks), last_step in results:
        assert stats.joined_groups == (3,) and last_step == 2
        # what a healing peer reads while this group waits for the site's groups
        assert marks == [SyncKind.site_sync().marker(2)]


def test_a_lost_site_sync_sends_every_group_back_to_the_anchor():
    config = _config(sync_every=1)

    def work(t: int, comm: Any) -> tuple[Tensor, Any]:
        comm.commit = False
        fed = Federation(config, comm)
        shard = torch.zeros(2)
        fed.start([shard], step=0)
        shard.fill_(float(t + 1))
        stats = fed.maybe_sync(1)
        return shard.clone(), stats

    for shard, stats in InProcessGroups(PLANNED, site_blocks=config.site_blocks(PLANNED)).run(work):
        assert stats.lost and stats.syncs_lost == 1 and torch.equal(shard, torch.zeros(2))


def _run(
    sync_delay: int, stop_at: int | None = None, resume: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Three live groups of four in sites [0, 2] and [1, 3], Nesterov: groups (0, 1, 2) until group 1 is gone before
    step 5 and group 3 takes its thread (healed: the anchor), joining the site sync after step 6. Site syncs after
    steps 2, 6, 10, outer steps after 4, 8, 12. Every group's weights after every step."""
    config = _config(levels={2: 2, 4: 4}, sync_every=2, outer_optimizer="nesterov", sync_delay=sync_delay)
    labels = [(0, (0, 1, 2)), (5, (0, 3, 2))]
    return run_live(config, labels, {3: 6}, 13, sites=SITES, stop_at=stop_at, resume=resume)


@pytest.mark.parametrize(("sync_delay", "stop_at"), [(0, 5), (0, 6), (1, 7)])
def test_a_federation_of_sites_whose_live_groups_changed_resumes_exactly(sync_delay, stop_at):
    straight = _run(sync_delay)
    assert straight[0]["landed"][6].joined_groups == (3,)  # the new group joined the site sync after step 6
    saved = _run(sync_delay, stop_at=stop_at)
    assert_resumed_exactly(straight, _run(sync_delay, resume=saved), stop_at)
