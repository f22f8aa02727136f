"""The reports' pure parts: measures, targets and their ids, the generated doc sections (no runs needed)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.metrics import link_label, link_slug, pace_window, spread
from benchmarks.reports import elastic, hetero, latency, recipes, torchft, tuning, walltime
from benchmarks.reports.docs import page_with_section, replace_section
from benchmarks.reports.overlap import TARGET_IDS as OVERLAP_TARGET_IDS
from benchmarks.reports.targets import TARGET_IDS, targets, targets_table
from benchmarks.reports.topologies import TARGET_IDS as TOPOLOGY_TARGET_IDS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def test_spread_ignores_missing_values():
    assert spread([3.0, math.nan, 1.0, None, 2.0, math.inf]) == {
        "median": 2.0,
        "mean": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
    }
    assert spread([])["n"] == 0


def test_link_names():
    assert link_label(None) == link_slug(None) == "unthrottled"
    assert link_label(50.0) == "50 Mbit/s" and link_slug(50.0) == "50mbit"


@pytest.mark.parametrize(
    ("sync_every", "max_steps", "window"), [(8, 16, range(9, 17)), (32, 32, range(1, 33)), (1024, 16, range(9, 17))]
)
def test_the_pace_window_is_whole_rounds_after_the_first_sync(sync_every: int, max_steps: int, window: range):
    run = {"config": {"max_steps": max_steps, "federation": {"sync_every": sync_every}}}
    assert pace_window(run) == window


def _config(kind: str, link: float | None, tokens: float, utilization: float = math.nan, ratio: float = 1.0) -> dict:
    one = spread([tokens])
    return {
        "kind": kind, "link": link, "tokens_per_s": one, "utilization": spread([utilization]),
        "inrun_utilization": spread([utilization - 0.1]), "bytes_ratio": ratio,
        "link_bytes_per_step": spread([1.0]), "calibration_input": False, "prediction_error": -0.1,
    }  # fmt: skip


def _summary() -> dict:
    return {
        "fl_fsdp-50mbit": _config("fl_fsdp", 50.0, 100.0, utilization=0.90),
        "fl_fsdp-int8-50mbit": _config("fl_fsdp-int8", 50.0, 100.0, utilization=0.97, ratio=1.05),
        "fl_fsdp-int4ef-50mbit": _config("fl_fsdp-int4ef", 50.0, 100.0, utilization=0.93),
        "fl_fsdp-20mbit": _config("fl_fsdp", 20.0, 800.0),
        "fl_fsdp-int8-20mbit": _config("fl_fsdp-int8", 20.0, 1000.0),
        "fsdp-20mbit": {**_config("fsdp", 20.0, 100.0), "tokens_per_s_true_reduce_scatter": 125.0},
    }


def test_targets_are_computed_from_the_medians_and_can_fail():
    rows = {r["id"]: r for r in targets(_summary())}
    utilization = rows["utilization-50mbit"]  # judged on the defaults, the best option beside them
    assert utilization["measured"] == pytest.approx(0.93) and not utilization["met"]
    assert utilization["configuration"] == "fl_fsdp-int4ef-50mbit"
    assert utilization["best_configuration"] == "fl_fsdp-int8-50mbit"
    assert utilization["best"]["median"] == pytest.approx(0.97)
    float32 = rows["fl-fsdp-float32-speedup-20mbit"]
    assert float32["measured"] == pytest.approx(8.0) and not float32["met"]  # 8.0 < 8.04
    corrected = rows["fl-fsdp-fastest-speedup-20mbit-true-reduce-scatter"]
    assert corrected["measured"] == pytest.approx(1000 / 125) and not corrected["met"]
    assert rows["race-equal-time"]["measured"] is None and rows["race-equal-time"]["runs"] == 0
    assert rows["link-bytes-model"]["measured"] == pytest.approx(0.05) and not rows["link-bytes-model"]["met"]
    assert rows["planner-calibration"]["measured"] == pytest.approx(0.1) and rows["planner-calibration"]["met"]
    table = targets_table(list(rows.values()))
    assert "| **no** |" in table and "not run" in table and "| `utilization-50mbit` |" in table


def test_the_default_sync_is_compared_with_the_fsdp_of_its_own_sweep():
    defaults = {
        "fsdp-20mbit": {**_config("fsdp", 20.0, 50.0), "tokens_per_s_true_reduce_scatter": 80.0},
        "fl_fsdp-int4ef-20mbit": _config("fl_fsdp-int4ef", 20.0, 600.0),
    }
    rows = {r["id"]: r for r in targets(_summary(), defaults=defaults)}
    assert rows["fl-fsdp-speedup-20mbit"]["measured"] == pytest.approx(12.0) and rows["fl-fsdp-speedup-20mbit"]["met"]
    true_rs = rows["fl-fsdp-speedup-20mbit-true-reduce-scatter"]
    assert true_rs["measured"] == pytest.approx(7.5) and not true_rs["met"]
    assert list(rows) == list(TARGET_IDS)


def test_target_ids_are_unique_kebab_case_and_those_of_targets_json():
    assert len(set(TARGET_IDS)) == len(TARGET_IDS)
    assert all(KEBAB.match(target_id) and len(target_id) <= 60 for target_id in TARGET_IDS)
    recorded = json.loads((RESULTS / "targets.json").read_text())
    every = (*TARGET_IDS, *OVERLAP_TARGET_IDS, *TOPOLOGY_TARGET_IDS, *elastic.TARGET_IDS, *elastic.STANDBY_TARGET_IDS)
    every = (
        *every,
        *elastic.STRANGER_TARGET_IDS,
        *elastic.TWO_LOST_TARGET_IDS,
        *elastic.HANG_TARGET_IDS,
        *elastic.HEAL_SOURCE_TARGET_IDS,
        *elastic.MIXED_TARGET_IDS,
    )
    every = (*every, *torchft.TARGET_IDS)
    every = (*every, *hetero.TARGET_IDS, *latency.TARGET_IDS, *recipes.TARGET_IDS, *tuning.TARGET_IDS)
    every = (*every, walltime.TARGET_ID)
    assert [row["id"] for row in recorded] == list(every) and len(set(every)) == len(every)
    assert all(KEBAB.match(target_id) for target_id in (*OVERLAP_TARGET_IDS, *TOPOLOGY_TARGET_IDS))
    assert all({"id", "target", "measured", "bound", "met", "runs"} <= set(row) for row in recorded)


def test_replace_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- generated:x -->\nold\n<!-- /generated:x -->\nb\n")
    replace_section(page, "x", "new table")
    assert page.read_text() == "a\n<!-- generated:x -->\nnew table\n<!-- /generated:x -->\nb\n"
    with pytest.raises(ValueError, match="no <!-- generated:y -->"):
        replace_section(page, "y", "z")


def test_each_generated_section_is_on_one_benchmark_page(tmp_path):
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    first.write_text("<!-- generated:x -->\n<!-- /generated:x -->\n")
    second.write_text("<!-- generated:y -->\n<!-- /generated:y -->\n<!-- generated:x -->\n<!-- /generated:x -->\n")
    assert page_with_section([first, second], "y") == second
    with pytest.raises(ValueError, match="found it in .*first.md, .*second.md"):
        page_with_section([first, second], "x")
    with pytest.raises(ValueError, match="found it in none of"):
        page_with_section([first, second], "z")
    # The report writes each section of the benchmark pages where it stands (docs/benchmarks.md or a sub-page).
    from benchmarks.report import BENCHMARKS_DOC, BENCHMARKS_PAGES

    pages = [BENCHMARKS_DOC, *sorted(BENCHMARKS_PAGES.glob("*.md"))]
    names = re.findall(r"<!-- generated:(\w+) -->", "".join(page.read_text() for page in pages))
    assert "targets" in names and "race" in names
    assert {name: page_with_section(pages, name).name for name in names}["targets"] == "benchmarks.md"


def test_the_harness_sends_barriers_and_lightnings_broadcast_across_nodes():
    from benchmarks.reports.instrumentation import barrier_bytes, harness_bytes, sigterm_broadcast_bytes

    message = 3 * 48 + 4 * 66  # an empty gloo message: three headers, four frames (framed_bytes)
    # 8 ranks, 2 per node: the dissemination barrier's 24 messages, 20 between nodes; the broadcast tree's 7, 6
    assert barrier_bytes(8, 2, 1500) == 20 * message
    assert sigterm_broadcast_bytes(8, 2, 1500) == 6 * (8 + message)
    assert harness_bytes(8, 2, steps=16, sync_windows=2, mtu=1500) == (5 + 3 * 2) * 20 * message + 16 * 6 * (
        8 + message
    )
    assert harness_bytes(1, 1, steps=16, sync_windows=0, mtu=1500) == 0
    # The federated strategies broadcast the flag inside each group: two groups of two nodes, over the replicas
    # (one message between the nodes per shard position) and then inside a node (none)
    replicas, shards = [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sigterm_broadcast_bytes(8, 2, 1500, replicas + shards) == 4 * (8 + message)
    # one group per node: nothing reaches a link
    assert sigterm_broadcast_bytes(8, 2, 1500, [[0, 1], [2, 3], [4, 5], [6, 7]]) == 0


def _run(configuration: str, link: float | None) -> dict:
    from benchmarks.harness.config import RunIdentity
    from benchmarks.presets import CONFIGURATIONS, TRAINING_4X2

    cfg = CONFIGURATIONS[configuration].run_config(TRAINING_4X2, num_nodes=4, devices=2, out="o", cache_dir="c")
    identity = RunIdentity("test", configuration, 0, link, 0)
    return {"config": cfg.record(), "identity": identity.__dict__}


def test_a_runs_byte_model_is_its_training_windows_collectives_and_the_harness():
    from benchmarks.reports.sweep import byte_model, emulated, landings_in_training, setup_of
    from lightning_fedshard.plan import MODELS, predict

    nosync, every8, fragments = _run("fl_fsdp-nosync", None), _run("fl_fsdp", 50.0), _run("fl_fsdp-int4ef-f4-d1", 50.0)
    assert [landings_in_training(r) for r in (nosync, every8, fragments)] == [0, 2, 8]
    # FL+FSDP's groups are whole nodes: without a sync in its 16 steps only the harness crosses the links
    model, harness = byte_model(nosync)
    assert model == harness > 0
    # with syncs, the planner's bytes per step (it amortizes the syncs over sync_every) plus the harness
    model, harness = byte_model(every8)
    planned = predict(MODELS["xs"], emulated(50.0), setup_of(every8)).link_bytes_per_step
    assert model == pytest.approx(planned + harness) and harness > byte_model(nosync)[1]  # 6 more barriers
    assert byte_model(fragments)[1] > harness  # a sync window per fragment: 8 of them


def test_the_byte_target_names_its_worst_configuration_and_the_worst_with_training_traffic():
    from benchmarks.reports.targets import bytes_row

    harness_only = {**_config("fl_fsdp-nosync", None, 1.0, ratio=1.04), "model_bytes_per_step": 5.0}
    harness_only["harness_bytes_per_step"] = 5.0
    int4 = {**_config("fl_fsdp-int4ef", 50.0, 1.0, ratio=0.99), "model_bytes_per_step": 600.0}
    int4["harness_bytes_per_step"] = 17.0
    row = bytes_row({"fl_fsdp-nosync-unthrottled": harness_only, "fl_fsdp-int4ef-50mbit": int4})
    assert row["measured"] == pytest.approx(0.04) and not row["met"] and row["worst"] == "fl_fsdp-nosync-unthrottled"
    assert (row["configurations"], row["within"]) == (2, 1)
    assert row["worst_with_training_traffic"] == "fl_fsdp-int4ef-50mbit"
    assert row["worst_with_training_traffic_error"] == pytest.approx(0.01)


def _elastic_run(members: list[list[int]], exit_codes: list[int], tokens_per_s: float, alive: float) -> dict:
    return {
        "config": {"groups": 2, "ranks_per_group": 2, "heartbeat": 2.0, "join": 60.0},
        "syncs": [
            {"members": m, "joined": [], "lost": False, "steps": 8, "t": float(i)} for i, m in enumerate(members)
        ],
        "groups": [
            {"group": g, "jobs": [{"exit_code": c, "start_up_seconds": 40.0 + g}]} for g, c in enumerate(exit_codes)
        ],
        "faults": [{"kind": "kill", "stall_seconds": 1.0}],
        "committed_tokens_per_s": tokens_per_s,
        "committed_tokens": 90,
        "trained_tokens": 100,
        "alive_fraction": alive,
    }


def test_elastic_goodput_leaves_out_a_repeat_whose_fault_free_run_lost_a_group():
    clean = _elastic_run([[0, 1], [0, 1]], [0, 0], 1000.0, 1.0)
    lost = _elastic_run([[0, 1], [0]], [0, 1], 800.0, 1.0)  # a group dropped although nothing was injected
    faulted = _elastic_run([[0, 1], [0]], [0, -9], 450.0, 0.5)
    results = {
        "faults": "kill:1@4",
        "runs": [
            {"kind": "faultfree", "repeat": 0, "result": clean},
            {"kind": "faulted", "repeat": 0, "result": faulted},
            {"kind": "faultfree", "repeat": 1, "result": lost},
            {"kind": "faulted", "repeat": 1, "result": faulted},
        ],
    }
    assert elastic.disturbed_repeats(results) == [1]
    assert elastic.goodputs(results) == [450.0 / (1000.0 * 0.5)]
    assert elastic.committed_shares(results) == [0.9, 0.9]
    row = next(r for r in elastic.targets(results) if r["id"] == "elastic-goodput")
    assert row["measured"] == 0.9 and not row["met"] and row["repeats_without_a_fault_free_baseline"] == [1]


def test_with_standbys_the_goodput_counts_the_standby_runs_and_a_takeover_counts_only_a_waiting_standby():
    clean = _elastic_run([[0, 1], [0, 1], [0, 1]], [0, 0], 1000.0, 1.0)  # syncs 1 s apart: one round is 1 s
    standby = _elastic_run([[0, 1], [0, 1]], [0, 0], 900.0, 0.9)
    standby["groups"][1]["jobs"] += [
        {"exit_code": 0, "standby": True, "takeover_seconds": 2.5, "ready_at_fault": True},
        {"exit_code": 0, "standby": True, "takeover_seconds": 40.0, "ready_at_fault": False},  # no spare was waiting
    ]
    standby["faults"] = [{"kind": "stop", "stall_seconds": 2.5}, {"kind": "stop", "stall_seconds": 4.5}]
    runs = {"standbys": 2, "runs": [{"kind": "faultfree", "repeat": 0, "result": clean},
                                    {"kind": "standby", "repeat": 0, "result": standby}]}  # fmt: skip
    old = {"faults": "kill:1@4", "runs": [{"kind": "faultfree", "repeat": 0, "result": clean},
                                          {"kind": "faulted", "repeat": 0, "result": standby}]}  # fmt: skip
    rows = {r["id"]: r for r in elastic.targets(old, runs)}
    assert (
        rows["elastic-goodput"]["measured"] == pytest.approx(900.0 / (1000.0 * 0.9)) and rows["elastic-goodput"]["met"]
    )
    assert rows["elastic-goodput"]["without_standbys"]["measured"] == pytest.approx(1.0)
    join = rows["standby-join-s"]
    assert (join["measured"], join["bound"], join["met"]) == (2.5, 3.0, True)
    assert join["no_standby_ready"]["takeovers"] == 1
    stall = rows["straggler-stall-s"]
    assert (stall["measured"], stall["bound"], stall["met"]) == (3.5, 3.0, False)
    assert "2.5, 40.0*" in elastic.standby_table(runs)
    assert [r["id"] for r in elastic.targets(old)][-2:] == list(elastic.STANDBY_TARGET_IDS)  # not run: said so


def _stranger_run(refusals: tuple[bool, bool, bool], checksum: str) -> dict:
    fetch, nosecret, badsecret = refusals
    refused = "FederationError: This job (elastic group 1) was refused: it does not hold the federation's secret (or"
    strangers = [
        {"kind": kind, "group": 1, "exit_code": 1 if ok else -9, "refused": refused if ok else None, "trained_steps": 0}
        for kind, ok in (("nosecret", nosecret), ("badsecret", badsecret))
    ]
    return {"faults": [{"kind": "fetch", "status": 403 if fetch else 200}], "strangers": strangers,
            "checksums": {"group0.0": checksum}, "syncs": []}  # fmt: skip


def test_the_stranger_target_counts_every_refusal_and_compares_the_weights():
    free = {"checksums": {"group0.0": "abc"}, "faults": [], "syncs": []}
    runs = [{"kind": "faultfree", "repeat": 0, "result": free},
            {"kind": "strangers", "repeat": 0, "result": _stranger_run((True, True, True), "abc")}]  # fmt: skip
    (row,) = elastic.stranger_targets({"runs": runs})
    assert row["measured"] == 1.0 and row["met"] and row["runs"] == 1
    runs[1]["result"] = _stranger_run((True, True, False), "abc")  # a stranger that was never refused
    (row,) = elastic.stranger_targets({"runs": runs})
    assert row["measured"] == 2 / 3 and not row["met"]
    runs[1]["result"] = _stranger_run((True, True, True), "xyz")  # every refusal, but the weights moved
    assert not elastic.stranger_targets({"runs": runs})[0]["met"]
    assert elastic.stranger_targets(None)[0]["note"].startswith("not run")


def test_the_two_groups_lost_target_bounds_the_stall_and_needs_both_places_taken():
    config = {"heartbeat": 2.0, "join": 60.0}
    standby = {"standby": True, "trained_at": 1.0}
    run = {"config": config, "faults": [{"stall_seconds": 3.0}, {"stall_seconds": 5.0}], "syncs": [],
           "groups": [{"jobs": [standby]}, {"jobs": [standby]}]}  # fmt: skip
    (row,) = elastic.two_lost_targets({"runs": [{"kind": "twolost", "repeat": 0, "result": run}]})
    assert row["measured"] == 5.0 and row["bound"] == 62.0 and row["met"]
    run["groups"] = [{"jobs": [standby]}]  # one place left empty
    assert not elastic.two_lost_targets({"runs": [{"kind": "twolost", "repeat": 0, "result": run}]})[0]["met"]


def test_the_hang_target_bounds_the_largest_stall_by_the_heartbeat_and_needs_every_hang_to_happen():
    def run(stalls: list[float], hung: bool = True) -> dict:
        faults = [{"kind": "hang", "stall_seconds": s, "hung": hung} for s in stalls]
        return {"config": {"heartbeat": 2.0}, "faults": faults + [{"kind": "restart", "stall_seconds": 9.0}],
                "syncs": [{"lost": True}], "checksums": {"a": "x", "b": "x"}}  # fmt: skip

    results = {"runs": [{"kind": "hanginsum", "repeat": 0, "result": run([2.5, 3.9])},
                        {"kind": "hanginsum_wait", "repeat": 0, "result": run([15.2, 15.9])}]}  # fmt: skip
    (row,) = elastic.hang_targets(results)
    assert (row["measured"], row["bound"], row["met"], row["hangs"]) == (3.9, 4.0, True, 2)
    assert row["waiting_for_the_timeout"]["median"] == pytest.approx(15.55) and row["consensus"] == [True]
    results["runs"][0]["result"] = run([2.5, 4.1])  # one stall past the bound
    assert not elastic.hang_targets(results)[0]["met"]
    results["runs"][0]["result"] = run([2.5], hung=False)  # the group never hung inside the sum: nothing measured
    assert not elastic.hang_targets(results)[0]["met"]
    assert elastic.hang_targets(None)[0]["note"].startswith("not run")


def test_the_heal_source_target_compares_joiners_in_the_same_runs_and_needs_every_source_killed():
    def run(cut: float, plain: float, source: int | None = 0) -> dict:
        faults = [{"kind": "healkill", "joined_seconds": cut, "source": source, "stall_seconds": 1.0},
                  {"kind": "restart", "joined_seconds": plain, "stall_seconds": 0.0}]  # fmt: skip
        syncs = [{"t": t, "lost": False} for t in (0.0, 10.0, 20.0, 30.0)]
        return {"config": {"heartbeat": 2.0}, "faults": faults, "syncs": syncs, "checksums": {"a": "x", "b": "x"}}

    results = {"runs": [{"kind": "healsource", "repeat": 0, "result": run(30.0, 21.0)}]}
    (row,) = elastic.heal_source_targets(results)
    assert (row["measured"], row["bound"], row["met"]) == (9.0, 12.0, True)
    results["runs"][0]["result"] = run(40.0, 21.0)  # past a retry at the next quorum
    assert not elastic.heal_source_targets(results)[0]["met"]
    results["runs"][0]["result"] = run(30.0, 21.0, source=None)  # the heal was never cut: nothing measured
    assert not elastic.heal_source_targets(results)[0]["met"]
    assert elastic.heal_source_targets(None)[0]["note"].startswith("not run")


def test_the_mixed_faults_target_needs_the_goodput_one_consensus_and_no_split_sync():
    def run(tokens_per_s: float, split: list[int] | None = None, checksums: tuple[str, ...] = ("x", "x")) -> dict:
        groups = [{"jobs": [{"exit_code": 0}]} for _ in range(2)]
        return {"config": {"groups": 2}, "committed_tokens_per_s": tokens_per_s, "alive_fraction": 0.9,
                "faults": [{"kind": "kill"}] * 12, "checksums": dict(enumerate(checksums)), "groups": groups,
                "syncs": [{"members": [0, 1], "lost": False}], "split_syncs": split or [],
                "committed_tokens": 90, "trained_tokens": 100}  # fmt: skip

    def results(mixed: dict) -> dict:
        return {"runs": [{"kind": "faultfree", "repeat": 0, "result": run(1000.0)},
                         {"kind": "mixed", "repeat": 0, "result": mixed}]}  # fmt: skip

    (row,) = elastic.mixed_targets(results(run(873.0)))
    assert row["measured"] == pytest.approx(873.0 / 900.0) and row["met"]
    assert not elastic.mixed_targets(results(run(850.0)))[0]["met"]  # 0.944
    assert not elastic.mixed_targets(results(run(873.0, split=[24])))[0]["met"]  # some groups applied sync 24
    assert not elastic.mixed_targets(results(run(873.0, checksums=("x", "y"))))[0]["met"]
    assert elastic.mixed_targets(None)[0]["note"].startswith("not run")
    unhung = run(873.0)
    unhung["faults"] = [{"kind": "kill"}] * 11 + [{"kind": "hang", "hung": False}]  # 11 applied
    assert not elastic.mixed_targets(results(unhung))[0]["met"]


def test_the_planner_factors_come_from_the_studys_own_setting_only():
    """The paper's-regime federations share fedavg's and the defaults' options, at another batch per group: their
    factors must not stand for the study's setting."""
    from benchmarks.recipes import load_results

    factors = recipes.planner_factors(load_results())
    assert factors[(8, 1, "float32", 0, None, "fedavg")][1] in ("fedavg_f32", "fedavg_f32_x3")
    assert factors[(8, 1, "int4", 0, None, "fedavg")][1] in ("int4ef", "int4ef_x3")
    assert factors[("fsdp",)][0] == 1.0  # the target is FSDP's own final loss
    assert not any(recipe.startswith(("paper_", "fsdp_b")) for _, recipe, _, _ in factors.values())
