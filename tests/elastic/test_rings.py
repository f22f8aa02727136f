"""How a fed ring reads the groups of a quorum, and when it keeps the ring it has."""

from __future__ import annotations

from lightning_fedshard.elastic.rings import _held_back, _quorum_groups


def test_the_groups_of_a_quorum_follow_the_global_ranks_of_one_in_group_position():
    # three groups of two ranks each: position 1 meets ranks 1, 5 and 7 (groups 0, 2 and 3)
    assert _quorum_groups([1, 5, 7], group_rank=1, group_world_size=2) == (0, 2, 3)
    assert _quorum_groups(None, None, None) == (0,)


def test_a_restarted_lighthouses_quorum_without_every_group_of_the_last_ring_keeps_that_ring():
    assert _held_back((5, (0, 1, 2)), quorum_id=1, members=(0, 1))


def test_a_new_ring_is_built_for_a_later_quorum_a_first_one_or_every_group_back():
    assert not _held_back((5, (0, 1, 2)), quorum_id=6, members=(0, 1))
    assert not _held_back(None, quorum_id=1, members=(0,))
    assert not _held_back((5, (0, 1)), quorum_id=1, members=(0, 1))
    assert not _held_back((5, (0, 1)), quorum_id=None, members=(0,))
