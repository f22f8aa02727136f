"""What a lighthouse's status page tells a group before it joins."""

from __future__ import annotations

import pytest

from lightning_fedshard.elastic.lighthouse import (
    HEARTBEAT,
    Vacancies,
    gone_from,
    live_heartbeats,
    managers_of,
    min_replicas,
    refusal_on,
    status_page,
    trained_federation,
    vacancies,
)


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


def _page(step: int, heartbeats: list[tuple[int, str, bool]]) -> str:
    """A status page in the lighthouse's layout: a last quorum of group 0 at ``step``, then ``(group, uuid, old)``."""
    member = f'<div class="member\n">\n  <b>tests_0:{"0" * 36}</b> <br/>\n  Step: {step} <br/>\n</div>\n'
    beats = "".join(
        f'<li class="heartbeat\n    {"old" if old else ""}\n  ">\n    tests_{g}:{u * 36}: seen 0.1s ago\n  </li>\n'
        for g, u, old in heartbeats
    )
    return member + "<h2>Heartbeats</h2>\n<ul>\n" + beats + "</ul>"


def test_a_standby_finds_the_places_of_groups_gone_only_once_the_federation_trains():
    alive = [(0, "a", False), (1, "b", False), (2, "c", False)]
    assert vacancies(_page(0, alive[:2]), "tests", 3) == Vacancies((), ended=False)  # still starting: no place
    assert vacancies(_page(4, alive), "tests", 3) == Vacancies((), ended=False)
    assert vacancies(_page(4, alive[:1] + [(1, "b", True)]), "tests", 3) == Vacancies((1, 2), ended=False)
    assert vacancies(_page(4, [(0, "a", True), (1, "b", True)]), "tests", 3) == Vacancies((), ended=True)
    assert vacancies(_page(4, alive), "other", 3) == Vacancies((), ended=False)


def test_two_jobs_that_took_one_place_show_as_two_live_managers_of_it():
    page = _page(4, [(1, "a", True), (1, "b", False), (1, "c", False), (2, "d", False)])
    assert live_heartbeats(page, "tests") == [(1, "b" * 36), (1, "c" * 36), (2, "d" * 36)]


def test_a_group_is_gone_once_every_manager_of_it_is_old_and_unknown_groups_are_not_gone():
    # What a collective waiting on the groups of its ring reads: only the lighthouse's own verdict counts.
    page = _page(4, [(0, "a", False), (1, "b", True), (2, "c", True), (2, "d", False), (3, "e", True)])
    assert gone_from(page, "tests", (0, 1, 2, 3, 5)) == (1, 3)  # 2 has a live manager; 5 is not listed at all
    assert gone_from(page, "other", (0, 1, 2, 3)) == ()
    assert gone_from("", "tests", (0, 1)) == ()  # an unreadable page (a lighthouse restarting): nobody is gone


def test_a_hung_group_whose_place_a_standby_took_is_gone_for_the_sum_it_hung_in():
    # Group 2's manager "c" took part in the sum and hung; a standby (manager "d") has taken place 2 since and
    # heartbeats: for the sum that waits on "c", group 2 is gone all the same.
    page = _page(4, [(0, "a", False), (2, "c", True), (2, "d", False)])
    managers = managers_of([f"tests_0:{'a' * 36}", f"tests_2:{'c' * 36}", f"other_1:{'e' * 36}"], "tests")
    assert managers == {0: "a" * 36, 2: "c" * 36}
    assert gone_from(page, "tests", (0, 2), managers) == (2,)
    assert gone_from(page, "tests", (0, 2)) == ()  # by index only, the standby's live manager hides the hung one
    assert gone_from(page, "tests", (0, 2), {2: "f" * 36}) == ()  # a manager the page does not list is not gone


def test_the_lighthouse_shows_the_groups_it_waits_for_while_a_quorum_lacks_them():
    # A lighthouse that waits for more groups than the federation plans could never run a sync: a group refuses it.
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    try:
        assert min_replicas(status_page(lighthouse.address())) == 3
    finally:
        lighthouse.shutdown()
    assert min_replicas("Next quorum status: Fast quorum found!") is None


def test_a_lighthouse_of_another_federation_or_a_larger_quorum_is_refused_with_the_reason():
    page = _page(4, [(0, "a", False), (1, "b", False)])  # federation "tests", groups 0 and 1 heartbeating
    assert refusal_on(page, "http://lh:29510", "tests", 2, num_groups=3) is None
    other = refusal_on(page, "http://lh:29510", "mine", 2, num_groups=3)
    assert other is not None and "serves another federation: 'tests' (groups [0, 1])" in other
    waiting = refusal_on("need min_replicas 4", "http://lh:29510", "tests", 0, num_groups=3)
    assert waiting is not None and "`--min_replicas 4`" in waiting and "`num_groups=3`" in waiting
