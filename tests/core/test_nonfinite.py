import pytest
import torch
from torch.testing import assert_close

from lightning_fedshard.core.config import OUTER_OPTIMIZERS, FederationConfig
from lightning_fedshard.core.outer import NonFiniteOuterGradientError, OuterStep
from tests.core.fake_comm import ThreadGroups


def _sync(values: list[list[float]], on_nonfinite: str, anchor: list[float] = [1.0, 1.0]) -> list:
    def work(g, comm):
        shard = torch.tensor(anchor)
        outer = OuterStep([shard], OUTER_OPTIMIZERS["nesterov"], comm, on_nonfinite=on_nonfinite)
        shard.copy_(torch.tensor(values[g]))
        try:
            stats = outer.step(step=12)
        except NonFiniteOuterGradientError as e:
            return e, outer.anchor[0].detach().clone(), outer.num_syncs
        return stats, shard.clone(), outer.num_syncs

    return ThreadGroups(len(values)).run(work)


def test_nonfinite_raises_naming_groups_step_and_sync_and_leaves_the_anchor():
    results = _sync([[0.0, 1.0], [float("nan"), 1.0], [1.0, float("inf")]], "raise")
    for error, anchor, num_syncs in results:
        assert isinstance(error, NonFiniteOuterGradientError)
        assert error.groups == (1, 2) and error.step == 12 and error.num_syncs == 0
        assert "group(s) [1, 2] at optimizer step 12, sync 1 (after 0 successful sync(s))" in str(error)
        assert_close(anchor, torch.tensor([1.0, 1.0]))
        assert num_syncs == 0


def test_skip_group_averages_the_healthy_groups_only_and_restarts_the_broken_one():
    # anchor [1, 1]; healthy groups at [0, 1] and [1, 3] -> mean delta [0.5, -1] (the NaN group is left out)
    # Nesterov: a1 = a0 - 0.7 * (d + 0.9 d) = [1 - 0.665, 1 + 1.33]
    results = _sync([[0.0, 1.0], [float("nan"), 0.0], [1.0, 3.0]], "skip_group")
    for stats, shard, num_syncs in results:
        assert stats.skipped_groups == (1,) and num_syncs == 1
        assert_close(shard, torch.tensor([0.335, 2.33]))
        assert stats.as_dict()["fedshard/skipped_groups"] == 1.0
        assert stats.outer_grad_norm == pytest.approx((0.5**2 + 1.0) ** 0.5)


def test_skip_group_still_raises_when_every_group_is_broken():
    for error, _, _ in _sync([[float("nan"), 0.0], [0.0, float("inf")]], "skip_group"):
        assert isinstance(error, NonFiniteOuterGradientError) and error.groups == (0, 1)


def test_healthy_syncs_log_no_skipped_groups():
    stats, _, _ = _sync([[0.0, 1.0], [1.0, 3.0]], "raise")[0]
    assert stats.skipped_groups == () and "fedshard/skipped_groups" not in stats.as_dict()


@pytest.mark.parametrize("make", [lambda: FederationConfig(on_nonfinite="ignore"), lambda: _outer("zero")])
def test_unknown_nonfinite_policy_is_rejected(make):
    with pytest.raises(ValueError, match=r"`on_nonfinite` must be one of \['raise', 'skip_group'\]"):
        make()


def _outer(policy: str) -> OuterStep:
    comm = ThreadGroups(1).run(lambda g, c: c)[0]
    return OuterStep([torch.zeros(1)], OUTER_OPTIMIZERS["fedavg"], comm, on_nonfinite=policy)
