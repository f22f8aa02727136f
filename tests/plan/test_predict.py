"""The planner against numbers done on paper, small clusters where every ring edge can be counted by hand."""

from __future__ import annotations

import math

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.wire.reducers import make_reducer
from lightning_fedshard.plan import CLUSTERS, MODELS, ClusterSpec, ModelSpec, TrainSetup, compare, predict, sweep
from lightning_fedshard.plan.predict import ring

# 2 nodes x 2 ranks, 1 GB/s per node, 10 GB/s inside a node, no latency, compute 1 s per step, no overlap
CLUSTER = ClusterSpec(
    "hand", num_nodes=2, devices_per_node=2, step_seconds=1.0, intra_bandwidth=10e9, inter_bandwidth=1e9,
    intra_latency=0.0, inter_latency=0.0, overlap_collectives=False, device_memory=1e12,
)  # fmt: skip
# 1,000 parameters in 2 layers of 400 and a root of 200
MODEL = ModelSpec("toy", num_parameters=1000, root_parameters=200, num_layers=2, hidden_size=8, num_heads=2, seq_len=4)


def test_llama_sizes_match_the_examples_and_the_paper():
    assert MODELS["xs"].num_parameters == 1_377_408  # LlamaLM(size="xs", vocab_size=4096).num_parameters()
    assert MODELS["xs"].root_parameters == 4096 * 128 + 128
    assert MODELS["llama-3.1-8b"].num_parameters == 8_030_261_248  # Llama-3.1-8B's published count


def test_ring_counts_only_edges_that_leave_a_node():
    # ranks 0-3 on nodes 0,0,1,1: a ring 0-1-2-3 crosses at 1->2 and 3->0, one edge per node
    col = ring("ag", [[0, 1, 2, 3]], tensor_bytes=4e9, factor=1.0, calls=1, cluster=CLUSTER)
    assert col.rank_bytes == 3e9 and col.node_bytes == 3e9 and col.link_bytes == 6e9
    assert col.seconds == pytest.approx(3.0)  # 3 GB through a 1 GB/s node link
    inside = ring("ag", [[0, 1]], tensor_bytes=4e9, factor=2.0, calls=1, cluster=CLUSTER)
    assert inside.link_bytes == 0 and not inside.crosses_nodes and inside.seconds == pytest.approx(4e9 / 10e9)


def test_fsdp_over_two_nodes_by_hand():
    p = predict(MODEL, CLUSTER, TrainSetup("fsdp"))
    # all-gather: forward + backward of the layers (800), forward of the root (200): 1,800 values x 4 bytes
    gather, scatter = p.step_collectives
    assert gather.link_bytes == 2 * 3 / 4 * 1800 * 4
    assert scatter.link_bytes == 2 * 3 / 4 * 1000 * 4
    assert p.link_bytes_per_step == pytest.approx(2 * 0.75 * 2800 * 4)
    assert p.step_seconds == pytest.approx(1.0 + (0.75 * 2800 * 4) / 1e9)
    assert p.batch_per_step == 4 and p.bottleneck == "compute"


def test_gloo_reduce_scatter_sends_an_all_reduce():
    gloo = predict(MODEL, ClusterSpec(**{**CLUSTER.__dict__, "gloo_reduce_scatter": True}), TrainSetup("fsdp"))
    assert gloo.step_collectives[1].link_bytes == 2 * 2 * 0.75 * 1000 * 4


def test_fl_fsdp_sends_nothing_across_nodes_between_syncs():
    p = predict(
        MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, reduce_dtype="float32"))
    )
    assert p.topology.num_groups == 2 and all(not c.crosses_nodes for c in p.step_collectives)
    outer, stats, in_group = p.sync_collectives
    # each rank all-reduces its 500-value shard over 2 groups: 2 (G-1)/G x 500 x 4 = 2,000 bytes, 2 ranks per node
    assert outer.rank_bytes == 2000 and outer.node_bytes == 4000 and outer.link_bytes == 8000
    # then the sync's statistics, 2 flags and 3 norms in float64, over the fed ring (across nodes), then in the group
    assert stats.rank_bytes == 2 * 1 / 2 * 5 * 8 and stats.link_bytes == 4 * 40 and stats.crosses_nodes
    assert in_group.link_bytes == 0 and not in_group.crosses_nodes
    assert p.link_bytes_per_step == pytest.approx((8000 + 160) / 4)
    assert p.exposed_sync_seconds == pytest.approx(((4000 + 80) / 1e9 + 40 / 10e9) / 4)  # in-group: 40 bytes, intra
    assert p.batch_per_step == 2  # one group of two ranks


