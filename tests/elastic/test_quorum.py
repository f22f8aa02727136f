"""What the groups of a quorum tell each other: the admission check and the changes of members."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.core.options.elastic import FederationError
from lightning_fedshard.elastic.quorum import (
    DESCRIPTION_BYTES,
    check_members,
    decode_description,
    encode_description,
    membership_change,
)


def _description(group: int, joining: bool, **changes: object) -> dict[str, object]:
    return {"federation": "f", "group": group, "joining": joining, "model": "219 values", "sync options": "every 8",
            **changes}  # fmt: skip


def test_a_quorum_of_one_federation_is_admitted():
    members = [_description(0, False), _description(1, False), _description(2, True)]
    assert all(check_members(members, position) is None for position in range(3))


def test_a_joining_job_with_another_model_is_refused_naming_both_values():
    members = [_description(0, False), _description(1, True, model="279 values"), _description(2, False)]
    assert check_members(members, 1) == (
        "it does not belong to the federation it reached (model '279 values' here, '219 values' in the federation)"
    )
    assert check_members(members, 0) == "retry" and check_members(members, 2) == "retry"  # the others ask again


def test_among_joining_groups_the_most_common_federation_and_description_win():
    members = [_description(0, True, federation="other"), _description(1, True), _description(2, True)]
    assert "federation 'other' here, 'f' in the federation" in str(check_members(members, 0))
    assert check_members(members, 1) == "retry"
    tie = [_description(0, True, model="a"), _description(1, True, model="b")]
    assert check_members(tie, 0) == "retry" and "model 'b' here, 'a'" in str(check_members(tie, 1))


def test_a_group_index_already_running_is_refused_to_the_newcomer():
    members = [_description(1, True), _description(1, False)]
    assert check_members(members, 0) == "group 1 is already running in federation 'f'"
    assert check_members(members, 1) == "retry"


def test_a_description_round_trips_through_its_fixed_size_buffer():
    description = {"federation": "f", "group": 2, "joining": True, "model": "219 values"}
    row = encode_description(description)
    assert row.dtype == torch.uint8 and row.numel() == DESCRIPTION_BYTES
    assert decode_description(row) == description
    assert decode_description(torch.zeros(DESCRIPTION_BYTES, dtype=torch.uint8)) == {
        "federation": None,
        "group": -1,
        "joining": True,
    }  # a peer whose collective failed sent nothing: a joining stranger
    with pytest.raises(FederationError, match=r"description is too long to exchange \(\d+ bytes\)"):
        encode_description({"model": "x" * DESCRIPTION_BYTES})


# -- membership ---------------------------------------------------------------------------------------------------


def _member(group: int, joining: bool = False, new: bool = False, healed_from: int | None = None) -> dict[str, object]:
    return {"group": group, "joining": joining, "new": new, "healed_from": healed_from}


def test_membership_lines_name_the_groups_the_step_and_the_peer_a_group_healed_from():
    # Group 0's view: group 1 left, group 3 is a new job (it healed from group 2), group 2 took its index back.
    change = membership_change("f", 0, (0, 1, 2), (0, 2, 3), [_member(0), _member(2), _member(3, True, True, 2)])
    assert change is not None and change.lines(8) == [
        "Elastic federation 'f' at step 8: group 3 joined, healed from group 2; groups now [0, 2, 3].",
        "Elastic federation 'f' at step 8: group 1 left; groups now [0, 2, 3].",
    ]
    # The new job's own view (its first quorum): itself only.
    mine = membership_change("f", 3, (), (0, 2, 3), [_member(0), _member(2), _member(3, True, True, 2)])
    assert mine is not None and mine.lines(8) == [
        "Elastic federation 'f' at step 8: group 3 (this job) joined, healed from group 2; groups now [0, 2, 3]."
    ]
    # A job that replaced a failed group of the same index before the others noticed, and a group that fell behind.
    replaced = membership_change(
        "f", 0, (0, 1, 2), (0, 1, 2), [_member(0), _member(1, True, True, 0), _member(2, True, healed_from=0)]
    )
    assert replaced is not None and replaced.joined == (1,) and replaced.healed == (2,)
    assert replaced.lines(12) == [
        "Elastic federation 'f' at step 12: group 1 joined, healed from group 0; groups now [0, 1, 2].",
        "Elastic federation 'f' at step 12: group 2 was behind and healed from group 0; groups now [0, 1, 2].",
    ]
    # Every group of a new federation joins at once; nothing changes at an ordinary sync.
    start = membership_change("f", 1, (), (0, 1), [_member(0, True, True), _member(1, True, True, 0)])
    assert start is not None and start.joined == (0, 1) and start.healed_from == {1: 0}
    assert membership_change("f", 0, (0, 1), (0, 1), [_member(0), _member(1)]) is None
