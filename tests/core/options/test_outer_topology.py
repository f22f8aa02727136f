"""The hierarchical outer topology (core.outer_topology): its schedule, its checks, and torch's own averager."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.core.transport.mesh import build_federation_mesh
from lightning_fedshard.core.transport.topology import FederationTopology
from tests.launch import run_ranks


def test_the_largest_period_that_divides_the_step_decides():
    levels = Hierarchical({8: 2, 32: 4})
    assert [levels.block_size(s) for s in (1, 7, 8, 16, 24, 32, 40, 64)] == [None, None, 2, 2, 2, 4, 2, 4]
    assert levels.site_sizes(4) == (2,) and "2 groups every 8 steps, 4 groups every 32 steps" in levels.describe()
    assert Hierarchical({32: 4, 8: 2}) == levels  # the order of the levels does not matter


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(outer_topology=Hierarchical({6: 2, 12: 4})), r"periods \[6, 12\] .* not multiples of `sync_every=8`"),
        (dict(outer_topology="ring"), r"Unknown `outer_topology='ring'`"),
        (
            dict(outer_topology=Hierarchical({8: 2, 16: 4}), fragments=3),
            r"The largest period of `outer_topology=Hierarchical\(levels=\{8: 2, 16: 4\}\)` \(16 steps\) must be"
            r" divisible by `fragments=3`",
        ),
        (
            dict(outer_topology=Hierarchical({8: 2, 16: 4}), fragments=2, sync_delay=8),
            r"\[0, period / fragments\) = \[0, 8\), got 8",
        ),
    ],
)
def test_bad_topologies_fail_in_the_constructor(options, match):
    with pytest.raises(ValueError, match=match):
        FederationConfig(**options)


@pytest.mark.parametrize(
    ("levels", "match"),
    [
        ({8: 3, 16: 6}, r"blocks of 3 consecutive groups \(period 8\) do not divide the 4 groups"),
        ({8: 2, 16: 2}, r"average the same number of groups"),
        ({8: 4, 16: 2}, r"the level of the largest period \(16 steps\) averages 2 groups; it must span all 4"),
        ({}, r"`levels` must map periods"),
        ({8: 0}, r"positive integer, got 0"),
    ],
)
def test_levels_that_do_not_fit_the_groups_are_refused(levels, match):
    with pytest.raises(ValueError, match=match):
        FederationConfig(num_groups=4, outer_topology=Hierarchical(levels)).topology(4, 1, hybrid=False)


def test_sites_given_by_the_user_are_the_blocks_of_their_level_and_the_others_nest():
    levels = Hierarchical({2: 2, 4: 4, 8: 8}, sites=[[0, 5, 2, 7], [1, 4, 3, 6]])
    assert levels.blocks(4, 8) == ((0, 5, 2, 7), (1, 4, 3, 6))
    assert levels.blocks(2, 8) == ((0, 5), (2, 7), (1, 4), (3, 6))  # inside the sites
    assert levels.site_blocks(8) == {2: levels.blocks(2, 8), 4: levels.blocks(4, 8)}
    assert Hierarchical({2: 2, 4: 4}).blocks(2, 4) == ((0, 1), (2, 3))  # no sites: consecutive groups
    assert levels != Hierarchical({2: 2, 4: 4, 8: 8}) and "sites [[0, 5, 2, 7], [1, 4, 3, 6]]" in levels.describe()


@pytest.mark.parametrize(
    ("sites", "match"),
    [
        ([[0, 1], [2]], r"must hold the same number of groups, got \[1, 2\]"),
        ([[0, 1, 2], [3, 4, 5]], r"hold 3 groups each, but no level .* averages 3 groups"),
        ([[0, 1], [1, 2]], r"must hold every one of the 4 groups \(0 .. 3\) exactly once"),
        ([[0, 1], [2, 4]], r"must hold every one of the 4 groups"),
        ([[0, -1], [2, 3]], r"an index >= 0, got -1"),
        ([], r"`sites` must be a list of non-empty lists"),
    ],
)
def test_sites_that_do_not_fit_are_refused(sites, match):
    with pytest.raises(ValueError, match=match):
        topology = Hierarchical({2: 2, 4: 4}, sites=sites)
        FederationConfig(num_groups=4, sync_every=2, outer_topology=topology).topology(4, 1, hybrid=False)


def test_a_site_of_groups_that_are_not_consecutive_averages_its_own_members():
    topology = Hierarchical({2: 2, 4: 4}, sites=[[0, 3], [2, 1]])
    config = FederationConfig(sync_every=2, reduce_dtype="float32", outer_topology=topology)

    def work(g: int, comm: Any) -> Tensor:
        shards = [torch.full((3,), float(g))]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        shards[0].mul_(2)
        fed.maybe_sync(2)
        return shards[0].clone()

    results = InProcessGroups(4, site_blocks=config.site_blocks(4)).run(work)
    assert [r[0].item() for r in results] == [3.0] * 4  # (0 + 6) / 2 and (4 + 2) / 2; consecutive: 1, 1, 5, 5


def test_sites_average_their_weights_and_the_federation_takes_the_outer_step():
    config = FederationConfig(sync_every=2, reduce_dtype="float32", outer_topology=Hierarchical({2: 2, 4: 4}))

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen = {}
        for step in range(1, 5):
            shards[0].add_(float((g + 1) * step))
            stats = fed.maybe_sync(step)
            seen[step] = (shards[0].clone(), fed.outer.anchor[0].detach().clone(), stats)
            if step == 2:
                with fed.consensus_weights():
                    seen["consensus"] = shards[0].clone()
                seen["distance"] = fed.consensus_distance
        return seen

    results = InProcessGroups(4).run(work)
    # step 2: sites {0, 1} and {2, 3} average (g + 1) * 3; the anchor (the federation's) is untouched
    for g, r in enumerate(results):
        shard, anchor, stats = r[2]
        site = (1 + 2) * 3 / 2 if g < 2 else (3 + 4) * 3 / 2
        assert torch.equal(shard, torch.full((3,), site)) and torch.equal(anchor, torch.zeros(3))
        assert stats.extra["site_size"] == 2 and stats.num_syncs == 0
        assert torch.equal(r["consensus"], torch.full((3,), (4.5 + 10.5) / 2))  # the exact mean over all groups
        assert r["distance"] == pytest.approx(3 * 3**0.5)  # every group 3 away in each of 3 values
        assert r[1][2] is None and r[3][2] is None
    # step 4: everyone meets: fedavg lands on the mean of the groups, in every group and the anchor
    expected = sum(((1 + 2) * 3 / 2 if g < 2 else (3 + 4) * 3 / 2) + (g + 1) * 7 for g in range(4)) / 4
    for r in results:
        shard, anchor, stats = r[4]
        assert_close(shard, torch.full((3,), expected)) and torch.equal(shard, anchor)
        assert "site_size" not in stats.extra and stats.num_syncs == 1


# ---------------------------------------------------------------------- against torch's HierarchicalModelAverager

STEPS = 12


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 1, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()


def _averager_worker(rank: int, store: str, out_dir: str, ours: dict[int, int]) -> None:
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        config = FederationConfig(
            num_groups=4, sync_every=2, reduce_dtype="float32", outer_topology=Hierarchical(ours)
        )  # one-rank groups, plain averaging
        topology = config.topology(4, 1, hybrid=False)
        comm = build_federation_mesh(topology, "cpu", config.site_blocks(4)).communicator()
        net = _net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        fed = Federation(config, comm)
        fed.start([p.data for p in net.parameters()], step=0)
        reference = _net()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        averager = HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)]))
        averager.step = 1  # its counter is the number of calls so far: count optimizer steps from 1, as we do
        for step in range(1, STEPS + 1):
            _train_step(net, optimizer, rank, step)
            fed.maybe_sync(step)
            _train_step(reference, reference_optimizer, rank, step)
            averager.average_parameters(reference.parameters())
        fed.finish(STEPS)
        ours_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        torch.save({"ours": ours_state, "torch": reference.state_dict()}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("ours", "same"), [({2: 2, 4: 4}, True), ({2: 2, 6: 4}, False)])
def test_hierarchical_fedavg_with_sgd_lands_on_torchs_hierarchical_model_averager(tmp_path, ours, same):
    run_ranks(_averager_worker, 4, (str(tmp_path / "store"), str(tmp_path), ours))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    worst = max((r["ours"][k] - r["torch"][k]).abs().max().item() for r in ranks for k in r["ours"])
    if same:  # every group ends with the same weights, and they are torch's
        assert worst <= 1e-6
        assert all(torch.equal(r["ours"][k], ranks[0]["ours"][k]) for r in ranks for k in r["ours"])
    else:  # a wrong period (the federation meets every 6 steps instead of 4) is seen
        assert worst > 1e-4


# ------------------------------------------------------------------------------------------------ mixings

from lightning_fedshard import Gossip, Mixing, Sampled  # noqa: E402


def _mixing_run(topology: Any, groups: int, steps: int, sync_every: int = 2) -> list[dict[str, Any]]:
    """Every group adds a group- and step-dependent vector; returns per group its weights before and after syncs."""
    config = FederationConfig(sync_every=sync_every, reduce_dtype="float32", outer_topology=topology)

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = [torch.zeros(4)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        before, after = {}, {}
        for step in range(1, steps + 1):
            shards[0].add_(torch.arange(4.0) * (g + 1) + step * g)
            before[step] = shards[0].clone()
            fed.maybe_sync(step)
            after[step] = shards[0].clone()
        with fed.consensus_weights():
            consensus = shards[0].clone()
        fed.finish(steps)
        return {"before": before, "after": after, "consensus": consensus, "final": shards[0].clone()}

    return InProcessGroups(groups).run(work)


@pytest.mark.parametrize(
    "topology",
    [Gossip(peers=1, seed=3), Gossip(peers=2, seed=1), Sampled(groups_per_round=2, seed=5),
     Mixing([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.5, 0], [0.25, 0.25, 0, 0.5], [0, 0, 0.5, 0.5]])],
)  # fmt: skip
def test_after_a_sync_each_group_holds_the_rounds_mix(topology):
    results = _mixing_run(topology, groups=4, steps=6)
    for step in (2, 4, 6):
        matrix = topology.weights(step // 2 - 1, 4)
        before = torch.stack([r["before"][step] for r in results]).double()
        expected = matrix @ before
        for g, r in enumerate(results):
            assert_close(r["after"][step].double(), expected[g], atol=1e-5, rtol=1e-6)
        # a doubly-stochastic mix keeps the groups' mean
        assert_close(torch.stack([r["after"][step] for r in results]).mean(0), before.mean(0).float())
    # the consensus between syncs is the exact mean, and the end averages every group
    mean = torch.stack([r["after"][6] for r in results]).mean(0)
    assert all(torch.allclose(r["consensus"], mean) for r in results)
    assert all(torch.equal(r["final"], results[0]["final"]) for r in results)


def test_the_uniform_mix_is_todays_outer_step_bit_for_bit():
    uniform = _mixing_run(Mixing([[0.25] * 4] * 4), groups=4, steps=6)
    config = FederationConfig(sync_every=2, reduce_dtype="float32")

    def plain(g: int, comm: Any) -> list[Tensor]:
        shards = [torch.zeros(4)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen = []
        for step in range(1, 7):
            shards[0].add_(torch.arange(4.0) * (g + 1) + step * g)
            fed.maybe_sync(step)
            seen.append(shards[0].clone())
        return seen

    for mixed, today in zip(uniform, InProcessGroups(4).run(plain)):
        assert all(torch.equal(mixed["after"][s + 1], today[s]) for s in range(6))


def test_gossip_and_sampled_are_mixings_of_their_matrices():
    for topology in (Gossip(peers=1, seed=7), Sampled(groups_per_round=3, seed=2)):
        direct = _mixing_run(topology, groups=4, steps=6)
        through = _mixing_run(Mixing(lambda round, t=topology: t.weights(round, 4)), groups=4, steps=6)
        for a, b in zip(direct, through):
            assert all(torch.equal(a["after"][s], b["after"][s]) for s in a["after"])


@pytest.mark.parametrize(
    "topology",
    [Gossip(peers=1, seed=3), Sampled(groups_per_round=2, seed=5), Mixing([[0.25] * 4] * 4)],
    ids=["gossip", "sampled", "uniform"],
)
def test_a_mixing_with_the_default_reduce_dtype_lands_on_the_exact_mix_and_ends_on_the_exact_mean(topology):
    """A mixing never moves the anchor, so the end of training (and a uniform round) averages the pseudo-gradient of
    the whole run: with the default ``reduce_dtype`` it must travel unrounded."""
    config = FederationConfig(sync_every=2, outer_topology=topology)  # reduce_dtype left at its default

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = [torch.zeros(300)]
        gen = torch.Generator().manual_seed(g)
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        before, after = {}, {}
        for step in range(1, 7):
            shards[0].add_(torch.randn(300, generator=gen))  # a different walk in every group
            before[step] = shards[0].clone()
            fed.maybe_sync(step)
            after[step] = shards[0].clone()
        fed.finish(6)
        return {"before": before, "after": after, "final": shards[0].clone()}

    results = InProcessGroups(4).run(work)
    for step in (2, 4, 6):
        mixed = topology.weights(step // 2 - 1, 4) @ torch.stack([r["before"][step] for r in results]).double()
        for g, r in enumerate(results):
            assert_close(r["after"][step].double(), mixed[g], atol=1e-6, rtol=0)
    mean = torch.stack([r["after"][6] for r in results]).double().mean(0)
    for r in results:
        assert_close(r["final"].double(), mean, atol=1e-6, rtol=0)


def test_distance_from_the_mean_shrinks_like_the_second_eigenvalue():
    matrix = torch.tensor([[0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5], [0, 0, 0.5, 0.5]], dtype=torch.float64)
    second = sorted(torch.linalg.eigvalsh(matrix).abs().tolist())[-2]  # symmetric: real eigenvalues
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        spread = (x - x.mean(0)).norm()
        x = matrix @ x
        assert (x - x.mean(0)).norm() <= second * spread + 1e-12


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Mixing([[0.6, 0.4], [0.6, 0.4]]), r"not doubly stochastic: column 0 sums to 1.2"),
        (lambda: Mixing([[1.5, -0.5], [-0.5, 1.5]]), r"negative entry"),
        (lambda: Mixing([[1.0, 0.0, 0.0]]), r"must be square, got shape \(1, 3\)"),
        (lambda: Gossip(peers=0), r"`peers` must be a positive integer, got 0"),
        (lambda: Sampled(groups_per_round=1), r"`groups_per_round` must be an integer of 2 or more, got 1"),
        (
            lambda: FederationConfig(outer_topology=Gossip(peers=1), outer_optimizer="nesterov"),
            r"and `outer_optimizer='nesterov'` cannot be combined: a mix moves no shared anchor",
        ),
    ],
)
def test_bad_mixings_fail_in_the_constructor(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("topology", "match"),
    [
        (Gossip(peers=4), r"`Gossip\(peers=4\)` needs more than 4 groups, the job has 4"),
        (Sampled(groups_per_round=5), r"samples more groups than the job's 4"),
        (Mixing([[1.0]]), r"is \(1, 1\), the job has 4 groups"),
    ],
)
def test_mixings_that_do_not_fit_the_groups_are_refused_before_launch(topology, match):
    with pytest.raises(ValueError, match=match):
        FederationConfig(num_groups=4, outer_topology=topology).topology(4, 1, hybrid=False)


def _gloo_matrices() -> list[Tensor]:
    """Three rounds of gossip, then a mix that is not symmetric (each group takes from the two groups before it)."""
    shift = torch.roll(torch.eye(4, dtype=torch.float64), 1, dims=1).T  # row i has its 1 in column i - 1
    cyclic = 0.5 * torch.eye(4, dtype=torch.float64) + 0.25 * shift + 0.25 * shift @ shift
    return [*(Gossip(peers=1, seed=11).weights(round, 4) for round in range(3)), cyclic]


def _gossip_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        comm = build_federation_mesh(FederationTopology(4, 4, 1), "cpu").communicator()
        results = []
        for round, matrix in enumerate(_gloo_matrices()):
            x = torch.arange(5.0) * (rank + 1) + round
            results.append(comm.mix_over_groups(x, matrix))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_mix_over_real_gloo_processes_matches_the_thread_fake(tmp_path):
    run_ranks(_gossip_worker, 4, (str(tmp_path / "store"), str(tmp_path)))

    def fake(g: int, comm: Any) -> list[Tensor]:
        out = []
        for round, matrix in enumerate(_gloo_matrices()):
            x = torch.arange(5.0) * (g + 1) + round
            out.append(comm.mix_over_groups(x, matrix))
        return out

    for rank, expected in enumerate(InProcessGroups(4).run(fake)):
        real = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(real) == 4 and all(torch.equal(a, b) for a, b in zip(real, expected))
        # the last mix is not symmetric: group i takes from i - 1 and i - 2, and sends to i + 1 and i + 2
        before = torch.stack([torch.arange(5.0) * (g + 1) + 3 for g in range(4)]).double()
        assert_close(real[3].double(), (_gloo_matrices()[3] @ before)[rank])


# ------------------------------------------------------------------------- what site syncs and mixes log


def _logged_run(topology: Any, steps: int) -> list[dict[int, Any]]:
    """4 groups, group ``g`` adds ``g + 1`` to each of 3 values per step; per group the stats of every sync."""
    config = FederationConfig(sync_every=1, reduce_dtype="float32", outer_topology=topology)

    def work(g: int, comm: Any) -> dict[int, Any]:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        seen = {}
        for step in range(1, steps + 1):
            shards[0].add_(float(g + 1))
            seen[step] = fed.maybe_sync(step)
        return seen

    return InProcessGroups(4, site_blocks=config.site_blocks(4)).run(work)


def test_a_site_sync_logs_its_drift_and_norm_and_counts_in_the_syncs():
    results = _logged_run(Hierarchical({1: 2, 4: 4}), steps=4)
    for seen in results:
        first = seen[1]  # weights 1, 2 | 3, 4 (each of 3 values) become 1.5 | 3.5; the anchor is 0
        assert first.drift == pytest.approx(0.5 * 3**0.5)  # every group 0.5 from its site mean in each value
        assert first.outer_grad_norm == pytest.approx((3 * (1.5**2 + 3.5**2) / 2) ** 0.5)  # RMS of |anchor - mean|
        assert first.kind == "site sync" and first.extra["site_size"] == 2
        assert [seen[s].num_syncs for s in range(1, 5)] == [0, 0, 0, 1]  # outer steps
        assert [seen[s].site_syncs for s in range(1, 5)] == [1, 2, 3, 3]
        assert [seen[s].total_syncs for s in range(1, 5)] == [1, 2, 3, 4]  # the progress bar's `syncs`
        logged = seen[3].as_dict()
        assert logged["fedshard/site_syncs"] == 3.0 and logged["fedshard/drift"] > 0
        assert logged["fedshard/outer_grad_norm"] > 0 and seen[4].as_dict()["fedshard/site_syncs"] == 3.0


def test_a_mix_logs_the_distance_from_what_each_group_took_and_counts_in_the_syncs():
    ring = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
    results = _logged_run(Mixing(ring), steps=2)
    before = torch.arange(1.0, 5.0, dtype=torch.float64)[:, None].expand(4, 3)  # group g holds g + 1 everywhere
    after = torch.tensor(ring, dtype=torch.float64) @ before
    drift = ((before - after).norm(dim=1) ** 2).mean().sqrt().item()
    norm = (after.norm(dim=1) ** 2).mean().sqrt().item()  # the anchor is 0
    for seen in results:
        assert seen[1].drift == pytest.approx(drift) and drift > 0
        assert seen[1].outer_grad_norm == pytest.approx(norm) and seen[1].kind == "mix"
        assert [(seen[s].num_syncs, seen[s].site_syncs, seen[s].total_syncs) for s in (1, 2)] == [(0, 1, 1), (0, 2, 2)]
        # each group of the ring sends to its two neighbours, logged as the mode's own statistic
        assert seen[1].as_dict()["fedshard/mixing_partners"] == 2.0


def test_the_count_of_site_syncs_survives_a_checkpoint_of_the_outer_state():
    config = FederationConfig(sync_every=1, reduce_dtype="float32", outer_topology=Hierarchical({1: 2, 2: 4}))

    def work(g: int, comm: Any) -> tuple[int, int]:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        fed.maybe_sync(1)
        fed.maybe_sync(2)
        resumed = Federation(config, comm)
        resumed.start([torch.zeros(3)], step=0)
        resumed.load_state_dict(fed.state_dict())
        return resumed.outer.site_syncs, resumed.outer.num_syncs

    assert InProcessGroups(4).run(work) == [(1, 1)] * 4


# ------------------------------------------------------------------------------- groups that meet, class paths alone


def _pairs(pairs: list[tuple[int, int]], groups: int = 4) -> torch.Tensor:
    """The mixing matrix that averages each pair of groups and leaves the others alone."""
    matrix = torch.eye(groups, dtype=torch.float64)
    for a, b in pairs:
        matrix[[a, a, b, b], [a, b, a, b]] = 0.5
    return matrix


@pytest.mark.parametrize(
    ("matrix", "parts"),
    [([[1.0, 0.0], [0.0, 1.0]], "[[0], [1]]"), (_pairs([(0, 1), (2, 3)]).tolist(), "[[0, 1], [2, 3]]")],
    ids=["identity", "two-blocks"],
)
def test_a_mixing_whose_groups_never_meet_is_refused_when_given(matrix, parts):
    with pytest.raises(ValueError) as error:
        Mixing(matrix)
    assert str(error.value).startswith(f"`Mixing(matrix)` never lets the groups {parts} meet: the graph of its nonzero")


def test_a_schedule_must_connect_the_groups_over_its_rounds():
    alternating = Mixing(lambda r: _pairs([(0, 1), (2, 3)] if r % 2 == 0 else [(1, 2), (3, 0)]))
    alternating.check_groups(4)  # no round connects the groups, the two rounds together do
    apart = Mixing(lambda r: _pairs([(0, 1), (2, 3)]))
    with pytest.raises(ValueError, match=r"rounds 0 to 255 together, never lets the groups \[\[0, 1\], \[2, 3\]\]"):
        apart.check_groups(4)
    with pytest.raises(ValueError, match="never lets the groups"):
        FederationConfig(num_groups=4, outer_topology=apart).topology(num_nodes=4, devices_per_node=1, hybrid=False)


@pytest.mark.parametrize("groups", [2, 3, 8, 64])
def test_valid_gossip_sampled_and_connected_matrices_still_pass(groups):
    Gossip(peers=1).check_groups(groups)
    Sampled(groups_per_round=2).check_groups(groups)
    ring = torch.eye(groups, dtype=torch.float64).roll(1, dims=1) * 0.5 + torch.eye(groups, dtype=torch.float64) * 0.5
    Mixing(ring).check_groups(groups)
    Mixing(lambda r: ring).check_groups(groups)
    Mixing([[1.0]]).check_groups(1)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("lightning_fedshard.Gossip", Gossip()), ("Gossip", Gossip()),
     ("lightning_fedshard.core.options.outer_topology.Gossip", Gossip())],
)  # fmt: skip
def test_an_outer_topology_class_path_alone_is_the_class_with_its_defaults(spec, expected):
    from lightning_fedshard.core.options.outer_topology import resolve_outer_topology

    assert resolve_outer_topology(spec) == expected
    assert FederationConfig(outer_topology=spec).mixing == expected


@pytest.mark.parametrize(
    ("spec", "advice"),
    [
        ("lightning_fedshard.Sampled",
         "`--trainer.strategy.outer_topology lightning_fedshard.Sampled"
         " --trainer.strategy.outer_topology.groups_per_round 2`"),
        ("Hierarchical",
         "`--trainer.strategy.outer_topology lightning_fedshard.Hierarchical --trainer.strategy.outer_topology.levels"
         " '{8: 2, 32: 4}'`"),
        ("lightning_fedshard.Mixing", "in Python `Mixing(matrix=[[0.5, 0.5], [0.5, 0.5]])`"),
    ],
)  # fmt: skip
def test_a_class_path_alone_with_required_arguments_says_how_to_give_them(spec, advice):
    with pytest.raises(ValueError) as error:
        FederationConfig(outer_topology=spec)
    assert str(error.value).startswith(f"`outer_topology={spec!r}` needs `")
    assert advice in str(error.value)
