"""Elastic federations on torchft: groups as separate jobs that fail, hang, rejoin and are refused, on CPU/gloo.

Each scenario starts an in-process lighthouse and its group jobs as subprocesses (``tests/elastic/cluster.py``) once
per module, and the tests check what the jobs recorded: the survivors' anchors are bit-identical across groups and equal
to an independent reference that replays the recorded membership (``tests/elastic/reference.py``), a group that joins
is bit-identical to the others after its first sync (weights, step, learning rate, data position), and every failure
ends within its bound with a clear error.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fedshard import Gossip
from tests.elastic.cluster import Cluster, Job, wait_for
from tests.elastic.reference import (
    cosine_lr,
    group_batches,
    initial_weights,
    replay,
    replay_eager,
    replay_gossip,
    replay_sites,
    sampled_positions,
    timeline,
)

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # launches processes

BASE = {"strategy": "fl_fsdp", "sync_every": 4, "max_steps": 24, "reduce_dtype": "float32", "step_sleep": 0.25}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic")


@pytest.fixture(scope="module")
def dropouts(root: Path) -> Iterator[dict[int, Job]]:
    """Four groups: 1 killed mid-round, 2 killed inside the sum over the groups, 3 stopped (SIGSTOP) mid-round."""
    cluster = Cluster(root / "dropouts", min_groups=1)
    spec = {**BASE, "num_groups": 4, "start_groups": 4}  # all train from step 0: a late job would skip its fault's step
    faults = {1: ("kill", 6), 2: ("kill_in_sum", 12), 3: ("stop", 14)}
    jobs = {g: cluster.start(g, {**spec, **_fault(faults.get(g))}) for g in range(4)}
    try:
        wait_for(lambda: jobs[0].progress() >= 20, 240, "group 0 to pass step 20")
        jobs[3].signal(signal.SIGCONT)  # the hung group wakes up, far behind the federation
        jobs[0].wait(240)
        jobs[3].wait(60)
        yield jobs
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def rejoin(root: Path) -> Iterator[dict[str, Job]]:
    """Three groups, the lighthouse waits for all three: group 2 is killed mid-round and a new job replaces it."""
    cluster = Cluster(root / "rejoin", min_groups=3)
    spec = {**BASE, "num_groups": 3}
    jobs = {
        "0": cluster.start(0, spec),
        "1": cluster.start(1, spec),
        "dead": cluster.start(2, {**spec, **_fault(("kill", 6))}),
    }
    try:
        jobs["dead"].wait(120)
        jobs["2"] = cluster.start(2, spec)
        for job in jobs.values():
            job.wait(240)
        yield jobs
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def standbys(root: Path) -> Iterator[dict[str, Any]]:
    """Three groups at a per-group pace (group 2 half as fast: it trains 2 of every 4 steps) and two standby jobs
    started with them: group 2 is killed mid-round, a standby takes its place (and its pace); the other standby waits
    until the federation ends and trains nothing."""
    cluster = Cluster(root / "standby", min_groups=1)
    spec = {**BASE, "num_groups": 3, "start_groups": 3, "max_steps": STANDBY_STEPS, "pace": SPEEDS}
    jobs: dict[str, Any] = {
        "0": cluster.start(0, spec),
        "1": cluster.start(1, spec),
        "dead": cluster.start(2, {**spec, **_fault(("kill", 6))}),
        "a": cluster.start(-1, {**spec, "standby": True}, name="standby_a"),
        "b": cluster.start(-1, {**spec, "standby": True}, name="standby_b"),
    }
    try:
        jobs["dead"].wait(120)
        jobs["died_at"] = time.time()
        for key in ("0", "1", "a", "b"):
            jobs[key].wait(240)
        yield jobs
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def fabric_rejoin(root: Path) -> Iterator[dict[str, Job]]:
    """The same on Fabric, FSDP2, int4 with error feedback, two fragments, a sum overlapped with a step, and Nesterov
    momentum in the outer step (whose state the joining group takes too); the new group is a standby Fabric job,
    started with the others, that takes group 2's place."""
    cluster = Cluster(root / "fabric", min_groups=3)
    spec = {**BASE, "num_groups": 3, "fabric": True, "strategy": "fl_fsdp2", "reduce_dtype": "int4", "fragments": 2,
            "sync_delay": 1, "outer_optimizer": "nesterov"}  # fmt: skip
    jobs = {
        "0": cluster.start(0, spec),
        "1": cluster.start(1, spec),
        "dead": cluster.start(2, {**spec, **_fault(("kill", 6))}),
        "2": cluster.start(-1, {**spec, "standby": True}, name="standby"),
    }
    try:
        jobs["dead"].wait(120)
        for job in jobs.values():
            job.wait(240)
        yield jobs
    finally:
        cluster.close()


