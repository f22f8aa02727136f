"""Fabric loops with the federated strategies compute the same algorithm as the independent reference."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.testing import assert_close

import lightning_fedshard.fabric
from lightning_fedshard import Gossip
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.transport.topology import FederationTopology
from tests.launch import launch
from tests.reference import reference_run, roundtrip_of

WORKER = Path(__file__).with_name("worker.py")
SCENARIOS = [
    # float32 outer traffic throughout: the loops are checked against float32 references to `1e-5`
    dict(
        name="fsdp",
        strategy="fl_fsdp",
        sync_every=2,
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        lr=0.01,
        batch_size=4,
        max_steps=7,
    ),
    # 2 groups x 2 replicas x 1 shard on 4 ranks, default sync_every (8) and outer optimizer (fedavg)
    dict(
        name="hsdp",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=1,
        reduce_dtype="float32",
        lr=0.01,
        batch_size=4,
        max_steps=10,
    ),
    # streaming: 2 fragments landing every 2 steps, sums overlapping one step, merged with alpha 0.5; stops at 7,
    # after the snapshot (step 7) of the fragment that would land at step 8
    dict(
        name="stream",
        strategy="fl_fsdp",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        merge_alpha=0.5,
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        wrap_linear=True,
        lr=0.01,
        batch_size=4,
        max_steps=7,
    ),
    # eager updates: 2 fragments, each sum in flight for a whole round; stops at 7 with both in flight
    dict(
        name="eager",
        strategy="fl_fsdp",
        sync_every=4,
        fragments=2,
        eager_updates=True,
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        wrap_linear=True,
        lr=0.01,
        batch_size=4,
        max_steps=7,
    ),
]
RESUME = [
    dict(name="resume_full", resume=True, state_dict_type="full"),
    dict(name="resume_sharded", resume=True, state_dict_type="sharded"),
]
# FSDP2: every scenario again on fl_fsdp2 / fl_hsdp2, in the same launch, named "<name>@fsdp2"
SCENARIOS += [dict(s, name=f"{s['name']}@fsdp2", strategy=f"{s['strategy']}2") for s in SCENARIOS]
RESUME += [dict(s, name=f"{s['name']}@fsdp2", strategy="fl_fsdp2") for s in RESUME]
# a compressed, overlapped gossip among 4 one-rank groups: 2 fragments, int4 messages taken a step before they land
GOSSIP = dict(
    name="gossip",
    strategy="fl_fsdp",
    num_groups=4,
    sync_every=4,
    fragments=2,
    sync_delay=1,
    reduce_dtype="int4",
    gossip=[1, 3],
    outer_optimizer="fedavg",
    wrap_linear=True,
    lr=0.01,
    batch_size=4,
    max_steps=11,
)
SCENARIOS.append(GOSSIP)
# a per-group pace among 4 one-rank groups: the last one half as fast, 2 fragments, int4 traffic
PACED = dict(
    name="paced",
    strategy="fl_fsdp",
    num_groups=4,
    sync_every=4,
    fragments=2,
    reduce_dtype="float32",
    pace=[1.0, 1.0, 1.0, 0.5],
    outer_optimizer="nesterov",
    wrap_linear=True,
    lr=0.01,
    batch_size=4,
    max_steps=11,
)
SCENARIOS.append(PACED)
TOPOLOGY = {
    "fsdp": FederationTopology(4, 2, 2),
    "hsdp": FederationTopology(4, 2, 1),
    "stream": FederationTopology(4, 2, 2),
    "eager": FederationTopology(4, 2, 2),
}
BOTH = [name for base in ("fsdp", "hsdp", "stream", "eager") for name in (base, f"{base}@fsdp2")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fabric")
    launch(WORKER, [json.dumps(SCENARIOS + RESUME), str(root)], num_nodes=2, devices=2, log_dir=root / "logs")
    return {s["name"]: [torch.load(root / s["name"] / f"rank{r}.pt") for r in range(4)] for s in SCENARIOS + RESUME}


@pytest.mark.slow
@pytest.mark.parametrize("name", BOTH)
def test_fabric_loop_matches_reference(results, name):
    spec = next(s for s in SCENARIOS if s["name"] == name)
    ranks = results[name]
    topology = TOPOLOGY[name.split("@")[0]]
    ref = reference_run(
        ranks[0]["initial"],
        [r["micro_batches"] for r in ranks],
        [topology.group_ranks(g) for g in range(topology.num_groups)],
        sync_every=spec.get("sync_every", 8),
        outer=spec.get("outer_optimizer", FederationConfig().outer_optimizer),
        inner="adamw",
        lr=spec["lr"],
        accumulate=1,
        max_steps=spec["max_steps"],
        fragments=ranks[0]["fragment_names"] if spec.get("fragments") else None,
        sync_delay=spec.get("sync_delay", 0),
        merge_alpha=spec.get("merge_alpha", 0.0),
        final_landing="reset",  # a fragment that lands at the last step keeps that landing's anchor
        eager=spec.get("eager_updates", False),
    )
    for r in ranks:  # every rank, every group: the consensus
        for k, v in ref["final"].items():
            assert_close(r["final"][f"net.{k}"], v, atol=1e-5, rtol=0)
    for r in ranks[1:]:
        for k in r["initial"]:
            assert torch.equal(r["initial"][k], ranks[0]["initial"][k]), "ranks started from different weights"
    assert max((ref["final"][k] - ranks[0]["initial"][f"net.{k}"]).abs().max() for k in ref["final"]) > 1e-2


@pytest.mark.slow
def test_fabric_runs_a_compressed_overlapped_gossip_that_equals_the_reference(results):
    ranks, topology = results["gossip"], FederationTopology(4, 4, 1)
    gossip = Gossip(*GOSSIP["gossip"])
    ref = reference_run(
        ranks[0]["initial"],
        [r["micro_batches"] for r in ranks],
        [topology.group_ranks(g) for g in range(topology.num_groups)],
        sync_every=GOSSIP["sync_every"],
        outer="fedavg",
        inner="adamw",
        lr=GOSSIP["lr"],
        accumulate=1,
        max_steps=GOSSIP["max_steps"],
        fragments=ranks[0]["fragment_names"],
        sync_delay=GOSSIP["sync_delay"],
        mixing=lambda round: gossip.weights(round, topology.num_groups),
        roundtrip=roundtrip_of(FederationConfig(reduce_dtype="int4").codec),
    )
    for r in ranks:
        for k, v in ref["final"].items():
            assert_close(r["final"][f"net.{k}"], v, atol=1e-5, rtol=0)
    assert max((ref["final"][k] - ranks[0]["initial"][f"net.{k}"]).abs().max() for k in ref["final"]) > 1e-2


@pytest.mark.slow
def test_a_paced_fabric_loop_skips_the_slow_groups_steps_and_equals_the_weighted_reference(results):
    ranks, topology = results["paced"], FederationTopology(4, 4, 1)
    ref = reference_run(
        ranks[0]["initial"],
        [r["micro_batches"] for r in ranks],
        [topology.group_ranks(g) for g in range(topology.num_groups)],
        sync_every=PACED["sync_every"],
        outer="nesterov",
        inner="adamw",
        lr=PACED["lr"],
        accumulate=1,
        max_steps=PACED["max_steps"],
        fragments=ranks[0]["fragment_names"],
        paced=lambda round: (4, 4, 4, 2),
    )
    for r in ranks:
        for k, v in ref["final"].items():
            assert_close(r["final"][f"net.{k}"], v, atol=1e-5, rtol=0)
    assert ranks[3]["trained"] == [1, 2, 5, 6, 9, 10] and ranks[0]["trained"] == list(range(1, 12))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["", "@fsdp2"])
def test_syncs_happen_inside_optimizer_step_and_finish_closes_the_round(results, backend):
    fsdp = results[f"fsdp{backend}"][0]
    assert fsdp["syncs_seen"] == [1, 2, 3] and fsdp["final_sync"] == 4  # steps 2, 4, 6, then finish() at 7
    hsdp = results[f"hsdp{backend}"][0]
    assert hsdp["syncs_seen"] == [1] and hsdp["final_sync"] == 2  # step 8, then finish() at 10
    assert hsdp["strategy_type"] == ("FLHSDP2Strategy" if backend else "FLHSDPStrategy")


@pytest.mark.slow
def test_every_sync_goes_through_the_runtime_entry_points(results):
    """The Fabric path: `optimizer_step` calls `FederatedRuntime.after_optimizer_step`, never the core itself."""
    for name in BOTH:
        spec = next(s for s in SCENARIOS if s["name"] == name)
        for r in results[name]:
            calls = r["runtime_calls"]
            assert calls.get("routed_syncs", 0) == r["num_syncs"] == r["final_sync"], name
            assert "bypassed_syncs" not in calls, name
            assert calls["after_optimizer_step"] == spec["max_steps"], name


@pytest.mark.slow
@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_groups_never_meet_between_syncs_in_a_fabric_loop(results, name):
    """Fabric issues no collective of its own in the user's loop: between syncs nothing spans two groups.

    Every collective of every rank is recorded from any caller (``tests/collective_spy.py``); sums in flight on their
    own thread (overlapped and eager syncs) are part of their sync.
    """
    for rank, r in enumerate(results[name]):
        groups = [set(g) for g in r["groups"]]
        wide = [(op, phase) for op, ranks, phase in r["collectives"] if not any(set(ranks) <= g for g in groups)]
        assert not [c for c in wide if c[1] == "between"], f"rank {rank}: {wide}"
        assert any(phase in ("sync", "background") for _, phase in wide), f"rank {rank}: the spy saw no sync"
        assert sum(1 for c in r["collectives"] if c[2] == "between") >= 7, "the spy saw no training step"


@pytest.mark.slow
def test_a_paced_loop_that_never_asks_whether_it_trains_is_stopped_at_its_first_skipped_step(tmp_path):
    """Two one-rank groups at speeds 1 and 0.5, ``sync_every=4``: the slow group skips steps 3 and 4 of each round."""
    spec = {"name": "unchecked", "unchecked_pace": True, "strategy": "fl_fsdp2"}
    launch(WORKER, [json.dumps([spec]), str(tmp_path)], num_nodes=2, devices=1, log_dir=tmp_path / "logs", timeout=120)
    slow = torch.load(tmp_path / "unchecked" / "rank1.pt")
    assert slow["steps"] == 2, "the slow group stepped past its first skipped step"
    assert "Group 1 skips optimizer step 3" in slow["error"] and "fabric.strategy.trains()" in slow["error"]
    fast = torch.load(tmp_path / "unchecked" / "rank0.pt")
    assert fast["error"] is not None and fast["steps"] < 8, "the fast group merged with a group that was gone"


def test_fabric_registry_and_early_errors():
    fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy="fl_fsdp")
    assert isinstance(fabric.strategy, lightning_fedshard.fabric.FLFSDPStrategy)
    assert fabric.strategy.topology.mesh_shape == (2, 1, 2)
    with pytest.raises(ValueError, match=r"divisible by `num_groups=3`"):
        L.Fabric(accelerator="cpu", devices=4, strategy=lightning_fedshard.fabric.FLFSDPStrategy(num_groups=3))
    with pytest.raises(ValueError, match=r"`sync_every` must be a positive integer, got -2"):
        lightning_fedshard.fabric.FLHSDPStrategy(sync_every=-2)
    with pytest.raises(ValueError, match=r"`state_dict_type='weird'` is not supported"):
        lightning_fedshard.fabric.FLFSDPStrategy(state_dict_type="weird")


def test_one_model_and_one_optimizer(monkeypatch):
    strategy = lightning_fedshard.fabric.FLFSDPStrategy()
    monkeypatch.setattr(strategy.runtime.model, "_synchronize_initial_weights", lambda module: None)  # no processes
    strategy.runtime.model.wrap(torch.nn.Linear(1, 1), lambda m: m)  # as if setup_module had run
    with pytest.raises(RuntimeError, match="federates one model"):
        strategy.setup_module(torch.nn.Linear(1, 1))
    first = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    strategy.setup_optimizer(first)
    with pytest.raises(RuntimeError, match="supports one optimizer"):
        strategy.setup_optimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume_full", "resume_sharded", "resume_full@fsdp2", "resume_sharded@fsdp2"])
def test_fabric_save_and_load_resume_exactly(results, name):
    """Saved between two syncs (step 3 of sync_every=2), loaded into a fresh setup: the same weights to the bit."""
    for rank in results[name]:
        assert torch.equal(rank["resumed"], rank["straight"])
        for k, v in rank["straight_full"].items():
            assert torch.equal(rank["resumed_full"][k], v)
    if name.startswith("resume_full"):  # the file's plain state dict is the consensus in the model's own key layout
        assert results[name][0]["consensus_keys"] == sorted(
            k.removeprefix("net.") for k in results[name][0]["straight_full"]
        )
