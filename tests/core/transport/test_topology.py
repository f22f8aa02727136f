import pytest

from lightning_fedshard.core.transport.topology import FederationTopology


def test_paper_fl_hsdp_layout():
    # 512 ranks, 16 groups of 32, shard 4 -> 8 replicas per group
    t = FederationTopology(world_size=512, num_groups=16, shard_size=4)
    assert t.mesh_shape == (16, 8, 4)
    assert t.coords(0) == (0, 0, 0)
    assert t.coords(37) == (1, 1, 1)
    assert t.rank(*t.coords(37)) == 37
    assert t.fed_ranks(1, 1) == [5 + 32 * g for g in range(16)]


def test_rank_sets_partition_the_world():
    t = FederationTopology(world_size=8, num_groups=2, shard_size=2)
    assert t.group_ranks(1) == [4, 5, 6, 7]
    assert t.shard_ranks(1, 1) == [6, 7]
    assert t.replicate_ranks(0, 1) == [1, 3]
    assert sorted(r for g in range(2) for s in range(2) for r in t.replicate_ranks(g, s)) == list(range(8))
    assert sorted(r for rep in range(2) for s in range(2) for r in t.fed_ranks(rep, s)) == list(range(8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "num_groups": 4, "shard_size": 1}, r"world size \(6\) must be divisible by `num_groups=4`"),
        (
            {"world_size": 8, "num_groups": 2, "shard_size": 3},
            r"group size \(4 .*\) must be divisible by `shard_size=3`",
        ),
        ({"world_size": 8, "num_groups": 0, "shard_size": 1}, r"`num_groups` must be a positive integer, got 0"),
        ({"world_size": 8, "num_groups": 2, "shard_size": True}, r"`shard_size` must be a positive integer, got True"),
    ],
)
def test_bad_shapes_name_the_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederationTopology(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="Rank 8 is outside a world of size 8"):
        FederationTopology(8, 2, 2).coords(8)