def test_hsdp_all_reduces_gradient_shards_across_nodes():
    p = predict(MODEL, CLUSTER, TrainSetup("hsdp"))
    *_, replicas = p.step_collectives
    # 2 rings (one per shard position) of 2 ranks on different nodes, 500 values each: 2 x 1/2 x 2,000 bytes per edge
    assert replicas.rank_bytes == 2000 and replicas.node_bytes == 4000 and replicas.link_bytes == 8000


def test_compressed_outer_traffic_uses_the_core_byte_count():

    p = predict(
        MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(reduce_dtype="int8", error_feedback=True))
    )
    assert p.sync_collectives[0].rank_bytes == pytest.approx(make_reducer("int8", 128, True).wire_bytes(500, 2))


def test_overlap_hides_the_sum_for_sync_delay_steps():
    slow = ClusterSpec(**{**CLUSTER.__dict__, "inter_bandwidth": 500.0})  # the sum takes 8 s
    blocking = predict(
        MODEL, slow, TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, reduce_dtype="float32"))
    )
    overlapped = predict(
        MODEL,
        slow,
        TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, sync_delay=1, reduce_dtype="float32")),
    )
    assert blocking.exposed_sync_seconds == pytest.approx(blocking.sync_seconds / 4)
    inner = overlapped.step_seconds - overlapped.exposed_sync_seconds
    assert overlapped.exposed_sync_seconds == pytest.approx((overlapped.sync_seconds - inner) / 4)
    assert blocking.bottleneck == "outer sync"


def test_eager_updates_hide_what_a_round_of_training_covers():
    slow = ClusterSpec(**{**CLUSTER.__dict__, "inter_bandwidth": 500.0})

    def fed(**options):
        federation = FederationConfig(reduce_dtype="float32", **options)
        return predict(MODEL, slow, TrainSetup("fl_fsdp", federation=federation))

    eager = fed(sync_every=4, eager_updates=True)  # one sum of the whole model per 4 steps
    inner = eager.step_seconds - eager.exposed_sync_seconds
    assert eager.exposed_sync_seconds == pytest.approx(max(0.0, eager.sync_seconds - 4 * inner) / 4)
    assert eager.exposed_sync_seconds < fed(sync_every=4, sync_delay=3).exposed_sync_seconds
    # 2 fragments: each sum is half as large, but both of a round share the link, which carries a model per round
    halves = fed(sync_every=4, fragments=2, eager_updates=True)
    assert halves.exposed_sync_seconds == pytest.approx(max(0.0, 2 * halves.sync_seconds - 4 * inner) / 4)
    hidden = fed(sync_every=64, eager_updates=True)  # a sum of 8 s is shorter than 64 steps of 1 s
    assert hidden.exposed_sync_seconds == 0.0 and hidden.compute_utilization == pytest.approx(1.0, abs=1e-5)


def test_sparse_and_eager_memory_and_bytes():
    def memory(**options):
        return predict(MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(**options))).memory

    # the top-k's magnitudes, tie counts and masks on top of int4's three float32 copies of the 500-value shard
    assert memory(reduce_dtype="sparse").sync == 500 * (12 + 4 + 4 + 3)
    eager = memory(sync_every=4, fragments=2, eager_updates=True)
    # the other fragment's buffer stays in flight, its start offsets wait on the host with the anchor
    assert eager.sync == 3 * 4 * 250 + 4 * 250 and eager.sync_overlaps_training
    assert eager.host_outer == memory(sync_every=4, fragments=2).host_outer + 2000
    sparse = predict(MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(reduce_dtype="sparse")))
    # 500 values padded to 2 chunks of 4096, one per group: 120 bytes each, sent twice (all-to-all, all-gather)
    assert sparse.sync_collectives[0].rank_bytes == make_reducer("sparse").wire_bytes(500, 2) == 2 * 120


def test_the_sweep_ranks_sparse_traffic_and_eager_updates():
    slow = ClusterSpec(**{**CLUSTER.__dict__, "inter_bandwidth": 1e4})
    ranked = sweep(MODEL, slow, TrainSetup("fl_fsdp"), top=200)
    options = {(p.setup.federation.reduce_dtype, p.setup.federation.eager_updates) for p in ranked}
    assert ("sparse", True) in options and ("float32", False) in options
    assert all(not (p.setup.federation.eager_updates and p.setup.federation.sync_delay) for p in ranked)


