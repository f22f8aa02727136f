"""The federation's state as a healing group takes it, and what the membership adds to syncs and checkpoints.

No torchft here: the communicator is built but never connects, and the heal's save and load functions it holds are
called directly, as torchft's thread and the training thread call them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.testing import assert_close

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.elastic import ElasticCommunicator, ElasticMembership


def _member(config: FederationConfig, shards: list[torch.Tensor], group: int) -> tuple[Federation, ElasticMembership]:
    """A lone group's federation (its syncs over a fake ring) and its membership of an elastic federation."""
    local = InProcessGroups(1).run(lambda g, c: c)[0]
    federation = Federation(config, local)
    federation.start(shards, step=0)
    return federation, ElasticMembership(federation, ElasticCommunicator(Elastic(group=group), group, local, dict))


def test_a_healing_group_takes_the_peers_anchor_outer_state_schedule_and_host_state():
    config = FederationConfig(num_groups=2, sync_every=2, outer_optimizer="nesterov", elastic=Elastic(group=0))
    peer_shards = [torch.zeros(4), torch.zeros(2)]
    peer, peer_membership = _member(config, peer_shards, group=0)
    peer_membership.host_state = lambda: {"fit_loop": "at step 4"}
    for step in range(1, 5):
        with torch.no_grad():
            for shard in peer_shards:
                shard.add_(0.5)
        peer.maybe_sync(step)
    state: dict[str, Any] = peer_membership.communicator._send()  # torchft's thread asks the peer
    assert state["step"] is None and state["sync"] is None and state["host"] == {"fit_loop": "at step 4"}

    shards = [torch.full((4,), 9.0), torch.full((2,), 9.0)]
    joiner, membership = _member(config, shards, group=1)
    loaded: list[tuple[int, Any]] = []
    membership.load_host_state = lambda step, host: loaded.append((step, host))
    state["step"] = 4
    membership.communicator._load(state)  # type: ignore[misc]  # the training thread applies it in the quorum

    for shard, anchor in zip(shards, peer.outer.anchor):
        assert_close(shard, anchor.to(shard.dtype))
    assert (joiner.last_synced_step, joiner.last_step, joiner.landed_at) == (4, 4, [4])
    assert_close(joiner.outer.state_dict()["optimizers"], peer.outer.state_dict()["optimizers"])
    assert membership.peer_sync is None and loaded == [(4, {"fit_loop": "at step 4"})]


def test_the_membership_names_the_groups_of_each_sync_and_keeps_them_in_checkpoints():
    config = FederationConfig(num_groups=3, sync_every=2, elastic=Elastic(group=0))
    federation, membership = _member(config, [torch.zeros(4)], group=0)
    communicator = membership.communicator
    assert communicator.on_new_members is not None
    resets: list[int] = []
    federation.outer.reducers[0].reset_residual = lambda: resets.append(1)  # type: ignore[method-assign]
    communicator.on_new_members((0, 1, 2))  # the first quorum: nothing to reset
    communicator.on_new_members((0, 2))  # group 1 left: the residuals' chunks were laid out over three groups
    assert resets == [1]
    communicator.last_heal_seconds = 0.25
    stats = federation.annotate_stats(SyncStats(0.0, 0.0, 0, 0.0, 1)) if federation.annotate_stats else None
    assert stats is not None and (stats.extra["groups"], stats.extra["heal_seconds"]) == (2, 0.25)

    saved = federation.state_dict()
    assert saved["members"] == [0, 2] and saved["membership"] == {"step": 0, "batches_committed": 0}
    restored, restored_membership = _member(config, [torch.zeros(4)], group=0)
    restored.load_state_dict({**saved, "membership": {"step": 7, "batches_committed": 3}})
    assert restored_membership.members == (0, 2) and restored_membership.communicator.step == 7
    plain = Federation(FederationConfig(num_groups=3, sync_every=2), InProcessGroups(1).run(lambda g, c: c)[0])
    assert "members" not in plain.state_dict() and not plain.groups_may_join
