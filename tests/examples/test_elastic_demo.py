"""The elastic demo (``examples/elastic_shakespeare.py``): its fault spec, its command line and its report."""

from __future__ import annotations

import json
import os
import re
import runpy
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
            "Fault 'crash:1@20' is not KIND:GROUP@STEP with KIND one of ['kill', 'stop', 'restart']",
        ),
        ("kill:1", "Fault 'kill:1' is not KIND:GROUP@STEP"),
        ("kill:3@20", "Fault 'kill:3@20': the group must be in [0, 3) and the step positive"),
        ("kill:1@0", "the step positive"),
    ],
)
def test_a_bad_fault_is_refused_naming_it(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_faults(spec, groups=3)


def test_the_command_line_refuses_a_fault_only_the_benchmarks_inject_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["elastic_shakespeare.py", "--faults", "hang:1@8"])
    message = "Fault 'hang:1@8' is not KIND:GROUP@STEP with KIND one of ['kill', 'stop', 'restart']"
    with pytest.raises(ValueError, match=re.escape(message)):
        runpy.run_path(str(ROOT / "examples" / "elastic_shakespeare.py"), run_name="__main__")
    assert not (tmp_path / "outputs").exists()


def test_a_sync_some_groups_applied_and_others_lost_is_reported_but_a_joiner_may_lose_it_alone():
    from lightning_fedshard.examples.elastic import split_syncs

    def sync(step: int, lost: bool, joined: tuple[int, ...] = ()) -> dict:
        return {"event": "sync", "step": step, "members": [0, 1], "joined": list(joined), "lost": lost}

    events = {(0, "group0.0"): [sync(8, False), sync(16, False, (1,))],
              (1, "group1.0"): [sync(8, True), sync(16, True, (1,))]}  # fmt: skip
    assert split_syncs(events) == [8]  # at 16, group 1 had just joined: its heal failed, it heals at the next


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_command_line_runs_a_federation_that_outlives_a_stopped_group_and_writes_its_report(tmp_path):
    pytest.importorskip("torchft")
    report = tmp_path / "report.json"
    args = ["--groups", "2", "--max-steps", "8", "--sync-every", "4", "--faults", "stop:1@5", "--report", str(report)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_shakespeare.py"), *args],
        capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    groups = {g["group"]: g for g in result["groups"]}
    assert groups[0]["steps"] == 8 and [j["exit_code"] for j in groups[0]["jobs"]] == [0]
    assert [j["exit_code"] for j in groups[1]["jobs"]] == [-9]  # stopped, ended by the demo at the end
    last = result["syncs"][-1]
    assert last["step"] == 8 and last["members"] == [0] and not last["lost"]
    assert list(result["checksums"]) == ["group0.0"]
    assert "fault stop:1@5: survivors stalled" in run.stdout and f"report: {report}" in run.stdout
