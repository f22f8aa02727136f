"""The planner's own inputs: the cluster, model and setup they name, in the units of the specs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan.inputs import PlannerInputs
from lightning_fedshard.plan.specs import CLUSTERS, GIB, MODELS


def test_the_inputs_replace_the_cluster_presets_values_in_its_units():
    inputs = PlannerInputs(cluster="emulated-4x2", peak_tflops=2.0, device_memory_gib=8.0, inter_gbit_per_s=0.8)
    cluster = inputs.cluster_spec()
    assert (cluster.peak_flops, cluster.device_memory, cluster.inter_bandwidth) == (2e12, 8 * GIB, 1e8)
    assert cluster.num_nodes == CLUSTERS["emulated-4x2"].num_nodes  # not given: the preset's


def test_a_round_trip_is_twice_the_one_way_latency_between_nodes():
    assert PlannerInputs(cluster="emulated-4x2", rtt_ms=100.0).cluster_spec().inter_latency == pytest.approx(0.05)


def test_the_model_is_the_preset_at_the_given_sequence_length():
    assert PlannerInputs(model="xs", seq_len=64).model_spec() == replace(MODELS["xs"], seq_len=64)
    assert PlannerInputs(model="xs").model_spec() == MODELS["xs"]


def test_the_setup_holds_the_sync_options_and_the_precisions_width():
    federation = FederationConfig(num_groups=2)
    setup = PlannerInputs(precision="fp32", micro_batch=3).setup(federation)
    assert (setup.federation, setup.param_bytes, setup.grad_bytes, setup.micro_batch) == (federation, 4, 4, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top": 0}, "top"),
        ({"rtt_ms": -1.0}, "`rtt_ms=-1.0` must be at least 0"),
    ],
)
def test_bad_inputs_are_refused_when_given(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlannerInputs(**kwargs)


def test_node_speeds_must_give_each_node_a_positive_speed():
    assert PlannerInputs(node_speeds=[1, 0.5]).checked_node_speeds(2) == [1.0, 0.5]
    with pytest.raises(ValueError, match="each of the 3 nodes"):
        PlannerInputs(node_speeds=[1, 0.5]).checked_node_speeds(3)
