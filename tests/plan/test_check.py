"""The plan check a strategy runs at the end of training (`plan=...`), on hand-made run facts."""

from __future__ import annotations

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan.check import RunFacts, check_run, cluster_of
from lightning_fedshard.plan.specs import TrainSetup

FACTS = RunFacts(
    num_nodes=2, devices_per_node=2, hybrid=False, num_groups=2, shard_size=2, num_parameters=1000, num_units=3,
    steps=8, seconds=10.0, syncs=2, sync_seconds=1.0, exposed_seconds=0.8,
)  # fmt: skip


def test_cluster_from_a_preset_or_a_dict_with_the_runs_nodes():
    cluster = cluster_of({"cluster": "emulated-4x2", "inter_bandwidth": 1e3}, num_nodes=2, devices_per_node=2)
    assert (cluster.num_nodes, cluster.devices_per_node, cluster.inter_bandwidth) == (2, 2, 1e3)
    assert cluster_of("leonardo-512", 3, 1).num_nodes == 3
    with pytest.raises(ValueError, match=r"Unknown cluster preset 'nope'"):
        cluster_of("nope", 1, 1)
    with pytest.raises(ValueError, match=r"keys \['bandwidth'\] are not cluster fields"):
        cluster_of({"bandwidth": 1.0}, 1, 1)


def test_check_run_predicts_the_sum_from_the_network_and_keeps_the_measured_step():
    plan = {"cluster": "emulated-4x2", "inter_bandwidth": 1e3, "inter_latency": 0.0, "intra_bandwidth": 1e12}
    report = check_run(
        plan, TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, reduce_dtype="float32")), FACTS
    )
    assert report["measured_step_seconds"] == pytest.approx(10.0 / 8)
    assert report["measured_sync_seconds"] == pytest.approx(0.5)
    assert report["measured_exposed_sync_per_step"] == pytest.approx(0.1)
    # the outer sum: 2 ranks per node each send 2 (G-1)/G x 500 values x 4 bytes = 2,000 bytes at 1,000 bytes/s; the
    # statistics sums over the fed ring (2 flags and 3 norms, float64): 2 ranks x 2 (G-1)/G x 40 bytes = 80 bytes more,
    # then inside the group: 2 all-reduces of 2 latency-bound steps at the preset's 50 us inside a node
    sync = 4.0 + 0.08 + 2 * 2 * 50e-6
    assert report["predicted_sync_seconds"] == pytest.approx(sync)
    inner = 10.0 / 8 - 0.1
    assert report["predicted_step_seconds"] == pytest.approx(inner + (sync / 4))
