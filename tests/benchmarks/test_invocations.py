"""Every invocation of a study is on record (``benchmarks/harness/invocations.py``), and an elastic benchmark's results
file is never overwritten by a later invocation."""

from __future__ import annotations

import json
import subprocess
import types

import pytest

from benchmarks import elastic
from benchmarks.harness.invocations import record_invocation


def test_each_invocation_appends_one_line_with_its_command_commit_and_planned_runs(tmp_path, monkeypatch):
    done = types.SimpleNamespace(stdout="abc1234\n")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: done)  # no git here: the commit as git prints it
    log = tmp_path / "results" / "invocations.jsonl"
    record_invocation(log, "benchmarks.paper", ["--seeds", "0"], ["a-s0", "b-s0"])
    record_invocation(log, "benchmarks.paper", [], [])
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    assert first["command"] == "python -m benchmarks.paper --seeds 0" and first["runs"] == ["a-s0", "b-s0"]
    assert first["commit"] == "abc1234" and second["command"] == "python -m benchmarks.paper" and first["at"]


def test_the_elastic_benchmark_refuses_a_results_file_that_exists_before_it_records_or_runs_anything(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "elastic.json"
    out.write_text("{}")
    monkeypatch.setattr(elastic, "INVOCATIONS", tmp_path / "invocations.jsonl")
    with pytest.raises(SystemExit):
        elastic.main(["--out", str(out)])
    assert f"--out {out} exists: every invocation is kept" in capsys.readouterr().err
    assert out.read_text() == "{}" and not (tmp_path / "invocations.jsonl").exists()
