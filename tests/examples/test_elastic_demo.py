"""The elastic demo (``examples/elastic_shakespeare.py``): its fault spec, and one short run with a kill and a hang."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fedshard.examples.elastic import Fault, parse_faults

ROOT = Path(__file__).parents[2]


def test_faults_are_parsed_in_the_order_of_their_steps():
    assert parse_faults("restart:1@30, kill:1@20,stop:2@50", groups=3) == [
        Fault("kill", 1, 20), Fault("restart", 1, 30), Fault("stop", 2, 50)
    ]  # fmt: skip
    assert parse_faults("", groups=2) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "crash:1@20",
            "Fault 'crash:1@20' is not KIND:GROUP@STEP with KIND one of ['kill', 'stop', 'hang', 'restart',"
            " 'healkill', 'lighthouse', 'nosecret', 'badsecret', 'fetch']",
        ),
        ("kill:1", "Fault 'kill:1' is not KIND:GROUP@STEP"),
        ("kill:3@20", "Fault 'kill:3@20': the group must be in [0, 3) and the step positive"),
        ("kill:1@0", "the step positive"),
    ],
)
def test_a_bad_fault_is_refused_naming_it(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_faults(spec, groups=3)


def test_a_hang_in_a_sum_at_a_step_without_a_sync_is_refused_before_anything_starts(tmp_path):
    from lightning_fedshard.examples.elastic import DemoConfig, ElasticDemo

    config = DemoConfig(groups=3, sync_every=4, faults=parse_faults("hang:1@6", groups=3))
    message = "Fault hang:1@6: a group hangs inside the sum of a sync, and step 6"
    with pytest.raises(ValueError, match=re.escape(message)):
        ElasticDemo(config, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_demo_survives_a_kill_and_a_hang_in_a_sum_a_standby_takes_the_killed_groups_place_and_it_reports_them(
    tmp_path,
):
    pytest.importorskip("torchft")
    report = tmp_path / "report.json"
    args = ["--groups", "3", "--max-steps", "24", "--sync-every", "4", "--faults", "kill:1@5,hang:2@8",
            "--standbys", "1", "--step-sleep", "0.3", "--report", str(report)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_shakespeare.py"), *args],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    groups = {g["group"]: g for g in result["groups"]}
    assert groups[0]["steps"] == 24 and groups[0]["jobs"][0]["exit_code"] == 0
    killed, standby = groups[1]["jobs"]
    assert killed["exit_code"] == -9 and not killed.get("standby")
    # the standby took group 1's place at a sync after the kill, trained to the end and counts as alive from then on
    assert standby["standby"] and standby["exit_code"] == 0 and 0 < standby["steps_trained"] < 24
    assert standby["takeover_seconds"] > 0 and standby["join_seconds"] > 0
    assert [j["exit_code"] for j in groups[2]["jobs"]] == [-9]  # hung, ended by the demo at the end
    assert [f["kind"] for f in result["faults"]] == ["kill", "hang"]
    assert all(f["stall_seconds"] is not None for f in result["faults"])
    hang = result["faults"][1]
    # Group 2 stopped inside the sum of its sync at step 8: the survivors gave the sum up once the lighthouse counted
    # it gone (its heartbeat timeout, 2 s), long before the elastic timeout (15 s); nobody applied that sync.
    assert hang["hung"] and hang["stall_seconds"] < 8.0
    assert next(s for s in result["syncs"] if s["step"] == 8)["lost"]
    last = result["syncs"][-1]
    assert last["step"] == 24 and last["members"] == [0, 1] and not last["lost"]
    assert sorted(result["checksums"]) == ["group0.0", "standby.0"] and result["committed_tokens"] > 0
    # the rounds in flight of the killed and the hung group were never committed
    assert groups[0]["jobs"][0]["steps_trained"] == 24
    assert 0 < result["committed_tokens"] <= result["trained_tokens"]
    assert all(g["jobs"][0]["start_up_seconds"] > 0 for g in groups.values())
    # every group but the one the others took the first weights from healed when it joined
    assert sum(g["jobs"][0]["join_seconds"] is not None for g in groups.values()) == 2
    assert "fault kill:1@5: survivors stalled" in run.stdout and "final consensus checksums: all equal" in run.stdout


def test_the_stranger_faults_need_a_secret():
    from lightning_fedshard.examples.elastic import DemoConfig, ElasticDemo, parse_faults

    config = DemoConfig(groups=2, faults=parse_faults("nosecret:1@4", 2))
    with pytest.raises(ValueError, match="The stranger faults .* need a federation `secret`"):
        ElasticDemo(config, Path("/tmp/unused"))


def test_a_sync_some_groups_applied_and_others_lost_is_reported_but_a_joiner_may_lose_it_alone():
    from lightning_fedshard.examples.elastic import split_syncs

    def sync(step: int, lost: bool, joined: tuple[int, ...] = ()) -> dict:
        return {"event": "sync", "step": step, "members": [0, 1], "joined": list(joined), "lost": lost}

    events = {(0, "group0.0"): [sync(8, False), sync(16, False, (1,))],
              (1, "group1.0"): [sync(8, True), sync(16, True, (1,))]}  # fmt: skip
    assert split_syncs(events) == [8]  # at 16, group 1 had just joined: its heal failed, it heals at the next


def test_a_lighthouse_fault_on_a_lighthouse_the_demo_did_not_start_needs_a_way_to_restart_it(tmp_path):
    from lightning_fedshard.examples.elastic import DemoConfig, ElasticDemo

    config = DemoConfig(groups=3, faults=parse_faults("lighthouse:0@8", groups=3))
    with pytest.raises(ValueError, match="The lighthouse fault needs `restart_lighthouse`"):
        ElasticDemo(config, tmp_path, lighthouse="http://localhost:29510")
    ElasticDemo(config, tmp_path, lighthouse="http://localhost:29510", restart_lighthouse=lambda down: None)


def test_a_sync_after_a_lost_one_commits_the_carried_rounds_of_its_contributors():
    from lightning_fedshard.examples.elastic import _timeline, committed_group_steps

    def sync(step: int, members: list[int], joined: list[int], lost: bool) -> dict:
        return {"event": "sync", "step": step, "members": members, "joined": joined, "lost": lost, "t": float(step)}

    timeline = [sync(0, [0, 1], [0, 1], False), sync(8, [0, 1], [], False), sync(16, [0, 1, 2], [2], True),
                sync(24, [0, 2], [], False)]  # fmt: skip
    events = {(0, "group0.0"): timeline}
    syncs = {s["step"]: s for s in _timeline(events)}
    assert [committed_group_steps(syncs[s]) for s in (0, 8, 16, 24)] == [0, 16, 0, 16 + 8]
    # group 0 carried steps 9-24 over the lost sync; group 2 joined at 16 and trained 17-24
    assert committed_group_steps({"members": [0, 1], "joined": [], "lost": False, "steps": 8}) == 16  # older reports
