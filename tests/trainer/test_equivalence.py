"""Multi-process proofs that the Trainer strategies compute exactly the FL+FSDP / FL+HSDP algorithm.

Two launches (4 ranks as 2 nodes x 2 devices, 8 ranks as 2 nodes x 4 devices) run several scenarios each; every
test then checks what the ranks recorded against an independent single-process reference (``reference.py``) or
against Lightning's stock FSDP strategy.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.testing import assert_close

from benchmarks.harness.config import topology_from_record, topology_record
from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.transport.topology import FederationTopology
from tests.launch import launch
from tests.reference import reference_run, roundtrip_of

pytestmark = pytest.mark.slow  # launches processes

WORKER = Path(__file__).with_name("worker.py")
# float32 outer traffic: these scenarios check the algorithm to `1e-5` against float32 references (the package default,
# int4 with error feedback, is checked by `by_name` against a tolerance).
BASE = dict(inner="adamw", lr=0.01, batch_size=4, accumulate=1, reduce_dtype="float32")

SCENARIOS_4 = [
    # degenerate case: SGD, sync every step, plain averaging == one FSDP over all ranks
    dict(
        BASE,
        name="fedavg_h1",
        strategy="fl_fsdp",
        inner="sgd",
        lr=0.1,
        sync_every=1,
        outer_optimizer="fedavg",
        max_steps=4,
        same_init=True,
    ),
    dict(BASE, name="plain", strategy="plain_fsdp", inner="sgd", lr=0.1, max_steps=4, same_init=True),
    # AdamW + Nesterov, gradient accumulation, stops mid-round, validates mid-round, checkpoints mid-round
    dict(
        BASE,
        name="fsdp_nesterov",
        strategy="fl_fsdp",
        sync_every=2,
        outer_optimizer="nesterov",
        max_steps=7,
        accumulate=2,
        val_check_interval=6,
        csv=True,
        mid_ckpt_step=3,
        plan={"cluster": "emulated-4x2", "inter_bandwidth": 1e8},  # the plan check at the end of fit
    ),
    # the registered name with its defaults: one group per node, sync every 8, fedavg
    dict(BASE, name="by_name", strategy="fl_fsdp", by_name=True, max_steps=9),
    # four one-rank groups (FSDP over one rank keeps whole parameters)
    dict(BASE, name="four_groups", strategy="fl_fsdp", num_groups=4, sync_every=3, max_steps=6),
    # a single group: plain FSDP over all ranks plus a one-worker outer step (the strategy warns)
    dict(
        BASE, name="one_group", strategy="fl_fsdp", num_groups=1, sync_every=3, max_steps=4, outer_optimizer="nesterov"
    ),
    # HSDP with one-rank shards: data parallel inside each group (FSDP alone would not reduce across replicas)
    # ... with a checkpoint between syncs (step 4): FSDP2's state dict of (Replicate, Shard) over one-rank shards is
    # the parameters' own memory, so a consensus not copied out would show the group's own weights
    dict(
        BASE,
        name="hsdp_shard1",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=1,
        sync_every=3,
        max_steps=6,
        mid_ckpt_step=4,
    ),  # fmt: skip
    # streaming fragments, overlapped sums and merging; each stops between a snapshot and its landing
    dict(
        BASE,
        name="stream_f2_d1_a05",
        strategy="fl_fsdp",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        merge_alpha=0.5,
        outer_optimizer="nesterov",
        wrap_linear=True,
        max_steps=7,
    ),
    dict(
        BASE,
        name="stream_f1_d1",
        strategy="fl_fsdp",
        sync_every=2,
        sync_delay=1,
        outer_optimizer="nesterov",
        max_steps=5,
    ),
    dict(
        BASE,
        name="stream_f2_a05_hsdp",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=1,
        sync_every=4,
        fragments=2,
        merge_alpha=0.5,
        wrap_linear=True,
        max_steps=6,
    ),
    # int8 outer traffic with error feedback: close to the float32 reference, not equal to it
    dict(
        BASE,
        name="int8_ef",
        strategy="fl_fsdp",
        sync_every=2,
        outer_optimizer="nesterov",
        reduce_dtype="int8",
        error_feedback=True,
        max_steps=6,
    ),
    # every sync option that issues collectives at once, to check that none spans more than a ring or a group
    dict(
        BASE,
        name="scope_int4_f2_d1",
        strategy="fl_fsdp",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        reduce_dtype="int4",
        error_feedback=True,
        wrap_linear=True,
        max_steps=5,
    ),
    # eager updates: each fragment's sum in flight for a whole round, stopping with both sums in flight
    dict(
        BASE,
        name="eager_f2",
        strategy="fl_fsdp",
        sync_every=4,
        fragments=2,
        eager_updates=True,
        outer_optimizer="nesterov",
        wrap_linear=True,
        max_steps=7,
    ),
    # a hierarchical topology: 2 sites of 2 one-rank groups average every 2 steps, everyone meets every 4; AdamW
    # inside, Nesterov outside, stopping between two meetings
    dict(
        BASE,
        name="hierarchical",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Hierarchical({2: 2, 4: 4})),
        outer_optimizer="nesterov",
        max_steps=7,
    ),
    # sites around a streaming federation: 2 sites of 2 one-rank groups average every 2 steps; the federation's round
    # is 8 steps, its 2 fragments land every 4, each sum overlapped with a step, half the local progress merged
    dict(
        BASE,
        name="hierarchical_stream",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Hierarchical({2: 2, 8: 4})),
        fragments=2,
        sync_delay=1,
        merge_alpha=0.5,
        outer_optimizer="nesterov",
        wrap_linear=True,
        max_steps=11,
    ),
    # ... and around eager updates: each fragment's sum in flight for a whole 8-step round, the sites averaging their
    # groups' weights and round starts every 2 steps
    dict(
        BASE,
        name="hierarchical_eager",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Hierarchical({2: 2, 8: 4})),
        fragments=2,
        eager_updates=True,
        outer_optimizer="nesterov",
        wrap_linear=True,
        max_steps=11,
    ),
    # the same with sites that are not consecutive groups: {0, 3} and {1, 2}
    dict(
        BASE,
        name="hierarchical_sites",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Hierarchical({2: 2, 4: 4}, sites=[[0, 3], [1, 2]])),
        outer_optimizer="nesterov",
        max_steps=7,
    ),
    # gossip by fragments: the two fragments mix in turn, every 2 steps, each with its 4-step round's matrix
    dict(
        BASE,
        name="gossip_f2",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=4,
        fragments=2,
        outer_topology=topology_record(Gossip(peers=1, seed=3)),
        outer_optimizer="fedavg",
        wrap_linear=True,
        max_steps=11,
    ),
    # the same mixes taken a step before they land, encoded in int4 against the anchor
    dict(
        BASE,
        name="gossip_f2_d1_int4",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=4,
        fragments=2,
        sync_delay=1,
        reduce_dtype="int4",
        outer_topology=topology_record(Gossip(peers=1, seed=3)),
        outer_optimizer="fedavg",
        wrap_linear=True,
        max_steps=11,
    ),
    # mixings: one-rank groups, plain averaging, stopping between two syncs (the end averages every group)
    dict(
        BASE,
        name="gossip",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Gossip(peers=1, seed=3)),
        outer_optimizer="fedavg",
        max_steps=7,
    ),
    dict(
        BASE,
        name="sampled",
        strategy="fl_fsdp",
        num_groups=4,
        sync_every=2,
        outer_topology=topology_record(Sampled(groups_per_round=2, seed=1)),
        outer_optimizer="fedavg",
        max_steps=7,
    ),
    # one-rank groups: the fed ring spans the world, where Lightning's own collectives run (it deadlocked once)
    dict(
        BASE, name="stream_one_rank_groups", strategy="fl_fsdp", num_groups=4, sync_every=2, sync_delay=1, max_steps=5
    ),
    # a user callback and ModelCheckpoint (every sync step) in either order, stopping mid-round
    *(
        dict(
            BASE,
            name=f"order_{order}",
            strategy="fl_fsdp",
            sync_every=2,
            outer_optimizer="nesterov",
            max_steps=5,
            order=order,
        )
        for order in ("user_first", "ckpt_first")
    ),
]
SCENARIOS_8 = [
    # FL+HSDP with a mixing that leaves the two groups apart after every sync
    dict(
        BASE,
        name="mixing_hsdp",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=2,
        sync_every=2,
        outer_topology=topology_record(Mixing([[0.75, 0.25], [0.25, 0.75]])),
        outer_optimizer="fedavg",
        max_steps=5,
    ),
    dict(
        BASE,
        name="eager_hsdp",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=2,
        sync_every=2,
        eager_updates=True,
        outer_optimizer="nesterov",
        max_steps=5,
    ),
    dict(
        BASE,
        name="scope_int4_hsdp",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=2,
        sync_every=4,
        fragments=2,
        sync_delay=1,
        reduce_dtype="int4",
        error_feedback=True,
        wrap_linear=True,
        max_steps=5,
    ),
    dict(
        BASE,
        name="hsdp_nesterov",
        strategy="fl_hsdp",
        num_groups=2,
        shard_size=2,
        sync_every=2,
        outer_optimizer="nesterov",
        max_steps=7,
        accumulate=2,
        val_check_interval=6,
        mid_ckpt_step=3,
    ),
]


#: Scenarios that run on FSDP2 too (``fl_fsdp2`` / ``fl_hsdp2``), in the same launches, named ``<name>@fsdp2``.
FSDP2_TWINS = {
    "fedavg_h1",
    "fsdp_nesterov",
    "four_groups",
    "hsdp_shard1",
    "stream_f2_d1_a05",
    "int8_ef",
    "hsdp_nesterov",
    "eager_f2",
    "hierarchical",
    "hierarchical_stream",
    "gossip",
}


def _on_fsdp2(spec: dict) -> dict:
    return dict(spec, name=f"{spec['name']}@fsdp2", strategy=f"{spec['strategy']}2")


SCENARIOS_4 += [_on_fsdp2(s) for s in SCENARIOS_4 if s["name"] in FSDP2_TWINS]
SCENARIOS_4.append(  # a configure_model that shards the model itself on the strategy's device mesh
    dict(
        BASE,
        name="own_sharding@fsdp2",
        strategy="fl_fsdp2",
        sync_every=2,
        outer_optimizer="nesterov",
        max_steps=5,
        own_sharding=True,
    )  # fmt: skip
)
SCENARIOS_8 += [_on_fsdp2(s) for s in SCENARIOS_8 if s["name"] in FSDP2_TWINS]


def both(*cases: tuple) -> list[tuple]:
    """Each case (a scenario name first), on FSDP1 and on FSDP2."""
    return [c for case in cases for c in (case, (f"{case[0]}@fsdp2", *case[1:]))]


def _run(tmp_path_factory: pytest.TempPathFactory, specs: list[dict], nodes: int, devices: int) -> dict[str, list]:
    root = tmp_path_factory.mktemp(f"ranks{nodes * devices}")
    launch(WORKER, [json.dumps(specs), str(root)], nodes, devices, root / "logs", timeout=400)
    return {s["name"]: _load(root / s["name"], nodes * devices) for s in specs}


def _load(folder: Path, world: int) -> list[dict]:
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in ranks:
        r["dir"] = folder
    return ranks


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _run(tmp_path_factory, SCENARIOS_4, nodes=2, devices=2)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _run(tmp_path_factory, SCENARIOS_8, nodes=2, devices=4)


def _spec(name: str) -> dict:
    return next(s for s in SCENARIOS_4 + SCENARIOS_8 if s["name"] == name)


def _reference(ranks: list[dict], spec: dict, topology: FederationTopology) -> dict:
    fragments = ranks[0].get("fragment_names")
    return reference_run(
        ranks[0]["initial"],
        [r["micro_batches"] for r in ranks],
        [topology.group_ranks(g) for g in range(topology.num_groups)],
        sync_every=spec.get("sync_every", 8),
        outer=spec.get("outer_optimizer", FederationConfig().outer_optimizer),
        inner=spec["inner"],
        lr=spec["lr"],
        accumulate=spec["accumulate"],
        max_steps=spec["max_steps"],
        fragments=[[n.removeprefix("net.") for n in f] for f in fragments] if spec.get("fragments") else None,
        sync_delay=spec.get("sync_delay", 0),
        merge_alpha=spec.get("merge_alpha", 0.0),
        final_landing="reset",  # a fragment that lands at the last step keeps that landing's anchor
        eager=spec.get("eager_updates", False),
        **_topology_reference(spec, topology.num_groups),
    )


def _topology_reference(spec: dict, num_groups: int) -> dict:
    """The reference's arguments for the spec's outer topology (none for the default)."""
    if "outer_topology" not in spec:
        return {}
    topology = topology_from_record(spec["outer_topology"])
    if isinstance(topology, Hierarchical):
        sites = [list(site) for site in topology.sites] if topology.sites else None
        return {"hierarchical": topology.levels, "sites": sites}
    codec = FederationConfig(reduce_dtype=spec.get("reduce_dtype"), outer_topology=topology).codec
    roundtrip = None if codec.exact else roundtrip_of(codec)  # a mix's messages travel encoded
    return {"mixing": lambda round: topology.weights(round, num_groups), "roundtrip": roundtrip}


def _assert_state_close(actual: dict, expected: dict, atol: float) -> float:
    worst = 0.0
    for k, v in expected.items():
        got = actual[f"net.{k}"]
        worst = max(worst, (got - v).abs().max().item())
        assert_close(got, v, atol=atol, rtol=0)
    return worst


# -- degenerate case -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fedavg_h1", "fedavg_h1@fsdp2"])
def test_fedavg_every_step_with_sgd_equals_plain_fsdp(four, name):
    fed, plain = four[name][0]["final"], four["plain"][0]["final"]
    assert four[name][0]["micro_batches"] == four["plain"][0]["micro_batches"]
    for k in plain:
        assert_close(fed[k], plain[k], atol=1e-5, rtol=0)
    assert any((fed[k] - four[name][0]["initial"][k]).abs().max() > 1e-3 for k in fed), "nothing trained"


# -- against the independent reference --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"),
    [
        *both(("fedavg_h1", 4, 2, 2), ("fsdp_nesterov", 4, 2, 2), ("four_groups", 4, 4, 1), ("hsdp_shard1", 4, 2, 1)),
        ("one_group", 4, 1, 4),
        *both(("hsdp_nesterov", 8, 2, 2)),
        ("own_sharding@fsdp2", 4, 2, 2),
    ],
)
def test_matches_reference_implementation(four, eight, name, world, groups, shard):
    ranks = (four if world == 4 else eight)[name]
    topology = FederationTopology(world, groups, shard)
    ref = _reference(ranks, _spec(name), topology)
    _assert_state_close(ranks[0]["final"], ref["final"], atol=1e-5)
    # and the model really moved away from where it started
    assert max((ref["final"][k] - ranks[0]["initial"][f"net.{k}"]).abs().max() for k in ref["final"]) > 1e-2


def test_every_rank_gets_its_own_data(four, eight):
    for ranks in (
        four["fsdp_nesterov"],
        eight["hsdp_nesterov"],
        four["fsdp_nesterov@fsdp2"],
        eight["hsdp_nesterov@fsdp2"],
    ):
        seen = [set(i for mb in r["micro_batches"] for i in mb) for r in ranks]
        for a in range(len(seen)):
            for b in range(a + 1, len(seen)):
                assert not seen[a] & seen[b]


# -- consensus and replicas --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"),
    both(("fsdp_nesterov", 4, 2, 2), ("four_groups", 4, 4, 1), ("hsdp_shard1", 4, 2, 1), ("hsdp_nesterov", 8, 2, 2)),
)
def test_groups_identical_after_every_sync_and_replicas_at_every_step(four, eight, name, world, groups, shard):
    ranks = (four if world == 4 else eight)[name]
    spec = _spec(name)
    t = FederationTopology(world, groups, shard)
    steps = sorted(ranks[0]["shards_at"])
    synced = [s for s in steps if s == -1 or s % spec.get("sync_every", 8) == 0]
    assert -1 in synced and len(synced) >= 2
    differs_between_syncs = False
    for step in steps:
        for rep in range(t.num_replicas):
            for s in range(t.shard_size):
                fed = [ranks[r]["shards_at"][step] for r in t.fed_ranks(rep, s)]
                if step in synced:
                    for other in fed[1:]:
                        assert torch.equal(fed[0], other), f"groups differ after the sync at step {step}"
                else:
                    differs_between_syncs |= any(not torch.equal(fed[0], o) for o in fed[1:])
        for g in range(t.num_groups):
            for s in range(t.shard_size):
                reps = [ranks[r]["shards_at"][step] for r in t.replicate_ranks(g, s)]
                for other in reps[1:]:
                    assert torch.equal(reps[0], other), f"replicas of group {g} differ at step {step}"
    assert differs_between_syncs, "groups never drifted apart: the test would not see a missing sync"


@pytest.mark.parametrize(("name", "world"), both(("fsdp_nesterov", 4), ("hsdp_nesterov", 8)))
def test_validation_between_syncs_sees_the_consensus(four, eight, name, world):
    ranks = (four if world == 4 else eight)[name]
    for r in ranks:
        steps = [step for step, _ in r["val_shards"]]
        assert 3 in steps  # validation after micro-batch 6 = optimizer step 3, one step after the sync at 2
        for step, shards in r["val_shards"]:
            last_sync = step - step % 2
            assert torch.equal(shards, r["shards_at"][last_sync])
            if step == 3:
                assert not torch.equal(shards, r["shards_at"][3]), "the group's own weights were validated"


@pytest.mark.parametrize(("name", "world", "groups", "shard"), both(("hsdp_shard1", 4, 2, 1)))
def test_a_checkpoint_between_syncs_holds_the_consensus_not_the_groups_weights(four, name, world, groups, shard):
    ranks = four[name]
    ref = _reference(ranks, _spec(name), FederationTopology(world, groups, shard))
    mid = torch.load(ranks[0]["dir"] / "mid.ckpt", weights_only=False)
    assert mid["global_step"] == 4
    _assert_state_close(mid["state_dict"], ref["anchors"][3], atol=1e-5)


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"), both(("fsdp_nesterov", 4, 2, 2), ("hsdp_nesterov", 8, 2, 2))
)
def test_full_checkpoints_hold_the_consensus_and_load_into_the_plain_module(four, eight, name, world, groups, shard):
    ranks = (four if world == 4 else eight)[name]
    ref = _reference(ranks, _spec(name), FederationTopology(world, groups, shard))
    folder = ranks[0]["dir"]
    final = torch.load(folder / "final.ckpt", weights_only=False)
    _assert_state_close(final["state_dict"], ref["final"], atol=1e-5)
    mid = torch.load(folder / "mid.ckpt", weights_only=False)
    assert mid["global_step"] == 3
    _assert_state_close(mid["state_dict"], ref["anchors"][2], atol=1e-5)

    from tests.trainer.worker import Module

    plain = Module.load_from_checkpoint(folder / "final.ckpt", spec=_spec(name), map_location="cpu")
    assert isinstance(plain, L.LightningModule)
    for k, v in ref["final"].items():
        assert_close(plain.net.state_dict()[k], v, atol=1e-5, rtol=0)


def test_each_sync_is_logged(four):
    ranks = four["fsdp_nesterov"]
    rows = list(csv.DictReader(open(next(ranks[0]["dir"].glob("csv/*/metrics.csv")))))
    syncs = [row for row in rows if row.get("fedshard/sync_bytes")]
    # syncs at steps 2, 4, 6 and the final one at step 7, each written straight to the logger
    assert sorted({int(float(row["fedshard/num_syncs"])) for row in syncs}) == [1, 2, 3, 4]
    assert [int(row["step"]) for row in syncs] == [2, 4, 6, 7]  # one row per sync, at its optimizer step
    numel = ranks[0]["shards_at"][-1].numel()
    assert {float(row["fedshard/sync_bytes"]) for row in syncs} == {2 * (2 - 1) / 2 * numel * 4}
    for row in syncs:
        assert float(row["fedshard/outer_grad_norm"]) > 0
        assert float(row["fedshard/drift"]) > 0
        assert float(row["fedshard/sync_seconds"]) >= 0


@pytest.mark.parametrize("name", ["fsdp_nesterov", "fsdp_nesterov@fsdp2"])
def test_plan_check_logs_predicted_and_measured_times(four, name):
    ranks = four[name]
    report = ranks[0]["plan_report"]
    assert report["measured_step_seconds"] > 0 and report["measured_sync_seconds"] > 0
    # 2 groups x 2 shards of a 213-value model: each rank sends 2 x 1/2 x ~107 values x 4 bytes per sum at 100 MB/s
    assert 0 < report["predicted_sync_seconds"] < 1e-3 + 2 * 0.0001 * 2  # latency of the 2-step ring included
    assert (
        report["predicted_step_seconds"] >= report["measured_step_seconds"] - report["measured_exposed_sync_per_step"]
    )
    rows = list(csv.DictReader(open(next(ranks[0]["dir"].glob("csv/*/metrics.csv")))))
    logged = [row for row in rows if row.get("fedshard/plan/predicted_step_seconds")]
    assert len(logged) == 1 and float(logged[0]["fedshard/plan/measured_step_seconds"]) == pytest.approx(
        report["measured_step_seconds"]
    )


# -- OuterSync first in line: every other callback sees the synced state -------------------------------------------


@pytest.mark.parametrize("order", ["user_first", "ckpt_first"])
def test_user_callbacks_see_the_consensus_at_syncs_and_at_train_end(four, order):
    ranks = four[f"order_{order}"]
    topology = FederationTopology(4, 2, 2)
    assert all(r["callback_order"][0] == "OuterSync" for r in ranks)
    assert sorted(ranks[0]["probe_at_sync"]) == [2, 4]
    for s in range(topology.shard_size):
        fed = [ranks[r] for r in topology.fed_ranks(0, s)]
        for step in (2, 4):  # on_train_batch_end of a sync step
            assert torch.equal(fed[0]["probe_at_sync"][step], fed[1]["probe_at_sync"][step]), f"step {step}"
        # stopped at step 5, between two syncs: on_train_end sees the final sync's consensus in every group
        assert torch.equal(fed[0]["probe_at_train_end"], fed[1]["probe_at_train_end"])
        assert not torch.equal(fed[0]["shards_at"][3], fed[1]["shards_at"][3]), "groups never drifted apart"


def test_results_do_not_depend_on_callback_order(four):
    first, last = four["order_user_first"], four["order_ckpt_first"]
    for a, b in zip(first, last):
        assert torch.equal(a["shards_at"][-1], b["shards_at"][-1])
        for step in (2, 4):
            assert torch.equal(a["probe_at_sync"][step], b["probe_at_sync"][step])
    for step in (2, 4):  # the checkpoint of a sync step holds the consensus of that sync, in either order
        files = [torch.load(r[0]["dir"] / "ckpts" / f"step={step}.ckpt", weights_only=False) for r in (first, last)]
        for k, v in files[0]["state_dict"].items():
            assert torch.equal(files[1]["state_dict"][k], v)
        ref = _reference(first, _spec("order_user_first"), FederationTopology(4, 2, 2))
        _assert_state_close(files[0]["state_dict"], ref["anchors"][step], atol=1e-5)


def test_every_sync_goes_through_the_runtime_entry_points(four, eight):
    """The Trainer path: `OuterSync` calls `FederatedRuntime.after_optimizer_step` / `finish`, never the core itself."""
    for name, ranks in [*four.items(), *eight.items()]:
        for r in ranks:
            if r["num_syncs"] is None:
                continue  # the stock FSDP baseline
            calls = r["runtime_calls"]
            assert calls.get("routed_syncs", 0) == r["num_syncs"], name
            assert "bypassed_syncs" not in calls, name
            assert calls["after_optimizer_step"] >= r["global_step"], name


def test_no_collective_of_a_sync_spans_more_than_one_fed_ring_or_one_group(four, eight):
    """NaN flags, statistics and sums run over the fed ring and inside the group; nothing over the whole job."""
    for launch_ranks, world in ((four, 4), (eight, 8)):
        for name, ranks in launch_ranks.items():
            spec = _spec(name)
            groups = spec.get("num_groups", 2)  # both launches have two nodes: one group per node by default
            widest = max(groups, world // groups)  # a fed ring has one rank per group; a group world / G ranks
            for r in ranks:
                calls = r["runtime_calls"]
                assert calls.get("sync_collective_max_ranks", 0) <= widest, (name, calls)
    for name, ranks in (("scope_int4_f2_d1", four["scope_int4_f2_d1"]), ("scope_int4_hsdp", eight["scope_int4_hsdp"])):
        for r in ranks:  # the check saw the syncs: fragments with an overlapped int4 sum, on FL+FSDP and FL+HSDP
            assert r["num_syncs"] >= 2 and r["runtime_calls"]["sync_collectives"] > 0, name


# -- streaming fragments, overlap and merging --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "groups", "shard"),
    [
        *both(("stream_f2_d1_a05", 2, 2)),
        ("stream_f1_d1", 2, 2),
        ("stream_f2_a05_hsdp", 2, 1),
        ("stream_one_rank_groups", 4, 1),
    ],
)
def test_streaming_syncs_match_the_reference(four, name, groups, shard):
    ranks = four[name]
    ref = _reference(ranks, _spec(name), FederationTopology(4, groups, shard))
    worst = _assert_state_close(ranks[0]["final"], ref["final"], atol=1e-6)
    assert max((ref["final"][k] - ranks[0]["initial"][f"net.{k}"]).abs().max() for k in ref["final"]) > 1e-2
    print(f"{name}: max |strategy - reference| = {worst:.2e}")


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"),
    [
        *both(("eager_f2", 4, 2, 2)),
        ("eager_hsdp", 8, 2, 2),
        *both(("hierarchical", 4, 4, 1)),
        ("hierarchical_sites", 4, 4, 1),
        *both(("hierarchical_stream", 4, 4, 1)),
        ("hierarchical_eager", 4, 4, 1),
        *both(("gossip", 4, 4, 1)),
        ("gossip_f2", 4, 4, 1),
        ("gossip_f2_d1_int4", 4, 4, 1),
        ("sampled", 4, 4, 1),
        ("mixing_hsdp", 8, 2, 2),
    ],
)
def test_eager_updates_and_the_outer_topologies_match_the_reference(four, eight, name, world, groups, shard):
    ranks = (four if world == 4 else eight)[name]
    ref = _reference(ranks, _spec(name), FederationTopology(world, groups, shard))
    worst = _assert_state_close(ranks[0]["final"], ref["final"], atol=1e-6)
    assert max((ref["final"][k] - ranks[0]["initial"][f"net.{k}"]).abs().max() for k in ref["final"]) > 1e-2
    assert all(all(torch.equal(r["final"][k], ranks[0]["final"][k]) for k in r["final"]) for r in ranks)
    print(f"{name}: max |strategy - reference| = {worst:.2e}")


def test_fragments_are_whole_units_in_module_order(four):
    names = four["stream_f2_d1_a05"][0]["fragment_names"]
    # three Linear units of 70, 110 and 33 parameters: the balanced cut puts the first alone
    assert names == [["net.0.weight", "net.0.bias"], ["net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"]]
    whole = [f"net.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")]
    assert four["fsdp_nesterov"][0]["fragment_names"] == [whole]
    # FSDP2 shards every parameter on its own: fragments are whole parameters, in module order
    fsdp2 = four["stream_f2_d1_a05@fsdp2"][0]["fragment_names"]
    assert len(fsdp2) == 2 and all(fsdp2) and [n for f in fsdp2 for n in f] == whole


def test_fsdp2_shards_a_module_without_configure_model_by_the_policy(four):
    assert four["fsdp_nesterov@fsdp2"][0]["fsdp2_units"] == ["net"]  # no policy: the LightningModule's child
    assert four["stream_f2_d1_a05@fsdp2"][0]["fsdp2_units"] == ["net", "net.0", "net.2", "net.4"]  # Linear policy
    assert four["own_sharding@fsdp2"][0]["fsdp2_units"] == ["net", "net.0", "net.2", "net.4"]  # the user's own


@pytest.mark.parametrize(
    ("name", "tolerance"),
    [
        ("int8_ef", 0.02),
        ("int8_ef@fsdp2", 0.02),
        # `Trainer(strategy="fl_fsdp")` by its registry name: the package defaults, int4 outer traffic with error
        # feedback (half of int8's resolution per value, so a wider band)
        ("by_name", 0.05),
    ],
)
def test_compressed_outer_traffic_stays_close_to_the_float32_reference(four, name, tolerance):
    ranks = four[name]
    ref = _reference(ranks, _spec(name.removesuffix("@fsdp2")), FederationTopology(4, 2, 2))
    errors = [(ranks[0]["final"][f"net.{k}"] - v).abs().max().item() for k, v in ref["final"].items()]
    moved = max((v - ranks[0]["initial"][f"net.{k}"]).abs().max().item() for k, v in ref["final"].items())
    relative = max(errors) / moved
    assert 0 < relative < tolerance, f"{name}: error {max(errors):.2e} for a model that moved {moved:.2e}"
    for a, b in ((0, 2), (1, 3)):  # still one consensus: the two groups' shards at each position are equal
        assert torch.equal(ranks[a]["shards_at"][-1], ranks[b]["shards_at"][-1])
