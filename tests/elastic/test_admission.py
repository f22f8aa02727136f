"""The admission check's proof of the federation's secret: who is refused, who asks again."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_fedshard.core.options.elastic import Elastic, proof
from lightning_fedshard.elastic.admission import NO_SECRET, Admission

SECRET, OTHER, QUORUM = "federation-secret-0123", "another-secret-456789", 7


def _admission(secret: str | None) -> Admission:
    options = Elastic(lighthouse="http://localhost:29510", group=0, federation="f", secret=secret)
    connection = SimpleNamespace(options=options, rings=SimpleNamespace(quorum_id=QUORUM))
    return Admission(connection, None, dict)  # type: ignore[arg-type]


def _description(group: int, secret: str | None, joining: bool) -> dict[str, Any]:
    held = None if secret is None else proof(secret.encode(), "admission", QUORUM, group)
    return {"group": group, "joining": joining, "proof": held}


def test_groups_that_prove_the_same_secret_or_have_none_are_admitted():
    members = [_description(0, SECRET, False), _description(1, SECRET, True)]
    assert _admission(SECRET)._secret_verdict(members, 1) is None
    assert _admission(None)._secret_verdict([_description(0, None, False), _description(1, None, True)], 1) is None


@pytest.mark.parametrize("stranger", [None, OTHER])
def test_a_joining_job_without_the_secret_is_refused_and_the_running_groups_ask_again(stranger, caplog):
    quorum = [_description(0, SECRET, False), _description(1, SECRET, False), _description(2, stranger, True)]
    assert _admission(stranger)._secret_verdict(quorum, 2) == NO_SECRET
    with caplog.at_level(logging.WARNING, logger="lightning_fedshard.elastic.admission"):
        assert _admission(SECRET)._secret_verdict(quorum, 0) == "retry"
    assert ["refused the job of group 2 that does not prove the federation's secret" in r.getMessage()
            for r in caplog.records] == [True]  # fmt: skip
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_a_proof_is_bound_to_its_quorum_and_group():
    replayed = {**_description(1, SECRET, True), "group": 2}  # group 1's proof, claimed for group 2
    assert _admission(SECRET)._secret_verdict([_description(0, SECRET, False), replayed], 0) == "retry"
    stale = {"group": 1, "joining": True, "proof": proof(SECRET.encode(), "admission", QUORUM - 1, 1)}
    assert _admission(SECRET)._secret_verdict([_description(0, SECRET, False), stale], 0) == "retry"


def test_in_a_new_federation_the_side_with_fewer_groups_is_refused_and_a_tie_refuses_both():
    three = [_description(0, SECRET, True), _description(1, SECRET, True), _description(2, OTHER, True)]
    assert _admission(SECRET)._secret_verdict(three, 0) == "retry"
    assert _admission(OTHER)._secret_verdict(three, 2) == NO_SECRET
    two = [_description(0, SECRET, True), _description(1, None, True)]
    assert _admission(SECRET)._secret_verdict(two, 0) == NO_SECRET
    assert _admission(None)._secret_verdict(two, 1) == NO_SECRET
