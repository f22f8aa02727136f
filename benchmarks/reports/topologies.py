"""Outer topologies on the two-site cluster: their targets, their table and the planner's error on each.

Input: the ``sites`` sweep (``python -m benchmarks.run --preset sites``): 2 sites x 2 nodes x 2 ranks, 1 Gbit/s
between the nodes of a site and 20 Mbit/s between the sites, 4 one-node groups (sites {0, 1} and {2, 3}), float32
and plain averaging everywhere, 32 steps; repeat ``r`` trains with seed ``r``.

- **pace**: tokens/s over steps 17-32, the same window for every configuration (one federation meeting of
  ``Hierarchical({4: 2, 16: 4})`` and of flat ``sync_every=16``, four syncs of ``sync_every=4``); median over repeats.
- **perplexity paired by seed**: per seed ``ppl(option) / ppl(reference) - 1`` after 32 steps, then the mean.
- **at equal wall time**: ``A`` is ahead of ``B`` when it is at least as fast and its perplexity after the same steps
  is at least as low (the rule of the other sweeps).
- **planner**: ``fedshard plan``'s step time on ``emulated-2x2x2`` with the no-sync run's step time as compute,
  against the measured one: ``predicted / measured - 1``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from benchmarks import metrics
from benchmarks.harness.config import RunConfig
from benchmarks.reports.instrumentation import barrier_bytes
from benchmarks.reports.overlap import WINDOW_BARRIERS
from lightning_fedshard.plan.predict import predict
from lightning_fedshard.plan.specs import CLUSTERS, MODELS, TrainSetup

FLAT_H, FLAT_4H = "fl_fsdp-H4", "fl_fsdp-H16"
SITES, GOSSIP, NOSYNC = "fl_fsdp-sites-4-16", "fl_fsdp-gossip-H4", "fl_fsdp-nosync"
CONFIGURATIONS = (FLAT_H, FLAT_4H, SITES, GOSSIP)
WINDOW = range(17, 33)
SPEED_BOUND, PPL_BOUND = 0.9, 0.02
TARGET_IDS = ("hierarchical-speed", "hierarchical-ppl", "hierarchical-equal-time", "gossip-ppl", "topology-level-bytes")
LEVEL_BYTES_BOUND = 0.03

Row = dict[str, Any]


def window_tokens_per_second(run: dict[str, Any]) -> float:
    """Tokens of all ranks per second over :data:`WINDOW`."""
    clocks = {s["step"]: s["clock"] for s in run["steps"]}
    seconds = clocks[WINDOW.stop - 1] - clocks[WINDOW.start - 1]
    return float(run["tokens_per_step"]) * len(WINDOW) / seconds


def by_configuration(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The sweep's runs by configuration, in repeat order."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(results["runs"], key=lambda r: r["identity"]["repeat"]):
        runs.setdefault(run["identity"]["configuration"], []).append(run)
    return runs


def paired_gap(runs: dict[str, list[dict[str, Any]]], option: str, reference: str) -> tuple[float, list[float]]:
    """Mean over seeds of ``ppl(option) / ppl(reference) - 1``, and the per-seed gaps."""
    ref = {r["identity"]["seed"]: metrics.final_ppl(r) for r in runs.get(reference, [])}
    gaps = [
        metrics.final_ppl(r) / ref[r["identity"]["seed"]] - 1
        for r in runs.get(option, [])
        if r["identity"]["seed"] in ref
    ]
    return (statistics.mean(gaps) if gaps else math.nan), gaps


def predicted_step_seconds(run: dict[str, Any], compute_seconds: float) -> float:
    """The planner's step time of ``run``'s configuration on the two-site cluster."""
    config = RunConfig.from_record(run["config"])
    cluster = replace(CLUSTERS["emulated-2x2x2"], step_seconds=compute_seconds)
    setup = TrainSetup(strategy="fl_fsdp", federation=config.federation, micro_batch=config.batch_size,
                       param_bytes=4, grad_bytes=4)  # fmt: skip
    return predict(replace(MODELS[config.size], seq_len=config.seq_len), cluster, setup).step_seconds


def level_bytes(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind of sync: the median link bytes of its landings (the windows' barriers taken out) and the planner's."""
    config = RunConfig.from_record(run["config"])
    setup = TrainSetup(strategy="fl_fsdp", federation=config.federation, micro_batch=config.batch_size,
                       param_bytes=4, grad_bytes=4)  # fmt: skip
    prediction = predict(replace(MODELS[config.size], seq_len=config.seq_len), CLUSTERS["emulated-2x2x2"], setup)
    mtu = CLUSTERS["emulated-2x2x2"].tcp_mtu
    assert mtu is not None
    barriers = WINDOW_BARRIERS * barrier_bytes(run["world_size"], run["config"]["devices"], mtu)
    hierarchical = config.federation.hierarchical
    found: dict[str, list[float]] = {}
    for sync in run["syncs"]:
        if sync["step"] >= config.max_steps:
            continue
        size = hierarchical.block_size(sync["step"]) if hierarchical is not None else None
        level = 0 if size is None or size < prediction.topology.num_groups else len(prediction.sync_levels) - 1
        found.setdefault(prediction.sync_levels[level].name, []).append(sync["tx_bytes"] - barriers)
    out = {}
    for sync_level in prediction.sync_levels:
        if sync_level.name in found:
            measured = statistics.median(found[sync_level.name])
            out[sync_level.name] = {
                "measured": measured,
                "predicted": sync_level.link_bytes,
                "error": measured / sync_level.link_bytes - 1,
            }
    return out


