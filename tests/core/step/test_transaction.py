"""The sync transaction: participants once, absent groups in one exchange, the policy on NaN/Inf, weight and vote."""

from typing import Any

import pytest
import torch

from lightning_fedshard.core.config import OUTER_OPTIMIZERS
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.step.participation import Participation
from lightning_fedshard.core.step.transaction import MIX, SITE_SYNC, SyncKind, SyncTransaction
from lightning_fedshard.core.transport.inprocess import InProcessGroups


class _LeaveOut(Participation):
    """Leaves the given groups out; weighs group ``g`` by ``g + 1`` over the contributors' sum."""

    def __init__(self, out: tuple[int, ...]) -> None:
        self.out = out

    def idle(self, participants: tuple[int, ...], landing: int) -> tuple[int, ...]:
        return tuple(g for g in participants if g in self.out)

    def weight(self, fragment: int, step: int, contributors: tuple[int, ...], group: int) -> float | None:
        return (group + 1) * len(contributors) / sum(g + 1 for g in contributors)


def _outer(comm: Any, value: float, on_nonfinite: str = "skip_group") -> OuterStep:
    return OuterStep([torch.full((2,), value)], OUTER_OPTIMIZERS["fedavg"], comm, on_nonfinite=on_nonfinite)


def test_kinds_are_values_that_travel_as_plain_markers():
    for kind in (SyncKind.outer_step(2), SyncKind.site_sync(), SyncKind.mix(1)):
        marker = kind.marker(16)
        assert all(isinstance(v, (str, int, type(None))) for v in marker)
        assert SyncKind.from_marker(marker) == (kind, 16)
    assert SyncKind.site_sync().name == SITE_SYNC and SyncKind.mix(0).name == MIX
    with pytest.raises(ValueError, match="'gossip'"):
        SyncKind("gossip")


def test_open_marks_the_sync_while_it_asks_for_the_participants():
    def work(g: int, comm: Any) -> Any:
        outer = _outer(comm, 0.0)
        seen = []
        comm_participants = comm.participants
        comm.participants = lambda: (seen.append(outer.syncing), comm_participants())[1]
        transaction = SyncTransaction(outer, SyncKind.mix(1), 8)
        return transaction.open(), seen, outer.syncing

    for participants, seen, after in InProcessGroups(3).run(work):
        assert participants == (0, 1, 2) and seen == [("mix", 1, 8)] and after is None


def test_exchange_knows_broken_and_idle_groups_on_every_rank_and_the_rule_weighs_the_rest():
    def work(g: int, comm: Any) -> Any:
        transaction = SyncTransaction(_outer(comm, 0.0), SyncKind.outer_step(0), 4, _LeaveOut((3,)))
        transaction.open()
        transaction.exchange(finite=g != 1, device=torch.device("cpu"))
        return transaction.broken, transaction.idle, transaction.contributors, transaction.adds, transaction.weight()

    results = InProcessGroups(4).run(work)
    for g, (broken, idle, contributors, adds, weight) in enumerate(results):
        assert (broken, idle, contributors) == ((1,), (3,), (0, 2))
        assert adds == (g in (0, 2))
        assert weight == pytest.approx((g + 1) * 2 / 4)  # groups 0 and 2 weigh 1 and 3 over their sum 4
    # An idle group's NaN does not count: it adds nothing anyway.

    def idle_nan(g: int, comm: Any) -> Any:
        transaction = SyncTransaction(_outer(comm, 0.0), SyncKind.outer_step(0), 4, _LeaveOut((1,)))
        transaction.open()
        transaction.exchange(finite=g != 1, device=torch.device("cpu"))
        return transaction.broken

    assert InProcessGroups(2).run(idle_nan) == [(), ()]


def test_raise_policy_fails_the_sync_for_every_group_with_its_kind():
    def work(g: int, comm: Any) -> Any:
        transaction = SyncTransaction(_outer(comm, 0.0, "raise"), SyncKind.site_sync(), 6)
        transaction.open()
        with pytest.raises(NonFiniteOuterGradientError) as raised:
            transaction.exchange(finite=g != 2, device=torch.device("cpu"))
        return raised.value

    for error in InProcessGroups(3).run(work):
        assert error.groups == (2,) and error.sync == "site sync" and error.step == 6


def test_a_vote_that_fails_counts_one_lost_sync_unless_the_caller_counts():
    def work(g: int, comm: Any) -> Any:
        outer = _outer(comm, 0.0)
        comm.should_commit = lambda: False
        transaction = SyncTransaction(outer, SyncKind.outer_step(0), 2)
        first = transaction.commit()
        second = transaction.commit(count_lost=False)
        return first, second, outer.syncs_lost

    assert InProcessGroups(2).run(work) == [(False, False, 1)] * 2


def test_the_outer_step_merges_by_the_rules_weight_and_leaves_idle_groups_out():
    """Group g at anchor - (g + 1): the mean over groups 0 and 2 weighted 1:3 is (1 * 1 + 3 * 3) / 4 = 2.5."""

    def work(g: int, comm: Any) -> Any:
        outer = _outer(comm, 0.0)
        outer.shards[0].fill_(-(g + 1.0))
        transaction = SyncTransaction(outer, SyncKind.outer_step(0), 4, _LeaveOut((1,)))
        stats = outer.complete(outer.begin(transaction, background=False), step=4)
        return outer.shards[0].clone(), stats

    for shard, stats in InProcessGroups(3).run(work):
        torch.testing.assert_close(shard, torch.full((2,), -2.5), rtol=0, atol=0)
        assert stats.num_syncs == 1
