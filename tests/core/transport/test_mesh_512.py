"""The paper's 512-rank layouts, built rank by rank in one process on torch's fake process-group backend.

With ``backend="fake"`` and a ``FakeStore`` one process can play any rank of a 512-rank world: the device mesh and
all its subgroups are created as on the cluster, and collectives return at once without moving data. For a sample of
ranks (first, last, both sides of group borders, one in the middle) the test checks the mesh coordinates and the
members of the three process groups against the layout written out by hand:

    rank = g * F + r * S + s        # F = W / G ranks per group, S shard size, R = F / S replicas
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_fedshard.core.config import FederationConfig, resolve_outer_optimizer
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.transport.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.transport.topology import Axis, FederationTopology
from lightning_fedshard.core.wire.reducers import make_reducer

NODES, GPUS_PER_NODE = 128, 4
WORLD = NODES * GPUS_PER_NODE
#: Llama-3.1-8B with untied embeddings (tests/cli/test_paper_configs.py counts it from configs/paper/).
LLAMA_8B_PARAMETERS = 8_030_261_248


@dataclass(frozen=True)
class Layout:
    name: str
    hybrid: bool
    num_groups: int
    shard_size: int | None
    mesh_shape: tuple[int, int, int]
    #: Bytes one rank sends per outer all-reduce of Llama-3.1-8B in bfloat16: 2 (G-1)/G * P * 2 / S, worked out.
    sync_bytes_bf16: float


LAYOUTS = [
    # 2 * 127/128 * 8,030,261,248 * 2 / 4 = 127 * 62,736,416 = 7,967,524,832
    Layout(
        "fl_fsdp", hybrid=False, num_groups=128, shard_size=None, mesh_shape=(128, 1, 4), sync_bytes_bf16=7967524832.0
    ),
    # 2 * 15/16 * 8,030,261,248 * 2 / 4 = 7,528,369,920
    Layout("fl_hsdp", hybrid=True, num_groups=16, shard_size=4, mesh_shape=(16, 8, 4), sync_bytes_bf16=7528369920.0),
    # Baselines: one group, so nothing is sent.
    Layout("fsdp", hybrid=False, num_groups=1, shard_size=None, mesh_shape=(1, 1, 512), sync_bytes_bf16=0.0),
    Layout("hsdp", hybrid=True, num_groups=1, shard_size=4, mesh_shape=(1, 128, 4), sync_bytes_bf16=0.0),
]


def _topology(layout: Layout) -> FederationTopology:
    config = FederationConfig(num_groups=layout.num_groups, shard_size=layout.shard_size)
    return config.topology(NODES, GPUS_PER_NODE, layout.hybrid)


def _sample_ranks(group_size: int) -> list[int]:
    """First, last, the two ranks on each side of the second and of the last group border, one in the middle."""
    borders = {group_size, WORLD - group_size} - {0, WORLD}  # one group: no border
    ranks = {0, WORLD - 1, WORLD // 2 + 5}
    for border in borders:
        ranks |= {border - 1, border}
    return sorted(ranks)


@contextmanager
def _as_rank(rank: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _expected(rank: int, shape: tuple[int, int, int]) -> dict[str, object]:
    """The layout written out directly from the rank formula, independent of the topology code."""
    groups, replicas, shards = shape
    group_size = replicas * shards
    g, in_group = divmod(rank, group_size)
    r, s = divmod(in_group, shards)
    return {
        "coords": (g, r, s),
        Axis.SHARD: [g * group_size + r * shards + i for i in range(shards)],
        Axis.REPLICATE: [g * group_size + i * shards + s for i in range(replicas)],
        Axis.FED: [i * group_size + r * shards + s for i in range(groups)],
    }


def _check_rank(mesh: FederationMesh, layout: Layout) -> None:
    rank = dist.get_rank()
    expected = _expected(rank, layout.mesh_shape)
    assert mesh.coords == expected["coords"]
    g, r, s = mesh.coords
    for axis in Axis:
        members = mesh.ranks(axis)
        assert members == expected[axis], (rank, axis)
        assert rank in members
    assert mesh.ranks(Axis.FED).index(rank) == g
    topology = mesh.topology
    assert mesh.ranks(Axis.SHARD) == topology.shard_ranks(g, r)
    assert mesh.ranks(Axis.REPLICATE) == topology.replicate_ranks(g, s)
    assert mesh.ranks(Axis.FED) == topology.fed_ranks(r, s)

    fsdp_group = mesh.fsdp_process_group(layout.hybrid)
    if layout.hybrid:  # HSDP takes (shard group, replicate group)
        assert isinstance(fsdp_group, tuple)
        assert [dist.get_process_group_ranks(pg) for pg in fsdp_group] == [
            expected[Axis.SHARD],
            expected[Axis.REPLICATE],
        ]
        assert mesh.fsdp_sharding(hybrid=True) == "HYBRID_SHARD"
    else:
        assert not isinstance(fsdp_group, tuple)
        assert dist.get_process_group_ranks(fsdp_group) == expected[Axis.SHARD]
        assert mesh.fsdp_sharding(hybrid=False) == "FULL_SHARD"
    communicator = mesh.communicator()
    assert (communicator.num_groups, communicator.group_index) == (layout.mesh_shape[0], g)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_paper_layout_at_512_ranks(layout: Layout) -> None:
    topology = _topology(layout)
    assert topology.mesh_shape == layout.mesh_shape
    ranks = _sample_ranks(topology.group_size)
    assert {0, WORLD - 1} <= set(ranks)
    for rank in ranks:
        with _as_rank(rank):
            mesh = build_federation_mesh(topology, "cpu")
            assert mesh.device_mesh.mesh.shape == layout.mesh_shape
            _check_rank(mesh, layout)


def _bf16_sync_bytes(topology: FederationTopology, num_parameters: int) -> int:
    """What the reducer of a bfloat16 sync sends per rank: each rank's payload is its shard of ``P / S`` values."""
    return make_reducer("bfloat16").wire_bytes(num_parameters // topology.shard_size, topology.num_groups)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_sync_bytes_per_rank_at_512_ranks(layout: Layout) -> None:
    topology = _topology(layout)
    assert _bf16_sync_bytes(topology, LLAMA_8B_PARAMETERS) == pytest.approx(layout.sync_bytes_bf16, rel=1e-9)
    # FL+FSDP moves at each sync what HSDP's cross-node all-reduce moves at every step (up to (G-1)/G): 128 groups
    # of one node against 128 replicas of one node.
    if layout.name == "fl_fsdp":
        hsdp_every_step = 2 * (NODES - 1) / NODES * LLAMA_8B_PARAMETERS * 2 / GPUS_PER_NODE
        assert _bf16_sync_bytes(topology, LLAMA_8B_PARAMETERS) == pytest.approx(hsdp_every_step, rel=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda layout: layout.name)
def test_outer_step_reports_the_formula_on_the_fake_backend(layout: Layout) -> None:
    """The outer step's own byte count on a real mesh agrees with the formula (a shard of n values per rank).

    FL+HSDP's R replicas of a shard each send 1/R of it across the groups (the paper's layout: 8 replicas).
    """
    topology = _topology(layout)
    values_per_rank = 3 * topology.num_groups * topology.num_replicas  # whole numbers of bytes and parts
    with _as_rank(WORLD - 1):
        mesh = build_federation_mesh(topology, "cpu")
        shard = torch.zeros(values_per_rank)
        outer = OuterStep([shard], resolve_outer_optimizer("fedavg"), mesh.communicator(), reduce_dtype=torch.bfloat16)
        stats = outer.step()
    full_shard = _bf16_sync_bytes(topology, values_per_rank * topology.shard_size)
    assert stats.bytes_sent * topology.num_replicas == full_shard


@pytest.mark.parametrize(
    ("num_groups", "shard_size", "hybrid", "match"),
    [
        # 512 / 3 is not whole: some group would hold part of a node.
        (3, None, False, r"world size \(512 = 128 node\(s\) x 4 device\(s\)\) must be divisible by `num_groups=3`"),
        (96, None, False, r"divisible by `num_groups=96`"),
        (1024, None, False, r"divisible by `num_groups=1024`"),
        # Replicas of 3 ranks would split the 4 GPUs of a node.
        (16, 3, True, r"group size \(32 .*\) must be divisible by `shard_size=3`"),
        (128, 8, True, r"group size \(4 .*\) must be divisible by `shard_size=8`"),
    ],
)
def test_non_uniform_layouts_are_refused(num_groups: int, shard_size: int | None, hybrid: bool, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FederationConfig(num_groups=num_groups, shard_size=shard_size).topology(NODES, GPUS_PER_NODE, hybrid)


def test_every_accepted_group_count_keeps_groups_on_whole_nodes() -> None:
    """On 128 nodes x 4 GPUs, each accepted ``num_groups`` gives groups of whole nodes or inside one node."""
    accepted = []
    for num_groups in range(1, WORLD + 1):
        try:
            topology = FederationConfig(num_groups=num_groups).topology(NODES, GPUS_PER_NODE, hybrid=False)
        except ValueError:
            continue
        accepted.append(num_groups)
        group_size = topology.group_size
        assert group_size % GPUS_PER_NODE == 0 or GPUS_PER_NODE % group_size == 0, num_groups
    assert accepted == [2**k for k in range(10)]


def test_mesh_refuses_a_topology_of_another_world_size() -> None:
    with _as_rank(0):
        with pytest.raises(ValueError, match=r"does not match the process group's world size 512"):
            build_federation_mesh(FederationTopology(world_size=256, num_groups=64, shard_size=4), "cpu")
