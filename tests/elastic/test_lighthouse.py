"""What a lighthouse's status page tells a group before it joins."""

from __future__ import annotations

import pytest

from lightning_fedshard.elastic.lighthouse import HEARTBEAT, status_page, trained_federation


def test_the_lighthouse_status_page_lists_the_federations_heartbeating():
    page = (
        "<li class='heartbeat'>\n    tests_3:3be1ccc5-6d51-4bbf-bf15-150c1dd9313a: seen 0.09652s ago\n  </li>\n"
        "  other.run-1_12:3be1ccc5-6d51-4bbf-bf15-150c1dd9313b: seen 12.5s ago\n"
    )
    assert HEARTBEAT.findall(page) == [("tests", "3", "0.09652"), ("other.run-1", "12", "12.5")]


def test_the_lighthouse_shows_whether_a_federation_trained_on_it_and_whether_its_groups_are_alive():
    # A job at step 0 that finds its federation trained and none of its groups alive would start it again alone.
    import time
    from datetime import timedelta

    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient, LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    try:
        address, replica = lighthouse.address(), "tests_1:3be1ccc5-6d51-4bbf-bf15-150c1dd9313a"
        client = LighthouseClient(address, timedelta(seconds=5))
        client.quorum(replica, timedelta(seconds=5), "manager", "store", 0, 1)  # a new federation: nothing committed
        assert trained_federation(status_page(address), "tests") is None
        client.quorum(replica, timedelta(seconds=5), "manager", "store", 5, 1)  # 5 syncs committed
        trained = trained_federation(status_page(address), "tests")
        assert trained is not None and (trained.syncs, trained.groups, trained.alive) == (5, (1,), (1,))
        assert trained_federation(status_page(address), "other") is None
        time.sleep(1.5)  # past the lighthouse's heartbeat timeout: the group is gone
        trained = trained_federation(status_page(address), "tests")
        assert trained is not None and (trained.syncs, trained.alive) == (5, ())
    finally:
        lighthouse.shutdown()
