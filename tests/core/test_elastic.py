"""The elastic options, the admission check of a quorum, and the federation options that go with elastic groups.

The groups themselves (separate jobs on torchft) are tested in ``tests/elastic``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_fedshard import Elastic, FederationConfig, Hierarchical
from lightning_fedshard.core.elastic import _HEARTBEAT, _check_members


def test_elastic_options_are_checked_in_the_constructor():
    for bad, message in [
        ({"min_groups": 0}, "`Elastic(min_groups=...)` must be a positive integer, got 0"),
        ({"start_groups": 0}, "`Elastic(start_groups=...)` must be a positive integer or None, got 0"),
        ({"timeout": -1}, "`Elastic(timeout=...)` must be a positive number of seconds, got -1"),
        ({"quorum_retries": -2}, "must be a non-negative integer, got -2"),
        ({"federation": "a b"}, "`Elastic(federation='a b')` must be a non-empty name of letters, digits, '-' and '.'"),
        ({"federation": "x_1"}, "must be a non-empty name"),  # "_<digits>" ends a group's torchft id
        ({"group": "1"}, "`Elastic(group=...)` must be an integer, got '1'"),
    ]:
        with pytest.raises(ValueError, match=_escaped(message)):
            Elastic(**bad)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_the_group_index_comes_from_the_options_or_the_environment(monkeypatch):
    monkeypatch.delenv("FEDSHARD_GROUP", raising=False)
    assert Elastic(group=2).group_index(4) == 2
    with pytest.raises(ValueError, match=r"needs its index: pass `Elastic\(group=...\)` or set \$FEDSHARD_GROUP"):
        Elastic().group_index(4)
    monkeypatch.setenv("FEDSHARD_GROUP", "3")
    assert Elastic().group_index(4) == 3
    with pytest.raises(ValueError, match=r"The elastic group index 3 is outside \[0, num_groups=3\)"):
        Elastic().group_index(3)
    monkeypatch.setenv("FEDSHARD_GROUP", "x")
    with pytest.raises(ValueError, match=r"\$FEDSHARD_GROUP='x' is not a group index"):
        Elastic().group_index(3)


def test_the_lighthouse_comes_from_the_options_or_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"needs the lighthouse's address"):
        Elastic().lighthouse_address()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.1:29510")
    assert Elastic().lighthouse_address() == "http://10.0.0.1:29510"
    assert Elastic(lighthouse="http://h:1").lighthouse_address() == "http://h:1"


def test_an_elastic_job_is_one_group_of_a_planned_federation():
    config = FederationConfig(num_groups=4, elastic=Elastic(group=1))
    topology = config.topology(num_nodes=1, devices_per_node=4, hybrid=False)
    assert (topology.num_groups, topology.group_size, topology.shard_size) == (1, 4, 4)
    hybrid = config.topology(num_nodes=2, devices_per_node=2, hybrid=True)
    assert (hybrid.num_groups, hybrid.num_replicas, hybrid.shard_size) == (1, 2, 2)
    assert "elastic (federation 'fedshard', at least 1 group(s))" in config.describe()


def test_elastic_federation_options_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match=r"An elastic federation needs `num_groups`"):
        FederationConfig(elastic=Elastic())
    with pytest.raises(ValueError, match=r"runs neither `outer_topology=.*` nor `eager_updates=True`"):
        FederationConfig(num_groups=2, elastic=Elastic(), eager_updates=True)
    with pytest.raises(ValueError, match=r"runs neither `outer_topology=Hierarchical"):
        FederationConfig(num_groups=4, elastic=Elastic(), outer_topology=Hierarchical({8: 2, 16: 4}))
    with pytest.raises(ValueError, match=r"`elastic` must be a `lightning_fedshard.Elastic` or None, got True"):
        FederationConfig(num_groups=2, elastic=True)  # type: ignore[arg-type]


def _description(group: int, joining: bool, **changes: object) -> dict[str, object]:
    return {"federation": "f", "group": group, "joining": joining, "model": "219 values", "sync options": "every 8",
            **changes}  # fmt: skip


def test_a_quorum_of_one_federation_is_admitted():
    members = [_description(0, False), _description(1, False), _description(2, True)]
    assert all(_check_members(members, position) is None for position in range(3))


def test_a_joining_job_with_another_model_is_refused_naming_both_values():
    members = [_description(0, False), _description(1, True, model="279 values"), _description(2, False)]
    assert _check_members(members, 1) == (
        "it does not belong to the federation it reached (model '279 values' here, '219 values' in the federation)"
    )
    assert _check_members(members, 0) == "retry" and _check_members(members, 2) == "retry"  # the others ask again


def test_among_joining_groups_the_most_common_federation_and_description_win():
    members = [_description(0, True, federation="other"), _description(1, True), _description(2, True)]
    assert "federation 'other' here, 'f' in the federation" in str(_check_members(members, 0))
    assert _check_members(members, 1) == "retry"
    tie = [_description(0, True, model="a"), _description(1, True, model="b")]
    assert _check_members(tie, 0) == "retry" and "model 'b' here, 'a'" in str(_check_members(tie, 1))


def test_a_group_index_already_running_is_refused_to_the_newcomer():
    members = [_description(1, True), _description(1, False)]
    assert _check_members(members, 0) == "group 1 is already running in federation 'f'"
    assert _check_members(members, 1) == "retry"


def test_the_lighthouse_status_page_lists_the_federations_heartbeating():
    page = (
        "<li class='heartbeat'>\n    tests_3:3be1ccc5-6d51-4bbf-bf15-150c1dd9313a: seen 0.09652s ago\n  </li>\n"
        "  other.run-1_12:3be1ccc5-6d51-4bbf-bf15-150c1dd9313b: seen 12.5s ago\n"
    )
    assert _HEARTBEAT.findall(page) == [("tests", "3", "0.09652"), ("other.run-1", "12", "12.5")]


def test_the_package_imports_without_torchft():
    code = (
        "import sys; sys.modules['torchft'] = None; import lightning_fedshard as l; "
        "print(l.Elastic(group=0).group_index(2), 'torchft' in sys.modules and sys.modules['torchft'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["0", "False"]
