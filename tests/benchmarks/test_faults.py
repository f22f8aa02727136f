"""The elastic benchmark's faults (``benchmarks/harness/faults.py``): their spec, the checks before a run, and one short
run of the demo with a kill, a hang inside a sum and a standby."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.harness.faults import FaultyDemo, parse_faults
from lightning_fedshard.examples.elastic import DemoConfig, Fault, summary


def test_every_kind_of_fault_is_parsed_and_a_bad_one_is_refused_naming_the_kinds():
    assert parse_faults("hang:1@8,healkill:2@9,lighthouse:0@4,kill:1@2", groups=3) == [
        Fault("kill", 1, 2), Fault("lighthouse", 0, 4), Fault("hang", 1, 8), Fault("healkill", 2, 9)
    ]  # fmt: skip
    message = (
        "Fault 'crash:1@20' is not KIND:GROUP@STEP with KIND one of ['kill', 'stop', 'restart', 'hang', 'healkill',"
        " 'lighthouse', 'nosecret', 'badsecret', 'fetch']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_faults("crash:1@20", groups=3)


def test_a_hang_in_a_sum_at_a_step_without_a_sync_is_refused_before_anything_starts(tmp_path):
    config = DemoConfig(groups=3, sync_every=4, faults=parse_faults("hang:1@6", groups=3))
    message = "Fault hang:1@6: a group hangs inside the sum of a sync, and step 6"
    with pytest.raises(ValueError, match=re.escape(message)):
        FaultyDemo(config, tmp_path)


def test_the_stranger_faults_need_a_secret():
    config = DemoConfig(groups=2, faults=parse_faults("nosecret:1@4", 2))
    with pytest.raises(ValueError, match="The stranger faults .* need a federation `secret`"):
        FaultyDemo(config, Path("/tmp/unused"))


def test_a_lighthouse_fault_on_a_lighthouse_the_demo_did_not_start_needs_a_way_to_restart_it(tmp_path):
    config = DemoConfig(groups=3, faults=parse_faults("lighthouse:0@8", groups=3))
    with pytest.raises(ValueError, match="The lighthouse fault needs `restart_lighthouse`"):
        FaultyDemo(config, tmp_path, lighthouse="http://localhost:29510")
    FaultyDemo(config, tmp_path, lighthouse="http://localhost:29510", restart_lighthouse=lambda down: None)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_demo_survives_a_kill_and_a_hang_in_a_sum_a_standby_takes_the_killed_groups_place_and_it_reports_them(
    tmp_path, monkeypatch
):
    pytest.importorskip("torchft")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    faults = parse_faults("kill:1@5,hang:2@8", groups=3)
    config = DemoConfig(groups=3, max_steps=24, sync_every=4, faults=faults, standbys=1, step_sleep=0.3)
    result = FaultyDemo(config, tmp_path / "jobs").run(timeout=400)
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
    text = summary(result)
    assert "fault kill:1@5: survivors stalled" in text and "final consensus checksums: all equal" in text
