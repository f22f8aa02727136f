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
        ({"min_groups": 3, "start_groups": 2}, "`Elastic(start_groups=2)` is smaller than `min_groups=3`"),
        (
            {"lighthouse": "10.0.0.1:29510"},
            "`Elastic(lighthouse='10.0.0.1:29510')` is not a lighthouse address: it"
            " must read like 'http://10.0.0.1:29510'",
        ),
        ({"lighthouse": "http://:29510"}, "`Elastic(lighthouse='http://:29510')` is not a lighthouse address"),
        ({"manager_port": 70000}, "`Elastic(manager_port=70000)` must be a port number in [0, 65535]"),
        ({"hostname": ""}, "`Elastic(hostname='')` must be a non-empty address"),
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
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "10.0.0.1:29510")
    with pytest.raises(ValueError, match=r"\$TORCHFT_LIGHTHOUSE='10.0.0.1:29510' is not a lighthouse address"):
        Elastic().lighthouse_address()


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


def test_elastic_group_counts_larger_than_the_planned_federation_are_refused():
    # Otherwise every group waits for groups that never come, for the whole `quorum_timeout` (15 minutes by default).
    with pytest.raises(ValueError, match=r"`Elastic\(min_groups=3\)` is larger than `num_groups=2`: the federation is"):
        FederationConfig(num_groups=2, elastic=Elastic(min_groups=3))
    with pytest.raises(ValueError, match=r"`Elastic\(start_groups=5\)` is larger than `num_groups=4`.*timeout=900"):
        FederationConfig(num_groups=4, elastic=Elastic(start_groups=5))
    FederationConfig(num_groups=4, elastic=Elastic(min_groups=2, start_groups=4))  # a planned federation: fine


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


@pytest.mark.slow
def test_the_package_imports_without_torchft():
    code = (
        "import sys; sys.modules['torchft'] = None; import lightning_fedshard as l; "
        "print(l.Elastic(group=0).group_index(2), 'torchft' in sys.modules and sys.modules['torchft'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["0", "False"]


# -- membership ---------------------------------------------------------------------------------------------------


def _member(group: int, joining: bool = False, new: bool = False, healed_from: int | None = None) -> dict[str, object]:
    return {"group": group, "joining": joining, "new": new, "healed_from": healed_from}


def test_membership_lines_name_the_groups_the_step_and_the_peer_a_group_healed_from():
    from lightning_fedshard.core.elastic import membership_change

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


def test_a_heal_silences_lightnings_mid_epoch_resume_warning_until_the_first_step():
    import types
    import warnings

    from lightning.fabric.utilities.rank_zero import rank_zero_warn
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from lightning_fedshard.runtime import FederatedRuntime

    def lightnings_warning() -> None:  # what Lightning's epoch loop says when it restarts mid-epoch
        rank_zero_warn(
            "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable.",
            category=PossibleUserWarning,
        )

    runtime = FederatedRuntime(FederationConfig(num_groups=2, elastic=Elastic(group=1)), hybrid=False, name="fl_fsdp")
    loaded: list[object] = []
    runtime.set_host_state(dict, loaded.append)
    runtime._federation = types.SimpleNamespace(maybe_sync=lambda step: None)  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as seen:
        runtime._joining = True  # inside `join`: a peer's state arrives
        runtime._load_host_state_of_peer(8, {"host": {"fit_loop": "at step 8"}, "hyperparameters": []})
        runtime._joining = False
        assert loaded == [{"fit_loop": "at step 8"}] and runtime.step == 8
        lightnings_warning()  # the epoch loop restarts at the peer's position: a heal, not a resume
        assert [str(w.message) for w in seen] == []
        runtime.after_optimizer_step(9)
        lightnings_warning()  # a real resume later on is still told
        assert len(seen) == 1 and "dataloader is not resumable" in str(seen[0].message)


def test_the_heal_server_writes_no_access_log(capfd):
    # torchft's HTTP transport serves a healing peer through Python's http.server, which logs every request to stderr.
    import urllib.request
    from datetime import timedelta

    pytest.importorskip("torchft")
    import torch
    from torchft.checkpointing import HTTPTransport

    from lightning_fedshard.core.elastic import _heal_transport

    for hostname in (None, "127.0.0.1"):
        transport = _heal_transport(HTTPTransport, timedelta(seconds=10), hostname)
        try:
            transport.send_checkpoint(
                dst_ranks=[1], step=3, state_dict={"w": torch.ones(2)}, timeout=timedelta(seconds=10)
            )
            address = transport.metadata()  # http://host:port/checkpoint/
            with urllib.request.urlopen(f"{address.rstrip('/')}/3/full", timeout=10) as response:
                assert response.status == 200
        finally:
            transport.shutdown(wait=False)
    assert "GET /checkpoint" not in capfd.readouterr().err


def test_the_lighthouse_shows_whether_a_federation_trained_on_it_and_whether_its_groups_are_alive():
    # A job at step 0 that finds its federation trained and none of its groups alive would start it again alone.
    import time
    from datetime import timedelta

    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient, LighthouseServer

    from lightning_fedshard.core.elastic import _status_page, _trained_federation

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    try:
        address, replica = lighthouse.address(), "tests_1:3be1ccc5-6d51-4bbf-bf15-150c1dd9313a"
        client = LighthouseClient(address, timedelta(seconds=5))
        client.quorum(replica, timedelta(seconds=5), "manager", "store", 0, 1)  # a new federation: nothing committed
        assert _trained_federation(_status_page(address), "tests") is None
        client.quorum(replica, timedelta(seconds=5), "manager", "store", 5, 1)  # 5 syncs committed
        trained = _trained_federation(_status_page(address), "tests")
        assert trained is not None and (trained.syncs, trained.groups, trained.alive) == (5, (1,), (1,))
        assert _trained_federation(_status_page(address), "other") is None
        time.sleep(1.5)  # past the lighthouse's heartbeat timeout: the group is gone
        trained = _trained_federation(_status_page(address), "tests")
        assert trained is not None and (trained.syncs, trained.alive) == (5, ())
    finally:
        lighthouse.shutdown()
