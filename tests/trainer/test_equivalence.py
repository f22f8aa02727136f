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

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.topology import FederationTopology
from tests.launch import launch
from tests.reference import reference_run

WORKER = Path(__file__).with_name("worker.py")
BASE = dict(inner="adamw", lr=0.01, batch_size=4, accumulate=1)

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
    dict(BASE, name="hsdp_shard1", strategy="fl_hsdp", num_groups=2, shard_size=1, sync_every=3, max_steps=6),
]
SCENARIOS_8 = [
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
    )


def _assert_state_close(actual: dict, expected: dict, atol: float) -> float:
    worst = 0.0
    for k, v in expected.items():
        got = actual[f"net.{k}"]
        worst = max(worst, (got - v).abs().max().item())
        assert_close(got, v, atol=atol, rtol=0)
    return worst


# -- degenerate case -----------------------------------------------------------------------------------------------


def test_fedavg_every_step_with_sgd_equals_plain_fsdp(four):
    fed, plain = four["fedavg_h1"][0]["final"], four["plain"][0]["final"]
    assert four["fedavg_h1"][0]["micro_batches"] == four["plain"][0]["micro_batches"]
    for k in plain:
        assert_close(fed[k], plain[k], atol=1e-5, rtol=0)
    assert any((fed[k] - four["fedavg_h1"][0]["initial"][k]).abs().max() > 1e-3 for k in fed), "nothing trained"


# -- against the independent reference --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"),
    [
        ("fedavg_h1", 4, 2, 2),
        ("fsdp_nesterov", 4, 2, 2),
        ("by_name", 4, 2, 2),
        ("four_groups", 4, 4, 1),
        ("hsdp_shard1", 4, 2, 1),
        ("one_group", 4, 1, 4),
        ("hsdp_nesterov", 8, 2, 2),
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
    for ranks in (four["fsdp_nesterov"], eight["hsdp_nesterov"]):
        seen = [set(i for mb in r["micro_batches"] for i in mb) for r in ranks]
        for a in range(len(seen)):
            for b in range(a + 1, len(seen)):
                assert not seen[a] & seen[b]


# -- consensus and replicas --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "world", "groups", "shard"),
    [("fsdp_nesterov", 4, 2, 2), ("four_groups", 4, 4, 1), ("hsdp_shard1", 4, 2, 1), ("hsdp_nesterov", 8, 2, 2)],
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


@pytest.mark.parametrize(("name", "world"), [("fsdp_nesterov", 4), ("hsdp_nesterov", 8)])
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


@pytest.mark.parametrize(("name", "world", "groups", "shard"), [("fsdp_nesterov", 4, 2, 2), ("hsdp_nesterov", 8, 2, 2)])
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
