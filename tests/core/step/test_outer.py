import functools

import pytest
import torch
from torch.testing import assert_close

from lightning_fedshard.core.config import OUTER_OPTIMIZERS
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction
from lightning_fedshard.core.transport.inprocess import InProcessGroups


def _run_syncs(local_updates: list[list[list[float]]], outer: str, anchor: list[float], **kwargs) -> list:
    """Each group starts at ``anchor``; before sync k group g sets its shard to ``local_updates[k][g]``."""
    groups = InProcessGroups(len(local_updates[0]))

    def work(g, comm):
        shard = torch.tensor(anchor)
        step = OuterStep([shard], OUTER_OPTIMIZERS[outer], comm, **kwargs)
        out = []
        for round_values in local_updates:
            shard.copy_(torch.tensor(round_values[g]))
            stats = step.step()
            out.append((shard.clone(), stats))
        return out

    return groups.run(work)


def test_fedavg_replaces_every_group_by_the_mean():
    results = _run_syncs([[[1.0, 2.0], [3.0, 6.0]]], "fedavg", anchor=[0.0, 0.0])
    for g in range(2):
        assert_close(results[g][0][0], torch.tensor([2.0, 4.0]))


def test_nesterov_matches_hand_computed_steps():
    # anchor a0 = [1, 1]; lr 0.7, momentum 0.9, nesterov.
    # sync 1: groups at [0, 1] and [1, 3] -> deltas [1, 0], [0, -2] -> mean d1 = [0.5, -1]
    #         buf = d1; update = d1 + 0.9 * buf = [0.95, -1.9]; a1 = a0 - 0.7 * update = [0.335, 2.33]
    # sync 2: groups at [0.335, 2.0] and [0.135, 2.33] -> deltas [0, 0.33], [0.2, 0] -> d2 = [0.1, 0.165]
    #         buf = 0.9 * [0.5, -1] + d2 = [0.55, -0.735]; update = d2 + 0.9 * buf = [0.595, -0.4965]
    #         a2 = a1 - 0.7 * update = [-0.0815, 2.67755]
    rounds = [[[0.0, 1.0], [1.0, 3.0]], [[0.335, 2.0], [0.135, 2.33]]]
    results = _run_syncs(rounds, "nesterov", anchor=[1.0, 1.0])
    for g in range(2):
        assert_close(results[g][0][0], torch.tensor([0.335, 2.33]))
        assert_close(results[g][1][0], torch.tensor([-0.0815, 2.67755]))
    stats = results[0][0][1]
    assert stats.outer_grad_norm == pytest.approx((0.5**2 + 1.0) ** 0.5)
    # drift: RMS over groups of |d_g - d|; both groups are [0.5, 1] away from the mean.
    assert stats.drift == pytest.approx((0.5**2 + 1.0) ** 0.5)
    # ring all-reduce over 2 groups of 2 float32 values: 2 * (1/2) * 8 bytes
    assert stats.bytes_sent == 8
    assert stats.num_syncs == 1 and results[0][1][1].num_syncs == 2


def test_custom_optimizer_factory_and_bfloat16_wire():
    factory = functools.partial(torch.optim.SGD, lr=0.5)
    groups = InProcessGroups(2)

    def work(g, comm):
        shard = torch.zeros(3)
        step = OuterStep([shard], factory, comm, reduce_dtype=torch.bfloat16)
        shard.copy_(torch.tensor([1.0, 2.0, 3.0]) * (g + 1))
        stats = step.step()
        return shard, stats

    (s0, st0), (s1, _) = groups.run(work)
    # mean local = [1.5, 3, 4.5]; delta = -mean; anchor = 0 - 0.5 * delta = 0.5 * mean
    assert_close(s0, torch.tensor([0.75, 1.5, 2.25]))
    assert_close(s0, s1)
    assert st0.bytes_sent == 3 * 2  # bfloat16 on the wire


def test_inner_shards_with_padding_and_several_tensors_stay_independent():
    groups = InProcessGroups(3)

    def work(g, comm):
        a, b = torch.zeros(4), torch.zeros(2, 3)
        step = OuterStep([a, b], OUTER_OPTIMIZERS["fedavg"], comm)
        a.fill_(g)
        b.fill_(10 * g)
        step.step()
        return a, b

    for a, b in groups.run(work):
        assert_close(a, torch.full((4,), 1.0))
        assert_close(b, torch.full((2, 3), 10.0))


def test_factory_that_returns_no_optimizer_is_rejected():
    with pytest.raises(ValueError, match="returned list"):
        OuterStep([torch.zeros(2)], lambda params: list(params), InProcessGroups(1).run(lambda g, c: c)[0])


def test_state_dict_round_trip_restores_momentum():
    groups = InProcessGroups(2)

    def work(g, comm):
        shard = torch.zeros(2)
        step = OuterStep([shard], OUTER_OPTIMIZERS["nesterov"], comm)
        shard.fill_(g + 1.0)
        step.step()
        state = step.state_dict()
        other = OuterStep([shard.clone()], OUTER_OPTIMIZERS["nesterov"], comm)
        other.load_state_dict(state)
        return step, other

    for step, other in groups.run(work):
        assert_close(other.anchor[0], step.anchor[0])
        buf = step.optimizer.state[step.anchor[0]]["momentum_buffer"]
        assert_close(other.optimizer.state[other.anchor[0]]["momentum_buffer"], buf)
        assert other.num_syncs == 1