def _fault(fault: tuple[str, int] | None, rank: int = 0) -> dict[str, Any]:
    return {} if fault is None else {"fault": {"kind": fault[0], "step": fault[1], "rank": rank}}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- groups that drop out ----------------------------------------------------------------------------------------


def test_survivors_go_on_without_the_groups_that_failed(dropouts):
    survivor = dropouts[0].result()
    assert survivor["error"] is None and survivor["global_step"] == 24
    syncs = {s["step"]: s for s in survivor["syncs"]}
    assert 1 not in syncs[8]["members"]  # killed at step 6: gone by the next sync
    assert syncs[12]["lost"] and 2 in syncs[12]["members"]  # killed inside the sum: nobody applies that sync
    assert syncs[16]["members"] == [0]  # 2 died in the sum at 12, 3 hangs since step 14
    assert not any(s["lost"] for s in survivor["syncs"] if s["step"] != 12)
    # Woken up at step 14 while group 0 passed 20, group 3 took part in group 0's next sync adding nothing, and ended.
    woken = [s for s in survivor["syncs"] if 3 in s["members"] and s["step"] > 16]
    assert len(woken) == 1 and woken[0]["joined"] == [3] and not woken[0]["lost"]
    assert all(s["members"] == [0] for s in survivor["syncs"] if s["step"] > woken[0]["step"])


def test_a_group_that_hung_and_woke_up_behind_the_others_ends_with_a_clear_error(dropouts):
    result = dropouts[3].result()
    assert result["error"].startswith("FederationError: Elastic group 3 fell behind the federation (it is at")
    assert dropouts[3].procs[0].poll() == 3


def test_the_anchors_of_the_survivors_agree_and_equal_the_reference(dropouts):
    records = [dropouts[g].result() for g in (0, 2) if (dropouts[g].out / "rank0.pt").exists()]
    records += [r for r in [_partial(dropouts[1]), _partial(dropouts[3])] if r is not None]
    reference = replay(timeline([r["syncs"] for r in records]), 4, 1, 24, initial_weights())
    survivor = dropouts[0].result()
    for step, consensus in survivor["consensus"].items():
        assert _max_error(consensus, reference[step]) < 1e-6, step
    assert survivor["final"] is not None and _max_error(survivor["final"], reference[24]) < 1e-6


def _partial(job: Job) -> dict[str, Any] | None:
    """A killed job writes nothing: its syncs are known from the survivors' records only."""
    return job.result() if (job.out / "rank0.pt").exists() else None


def _group_1_killed(root: Path, name: str, spec: dict[str, Any], at: int) -> list[dict[str, Any]]:
    """``spec['num_groups']`` single-rank group jobs started together, group 1 killed at step ``at``: the survivors'
    records, once every survivor ended cleanly."""
    groups = spec["num_groups"]
    cluster = Cluster(root / name, min_groups=1)
    spec = {**BASE, "start_groups": groups, **spec}
    survivors = [g for g in range(groups) if g != 1]
    try:
        jobs = {g: cluster.start(g, {**spec, **_fault(("kill", at) if g == 1 else None)}) for g in range(groups)}
        assert [jobs[g].wait(240) for g in survivors] == [[0]] * len(survivors)
    finally:
        cluster.close()
    return [jobs[g].result() for g in survivors]


