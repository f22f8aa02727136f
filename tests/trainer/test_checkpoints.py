"""Multi-process proofs that checkpoints resume exactly, survive failures and change nothing while training.

Four launches: a 4-rank FL+FSDP job (2 nodes x 2 devices, 2 groups) in which one rank dies mid-save, the 4-rank
scenarios (straight runs, resumes, topology change, non-finite syncs), then the same for FL+HSDP on 8 ranks (2 nodes x 4
devices, 2 groups x 2 replicas x 2 shards). Every run trains 8 steps with ``sync_every=3`` (syncs after steps 3, 6 and
a final one after 8), AdamW + a step LR schedule inside, Nesterov outside, and dropout. A fifth, 2-rank launch checks
that a user error worded like a failed collective still gets its ``OnExceptionCheckpoint``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from benchmarks.harness.config import topology_record
from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled
from lightning_fedshard.checkpoint import FEDSHARD_KEY
from tests.launch import launch

pytestmark = pytest.mark.slow  # launches processes

WORKER = Path(__file__).with_name("ckpt_worker.py")
FSDP = dict(strategy="fl_fsdp")
HSDP = dict(strategy="fl_hsdp", num_groups=2, shard_size=2)
SHARDED = dict(state_dict_type="sharded")
FSDP2 = dict(strategy="fl_fsdp2")
HSDP2 = dict(strategy="fl_hsdp2", num_groups=2, shard_size=2)
DEATH = dict(ckpt=True, die_at_save_step=5, timeout_s=20)
STREAM = dict(sync_every=4, fragments=2, sync_delay=1, merge_alpha=0.5, reduce_dtype="int8", error_feedback=True)
EAGER = dict(sync_every=4, fragments=2, eager_updates=True, reduce_dtype="int4", error_feedback=True)
# 4 one-rank groups in 2 sites: the sites average after steps 2 and 6, the federation meets after 4 and 8
HIERARCHICAL = dict(
    num_groups=4, sync_every=2, outer_topology=topology_record(Hierarchical({2: 2, 4: 4})), reduce_dtype="float32"
)
# sites around a streaming federation: the sites average after steps 2, 4 and 6; the federation's 2 fragments land
# after 4 and 8, each sum started a step earlier (a sum is in flight after step 3), half the local progress merged
HIERARCHICAL_STREAM = dict(
    HIERARCHICAL,
    outer_topology=topology_record(Hierarchical({2: 2, 8: 4})),
    fragments=2,
    sync_delay=1,
    merge_alpha=0.5,
    reduce_dtype="int8",
    error_feedback=True,
)
# ... and around eager updates: fragment 0 syncs after 4, fragment 1 after 8, the sites average after 2, 4 and 6: after
# step 5 fragment 0's sum is in flight and the two sites hold different weights
HIERARCHICAL_EAGER = dict(
    HIERARCHICAL,
    outer_topology=topology_record(Hierarchical({2: 2, 8: 4})),
    fragments=2,
    eager_updates=True,
    reduce_dtype="int4",
    error_feedback=True,
)
# mixings of 4 one-rank groups every 2 steps, plain averaging: the groups differ after every sync
MIXING = dict(num_groups=4, sync_every=2, outer_optimizer="fedavg", reduce_dtype="float32")
RING = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
MIXINGS = {
    "gossip": dict(MIXING, outer_topology=topology_record(Gossip(peers=1, seed=3))),
    "sampled": dict(MIXING, outer_topology=topology_record(Sampled(groups_per_round=2, seed=1))),
    "ring": dict(MIXING, outer_topology=topology_record(Mixing(RING))),
    # messages taken after steps 1, 3, 5, 7 land a step later, int4-encoded: after step 3 a mix is in flight
    # sampled participation in the outer step (Nesterov), each sum started a step before it lands
    "sampled_outer": dict(
        MIXING,
        outer_topology=topology_record(Sampled(groups_per_round=2, seed=1, outer_step=True)),
        outer_optimizer="nesterov",
        sync_delay=1,
    ),
    "gossip_d1_int4": dict(
        MIXING, outer_topology=topology_record(Gossip(peers=1, seed=3)), sync_delay=1, reduce_dtype="int4"
    ),
}
# FL+HSDP on 8 ranks: 2 groups x 2 replicas x 2 shards mixing, and 4 groups x 2 replicas in 2 sites {0, 2}, {1, 3}
HSDP_MIXING = {
    **HSDP,
    **MIXING,
    "num_groups": 2,
    "outer_topology": topology_record(Mixing([[0.75, 0.25], [0.25, 0.75]])),
}
HSDP_SITES = {
    **HSDP,
    **HIERARCHICAL,
    "shard_size": 1,
    "outer_topology": topology_record(Hierarchical({2: 2, 4: 4}, sites=[[0, 2], [1, 3]])),
}


def _family(prefix: str, base: dict, runs_from: str) -> list[dict]:
    """A straight run writing a checkpoint after every step, and resumes from each kind of checkpoint."""
    return [
        dict(base, name=prefix, ckpt=True, presync_ckpt_step=6),
        dict(base, name=f"{prefix}_between", resume_from=f"{runs_from}/ckpts/step=4.ckpt"),
        dict(base, name=f"{prefix}_boundary", resume_from=f"{runs_from}/ckpts/step=6.ckpt"),
        dict(base, name=f"{prefix}_presync", resume_from=f"{runs_from}/presync6.ckpt"),
        dict(base, name=f"{prefix}_exc", ckpt=True, raise_at_step=5, expect_error=True),
        dict(base, name=f"{prefix}_exception", resume_from=f"{prefix}_exc/on_exception.ckpt"),
    ]


SCENARIOS_4 = [
    *_family("full", FSDP, "full"),
    *_family("sharded", {**FSDP, **SHARDED}, "sharded"),
    dict(FSDP, name="nockpt"),
    dict(FSDP, name="nockpt_again"),
    dict(FSDP, name="after_death", resume_from="../death4/death/ckpts/step=4.ckpt"),
    dict(FSDP, name="topology_groups", num_groups=4, resume_from="full/ckpts/step=4.ckpt"),
    dict(FSDP, name="nan_raise", ckpt=True, nan_at_step=3, expect_error=True),
    dict(FSDP, name="nan_skip", on_nonfinite="skip_group", nan_at_step=3, reduce_dtype="float32"),
    # streaming: fragments landing at 2, 4, 6, 8, each sum started one step earlier, int8 outer traffic with
    # error feedback; the checkpoints of steps 3 and 5 are written while a sum is in flight
    dict(FSDP, **STREAM, name="stream", ckpt=True),
    dict(FSDP, **STREAM, name="stream_inflight", resume_from="stream/ckpts/step=3.ckpt"),
    dict(FSDP, **STREAM, **SHARDED, name="stream_sharded", ckpt=True),
    dict(FSDP, **STREAM, **SHARDED, name="stream_sharded_inflight", resume_from="stream_sharded/ckpts/step=5.ckpt"),
    # FSDP2: the same checkpoints and resumes, sharing this launch
    *_family("full2", FSDP2, "full2")[:4],
    *_family("sharded2", {**FSDP2, **SHARDED}, "sharded2")[:2],
    dict(FSDP2, name="nockpt2"),
    dict(FSDP2, **STREAM, **SHARDED, name="stream2", ckpt=True),
    dict(FSDP2, **STREAM, **SHARDED, name="stream2_inflight", resume_from="stream2/ckpts/step=5.ckpt"),
    # eager updates: from step 4 on both fragments' sums are in flight, each for a whole round
    dict(FSDP, **EAGER, name="eager", ckpt=True),
    dict(FSDP, **EAGER, name="eager_inflight", resume_from="eager/ckpts/step=5.ckpt"),
    dict(FSDP, **HIERARCHICAL, name="hierarchical", ckpt=True),
    dict(FSDP, **HIERARCHICAL, name="hierarchical_apart", resume_from="hierarchical/ckpts/step=3.ckpt"),
    dict(FSDP, **HIERARCHICAL_STREAM, name="hstream", ckpt=True),
    dict(FSDP, **HIERARCHICAL_STREAM, name="hstream_inflight", resume_from="hstream/ckpts/step=3.ckpt"),
    dict(FSDP, **HIERARCHICAL_EAGER, name="heager_sites", ckpt=True),
    dict(FSDP, **HIERARCHICAL_EAGER, name="heager_sites_inflight", resume_from="heager_sites/ckpts/step=5.ckpt"),
    *(
        run
        for name, mixing in MIXINGS.items()
        for run in (
            dict(FSDP, **mixing, name=name, ckpt=True),
            dict(FSDP, **mixing, name=f"{name}_apart", resume_from=f"{name}/ckpts/step=3.ckpt"),
        )
    ),
]
SCENARIOS_8 = [
    *_family("hfull", HSDP, "hfull"),
    *_family("hsharded", {**HSDP, **SHARDED}, "hsharded"),
    dict(HSDP, name="hnockpt"),
    dict(HSDP, name="hafter_death", **SHARDED, resume_from="../death8/hdeath/ckpts/step=4.ckpt"),
    dict(HSDP, name="htopology_full", resume_from="../ranks4/full/ckpts/step=4.ckpt"),
    dict(HSDP, name="htopology_sharded", **SHARDED, resume_from="../ranks4/sharded/ckpts/step=4.ckpt"),
    dict(HSDP, name="hnan_raise", ckpt=True, nan_at_step=3, expect_error=True),
    dict(HSDP, name="hnan_skip", on_nonfinite="skip_group", nan_at_step=3, reduce_dtype="float32"),
    # FSDP2: FL+HSDP on fully_shard, 2 groups x 2 replicas x 2 shards
    *_family("hsharded2", {**HSDP2, **SHARDED}, "hsharded2")[:2],
    dict(HSDP, **EAGER, **SHARDED, name="heager", ckpt=True),
    dict(HSDP, **EAGER, **SHARDED, name="heager_inflight", resume_from="heager/ckpts/step=5.ckpt"),
    dict(HSDP_MIXING, name="hmixing", ckpt=True),
    dict(HSDP_MIXING, name="hmixing_apart", resume_from="hmixing/ckpts/step=3.ckpt"),
    dict(HSDP_SITES, **SHARDED, name="hsites", ckpt=True),
    dict(HSDP_SITES, **SHARDED, name="hsites_apart", resume_from="hsites/ckpts/step=3.ckpt"),
]
# (world, resumed run, uninterrupted run, checkpoint step)
RESUMES = [
    (world, f"{prefix}_{case}", prefix, step)
    for world, prefixes in ((4, ("full", "sharded")), (8, ("hfull", "hsharded")))
    for prefix in prefixes
    for case, step in (("between", 4), ("boundary", 6), ("presync", 6), ("exception", 5))
] + [(4, "after_death", "full", 4), (8, "hafter_death", "hfull", 4)]
RESUMES += [  # FSDP2
    (4, "full2_between", "full2", 4),
    (4, "full2_boundary", "full2", 6),
    (4, "full2_presync", "full2", 6),
    (4, "sharded2_between", "sharded2", 4),
    (8, "hsharded2_between", "hsharded2", 4),
]


def _launch(base: Path, folder: str, specs: list[dict], nodes: int, devices: int) -> Path:
    root = base / folder
    launch(WORKER, [json.dumps(specs), str(root)], nodes, devices, root / "logs", timeout=600)
    return root


def _die(base: Path, folder: str, spec: dict, nodes: int, devices: int) -> dict:
    root = base / folder
    with pytest.raises(RuntimeError, match="failed") as failure:
        launch(WORKER, [json.dumps([spec]), str(root)], nodes, devices, root / "logs", timeout=500)
    logs = [(root / "logs" / f"rank{r}.log").read_text() for r in range(nodes * devices)]
    seconds = time.time() - float((root / "died_at").read_text())  # from the death to the last survivor's exit
    return {"root": root, "seconds": seconds, "error": str(failure.value), "logs": logs}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def death4(base):
    return _die(base, "death4", dict(FSDP, name="death", dying_rank=3, **DEATH), nodes=2, devices=2)


@pytest.fixture(scope="module")
def death8(base):
    return _die(base, "death8", dict(HSDP, name="hdeath", dying_rank=5, **SHARDED, **DEATH), nodes=2, devices=4)


@pytest.fixture(scope="module")
def four(base, death4):
    return _launch(base, "ranks4", SCENARIOS_4, nodes=2, devices=2)


@pytest.fixture(scope="module")
def eight(base, four, death8):
    return _launch(base, "ranks8", SCENARIOS_8, nodes=2, devices=4)


def _ranks(root: Path, name: str) -> list[dict]:
    world = 4 if root.name == "ranks4" else 8
    return [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _max_diff(a: list[dict], b: list[dict], key: str) -> float:
    return max((x[key] - y[key]).abs().max().item() for x, y in zip(a, b))


# -- exact resume ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "resumed", "straight", "step"), RESUMES)
def test_resume_ends_with_exactly_the_weights_of_the_uninterrupted_run(four, eight, world, resumed, straight, step):
    root = four if world == 4 else eight
    got, want = _ranks(root, resumed), _ranks(root, straight)
    assert got[0]["global_step"] == 8 and got[0]["num_syncs"] == want[0]["num_syncs"] == 3
    for g, w in zip(got, want):
        if "presync" not in resumed:  # a pre-sync checkpoint starts before the sync that `shards_at` comes after
            assert torch.equal(g["initial"], w["shards_at"][step]), "the resumed run did not start at the checkpoint"
        assert sorted(g["shards_at"]) == list(range(step, 8))
        for s in g["shards_at"]:
            assert torch.equal(g["shards_at"][s], w["shards_at"][s]), f"diverged at step {s}"
        assert torch.equal(g["final_shards"], w["final_shards"])
        assert torch.equal(g["final_optimizer"], w["final_optimizer"])
        # the weights really moved after the checkpoint, so a lost update would show
        assert (w["final_shards"] - w["shards_at"][step]).abs().max() > 1e-3
    if "consensus" in want[0] and "consensus" in got[0]:  # recorded for full runs
        for k, v in want[0]["consensus"].items():
            assert torch.equal(got[0]["consensus"][k], v)
    print(f"{resumed}: max |resumed - uninterrupted| = {_max_diff(got, want, 'final_shards')}")


@pytest.mark.parametrize(
    ("world", "run", "sharded"),
    [(4, "full", False), (4, "sharded", True), (8, "hfull", False), (4, "full2", False), (8, "hsharded2", True)],
)
def test_checkpoint_between_syncs_holds_each_groups_own_state(four, eight, world, run, sharded):
    root = four if world == 4 else eight
    path = root / run / "ckpts" / "step=4.ckpt"
    if sharded:
        files = sorted(p.name for p in (path / FEDSHARD_KEY).iterdir())
        groups = [f for f in files if f.startswith("group") and ".replica" not in f]
        assert groups == ["group0.shard0.pt", "group0.shard1.pt", "group1.shard0.pt", "group1.shard1.pt"]
        # FL+HSDP: each further replica keeps the error-feedback residuals of the part of the shard it sums
        replicas = [f for f in files if ".replica" in f]
        assert replicas == ([f"group{g}.replica1.shard{s}.pt" for g in (0, 1) for s in (0, 1)] if world == 8 else [])
        entries = {f.removesuffix(".pt").replace(".", "/"): torch.load(path / FEDSHARD_KEY / f) for f in files}
    else:
        entries = torch.load(path, weights_only=False)[FEDSHARD_KEY]["entries"]
    g0, g1 = entries["group0/shard0"], entries["group1/shard0"]
    # between syncs the groups hold different weights and inner optimizer states: a checkpoint keeping group 0 alone
    # (stock full) or one chunk per key (stock sharded, DCP de-duplication) would lose group 1's
    assert not torch.equal(g0["weights"][0], g1["weights"][0])
    assert not torch.equal(g0["optimizers"][0]["state"][0]["exp_avg"], g1["optimizers"][0]["state"][0]["exp_avg"])
    anchor = entries["outer/shard0"]["outer"]["anchor"][0]
    assert not torch.equal(anchor, g0["weights"][0]) and not torch.equal(anchor, g1["weights"][0])


@pytest.mark.parametrize(
    ("world", "run", "plain"),
    [(4, "full", "nockpt"), (4, "sharded", "nockpt"), (8, "hfull", "hnockpt"), (4, "full2", "nockpt2")],
)
def test_taking_checkpoints_does_not_change_training(four, eight, world, run, plain):
    root = four if world == 4 else eight
    assert _max_diff(_ranks(root, run), _ranks(root, plain), "final_shards") == 0.0


# -- determinism -------------------------------------------------------------------------------------------------------


def test_same_seed_and_configuration_give_identical_weights(four):
    a, b = _ranks(four, "nockpt"), _ranks(four, "nockpt_again")
    for x, y in zip(a, b):
        assert torch.equal(x["final_shards"], y["final_shards"])
        assert not torch.equal(x["final_shards"], x["initial"])


# -- the consensus as the ordinary state dict, and its export ----------------------------------------------------------


@pytest.mark.parametrize(("full", "sharded"), [("full", "sharded"), ("full2", "sharded2")])
def test_state_dict_is_the_consensus_in_the_plain_layout(four, tmp_path, full, sharded):
    from lightning_fedshard import export_consensus
    from tests.trainer.ckpt_worker import Module

    path = four / full / "ckpts" / "step=4.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    state_dict = checkpoint["state_dict"]
    assert list(state_dict) == list(Module().state_dict())
    plain = Module.load_from_checkpoint(path, map_location="cpu")  # Lightning alone, no strategy
    for k, v in state_dict.items():
        assert torch.equal(plain.state_dict()[k], v)
    # the sharded checkpoint of the same step holds the same consensus, and both export to the same file
    sharded_path = four / sharded / "ckpts" / "step=4.ckpt"
    for source, out in ((path, tmp_path / "a"), (sharded_path, tmp_path / "b")):
        exported = torch.load(export_consensus(source, out))
        assert sorted(exported) == sorted(state_dict)  # DCP keeps its own key order
        for k, v in state_dict.items():
            assert torch.equal(exported[k], v)


# -- topology changes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "run", "differences"),
    [
        (4, "topology_groups", ["num_groups: checkpoint 2, this run 4", "shard_size: checkpoint 2, this run 1"]),
        (8, "htopology_full", ["world_size: checkpoint 4, this run 8", "hybrid: checkpoint False, this run True"]),
        (8, "htopology_sharded", ["num_replicas: checkpoint 1, this run 2"]),
    ],
)
def test_other_topology_resumes_from_the_consensus_with_a_warning(four, eight, world, run, differences):
    ranks = _ranks(four if world == 4 else eight, run)
    warned = [w for w in ranks[0]["warnings"] if w.startswith("CheckpointTopologyWarning")]
    assert len(warned) == 1
    for text in differences + ["Resuming from the consensus", "were dropped"]:
        assert text in warned[0]
    assert ranks[0]["global_step"] == 8 and ranks[0]["num_syncs"] == 3  # counters kept: syncs 6 and 8 only
    if run == "topology_groups":  # four one-rank groups (same local layout): all start from the one consensus
        for r in ranks[1:]:
            assert torch.equal(r["initial"], ranks[0]["initial"])


# -- non-finite outer gradients ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "run"), [(4, "nan_raise"), (8, "hnan_raise")])
def test_nonfinite_outer_gradient_raises_and_leaves_anchor_and_checkpoints(four, eight, world, run):
    root = four if world == 4 else eight
    for r in _ranks(root, run):
        assert r["error"].startswith("NonFiniteOuterGradientError: Non-finite outer gradient")
        assert "group(s) [1] at optimizer step 3, sync 1 (after 0 successful sync(s))" in r["error"]
        assert torch.equal(r["final_anchor"], r["before_nan"]["anchor"])
        assert r["ckpt_sha_after"] == r["before_nan"]["ckpt_sha"] is not None
    files = sorted(p.name for p in (root / run / "ckpts").iterdir())
    assert files == ["step=1.ckpt", "step=2.ckpt"], "a checkpoint of the broken state was written"
    assert not (root / run / "on_exception.ckpt").exists()


@pytest.mark.parametrize(("world", "run", "group_size"), [(4, "nan_skip", 2), (8, "hnan_skip", 4)])
def test_skip_group_averages_the_healthy_groups_and_restarts_the_broken_one(four, eight, world, run, group_size):
    ranks = _ranks(four if world == 4 else eight, run)
    assert any("Skipped federation group(s) [1]" in w for w in ranks[0]["warnings"])
    assert ranks[0]["global_step"] == 8 and ranks[0]["num_syncs"] == 3
    for rank, r in enumerate(ranks):
        assert torch.isfinite(r["final_shards"]).all()
        # first sync, Nesterov (lr 0.7, momentum 0.9) over group 0 alone: a1 = a0 - 0.7 * 1.9 * (a0 - theta_0)
        partner = ranks[rank % group_size]  # the rank of group 0 at the same in-group position
        a0, theta0 = partner["before_nan"]["anchor"], partner["before_nan"]["shards"]
        torch.testing.assert_close(r["shards_at"][3], a0 - 0.7 * 1.9 * (a0 - theta0), atol=1e-6, rtol=0)


# -- a rank that dies --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "dying"), [(4, 3), (8, 5)])
def test_dead_rank_stops_the_others_with_a_clear_error_and_keeps_checkpoints(death4, death8, world, dying):
    death = death4 if world == 4 else death8
    codes = [int(c) for c in re.search(r"exit codes \[([^\]]*)\]", death["error"]).group(1).split(",")]
    assert len(codes) == world and all(c != 0 for c in codes), "a survivor hung or exited cleanly"
    assert death["seconds"] < 20 + 40  # the strategy's 20 s timeout plus slack for a loaded machine, never a hang
    for rank, log in enumerate(death["logs"]):
        if rank != dying:
            assert f"lightning_fedshard: rank {rank} stopped because a collective failed" in log
            assert "Checkpoints already on disk are intact" in log
    run = death["root"] / ("death" if world == 4 else "hdeath") / "ckpts"
    assert sorted(p.name for p in run.iterdir()) == [f"step={s}.ckpt" for s in (1, 2, 3, 4)]
    assert not (run / "step=5.ckpt").exists()


# -- a user error that reads like a failed collective ----------------------------------------------------------------


def test_user_error_with_the_words_of_a_collective_failure_still_saves_its_on_exception_checkpoint(base):
    spec = dict(FSDP, name="user_error", ckpt=True, user_error_at_step=3, expect_error=True)
    root = _launch(base, "user_error", [spec], nodes=1, devices=2)
    ranks = [torch.load(root / "user_error" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["error"] == "RuntimeError: timeout reading shard from gloo nccl"
    assert not any("Not saving checkpoint" in w for w in ranks[0]["warnings"])
    path = root / "user_error" / "on_exception.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["global_step"] == 3 and checkpoint[FEDSHARD_KEY]["schedule"]["last_synced_step"] == 3
    from tests.trainer.ckpt_worker import Module

    plain = Module.load_from_checkpoint(path, map_location="cpu")  # loads with Lightning alone
    for k, v in checkpoint["state_dict"].items():
        assert torch.equal(plain.state_dict()[k], v)


# -- streaming fragments -----------------------------------------------------------------------------------------------


STREAM_RESUMES = [
    (4, "stream_inflight", "stream", 3),
    (4, "stream_sharded_inflight", "stream_sharded", 5),
    (4, "stream2_inflight", "stream2", 5),
    (4, "eager_inflight", "eager", 5),
    (8, "heager_inflight", "heager", 5),
]


@pytest.mark.parametrize(("world", "resumed", "straight", "step"), STREAM_RESUMES)
def test_resume_with_fragments_and_a_sum_in_flight_is_exact(four, eight, world, resumed, straight, step):
    ranks = four if world == 4 else eight
    got, want = _ranks(ranks, resumed), _ranks(ranks, straight)
    assert all(r["pending_at_save"][step] for r in want), "no sum was in flight when the checkpoint was written"
    assert got[0]["num_syncs"] == want[0]["num_syncs"] == 5  # landings at 2, 4, 6, 8, then the other fragment
    for g, w in zip(got, want):
        assert torch.equal(g["initial"], w["shards_at"][step])
        for s in range(step, 8):
            assert torch.equal(g["shards_at"][s], w["shards_at"][s]), f"diverged at step {s}"
        assert torch.equal(g["final_shards"], w["final_shards"])
        assert torch.equal(g["final_optimizer"], w["final_optimizer"])
        assert (w["final_shards"] - w["shards_at"][step]).abs().max() > 1e-3


# -- a hierarchical outer topology -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resumed", "straight", "step"), [("hstream_inflight", "hstream", 3), ("heager_sites_inflight", "heager_sites", 5)]
)
def test_resume_of_sites_around_the_federations_round_with_a_sum_in_flight_is_exact(four, resumed, straight, step):
    """Mid-round the sites hold different weights and a sum is in flight (a delayed landing, or an eager sum)."""
    got, want = _ranks(four, resumed), _ranks(four, straight)
    assert all(r["pending_at_save"][step] for r in want), "no sum was in flight when the checkpoint was written"
    assert not torch.equal(want[0]["shards_at"][step], want[2]["shards_at"][step])  # two sites differ
    assert got[0]["num_syncs"] == want[0]["num_syncs"]
    for g, w in zip(got, want):
        assert torch.equal(g["initial"], w["shards_at"][step])
        for s in range(step, 8):
            assert torch.equal(g["shards_at"][s], w["shards_at"][s]), f"diverged at step {s}"
        assert torch.equal(g["final_shards"], w["final_shards"])
        assert torch.equal(g["final_optimizer"], w["final_optimizer"])
        assert (w["final_shards"] - w["shards_at"][step]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("world", "name", "other_group"),
    [(4, "hierarchical", 2), (4, "gossip", 1), (4, "sampled", 1), (4, "ring", 1), (8, "hmixing", 4), (8, "hsites", 2)]
    + [(4, "gossip_d1_int4", 1), (4, "sampled_outer", 1)],
)
def test_resume_while_the_groups_hold_different_weights_is_exact(four, eight, world, name, other_group):
    """Mid-round (step 3, after the syncs of step 2) the groups differ; the checkpoint keeps every group's weights."""
    root = four if world == 4 else eight
    got, want = _ranks(root, f"{name}_apart"), _ranks(root, name)
    if name == "hierarchical":
        assert got[0]["num_syncs"] == want[0]["num_syncs"] == 2  # the federation met after steps 4 and 8
    # rank 0 and the rank at the same in-group position of another group (another site) hold different weights
    assert not torch.equal(want[0]["shards_at"][3], want[other_group]["shards_at"][3])
    if name in ("gossip_d1_int4", "sampled_outer"):
        assert all(r["pending_at_save"][3] for r in want), "nothing was in flight when the checkpoint was written"
    for g, w in zip(got, want):
        assert torch.equal(g["initial"], w["shards_at"][3])
        for s in range(3, 8):
            assert torch.equal(g["shards_at"][s], w["shards_at"][s]), f"diverged at step {s}"
        assert torch.equal(g["final_shards"], w["final_shards"])
