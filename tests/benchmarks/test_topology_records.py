"""A benchmark run's outer topology travels to its ranks as JSON and comes back as the same object."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.config import RunConfig
from benchmarks.presets import PRESETS
from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled
from lightning_fedshard.core.config import FederationConfig


@pytest.mark.parametrize(
    "topology",
    ["all", Hierarchical({4: 2, 16: 4}), Hierarchical({4: 2, 8: 4}, sites=[[0, 3], [1, 2]]), Gossip(peers=2, seed=5),
     Sampled(groups_per_round=2, seed=1), Sampled(groups_per_round=2, seed=1, outer_step=True),
     Mixing([[0.5, 0.5], [0.5, 0.5]])],
)  # fmt: skip
def test_the_outer_topology_survives_the_run_config_json(topology):
    config = RunConfig(
        "fl_fsdp", 4, 2, "/tmp/out", "/tmp/data", FederationConfig(sync_every=4, outer_topology=topology)
    )
    back = RunConfig.from_record(json.loads(config.to_json()))
    if isinstance(topology, Mixing) and not isinstance(topology, (Gossip, Sampled)):
        assert back.federation.outer_topology.weights(0, 2).tolist() == topology.weights(0, 2).tolist()
    else:
        assert back.federation.outer_topology == topology


def test_the_sites_sweep_seeds_each_repeat_and_runs_on_two_sites(tmp_path):
    preset = PRESETS["sites"]
    jobs = preset.jobs(tmp_path)
    assert preset.sites == 2 and preset.between_sites_mbit == 20.0
    assert {j.config.seed for j in jobs} == {0, 1, 2} and all(j.config.init_seed == j.config.seed for j in jobs)
    assert {j.identity.configuration for j in jobs} >= {"fl_fsdp-H4", "fl_fsdp-H16", "fl_fsdp-sites-4-16"}