def test_sampled_participation_draws_among_the_live_groups_and_equals_the_reference(root):
    # One group of the live ones per round (FedAvg's client sampling); group 1 is killed mid-round, so from step 8 on
    # the sample is drawn among groups [0, 2], and its position 1 is group 2.
    survivors = _group_1_killed(root, "sampled", {"num_groups": 3, "sampled": [1, 3]}, at=6)
    syncs = timeline([r["syncs"] for r in survivors])
    assert sorted(syncs[4]["members"]) == [0, 1, 2] and sorted(syncs[8]["members"]) == [0, 2]
    assert not any(s["lost"] or s["joined"] for step, s in syncs.items() if step > 0)
    reference = replay(syncs, 3, 1, 24, initial_weights(), sampled=(1, 3))
    for record in survivors:
        assert record["error"] is None and record["global_step"] == 24
        for step, consensus in record["consensus"].items():
            assert _max_error(consensus, reference[step]) < 1e-6, (record["group"], step)
            assert _equal(consensus, survivors[0]["consensus"][step]), (record["group"], step)
        assert _max_error(record["final"], reference[24]) < 1e-6
    # Some round sampled position 1 among the live [0, 2], i.e. group 2 (not the gone group 1).
    assert any(sampled_positions(1, 3, (step - 1) // 4, 2) == [1] for step in syncs if step >= 8)


def test_eager_updates_lose_the_sum_in_flight_of_a_group_that_died_and_equal_the_reference(root):
    # Group 1 is killed mid-round: the sum that started with it at step 4 was to land at step 8; the survivors' vote
    # there fails, the anchor stays, and the sum they start at step 8 (without group 1) lands at step 12.
    survivors = _group_1_killed(root, "eager", {"num_groups": 3, "eager_updates": True}, at=6)
    landed = timeline([r["syncs"] for r in survivors])
    started = survivors[0]["started"]
    assert all(r["started"] == started for r in survivors)
    assert sorted(started[4]["members"]) == [0, 1, 2] and sorted(started[8]["members"]) == [0, 2]
    assert landed[8]["lost"] and not any(s["lost"] for step, s in landed.items() if step != 8)
    syncs = {step: {**sum_, "lost": landed.get(step, {"lost": False})["lost"]} for step, sum_ in started.items()}
    reference = replay_eager(syncs, 3, 1, 24, initial_weights())
    for record in survivors:
        assert record["error"] is None and record["global_step"] == 24
        assert 8 not in record["consensus"] and 12 in record["consensus"]
        for step, consensus in record["consensus"].items():
            assert _max_error(consensus, reference[step]) < 1e-6, (record["group"], step)
            assert _equal(consensus, survivors[0]["consensus"][step]), (record["group"], step)
        assert _max_error(record["final"], reference[24]) < 1e-6
    assert _equal(survivors[0]["final"], survivors[1]["final"])


def test_a_gossip_mixes_the_live_groups_by_position_and_equals_the_reference(root):
    # Gossip among groups [0, 1, 2] (a pair and one alone each round); group 1 is killed mid-round, so from the mix
    # after step 8 on the two survivors pair up (a uniform round). Between syncs each group holds its own weights.
    survivors = _group_1_killed(root, "gossip", {"num_groups": 3, "gossip": [1, 2]}, at=6)
    syncs = timeline([r["syncs"] for r in survivors])
    assert sorted(syncs[4]["members"]) == [0, 1, 2] and sorted(syncs[8]["members"]) == [0, 2]
    assert not any(s["lost"] or s["joined"] for step, s in syncs.items() if step > 0)
    after, final = replay_gossip(syncs, 3, 24, initial_weights(), Gossip(1, seed=2).weights)
    for record in survivors:
        assert record["error"] is None and record["global_step"] == 24
        for step, consensus in record["consensus"].items():
            if 0 < step < 24:
                assert _max_error(consensus, after[step][record["group"]]) < 1e-6, (record["group"], step)
        assert _max_error(record["final"], final) < 1e-6
    assert not _equal(survivors[0]["consensus"][4], survivors[1]["consensus"][4])  # the groups differ between syncs
    assert _equal(survivors[0]["final"], survivors[1]["final"])


def test_sites_leave_out_a_gone_group_and_equal_the_reference(root):
    # Sites [0, 2] and [1, 3] average every 2 steps, the federation every 4; group 1 is killed mid-round, so from the
    # site sync after step 6 on, site [1, 3] is group 3 alone. The consensus of an elastic federation is the anchor.
    levels, sites = {2: 2, 4: 4}, [[0, 2], [1, 3]]
    spec = {"num_groups": 4, "sync_every": 2, "hierarchical": [list(levels.items()), sites]}
    survivors = _group_1_killed(root, "sites", spec, at=5)
    syncs = timeline([r["syncs"] for r in survivors])
    assert sorted(syncs[2]["members"]) == [0, 1, 2, 3] and sorted(syncs[6]["members"]) == [0, 2, 3]
    assert not any(s["lost"] or s["joined"] for step, s in syncs.items() if step > 0)
    reference = replay_sites(syncs, 4, 24, initial_weights(), levels, sites)
    for record in survivors:
        assert record["error"] is None and record["global_step"] == 24
        for step, consensus in record["consensus"].items():
            outer = max(s for s in reference if s <= step)  # after a site sync: the anchor of the last outer step
            assert _max_error(consensus, reference[outer]) < 1e-6, (record["group"], step)
            assert _equal(consensus, survivors[0]["consensus"][step]), (record["group"], step)
        assert _max_error(record["final"], reference[24]) < 1e-6


# -- a group that joins ------------------------------------------------------------------------------------------


def test_a_new_group_heals_and_is_bit_identical_after_its_first_sync(rejoin):
    first, joiner = rejoin["0"].result(), rejoin["2"].result()
    assert joiner["error"] is None and joiner["joined_at"] == 8  # the others waited for it at their next sync
    join = joiner["syncs"][0]
    assert join["step"] == 8 and join["joined"] == [2] and join["heal_seconds"] > 0
    for step, consensus in joiner["consensus"].items():
        assert _equal(consensus, first["consensus"][step]), step
    assert _equal(joiner["final"], first["final"])


def test_every_group_logs_who_joined_left_and_healed_from_whom_and_no_access_log(rejoin):
    joiner = rejoin["2"].log()
    assert "Elastic federation 'tests' at step 8: group 2 (this job) joined, healed from group " in joiner
    for key in ("0", "1"):
        survivor = rejoin[key].log()
        # The killed job was replaced before the others' next sync: the new job took its place in the same quorum.
        assert "Elastic federation 'tests' at step 8: group 2 joined, healed from group " in survivor, key
        assert "; groups now [0, 1, 2]." in survivor and "GET /checkpoint" not in survivor


def test_a_new_group_continues_at_the_federations_step_learning_rate_and_data(rejoin):
    joiner, first = rejoin["2"].result(), rejoin["0"].result()
    assert sorted(joiner["batches"]) == list(range(8, 24))
    expected = group_batches(2, 3, 1, 24)
    for step, indices in joiner["batches"].items():
        assert indices == expected[step][0], step  # group 2's part of the data, at the federation's step
        assert joiner["lrs"][step] == first["lrs"][step] == pytest.approx(cosine_lr(step, 24), rel=1e-12)


def test_with_a_new_group_the_anchors_equal_the_reference(rejoin):
    records = [rejoin[k].result() for k in ("0", "1", "2")]
    reference = replay(timeline([r["syncs"] for r in records]), 3, 1, 24, initial_weights())
    for record in records:
        for step, consensus in record["consensus"].items():
            assert _max_error(consensus, reference[step]) < 1e-6, (record["group"], step)


# -- standby groups ----------------------------------------------------------------------------------------------


STANDBY_STEPS = 40  # the standby detects the death after the lighthouse's heartbeat timeout (2 s, 8 steps)
SPEEDS = [1.0, 1.0, 0.5]  # the planned groups' pace in the standby scenario


def _standby_that_took_over(standbys: dict[str, Any]) -> dict[str, Any]:
    results = [standbys[k].result() for k in ("a", "b")]
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    took, idle = sorted(results, key=lambda r: r["joined_at"] is None)
    assert took["joined_at"] is not None and idle["joined_at"] is None and idle["global_step"] == 0
    return took


def test_a_standby_takes_a_dead_groups_index_and_data_at_a_sync_and_is_bit_identical_after_it(standbys):
    took, first = _standby_that_took_over(standbys), standbys["0"].result()
    assert took["group"] == 2 and took["global_step"] == STANDBY_STEPS
    join = took["syncs"][0]
    assert join["step"] == took["joined_at"] > 6 and join["step"] % 4 == 0  # a sync after the death
    assert join["joined"] == [2] and join["heal_seconds"] > 0 and took["trained_at"] > standbys["died_at"] - 1
    for step, consensus in took["consensus"].items():
        assert _equal(consensus, first["consensus"][step]), step
    assert _equal(took["final"], first["final"])
    expected = group_batches(2, 3, 1, STANDBY_STEPS)
    # at group 2's pace: the first 2 steps of every round of 4, on the dead group's part of the data
    assert sorted(took["batches"]) == [t for t in range(took["joined_at"], STANDBY_STEPS) if t % 4 < 2]
    for step, indices in took["batches"].items():
        assert indices == expected[step][0], step  # the dead group's part of the data, at the federation's step
        assert took["lrs"][step] == first["lrs"][step]


def test_with_a_standby_and_a_pace_the_anchors_equal_the_reference_weighted_by_the_steps_trained(standbys):
    records = [standbys["0"].result(), standbys["1"].result(), _standby_that_took_over(standbys)]
    syncs = timeline([r["syncs"] for r in records])
    reference = replay(syncs, 3, 1, STANDBY_STEPS, initial_weights(), paced=SPEEDS)
    for record in records:
        for step, consensus in record["consensus"].items():
            assert _max_error(consensus, reference[step]) < 1e-6, (record["group"], step)


def test_the_standby_that_found_no_place_ends_without_training_when_the_federation_ends(standbys):
    logs = [standbys[k].log() for k in ("a", "b")]
    assert sum("taking the place of group 2" in log for log in logs) == 1
    assert any("it trained nothing" in log for log in logs), logs
    assert standbys["a"].wait(1) == [0] and standbys["b"].wait(1) == [0]


def test_fabric_fsdp2_standby_with_compressed_fragments_takes_a_dead_groups_place(fabric_rejoin):
    first, joiner = fabric_rejoin["0"].result(), fabric_rejoin["2"].result()
    assert first["error"] is None and joiner["error"] is None and joiner["group"] == 2
    assert joiner["joined_at"] == 7  # the others began a fragment's sum after step 7 (one step before it lands)
    assert joiner["consensus"] and all(_equal(c, first["consensus"][s]) for s, c in joiner["consensus"].items())
    assert _equal(joiner["final"], first["final"])
    assert all(joiner["lrs"][s] == first["lrs"][s] for s in joiner["lrs"])
    expected = group_batches(2, 3, 1, 24)
    assert all(indices == expected[s][0] for s, indices in joiner["batches"].items())


# -- a group fails as a unit -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_death(root: Path) -> Iterator[dict[int, Job]]:
    """Two FL+HSDP groups of two replicas: rank 1 of group 1 dies at step 6."""
    cluster = Cluster(root / "rank_death", min_groups=1)
    spec = {**BASE, "num_groups": 2, "start_groups": 2, "strategy": "fl_hsdp", "shard_size": 1}
    jobs = {0: cluster.start(0, spec, ranks=2), 1: cluster.start(1, {**spec, **_fault(("kill", 6), rank=1)}, ranks=2)}
    try:
        wait_for(lambda: jobs[1].procs[1].poll() is not None, 120, "rank 1 of group 1 to die")
        died = time.monotonic()
        jobs[1].wait(60)
        jobs[1].took = time.monotonic() - died  # type: ignore[attr-defined]
        jobs[0].wait(240)
        yield jobs
    finally:
        cluster.close()


def test_a_rank_that_dies_takes_its_whole_group_down(rank_death):
    codes = [p.poll() for p in rank_death[1].procs]
    assert codes[1] == -9 and codes[0] not in (None, 0)  # the other rank ended too, with an error
    assert rank_death[1].took < 15  # FSDP's collective fails at once; the group watchdog bounds the rest


def test_the_other_group_goes_on_alone_and_equals_the_reference(rank_death):
    survivor = rank_death[0].result()
    assert survivor["error"] is None and survivor["global_step"] == 24
    assert all(s["members"] == [0] for s in survivor["syncs"] if s["step"] >= 8)
    records = [survivor] + ([rank_death[1].result()] if (rank_death[1].out / "rank0.pt").exists() else [])
    reference = replay(timeline([r["syncs"] for r in records]), 2, 2, 24, initial_weights())
    for step, consensus in survivor["consensus"].items():
        assert _max_error(consensus, reference[step]) < 1e-6, step


# -- who may join ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refused(root: Path) -> Iterator[dict[int, Job]]:
    """A running group, then a job with another model and one of another federation on the same lighthouse."""
    cluster = Cluster(root / "refused", min_groups=1)
    spec = {**BASE, "num_groups": 3, "max_steps": 80}  # long enough for the others to start while it trains
    jobs = {0: cluster.start(0, spec)}
    try:
        wait_for(lambda: jobs[0].progress() >= 4, 120, "group 0 to train")
        jobs[1] = cluster.start(1, {**spec, "hidden": 12})
        jobs[2] = cluster.start(2, {**spec, "federation": "other"})
        for job in jobs.values():
            job.wait(240)
        yield jobs
    finally:
        cluster.close()


def test_a_job_with_another_model_is_refused_naming_both(refused):
    error = refused[1].result()["error"]
    assert error.startswith("FederationError: This job (elastic group 1) was refused")
    assert "'279 values per rank in 1 shard(s) of float32' here, '219 values per rank" in error


def test_a_job_of_another_federation_is_refused_naming_both(refused):
    error = refused[2].result()["error"]
    assert error.startswith("FederationError: This job (elastic group 2) was refused: the lighthouse at")
    assert "serves another federation: 'tests' (groups [0" in error and "belongs to federation 'other'" in error


SECRET = "the-federation-secret-0123"


@pytest.fixture(scope="module")
def strangers(root: Path) -> Iterator[dict[str, Any]]:
    """A group of a federation with a secret, then the same job without the secret and with another one; and the
    group alone, without strangers, for its weights."""
    cluster = Cluster(root / "strangers", min_groups=1)
    spec = {**BASE, "num_groups": 3, "max_steps": 80, "secret": SECRET}
    jobs = {0: cluster.start(0, spec)}
    try:
        wait_for(lambda: jobs[0].progress() >= 4, 120, "group 0 to train")
        jobs[1] = cluster.start(1, {**spec, "secret": None})
        jobs[2] = cluster.start(2, {**spec, "secret": "another-secret-of-16+"})
        jobs[1].wait(240)
        fetched = _fetch_as_a_stranger(jobs[1].log())  # while group 0 still trains and serves heals
        for job in jobs.values():
            job.wait(240)
    finally:
        cluster.close()
    alone = Cluster(root / "alone", min_groups=1)
    try:
        solo = alone.start(0, spec)
        solo.wait(240)
    finally:
        alone.close()
    yield {"jobs": jobs, "solo": solo, "fetched": fetched}


def _fetch_as_a_stranger(log: str) -> int:
    """A plain HTTP fetch of the whole state from the heal server a refused job named in its log: the status."""
    import re
    import urllib.error
    import urllib.request

    netloc = re.search(r"heal server at (\S+) refused this job", log)
    assert netloc is not None, log[-2000:]
    try:
        with urllib.request.urlopen(f"http://{netloc.group(1)}/checkpoint/8/full", timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_jobs_without_the_federations_secret_are_refused_and_the_federation_ends_as_without_them(strangers):
    jobs = strangers["jobs"]
    assert strangers["fetched"] == 403  # a stranger's plain fetch of the state from a group's heal server
    for g in (1, 2):  # the heal server of group 0 refused their fetch (they received nothing), then the admission
        error = jobs[g].result()["error"]
        assert error == (
            f"FederationError: This job (elastic group {g}) was refused: it does not hold the federation's secret (or"
            " holds another one)."
        )
        assert jobs[g].result()["global_step"] == 0
        log = jobs[g].log()
        assert "heal server at" in log and "refused this job: it does not hold the federation's" in log
    running = jobs[0].result()
    assert running["error"] is None and running["global_step"] == 80
    assert all(s["members"] == [0] and not s["lost"] for s in running["syncs"])
    assert jobs[0].log().count("Refused a heal request from") >= 2  # one line per refused request on its side
    assert "refused the job of group 1 that does not prove the federation's secret" in jobs[0].log()
    assert _equal(running["final"], strangers["solo"].result()["final"])  # as if no stranger had come
    assert all(SECRET not in job.log() for job in jobs.values())


def test_a_group_that_starts_after_its_federation_ended_is_refused_instead_of_training_alone(root):
    # Group 0 trains to its end alone; group 1's job reaches the lighthouse only then (a slow start, a late requeue).
    cluster = Cluster(root / "late", min_groups=1)
    spec = {**BASE, "num_groups": 2, "max_steps": 8, "step_sleep": 0.0}
    try:
        first = cluster.start(0, spec)
        assert first.wait(180) == [0]
        late = cluster.start(1, spec)
        assert late.wait(180) == [3]  # not 0 with a model of its own, trained from step 0
        result = late.result()
        assert result["error"].startswith(
            "FederationError: This job (elastic group 1) was refused: federation 'tests' already trained on the"
            f" lighthouse at {cluster.address} (groups [0] had committed"
        )
        assert (
            "this job would silently start a second federation 'tests' from step 0 on fresh weights" in result["error"]
        )
        assert result["syncs"] == [] and result["global_step"] == 0
        assert "Elastic federation 'tests' at step 0: group 0 (this job) joined; groups now [0]." in first.log()
    finally:
        cluster.close()


def test_the_running_group_is_not_disturbed_by_refused_jobs(refused):
    running = refused[0].result()
    assert running["error"] is None and running["global_step"] == 80
    assert all(s["members"] == [0] and not s["lost"] for s in running["syncs"])


# -- the lighthouse ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outage(root: Path) -> Iterator[dict[str, Any]]:
    """Two groups: the lighthouse is down for 2 s, later for good."""
    cluster = Cluster(root / "outage", min_groups=1)
    # A quorum may wait out a failed sync's collectives (`timeout`, 10 s) of a slower group: 20 s is enough.
    spec = {**BASE, "num_groups": 2, "max_steps": 200, "quorum_timeout": 20, "quorum_retries": 3}
    jobs = {0: cluster.start(0, spec), 1: cluster.start(1, spec)}
    try:
        wait_for(lambda: jobs[0].progress() >= 8, 120, "group 0 to train")
        cluster.restart_lighthouse(2.0)
        after_short = max(job.progress() for job in jobs.values())
        # every group, not only the first: a loaded machine may hold one group back for a while
        wait_for(lambda: min(j.progress() for j in jobs.values()) >= after_short + 8, 120, "training after the outage")
        cluster.stop_lighthouse()
        for job in jobs.values():
            job.wait(120)
        yield {"jobs": jobs, "after_short": after_short}
    finally:
        cluster.close()


def test_a_short_lighthouse_outage_is_ridden_out(outage):
    # A restarted lighthouse may answer one group alone first; the groups then rebuild their rings, which can cost
    # the sync in between (at most one), and go on together.
    for job in outage["jobs"].values():
        after = [s for s in job.result()["syncs"] if s["step"] > outage["after_short"]]
        assert len(after) >= 2 and sum(s["lost"] for s in after) <= 1
        assert all(s["members"] == [0, 1] for s in after if not s["lost"])


def test_a_long_lighthouse_outage_ends_every_group_with_a_clear_error(outage):
    for job in outage["jobs"].values():
        result = job.result()
        assert result["error"].startswith(f"FederationError: Elastic group {result['group']} lost the lighthouse at")
        # the job's quorum timeout and retries, not the default 15 minutes (the fixture waits 120 s for the jobs)
        assert "it did not answer within 20 s and 3 retries" in result["error"]
        assert result["global_step"] < 200


def test_a_heal_that_keeps_failing_ends_with_a_clear_error(root):
    # The joining group's every transfer of a peer's state fails (injected into its copy of torchft's transport).
    cluster = Cluster(root / "heal_fails", min_groups=1)
    try:
        running = cluster.start(0, {**BASE, "num_groups": 2, "max_steps": 400})
        wait_for(lambda: running.progress() >= 4, 120, "group 0 to train")
        joiner = cluster.start(1, {**BASE, "num_groups": 2, "max_steps": 400, "fault": {"kind": "fail_heals"}})
        assert joiner.wait(180) == [3]
        error = joiner.result()["error"]
        assert error.startswith("FederationError: Elastic group 1 could not join the federation: 3 attempts in a row")
        running.signal(signal.SIGTERM)  # Lightning ends `fit` at its next step; the job writes what it saw
        running.wait(60)
        syncs = running.result()["syncs"]
        assert len(syncs) > 3 and not any(s["lost"] for s in syncs)  # it went on, undisturbed, while 1 tried
    finally:
        cluster.close()


def test_fewer_groups_than_the_lighthouse_waits_for_is_a_clear_error(root):
    cluster = Cluster(root / "alone", min_groups=2)
    try:
        job = cluster.start(0, {**BASE, "num_groups": 2, "quorum_timeout": 4, "quorum_retries": 0})
        assert job.wait(120) == [3]
        error = job.result()["error"]
        assert "got no quorum within 4 s: fewer groups are running than the lighthouse" in error
    finally:
        cluster.close()


# -- checkpoints -------------------------------------------------------------------------------------------------


def test_a_whole_federation_restarted_from_checkpoints_resumes_exactly(root):
    # FL+HSDP on FSDP2 under the Trainer, int4 with error feedback (its residuals are in the checkpoints too).
    spec = {**BASE, "strategy": "fl_hsdp2", "num_groups": 2, "max_steps": 14, "reduce_dtype": "int4", "ckpt_every": 6,
            "step_sleep": 0.0}  # fmt: skip
    cluster = Cluster(root / "straight", min_groups=2)
    try:
        straight = [cluster.start(g, spec) for g in range(2)]
        assert [job.wait(180) for job in straight] == [[0], [0]]
    finally:
        cluster.close()
    cluster = Cluster(root / "resumed", min_groups=2)
    try:
        resumed = [
            cluster.start(g, {**spec, "resume": str(straight[g].out / "ckpts" / "step=6.ckpt")}) for g in range(2)
        ]
        assert [job.wait(180) for job in resumed] == [[0], [0]]
    finally:
        cluster.close()
    for before, after in zip(straight, resumed):
        assert after.result()["joined_at"] == 6  # mid-round: the groups held different weights when they stopped
        assert _equal(after.result()["final"], before.result()["final"])
