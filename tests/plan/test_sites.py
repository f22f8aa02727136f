"""The planner on a cluster of two sites: uplinks shared by everything that leaves a site, and each topology's syncs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_fedshard import Gossip, Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan.predict import predict, ring
from lightning_fedshard.plan.specs import CLUSTERS, MODELS, ClusterSpec, TrainSetup

SITES = CLUSTERS["emulated-2x2x2"]
FLAT = replace(SITES, nodes_per_site=None, site_bandwidth=None)


def _setup(**federation) -> TrainSetup:
    config = FederationConfig(reduce_dtype="float32", **federation)
    return TrainSetup(strategy="fl_fsdp", federation=config, micro_batch=4, param_bytes=4, grad_bytes=4)


def test_a_ring_through_both_sites_waits_for_the_uplink_and_counts_what_crosses_it():
    rings = [[0, 2, 4, 6], [1, 3, 5, 7]]  # node 0, 1 | 2, 3: two edges of each ring leave their site
    on_sites, flat = ring("r", rings, 1e6, 2.0, 1.0, SITES), ring("r", rings, 1e6, 2.0, 1.0, FLAT)
    per_edge = 2 * 3 / 4 * 1e6
    assert on_sites.site_bytes == 4 * per_edge and flat.site_bytes == 0
    # the uplink carries one edge of each of the two rings in each direction, at 20 Mbit/s
    assert on_sites.seconds == pytest.approx(2 * per_edge / SITES.site_bandwidth + 6 * SITES.site_latency)
    assert on_sites.link_bytes == flat.link_bytes  # the node counters see the same bytes either way


def test_hierarchical_levels_take_their_share_of_the_steps_and_sites_never_cross_the_uplink():
    p = predict(MODELS["xs"], SITES, _setup(sync_every=4, outer_topology=Hierarchical({4: 2, 16: 4})))
    site, everyone = p.sync_levels
    assert (site.per_step, everyone.per_step) == (3 / 16, 1 / 16)  # steps 4, 8, 12 | 16
    assert site.site_bytes == 0 and everyone.site_bytes > 0
    assert p.exposed_sync_seconds == pytest.approx(3 / 16 * site.seconds + 1 / 16 * everyone.seconds)
    flat_h16 = predict(MODELS["xs"], SITES, _setup(sync_every=16))
    flat_h4 = predict(MODELS["xs"], SITES, _setup(sync_every=4))
    assert flat_h16.step_seconds < p.step_seconds < flat_h4.step_seconds
    assert everyone.seconds == pytest.approx(flat_h16.sync_levels[0].seconds)


def test_sites_that_pair_groups_across_the_uplink_put_the_site_level_on_it():
    crossing = predict(
        MODELS["xs"], SITES, _setup(sync_every=4, outer_topology=Hierarchical({4: 2, 16: 4}, sites=[[0, 2], [1, 3]]))
    )
    assert crossing.sync_levels[0].site_bytes > 0


def test_gossip_sends_one_shard_to_its_partner_per_sync():
    p = predict(MODELS["xs"], FLAT, _setup(sync_every=4, outer_topology=Gossip(peers=1)))
    (level,) = p.sync_levels
    shard_bytes = MODELS["xs"].num_parameters / 2 * 4
    assert level.per_step == 1 / 4
    assert level.collectives[0].rank_bytes == pytest.approx(shard_bytes, rel=1e-6)
    ring_bytes = predict(MODELS["xs"], FLAT, _setup(sync_every=4)).sync_collectives[0].rank_bytes
    assert level.collectives[0].rank_bytes / ring_bytes == pytest.approx(
        2 / 3, rel=1e-3
    )  # n against the ring's 2 (G - 1) / G n


def test_a_topology_that_does_not_fit_the_groups_is_refused_before_predicting():
    with pytest.raises(ValueError, match="do not divide the 4 groups"):
        predict(MODELS["xs"], SITES, _setup(sync_every=4, outer_topology=Hierarchical({4: 3, 12: 6})))


@pytest.mark.parametrize(
    ("changes", "match"),
    [(dict(nodes_per_site=3), r"`nodes_per_site=3` must divide `num_nodes=4`"),
     (dict(nodes_per_site=2, site_bandwidth=None), r"`site_bandwidth=None` must be a positive number")],
)  # fmt: skip
def test_bad_sites_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        replace(ClusterSpec("c", num_nodes=4, devices_per_node=2, site_bandwidth=1e6), **changes)
