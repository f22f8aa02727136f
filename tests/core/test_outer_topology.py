"""The hierarchical outer topology (core.outer_topology): its schedule, its checks, and torch's own averager."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from lightning_fedshard import Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.mesh import build_federation_mesh
from tests.core.fake_comm import ThreadGroups


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
        (dict(outer_topology=Hierarchical({8: 2, 16: 4}), fragments=2), r"one fragment and no overlap"),
        (dict(outer_topology=Hierarchical({8: 2, 16: 4}), sync_delay=1), r"one fragment and no overlap"),
        (dict(outer_topology=Hierarchical({8: 2, 16: 4}), eager_updates=True), r"one fragment and no overlap"),
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
        return seen

    results = ThreadGroups(4).run(work)
    # step 2: sites {0, 1} and {2, 3} average (g + 1) * 3; the anchor (the federation's) is untouched
    for g, r in enumerate(results):
        shard, anchor, stats = r[2]
        site = (1 + 2) * 3 / 2 if g < 2 else (3 + 4) * 3 / 2
        assert torch.equal(shard, torch.full((3,), site)) and torch.equal(anchor, torch.zeros(3))
        assert stats.site_size == 2 and stats.num_syncs == 0
        assert torch.equal(r["consensus"], torch.full((3,), (4.5 + 10.5) / 2))  # the exact mean over all groups
        assert r[1][2] is None and r[3][2] is None
    # step 4: everyone meets: fedavg lands on the mean of the groups, in every group and the anchor
    expected = sum(((1 + 2) * 3 / 2 if g < 2 else (3 + 4) * 3 / 2) + (g + 1) * 7 for g in range(4)) / 4
    for r in results:
        shard, anchor, stats = r[4]
        assert_close(shard, torch.full((3,), expected)) and torch.equal(shard, anchor)
        assert stats.site_size == 0 and stats.num_syncs == 1


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
        comm = build_federation_mesh(topology, "cpu", config.site_sizes(4)).communicator()
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


@pytest.mark.parametrize(("ours", "same"), [({2: 2, 4: 4}, True), ({2: 2, 6: 4}, False)])
def test_hierarchical_fedavg_with_sgd_lands_on_torchs_hierarchical_model_averager(tmp_path, ours, same):
    mp.start_processes(
        _averager_worker, args=(str(tmp_path / "store"), str(tmp_path), ours), nprocs=4, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    worst = max((r["ours"][k] - r["torch"][k]).abs().max().item() for r in ranks for k in r["ours"])
    if same:  # every group ends with the same weights, and they are torch's
        assert worst <= 1e-6
        assert all(torch.equal(r["ours"][k], ranks[0]["ours"][k]) for r in ranks for k in r["ours"])
    else:  # a wrong period (the federation meets every 6 steps instead of 4) is seen
        assert worst > 1e-4
