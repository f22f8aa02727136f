"""The elastic options and the federation options that go with elastic groups.

The elastic machinery (admission, heals, the lighthouse) and the groups themselves (separate jobs on torchft) are
tested in ``tests/elastic``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_fedshard import Elastic, FederationConfig, Hierarchical


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
        ({"standby": "yes"}, "`Elastic(standby=...)` must be True or False, got 'yes'"),
        ({"standby": True, "group": 1}, "`Elastic(standby=True, group=1)`: a standby has no group of its own"),
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
    with pytest.raises(ValueError, match=r"\$FEDSHARD_GROUP=3 is outside \[0, num_groups=3\)"):
        Elastic().group_index(3)
    monkeypatch.setenv("FEDSHARD_GROUP", "x")
    with pytest.raises(ValueError, match=r"\$FEDSHARD_GROUP='x' is not a group index"):
        Elastic().group_index(3)
    with pytest.raises(ValueError, match="A standby group has no index until it takes the place of a group"):
        Elastic(standby=True).group_index(3)  # $FEDSHARD_GROUP does not count for a standby


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
    FederationConfig(num_groups=2, elastic=Elastic(), eager_updates=True, fragments=2)  # sums in flight are healed
    with pytest.raises(ValueError, match=r"averages 4 groups; it must span all 8 groups"):  # the planned groups
        FederationConfig(num_groups=8, elastic=Elastic(), outer_topology=Hierarchical({8: 2, 16: 4}))
    with pytest.raises(ValueError, match=r"`elastic` must be a `lightning_fedshard.Elastic` or None, got True"):
        FederationConfig(num_groups=2, elastic=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_peer_check_that_is_not_a_number_of_seconds_is_refused_naming_it(value):
    message = r"`Elastic\(peer_check=...\)` must be a number of seconds >= 0 \(0: never\), got"
    with pytest.raises(ValueError, match=message):
        Elastic(peer_check=value)  # type: ignore[arg-type]
    assert Elastic(peer_check=0).peer_check == 0 and Elastic().peer_check == 1.0


def test_elastic_group_counts_larger_than_the_planned_federation_are_refused():
    # Otherwise every group waits for groups that never come, for the whole `quorum_timeout` (15 minutes by default).
    with pytest.raises(ValueError, match=r"`Elastic\(min_groups=3\)` is larger than `num_groups=2`: the federation is"):
        FederationConfig(num_groups=2, elastic=Elastic(min_groups=3))
    with pytest.raises(ValueError, match=r"`Elastic\(start_groups=5\)` is larger than `num_groups=4`.*timeout=900"):
        FederationConfig(num_groups=4, elastic=Elastic(start_groups=5))
    FederationConfig(num_groups=4, elastic=Elastic(min_groups=2, start_groups=4))  # a planned federation: fine


@pytest.mark.slow
def test_the_package_imports_without_torchft():
    code = (
        "import sys; sys.modules['torchft'] = None; import lightning_fedshard as l; "
        "print(l.Elastic(group=0).group_index(2), 'torchft' in sys.modules and sys.modules['torchft'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["0", "False"]


SECRET = "0123456789abcdef-federation"


def test_the_secret_comes_from_the_options_or_the_environment_and_is_never_shown(monkeypatch):
    from lightning_fedshard.core.options.elastic import SECRET_ENV

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert Elastic().federation_secret() is None
    elastic = Elastic(secret=SECRET)
    assert elastic.federation_secret() == SECRET.encode()
    shown = [repr(elastic), elastic.describe(0, 2), repr(FederationConfig(num_groups=2, elastic=elastic))]
    shown.append(FederationConfig(num_groups=2, elastic=elastic).describe())
    assert all(SECRET not in text for text in shown)
    monkeypatch.setenv(SECRET_ENV, SECRET[::-1])
    assert Elastic().federation_secret() == SECRET[::-1].encode()
    assert Elastic(secret=SECRET).federation_secret() == SECRET.encode()  # the option wins


@pytest.mark.parametrize(
    ("secret", "message"),
    [("", r"`Elastic\(secret=...\)` is empty: a federation secret needs at least 16 characters"),
     ("short-secret", r"`Elastic\(secret=...\)` is 12 character\(s\) long: .* at least 16 characters")],
)  # fmt: skip
def test_an_empty_or_short_secret_is_refused_with_the_reason_and_not_its_value(secret, message, monkeypatch):
    from lightning_fedshard.core.options.elastic import SECRET_ENV

    with pytest.raises(ValueError, match=message) as error:
        Elastic(secret=secret)
    assert not secret or secret not in str(error.value)
    monkeypatch.setenv(SECRET_ENV, "tiny")
    with pytest.raises(ValueError, match=r"\$FEDSHARD_SECRET is 4 character\(s\) long"):
        Elastic().federation_secret()


@pytest.mark.parametrize("group", [2, 5, -1])
def test_a_group_outside_the_planned_federation_is_refused_when_the_strategy_is_built(group, monkeypatch):
    from lightning_fedshard import FLFSDPStrategy, FLHSDP2Strategy
    from lightning_fedshard.fabric import FLFSDPStrategy as FabricFLFSDPStrategy

    monkeypatch.delenv("FEDSHARD_GROUP", raising=False)
    message = rf"`Elastic\(group={group}\)` is outside \[0, num_groups=2\)"
    for strategy in (FLFSDPStrategy, FLHSDP2Strategy, FabricFLFSDPStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(num_groups=2, elastic=Elastic(group=group))
    FLFSDPStrategy(num_groups=2, elastic=Elastic(group=1))  # in range: fine
    monkeypatch.setenv("FEDSHARD_GROUP", "7")
    FLFSDPStrategy(num_groups=2, elastic=Elastic())  # the environment is the job's own: read when it starts


def test_the_elastic_start_line_describes_the_federation_once():
    from lightning_fedshard.core.backends.sharding import UNSHARDED
    from lightning_fedshard.runtime import FederatedRuntime

    elastic = Elastic(group=1, lighthouse="http://h:1", federation="llama-8b", min_groups=2)
    runtime = FederatedRuntime(FederationConfig(num_groups=4, elastic=elastic), False, "fl_fsdp", UNSHARDED)
    runtime.resolve_topology(1, 4)
    line = runtime.describe()
    assert line.startswith("fl_fsdp: elastic group 1 of 4 (lighthouse http://h:1), 1 replica(s) x 4 shard(s) here; ")
    assert line.endswith(", elastic (federation 'llama-8b', at least 2 group(s)), anchor on the CPU")
    assert line.count("llama-8b") == 1 and line.count("at least 2 group(s)") == 1, line