@pytest.mark.parametrize("reduce_dtype", ["int4", "int8"])
def test_drift_under_a_quantized_sync_is_the_distance_from_the_applied_mean(reduce_dtype):
    """Drift = RMS of |theta_g - theta_new|: the exact drift plus the estimate's error, with and without feedback.

    ``mean_g |d_g - m|^2 = mean_g |d_g - dbar|^2 + |m - dbar|^2`` for the exact mean ``dbar`` and the applied ``m``;
    the logged drift must match it to rounding at every sync (also the second one, where error feedback carries
    residuals: an estimate from the exact-mean identity came out negative there and was clamped to 0).
    """
    from lightning_fedshard.core.wire.reducers import make_reducer

    num_groups, numel = 3, 3000
    generator = torch.Generator().manual_seed(0)
    anchor0 = torch.randn(numel, generator=generator)
    moves = [[0.01 * torch.randn(numel, generator=generator) for _ in range(num_groups)] for _ in range(2)]

    def work(g, comm):
        shard = anchor0.clone()
        outer = OuterStep(
            [shard], OUTER_OPTIMIZERS["fedavg"], comm, reducer=lambda: make_reducer(reduce_dtype, 128, True)
        )
        seen = []
        for round_moves in moves:
            before = outer.anchor[0].detach().clone()
            shard.sub_(round_moves[g])
            own = (before - shard).clone()
            stats = outer.step()
            seen.append((own, before - outer.anchor[0].detach(), stats.drift))
        return seen

    results = InProcessGroups(num_groups).run(work)
    for k in range(len(moves)):
        own = torch.stack([results[g][k][0] for g in range(num_groups)]).double()
        applied = results[0][k][1].double()  # fedavg: the anchor moves by the applied mean
        exact_mean = own.mean(0)
        exact_drift = ((own - exact_mean) ** 2).sum(1).mean().sqrt().item()
        error = (applied - exact_mean).norm().item()
        expected = ((own - applied) ** 2).sum(1).mean().sqrt().item()
        assert expected == pytest.approx((exact_drift**2 + error**2) ** 0.5, rel=1e-9)
        for g in range(num_groups):
            drift = results[g][k][2]
            assert drift == pytest.approx(expected, rel=1e-5)
            # within the codec's bound of the float32 value: off by at most the quantization error of the mean
            assert exact_drift - 1e-6 <= drift <= exact_drift + error + 1e-6
            assert error < 0.2 * exact_drift  # the bound is tight: int4 / int8 estimate the mean well


def test_a_sync_the_communicator_does_not_commit_leaves_every_group_on_the_anchor_and_training_goes_on():
    """Commit step: the sum completed, the vote said no; nothing is applied and the next round starts normally."""

    def work(g, comm):
        shard = torch.zeros(4)
        outer = OuterStep([shard], OUTER_OPTIMIZERS["nesterov"], comm, reduce_dtype=torch.float32)
        shard.fill_(float(g + 1))
        comm.commit = False
        lost = outer.step(step=2)
        after_lost = (shard.clone(), outer.anchor[0].detach().clone(), outer.num_syncs)
        shard.fill_(float(2 * (g + 1)))
        comm.commit = True
        kept = outer.step(step=4)
        return lost, after_lost, kept, shard.clone()

    results = InProcessGroups(2).run(work)
    for lost, (shard, anchor, num_syncs), kept, final in results:
        assert lost.lost and lost.syncs_lost == 1 and lost.as_dict()["fedshard/syncs_lost"] == 1.0
        assert torch.equal(shard, torch.zeros(4)) and torch.equal(anchor, torch.zeros(4)) and num_syncs == 0
        assert not kept.lost and kept.num_syncs == 1 and kept.syncs_lost == 1
        # the next sync is a first Nesterov step from the untouched anchor: mean delta -3, lr 0.7 -> 0.7 * 1.9 * 3
        assert_close(final, torch.full((4,), 0.7 * 1.9 * 3.0))
    assert torch.equal(results[0][3], results[1][3])


def test_each_sync_reads_its_participants_once_and_divides_by_them():
    """The mean divides by the groups that take part in this sync (asked once, in `begin`), not the launch size."""

    class TwoOfThree:
        def __init__(self, inner):
            self.inner, self.group_index, self.asked = inner, inner.group_index, 0

        def participants(self):
            self.asked += 1
            return (0, 1, 2)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def work(g, comm):
        spy = TwoOfThree(comm)
        shard = torch.zeros(2)
        outer = OuterStep([shard], OUTER_OPTIMIZERS["fedavg"], spy, reduce_dtype=torch.float32)
        shard.fill_(float(g))
        pending = outer.begin(SyncTransaction(outer, SyncKind.outer_step(0), 1), background=False)
        stats = outer.complete(pending, step=1)
        return spy.asked, pending.participants, shard.clone(), stats.bytes_sent

    for asked, participants, shard, sent in InProcessGroups(3).run(work):
        assert asked == 1 and participants == (0, 1, 2)
        assert_close(shard, torch.full((2,), 1.0))  # (0 + 1 + 2) / 3
        assert sent == 2 * 2 * 2 * 4 // 3  # a ring all-reduce of 2 float32 values over 3 members
