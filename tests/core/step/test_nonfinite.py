import pytest
import torch
from torch.testing import assert_close

from lightning_fedshard.core.config import OUTER_OPTIMIZERS, FederationConfig
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.transport.inprocess import InProcessGroups


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

    return InProcessGroups(len(values)).run(work)


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
    comm = InProcessGroups(1).run(lambda g, c: c)[0]
    return OuterStep([torch.zeros(1)], OUTER_OPTIMIZERS["fedavg"], comm, on_nonfinite=policy)


# -------------------------------------------------- site syncs and mixes: a broken group must not reach its partners

from typing import Any  # noqa: E402

from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled  # noqa: E402
from lightning_fedshard.core.federation import Federation  # noqa: E402

SITES = Hierarchical({1: 2, 4: 4})  # sites {0, 1} and {2, 3} average after every step, the federation every 4
RING = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]


def _broken_run(topology: Any, on_nonfinite: str, broken: tuple[int, ...] = (1,), steps: int = 4) -> list[dict]:
    """4 one-rank groups drift apart; the groups in ``broken`` turn NaN in training step 2 (before its sync).

    Per group: ``{step: (weights before the sync, after it, stats)}``, and ``"error"``: ``(step, error, before,
    after)`` if a sync raised.
    """
    config = FederationConfig(sync_every=1, reduce_dtype="float32", outer_topology=topology, on_nonfinite=on_nonfinite)

    def work(g: int, comm: Any) -> dict:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen: dict = {}
        for step in range(1, steps + 1):
            shards[0].add_(torch.arange(3.0) + (g + 1) * step)
            if g in broken and step == 2:
                shards[0][0] = float("nan")
            before = shards[0].clone()
            try:
                stats = fed.maybe_sync(step)
            except NonFiniteOuterGradientError as e:
                seen["error"] = (step, e, before, shards[0].clone())
                return seen
            seen[step] = (before, shards[0].clone(), stats)
        return seen

    return InProcessGroups(4, site_blocks=config.site_blocks(4)).run(work)


@pytest.mark.parametrize(("topology", "sync"), [(SITES, "site sync"), (Mixing(RING), "mix"), (Gossip(1, 3), "mix")])
def test_raise_stops_at_the_site_sync_or_mix_that_would_take_in_a_broken_group(topology, sync):
    results = _broken_run(topology, "raise")
    for g, seen in enumerate(results):
        step, error, before, after = seen["error"]  # every group raises, at the sync of step 2
        assert step == 2 and error.groups == (1,) and error.step == 2 and error.sync == sync
        assert f"federation group(s) [1] at optimizer step 2, at a {sync} (after 0 outer step(s))" in str(error)
        assert "No group's weights were changed" in str(error)
        assert torch.allclose(after, before, rtol=0, atol=0, equal_nan=True)  # nothing written, in any group
        if g != 1:
            assert torch.isfinite(after).all(), f"group {g} took in the broken group's NaN"


def test_skip_group_leaves_a_broken_group_out_of_its_site_and_restarts_it_from_the_site_mean():
    results = _broken_run(SITES, "skip_group")
    before = {g: r[2][0] for g, r in enumerate(results)}
    for g, r in enumerate(results):
        _, after, stats = r[2]
        assert stats.skipped_groups == (1,) and stats.kind == "site sync"
        expected = before[0] if g < 2 else (before[2] + before[3]) / 2  # site {0, 1}: group 0 alone
        assert torch.equal(after, expected), g
        assert all(torch.isfinite(r[s][1]).all() for s in (3, 4))  # and it trains on, up to the federation's sync
        assert r[3][2].skipped_groups == () and r[4][2].kind == "outer step"


@pytest.mark.parametrize("topology", [Mixing(RING), Gossip(peers=1, seed=3)])
def test_skip_group_renormalizes_each_row_of_a_mix_over_the_healthy_groups(topology):
    results = _broken_run(topology, "skip_group")
    matrix = topology.weights(1, 4)  # the round of step 2
    matrix[:, 1] = 0.0  # group 1 gives nothing ...
    matrix /= matrix.sum(1, keepdim=True)  # ... and each row takes the same shares of the healthy groups
    before = torch.stack([torch.nan_to_num(r[2][0]) for r in results]).double()
    for g, r in enumerate(results):
        _, after, stats = r[2]
        assert stats.skipped_groups == (1,) and stats.kind == "mix"
        torch.testing.assert_close(after.double(), matrix[g] @ before)
        assert torch.isfinite(r[4][1]).all()
    if not isinstance(topology, Gossip):  # the ring: group 0 takes 2/3 of itself, 1/3 of 3
        torch.testing.assert_close(results[0][2][1].double(), (2 * before[0] + before[3]) / 3)


def _unsampled_at_step_2() -> int:
    chosen = Sampled(groups_per_round=2, seed=0).sample(1, 4)
    return next(g for g in range(4) if g not in chosen)


@pytest.mark.parametrize(
    ("topology", "broken", "sync"),
    [(SITES, (0, 1), "site sync"), (Sampled(groups_per_round=2, seed=0), (_unsampled_at_step_2(),), "mix")],
    ids=["a_whole_site", "a_group_left_out_of_the_round"],
)
def test_skip_group_still_raises_when_a_broken_group_has_no_healthy_group_to_take_from(topology, broken, sync):
    for seen in _broken_run(topology, "skip_group", broken=broken):
        step, error, before, after = seen["error"]
        assert step == 2 and error.groups == broken and error.sync == sync and error.policy == "skip_group"
        assert "had none at this sync" in str(error) and torch.allclose(after, before, rtol=0, atol=0, equal_nan=True)


def test_the_error_of_a_site_sync_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(NonFiniteOuterGradientError((1,), 0, 2, "mix", "skip_group")))
    assert (error.groups, error.step, error.sync, error.policy) == ((1,), 2, "mix", "skip_group")
