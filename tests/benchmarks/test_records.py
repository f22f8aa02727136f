"""Results files of every harness version read in the current form, and the presets that reproduce them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from benchmarks import records
from benchmarks.harness.config import RunConfig
from benchmarks.presets import CONFIGURATIONS, PRESETS, race_job
from lightning_fedshard.core.config import FederationConfig

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FLAT = {
    "strategy": "fl_hsdp",
    "num_nodes": 4,
    "devices": 2,
    "out": "/tmp/x/fl_hsdp-nosync-20mbit-r1",
    "cache_dir": "/tmp/x/data",
    "num_groups": 2,
    "sync_every": 1024,
    "max_steps": 16,
    "lr": 0.003,
    "seed": 0,
    "quant_block_size": None,
}


def _flat_run(name: str = "fl_hsdp-nosync-20mbit-r1", **config: object) -> dict:
    return {"name": name, "config": {**FLAT, **config}, "driver": {"link_mbit": 20.0}}


def test_a_flat_record_gets_the_old_defaults_and_its_identity():
    run = _flat_run()
    records.upgrade_run(run, "throughput")
    federation = run["config"]["federation"]
    assert FederationConfig(**federation) == FederationConfig(
        num_groups=2, sync_every=1024, outer_optimizer="nesterov", reduce_dtype="float32", error_feedback=False
    )
    assert "num_groups" not in run["config"] and "reduce_dtype" not in run["config"]
    assert run["config"]["init_seed"] == 0  # a field newer than the record: RunConfig's default
    assert run["identity"] == {
        "preset": "throughput",
        "configuration": "fl_hsdp-nosync",
        "repeat": 1,
        "link_mbit": 20.0,
        "seed": 0,
        "rtt_ms": 0.0,
    }
    again = copy.deepcopy(run)
    records.upgrade_run(again, "throughput")
    assert again == run  # a current record is left as it is


def test_baselines_ran_one_group_with_fedavg_and_fl_fsdp_one_group_per_node():
    fsdp = _flat_run("fsdp-50mbit-r0", strategy="fsdp", sync_every=8)
    fl_fsdp = _flat_run("fl_fsdp-50mbit-r0", strategy="fl_fsdp", sync_every=8)
    for run in (fsdp, fl_fsdp):
        records.upgrade_run(run, "throughput")
    assert fsdp["config"]["federation"]["num_groups"] == 1
    assert fsdp["config"]["federation"]["outer_optimizer"] == "fedavg"
    assert fl_fsdp["config"]["federation"]["num_groups"] is None


def test_a_race_run_is_identified_by_its_kind_and_seed():
    run = _flat_run("fl_fsdp-int8-s64-lr0.006-seed2", strategy="fl_fsdp", seed=2, reduce_dtype="int8")
    run["kind"] = ["fl_fsdp", 64, "int8"]
    run["driver"]["link_mbit"] = None
    records.upgrade_run(run, "race")
    assert run["identity"] == {
        "preset": "race",
        "configuration": "fl_fsdp-int8",
        "repeat": 2,
        "link_mbit": None,
        "seed": 2,
        "rtt_ms": 0.0,
    }
    assert "kind" not in run


def _effective(federation: dict) -> FederationConfig:
    """The sync options as they act (``error_feedback=None``: on for int8/int4; ``reduce_dtype=None``: the default)."""
    config = FederationConfig(**federation)
    on = config.compressed if config.error_feedback is None else config.error_feedback
    return FederationConfig(**{**federation, "error_feedback": on, "reduce_dtype": config.effective_reduce_dtype})


def _same_run(recorded: dict, planned: RunConfig) -> None:
    new = planned.record()
    training = {k: v for k, v in new.items() if k not in ("out", "cache_dir", "federation")}
    assert {k: recorded["config"][k] for k in training} == training, recorded["name"]
    if planned.federated:  # a baseline's sync options never act (one group runs no outer step)
        assert _effective(recorded["config"]["federation"]) == _effective(new["federation"]), recorded["name"]


@pytest.mark.parametrize("preset", ["throughput", "sync_grid", "defaults"])
def test_the_presets_plan_the_recorded_sweeps(preset: str):
    recorded = records.load(RESULTS / f"{preset}.json")
    jobs = {job.name: job for job in PRESETS[preset].jobs(Path("/tmp/work"))}
    assert sorted(jobs) == sorted(run["name"] for run in recorded["runs"])
    for run in recorded["runs"]:
        job = jobs[run["name"]]
        assert run["identity"] == job.identity.__dict__
        _same_run(run, job.config)


def test_the_race_plan_matches_the_recorded_race():
    recorded = records.load(RESULTS / "race.json")
    assert {run["identity"]["configuration"] for run in recorded["runs"]} <= set(CONFIGURATIONS)
    retired = {name for name, c in CONFIGURATIONS.items() if c.retired is not None}
    assert any(run["identity"]["configuration"] in retired for run in recorded["runs"])  # their runs are kept
    for run in recorded["runs"]:
        if run["identity"]["configuration"] in retired:
            with pytest.raises(ValueError, match="no longer runs"):
                race_job(Path("/tmp/work"), run["identity"]["configuration"], 8, 1e-3, 0)
            continue
        cfg = run["config"]
        job = race_job(Path("/tmp/work"), run["identity"]["configuration"], cfg["max_steps"], cfg["lr"], cfg["seed"])
        assert job.name == run["name"]
        _same_run(run, job.config)


def test_a_run_config_round_trips_through_its_json_record():
    config = CONFIGURATIONS["fl_fsdp-int8-d4"].run_config({"num_nodes": 4, "devices": 2}, out="o", cache_dir="c")
    assert RunConfig.from_record(config.record()) == config
    assert config.strategy_kwargs()["sync_delay"] == 4 and config.strategy_kwargs()["error_feedback"] is False
    baseline = CONFIGURATIONS["hsdp"].run_config({"num_nodes": 4, "devices": 2}, out="o", cache_dir="c")
    assert baseline.strategy_kwargs()["num_groups"] == 1


def _identity_run(name: str, configuration: str, link: float | None, invocation: int | None = None) -> dict:
    identity = {"preset": "p", "configuration": configuration, "repeat": 0, "link_mbit": link, "seed": 0}
    run = {"name": name, "identity": identity, "config": {"federation": {}}}
    if invocation is not None:
        run["invocation"] = invocation
    return run


def test_a_new_invocation_adds_to_the_results_and_reports_judge_each_cell_on_its_latest_runs(tmp_path, monkeypatch):
    import json

    from benchmarks.harness import sweep

    monkeypatch.setattr(sweep, "machine", lambda module: {"command": f"python -m {module}", "commit": "abc"})
    path = tmp_path / "p.json"
    legacy = {"preset": "p", "machine": {"commit": "old"}, "started": 1.0, "runs": [_identity_run("a-r0", "a", 20.0),
              _identity_run("b-r0", "b", 20.0)], "failed": []}  # fmt: skip
    path.write_text(json.dumps(legacy))
    results = sweep.ResultsFile.open(path, "p", "benchmarks.run")
    assert results.invocation == 1 and results.data["invocations"][0]["machine"] == {"commit": "old"}
    results.add_run(_identity_run("a-r0", "a", 20.0))  # cell a measured again: both runs stay
    written = json.loads(path.read_text())
    assert [(r["name"], r["invocation"]) for r in written["runs"]] == [("a-r0", 0), ("b-r0", 0), ("a-r0", 1)]
    assert written["invocations"][1]["machine"]["commit"] == "abc" and written["invocations"][1]["finished"]
    latest = records.load(path)["runs"]
    assert [(r["identity"]["configuration"], r["invocation"]) for r in latest] == [("b", 0), ("a", 1)]
    assert len(records.load(path, runs="all")["runs"]) == 3
    with pytest.raises(ValueError, match="holds the runs of preset 'p', not 'q'"):
        sweep.ResultsFile.open(path, "q", "benchmarks.run")


def test_a_preset_with_latency_names_and_records_each_cells_round_trip(tmp_path):
    from benchmarks.presets import CONFIGURATIONS, Preset

    preset = Preset("lat", "x", 1, 4, 2, {}, ((CONFIGURATIONS["fsdp"], 20.0, 100.0), (CONFIGURATIONS["fsdp"], 20.0)),
                    latency=True)  # fmt: skip
    first, second = preset.jobs(tmp_path)
    assert (first.name, first.identity.rtt_ms) == ("fsdp-20mbit-rtt100ms-r0", 100.0)
    assert (second.name, second.identity.rtt_ms) == ("fsdp-20mbit-rtt0ms-r0", 0.0)
    plain = Preset("plain", "x", 1, 4, 2, {}, ((CONFIGURATIONS["fsdp"], 20.0),)).jobs(tmp_path)[0]
    assert plain.name == "fsdp-20mbit-r0" and plain.identity.rtt_ms == 0.0