def test_memory_per_rank_by_hand():
    p = predict(
        MODEL,
        CLUSTER,
        TrainSetup("fl_fsdp", federation=FederationConfig(outer_optimizer="nesterov", reduce_dtype="float32")),
    )
    m = p.memory  # shard of 500 values
    assert (m.parameters, m.gradients, m.optimizer) == (2000, 2000, 4000)
    assert m.gathered == 2 * 400 * 4 and m.host_anchor == 2000 and m.host_outer == 2000
    # a float32 sync holds its 500-value buffer, less than training's transients (gathered units, activations)
    training = m.gathered + m.activations
    assert m.sync == 2000 and m.device == 8000 + training
    # The default int4 traffic keeps error-feedback residuals on the host: two more shards of float32; on the device
    # its sync holds about three float32 copies of the shard, more than training's transients here.
    default = predict(
        MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(outer_optimizer="nesterov"))
    ).memory
    assert default.host_outer == 2000 + 2 * 2000
    assert default.sync == 3 * 2000 > training and default.device == 8000 + 3 * 2000
    # overlapped with training (sync_delay > 0) the two add up; 2 fragments halve the sync's share
    overlapped = predict(
        MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, fragments=2, sync_delay=1))
    ).memory
    assert overlapped.sync == 3 * 1000 and overlapped.device == 8000 + training + 3 * 1000
    assert m.activations == 2 * 1 * 4 * 8 * 34  # layers x tokens x hidden x 34 (fused attention)


def test_bad_layouts_and_options_fail_with_the_strategy_messages():
    with pytest.raises(ValueError, match=r"divisible by `num_groups=3`"):
        predict(MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(num_groups=3)))
    with pytest.raises(ValueError, match=r"reduce_dtype"):
        predict(MODEL, CLUSTER, TrainSetup("fl_fsdp", federation=FederationConfig(reduce_dtype="fp8")))


def test_compare_and_sweep():
    assert [p.setup.strategy for p in compare(MODEL, CLUSTER, TrainSetup("fsdp"))] == [
        "fsdp", "hsdp", "fl_fsdp", "fl_hsdp"
    ]  # fmt: skip
    best = sweep(MODELS["llama-3.1-8b"], CLUSTERS["leonardo-512"], TrainSetup("fl_fsdp", micro_batch=2, param_bytes=2,
                 grad_bytes=2), top=5)  # fmt: skip
    assert len(best) == 5 and all(p.fits for p in best)
    fastest = max(p.tokens_per_second for p in best)
    assert all(p.tokens_per_second >= 0.995 * fastest or p is best[-1] for p in best[:1])


def test_paper_scale_compute_from_flops():
    p = predict(MODELS["llama-3.1-8b"], CLUSTERS["leonardo-512"], TrainSetup("fsdp", micro_batch=2, param_bytes=2))
    flops = 2 * 2048 * (6 * 8_030_261_248 + 12 * 32 * 4096 * 2048)
    assert p.compute_seconds == pytest.approx(flops / (312e12 * 0.4))
    assert math.isfinite(p.tokens_per_second) and p.sequences_per_step == 1024


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainSetup("ddp"), r"`strategy='ddp'` must be one of"),
        (lambda: TrainSetup("fsdp", micro_batch=0), r"`micro_batch=0` must be a positive number"),
        (lambda: ClusterSpec("c", 2, 0), r"`devices_per_node=0` must be a positive number"),
        (lambda: ClusterSpec("c", 2, 2, inter_bandwidth=-1.0), r"`inter_bandwidth=-1.0` must be a positive number"),
        (lambda: ClusterSpec("c", 2, 2, mfu=1.5), r"`mfu=1.5` must be in \(0, 1\]"),
        (lambda: ClusterSpec("c", 2, 2, step_seconds=0.0), r"`step_seconds=0.0` must be a positive number"),
    ],
)
def test_nonsense_inputs_are_refused_naming_the_value(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_fl_hsdp_sends_each_shard_across_groups_once_and_gathers_it_over_the_replicas():
    """The paper's FL+HSDP layout (16 groups x 8 replicas x shard 4): each replica sends 1/8 of its shard."""

    federation = FederationConfig(num_groups=16, shard_size=4, reduce_dtype="bfloat16")
    p = predict(MODELS["llama-3.1-8b"], CLUSTERS["leonardo-512"], TrainSetup("fl_hsdp", federation=federation))
    outer_sum, gather, *stats = p.sync_collectives
    assert [c.name for c in stats] == ["sync statistics: sums over the fed ring", "sync statistics: sums in the group"]
    shard = math.ceil(MODELS["llama-3.1-8b"].num_parameters / 4)
    assert outer_sum.rank_bytes == pytest.approx(make_reducer("bfloat16").wire_bytes(math.ceil(shard / 8), 16))
    part = math.ceil(shard / 8)
    assert "gather over replicas" in gather.name  # inside a group, over its 8 nodes: bf16 parts, 7/8 of them sent
    assert gather.rank_bytes == pytest.approx(7 / 8 * part * 8 * 2)
