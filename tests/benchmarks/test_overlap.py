"""The targets of sparse traffic, eager updates and FL+HSDP's bytes (benchmarks.reports.overlap), on made-up runs."""

from __future__ import annotations

import math

import pytest

from benchmarks.metrics import spread
from benchmarks.reports import overlap


def _race_run(configuration: str, seed: int, ppl: float, lr: float = 0.006, steps: int = 64) -> dict:
    return {
        "name": f"{configuration}-s{steps}-lr{lr:g}-seed{seed}",
        "identity": {"preset": "race", "configuration": configuration, "repeat": seed, "link_mbit": None, "seed": seed},
        "config": {"max_steps": steps, "lr": lr, "seed": seed},
        "vals": [{"step": steps, "val_ppl": ppl}],
    }


def test_perplexity_is_paired_by_seed_at_the_options_learning_rate():
    race = {"runs": [
        *(_race_run("fl_fsdp", s, p) for s, p in ((0, 100.0), (1, 200.0), (2, 50.0))),
        _race_run("fl_fsdp", 0, 10.0, lr=0.003),  # another learning rate of the tuning: not the options' rate
        *(_race_run("fl_fsdp-sparse", s, p) for s, p in ((0, 110.0), (1, 210.0))),
    ]}  # fmt: skip
    ppl = overlap.race_ppl(race)
    mean, per_seed = overlap.paired(ppl, "fl_fsdp-sparse", "fl_fsdp")
    assert per_seed == pytest.approx([0.1, 0.05]) and mean == pytest.approx(0.075)
    assert math.isnan(overlap.paired(ppl, "fl_fsdp-sparse-eager", "fl_fsdp")[0])


def test_rows_say_not_run_without_results_and_check_the_hsdp_reduction():
    rows = {r["id"]: r for r in overlap.targets(None, {}, None, None)}
    gossip = {"rows": [{"repeat": 0}], "summary": {"ratio": 0.666}}
    assert overlap.gossip_row(gossip)["met"] and not overlap.gossip_row({**gossip, "summary": {"ratio": 0.8}})["met"]
    assert set(rows) == set(overlap.TARGET_IDS) - {"sparse-bytes"}
    assert all(r["measured"] is None and not r["met"] for r in rows.values() if r["id"] != "eager-equal-time")
    hsdp = {
        "devices": 2,
        "rows": [{"repeat": 0}, {"repeat": 1}],
        "summary": {"float32": {"reduction": 1.98, "same_anchor_every_rank": True}, "int4": {"reduction": 1.9}},
    }
    assert overlap.hsdp_row(hsdp)["met"]
    hsdp["summary"]["float32"] |= {"same_anchor_every_rank": False, "max_ulps": 2.0}  # rounding of another order
    assert overlap.hsdp_row(hsdp)["met"]
    hsdp["summary"]["float32"]["max_ulps"] = 1e3
    assert not overlap.hsdp_row(hsdp)["met"]


def test_equal_time_needs_both_a_faster_pace_and_no_worse_perplexity():
    def config(step_time: float) -> dict:
        return {"step_time": spread([step_time])}

    configs = {
        f"{kind}-{link:g}mbit": config(t)
        for link in (5.0, 20.0)
        for kind, t in (("fl_fsdp-int4ef", 1.0), ("fl_fsdp-sparse-eager", 0.8 if link == 5.0 else 1.2))
    }
    ppl = {"fl_fsdp-int4ef": {0: 100.0}, "fl_fsdp-sparse-eager": {0: 99.0}}
    row = overlap.equal_time_row(configs, ppl)
    assert row["links"]["5mbit"]["ahead"] and not row["links"]["20mbit"]["ahead"] and not row["met"]


def test_hidden_sync_targets_are_judged_by_the_pace_not_the_in_run_utilization():
    def config(pace: float, in_run: float) -> dict:
        return {"pace_ratio": spread([pace, pace + 0.02, pace - 0.02]), "effective_utilization": spread([in_run])}

    configs = {
        "fl_fsdp-sparse-eager-5mbit": config(0.73, 0.99),  # the training thread never waits, the run is slower
        "fl_fsdp-sparse-eager-20mbit": config(0.98, 0.90),
    }
    rows = {r["id"]: r for r in overlap.targets(None, configs, None, None)}
    slow, fast = rows["eager-utilization-5mbit"], rows["eager-utilization-20mbit"]
    assert slow["measured"] == pytest.approx(0.73) and not slow["met"]
    assert slow["in_run"]["median"] == pytest.approx(0.99)
    assert fast["measured"] == pytest.approx(0.98) and fast["met"]
    assert fast["spread"]["n"] == 3


def test_the_in_run_utilization_row_is_judged_by_the_pace_of_its_configuration():
    from benchmarks.reports.targets import utilization_rows

    def option(in_run: float, pace: float) -> dict:
        return {
            "kind": "fl_fsdp-int8",
            "link": 50.0,
            "utilization": spread([pace]),
            "inrun_utilization": spread([in_run]),
            "pace_ratio": spread([pace]),
        }

    rows = {r["id"]: r for r in utilization_rows({"fl_fsdp-int8-50mbit": option(in_run=0.99, pace=0.80)})}
    row = rows["utilization-50mbit-in-run"]
    assert row["measured"] == pytest.approx(0.80) and not row["met"]
    assert row["in_run"]["median"] == pytest.approx(0.99)
