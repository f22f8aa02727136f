"""The framing of gloo's messages over TCP, and the message counts of gloo's algorithms, by hand."""

from __future__ import annotations

import math

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan import ClusterSpec, ModelSpec, TrainSetup, predict
from lightning_fedshard.plan.framing import (
    FRAME_HEADER_BYTES,
    allgather_messages,
    alltoall_messages,
    barrier_edges,
    broadcast_edges,
    framed_bytes,
    mss,
    ring_allreduce_messages,
    super_packet_bytes,
)

GLOO = 3 * 48  # three 48-byte gloo headers per message
S = 45 * 1448  # the largest frame at MTU 1500: 45 segments of 1448 bytes (1500 - 20 IPv4 - 32 TCP with timestamps)


def test_frame_sizes_follow_from_the_mtu():
    assert FRAME_HEADER_BYTES == 14 + 20 + 32
    assert mss(1500) == 1448 and super_packet_bytes(1500) == S == 65160
    assert mss(9000) == 8948 and super_packet_bytes(9000) == 7 * 8948  # 7 jumbo segments fit in 64 KiB
    assert super_packet_bytes(1500, gso_bytes=1500) == 1448  # a counter that sees every segment
    with pytest.raises(ValueError, match="no room"):
        mss(52)


def test_one_byte_in_one_message_costs_its_headers_two_notifications_one_data_frame_and_its_ack():
    assert framed_bytes(1, 1) == 1 + GLOO + 4 * 66


def test_a_message_needs_one_more_data_frame_and_ack_each_time_it_outgrows_a_frame():
    # the data operation carries its own 48-byte header: S - 48 payload bytes fill exactly one frame
    assert framed_bytes(S - 48, 1) == S - 48 + GLOO + (2 + 2 * 1) * 66
    assert framed_bytes(S - 47, 1) == S - 47 + GLOO + (2 + 2 * 2) * 66
    for k in (1, 2, 5):
        assert framed_bytes(k * S - 48, 1) == k * S - 48 + GLOO + (2 + 2 * k) * 66
    # counted per wire segment instead (a NIC counter after TSO), k segments of payload cost k data frames
    assert framed_bytes(3 * 1448 - 48, 1, gso_bytes=1500) == 3 * 1448 - 48 + GLOO + (2 + 2 * 3) * 66


def test_messages_share_the_payload_equally_and_each_pays_its_framing():
    assert framed_bytes(2000, 4) == 2000 + 4 * (GLOO + 4 * 66)
    assert framed_bytes(2 * S, 2) == 2 * framed_bytes(S, 1)
    assert framed_bytes(0, 0) == 0 and framed_bytes(0, 3) == 3 * (GLOO + 4 * 66)  # a barrier's empty messages
    with pytest.raises(ValueError, match="needs at least one message"):
        framed_bytes(10, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        framed_bytes(-1, 1)


def test_gloo_ring_all_reduce_sends_2_ranks_minus_1_messages_per_non_empty_segment():
    # 8 float64 values over 4 ranks: 8 segments of 8 bytes, all non-empty: 2 x 3 x 8 / 4 per rank
    assert ring_allreduce_messages(64, 4, element_size=8) == 12
    # 4 float64 flags: still 8 segments, only 4 non-empty
    assert ring_allreduce_messages(32, 4, element_size=8) == 2 * 3 * 4 / 4
    # 2.75 MB of float32 over 4 ranks: 3 segments of at most 1 MiB, rounded up to 2 per rank: 8 segments
    assert ring_allreduce_messages(2_754_816, 4) == 2 * 3 * 8 / 4
    # 10 MiB over 2 ranks: 10 segments of 1 MiB
    assert ring_allreduce_messages(10 * 2**20, 2) == 2 * 1 * 10 / 2
    assert ring_allreduce_messages(1000, 1) == 0 and ring_allreduce_messages(0, 4) == 0


def test_gloo_all_gather_all_to_all_broadcast_and_barrier_messages():
    assert allgather_messages(4) == 6 and allgather_messages(1) == 0  # each piece in two halves
    assert alltoall_messages(4) == 3
    # binomial tree from rank 0: 0->1, then 0->2, 1->3, then 0->4 .. 3->7
    assert broadcast_edges(range(8)) == [(0, 1), (0, 2), (1, 3), (0, 4), (1, 5), (2, 6), (3, 7)]
    assert broadcast_edges([5, 6, 7], root=1) == [(6, 7), (6, 5)]
    # dissemination barrier: rank i to i + 1, i + 2, i + 4
    edges = barrier_edges(range(8))
    assert len(edges) == 24 and (7, 0) in edges and (6, 0) in edges and (4, 0) in edges


def test_a_tcp_cluster_counts_the_framing_of_every_message_that_leaves_a_node():
    model = ModelSpec("toy", num_parameters=1000, root_parameters=200, num_layers=2, hidden_size=8, num_heads=2,
                      seq_len=4)  # fmt: skip
    plain = ClusterSpec("plain", num_nodes=2, devices_per_node=2, step_seconds=1.0, inter_latency=0.0)
    tcp = ClusterSpec(**{**plain.__dict__, "tcp_mtu": 1500})
    setup = TrainSetup("fl_fsdp", federation=FederationConfig(sync_every=4, reduce_dtype="float32"))
    bare, framed = predict(model, plain, setup), predict(model, tcp, setup)
    outer, tcp_outer = bare.sync_collectives[0], framed.sync_collectives[0]
    # 4 ranks, each in a ring of 2 ranks on 2 nodes, all-reduce their 500 float32 values: 2 (G-1)/G x 2,000 bytes over
    # a crossing edge, in 2 (G - 1) x 4 non-empty segments / G = 4 messages of 500 bytes (gloo: 2 segments per rank)
    assert outer.link_bytes == 4 * 2000 and outer.messages == tcp_outer.messages == 4 * 4
    assert tcp_outer.link_bytes == 4 * framed_bytes(2000, 4) == 4 * (2000 + 4 * (GLOO + 4 * 66))
    assert tcp_outer.node_bytes == outer.node_bytes and tcp_outer.seconds == outer.seconds  # times use the payload
    assert framed.link_bytes_per_step > bare.link_bytes_per_step
    assert math.isclose(
        framed.link_bytes_per_step - bare.link_bytes_per_step,
        sum(a.link_bytes - b.link_bytes for a, b in zip(framed.sync_collectives, bare.sync_collectives)) / 4,
    )