def analyze(results: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: pace, perplexity, the planner's step time and error."""
    runs = by_configuration(results)
    nosync = [window_tokens_per_second(r) for r in runs.get(NOSYNC, [])]
    compute = None
    if nosync and runs.get(NOSYNC):
        compute = float(runs[NOSYNC][0]["tokens_per_step"]) / statistics.median(nosync)
    table: dict[str, Any] = {}
    for name in CONFIGURATIONS:
        found = runs.get(name, [])
        if not found:
            continue
        paces = [window_tokens_per_second(r) for r in found]
        measured_step = float(found[0]["tokens_per_step"]) / statistics.median(paces)
        entry: dict[str, Any] = {
            "tokens_per_second": metrics.spread(paces),
            "ppl": metrics.spread(metrics.final_ppl(r) for r in found),
            "link_bytes_per_step": metrics.spread(metrics.link_bytes_per_step(r) for r in found),
            "runs": len(found),
        }
        entry["level_bytes"] = level_bytes(found[0])
        if compute is not None:
            predicted = predicted_step_seconds(found[0], compute)
            entry["planner"] = {"predicted_step_seconds": predicted, "measured_step_seconds": measured_step,
                                "error": predicted / measured_step - 1}  # fmt: skip
        table[name] = entry
    return {"configs": table, "runs": runs}


def targets(results: dict[str, Any] | None) -> list[Row]:
    """The rows ``hierarchical-speed``, ``hierarchical-ppl``, ``hierarchical-equal-time`` and ``gossip-ppl``."""
    if results is None:
        return [_row(i, t, math.nan, b, False, 0) for i, t, b in (
            ("hierarchical-speed", SPEED_TEXT, SPEED_BOUND), ("hierarchical-ppl", PPL_TEXT, PPL_BOUND),
            ("hierarchical-equal-time", EQUAL_TEXT, 2.0), ("gossip-ppl", GOSSIP_TEXT, PPL_BOUND),
            ("topology-level-bytes", LEVEL_TEXT, LEVEL_BYTES_BOUND))]  # fmt: skip
    analysis = analyze(results)
    configs, runs = analysis["configs"], analysis["runs"]
    tps = {name: c["tokens_per_second"]["median"] for name, c in configs.items()}
    planner = {name: c.get("planner", {}).get("error") for name, c in configs.items()}
    speed = tps[SITES] / tps[FLAT_4H]
    rows = [_row("hierarchical-speed", SPEED_TEXT, speed, SPEED_BOUND, speed >= SPEED_BOUND, 2 * configs[SITES]["runs"],
                 planner_error={SITES: planner[SITES], FLAT_4H: planner[FLAT_4H]})]  # fmt: skip
    gap, gaps = paired_gap(runs, SITES, FLAT_H)
    rows.append(_row("hierarchical-ppl", PPL_TEXT, gap, PPL_BOUND, gap <= PPL_BOUND, 2 * len(gaps), per_seed=gaps,
                     planner_error={FLAT_H: planner[FLAT_H]}))  # fmt: skip
    ahead = {}
    for reference in (FLAT_H, FLAT_4H):
        ref_gap, _ = paired_gap(runs, SITES, reference)
        ahead[reference] = {"speed_ratio": tps[SITES] / tps[reference], "ppl_gap": ref_gap,
                            "ahead": tps[SITES] >= tps[reference] and ref_gap <= 0}  # fmt: skip
    count = float(sum(a["ahead"] for a in ahead.values()))
    rows.append(_row("hierarchical-equal-time", EQUAL_TEXT, count, 2.0, count == 2.0, 3 * configs[SITES]["runs"],
                     against=ahead))  # fmt: skip
    gossip_gap, gossip_gaps = paired_gap(runs, GOSSIP, FLAT_H)
    rows.append(_row("gossip-ppl", GOSSIP_TEXT, gossip_gap, PPL_BOUND, gossip_gap <= PPL_BOUND, 2 * len(gossip_gaps),
                     per_seed=gossip_gaps, planner_error={GOSSIP: planner[GOSSIP]}))  # fmt: skip
    errors = {f"{name}: {level}": b["error"] for name, c in configs.items() for level, b in c["level_bytes"].items()}
    worst = max(abs(e) for e in errors.values())
    rows.append(_row("topology-level-bytes", LEVEL_TEXT, worst, LEVEL_BYTES_BOUND, worst <= LEVEL_BYTES_BOUND,
                     sum(c["runs"] for c in configs.values()), per_level=errors))  # fmt: skip
    return rows


LEVEL_TEXT = "every kind of sync's link bytes within 3% of the planner's byte model, two-site cluster (worst |error|)"
SPEED_TEXT = ("Hierarchical({4: 2, 16: 4}) tokens/s against flat sync_every=16, 2 sites x 2 nodes x 2 ranks,"
              " 1 Gbit/s inside a site, 20 Mbit/s between sites")  # fmt: skip
PPL_TEXT = "Hierarchical({4: 2, 16: 4}) perplexity after 32 steps against flat sync_every=4, paired by seed"
EQUAL_TEXT = "Hierarchical({4: 2, 16: 4}) ahead of flat sync_every=4 and of flat sync_every=16 at equal wall time"
GOSSIP_TEXT = "Gossip(peers=1) perplexity after 32 steps against flat sync_every=4 (4 groups), paired by seed"


def _row(target_id: str, target: str, measured: float, bound: float, met: bool, runs: int, **more: Any) -> Row:
    measured_or_none = None if math.isnan(measured) else measured
    return {"id": target_id, "target": target, "measured": measured_or_none, "bound": bound, "met": met, "runs": runs,
            **more}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """The sites sweep as a Markdown table."""
    configs = analyze(results)["configs"]
    head = (
        "| configuration | tokens/s (steps 17-32) | val_ppl after 32 steps | link MB/step | planner step s / measured |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for name, c in configs.items():
        t, p, b = c["tokens_per_second"], c["ppl"], c["link_bytes_per_step"]
        plan = c.get("planner")
        planned = "-"
        if plan is not None:
            planned = (
                f"{plan['predicted_step_seconds']:.3f} / {plan['measured_step_seconds']:.3f} ({plan['error']:+.0%})"
            )
        lines.append(f"| `{name}` | {t['median']:,.0f} ({t['min']:,.0f}-{t['max']:,.0f}) | {p['median']:.1f}"
                     f" ({p['min']:.1f}-{p['max']:.1f}) | {b['median'] / 1e6:.2f} | {planned} |")  # fmt: skip
    return "\n".join(lines)
