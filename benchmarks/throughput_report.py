"""The ``throughput`` sweep against the byte model, the planner and issue 9's targets; regenerates the docs' tables.

Reads ``benchmarks/results/throughput.json`` (written by ``python -m benchmarks.run --preset throughput``; nothing
here runs a model), and where they exist ``sync_grid.json`` and ``defaults.json`` (the presets of those names) and
``race.json`` (``python -m benchmarks.race``, scored by :mod:`benchmarks.race_report`), and writes:

- ``benchmarks/results/throughput_summary.json`` (and ``sync_grid_summary.json``, ``defaults_summary.json``,
  ``race_summary.json``): every derived number, per run and per configuration;
- ``benchmarks/results/targets.json``: issue 9's targets as ``{"target", "measured", "bound", "met", "runs"}``;
- the plots under ``docs/images/throughput_*.png``;
- with ``--write-docs``, the generated sections of ``docs/benchmarks.md`` and ``docs/plan.md`` (between
  ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` markers)::

    python -m benchmarks.throughput_report --write-docs

Definitions (per run, then median and min-max over the repeats):

- **step time**: clock of step 16 minus clock of step 8, over 8 steps: one whole round after the first sync (the
  pace window of :func:`benchmarks.sync_report.analyze_run`); tokens/s = tokens per step / step time.
- **utilization** of a federated run: the same repeat's no-sync pace / its pace, both over the whole run up to
  the end of the end-of-fit sync (``(train_seconds + finish_seconds) / steps``): rank 0 waits in that sync for the
  slowest group, so it is the slowest group's pace (rank 0's step clock is its own group's, and without syncs the
  groups drift apart). FL+FSDP's groups are whole nodes and send nothing across links between syncs, so its
  no-sync pace is measured once per repeat, unthrottled; FL+HSDP's replicas talk across nodes every step, so its
  no-sync run uses the same link.
- **in-run utilization**: the strategy's own figure over the pace window, ``1 - exposed sync seconds / window
  seconds`` (``fedshard/sync_exposed_seconds`` as rank 0 logged it): no second run, so no run-to-run noise.
- **link bytes per step**: every node's upload over training (validation and the end-of-fit syncs excluded) / steps.
- **model bytes**: :func:`lightning_fedshard.plan.predict` on the emulated cluster (ring collectives, gloo's
  reduce-scatter as an all-reduce, the outer reducer's own byte count).
- **calibration** (issue 10): the planner given only each strategy's measured no-sync compute time per step (its
  unthrottled no-sync run: FSDP and HSDP have no syncs) and the link rate, against the measured median.
- **FSDP corrected to a true reduce-scatter**: the measured step time minus the time the extra reduce-scatter
  bytes of gloo take on the link (the model's byte difference per node / link rate).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import race_report
from benchmarks.sync_report import analyze_run
from lightning_fedshard.plan import CLUSTERS, MODELS, TrainSetup, predict

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"
PAPER_FACTOR = 8.04
UTILIZATION_TARGET = 0.95
BYTES_TOLERANCE = 0.03
CALIBRATION_TOLERANCE = 0.15


def config_and_repeat(name: str) -> tuple[str, int]:
    """``"fl_fsdp-int8-50mbit-r2"`` -> ``("fl_fsdp-int8-50mbit", 2)``."""
    config, _, repeat = name.rpartition("-r")
    return config, int(repeat)


def link_of(config: str) -> float | None:
    """The link rate in a configuration name (Mbit/s; None: unthrottled)."""
    label = config.rsplit("-", 1)[1]
    return None if label == "unthrottled" else float(label.removesuffix("mbit"))


def kind_of(config: str) -> str:
    """The configuration without its link: ``"fl_fsdp-int8"``."""
    return config.rsplit("-", 1)[0]


def setup_of(run: dict[str, Any]) -> TrainSetup:
    """The planner's setup of a benchmark run (float32 everywhere, as the benchmark trains)."""
    cfg = run["config"]
    return TrainSetup(
        strategy=cfg["strategy"],
        num_groups=cfg["num_nodes"] if cfg["strategy"] == "fl_fsdp" else (cfg["num_groups"] or None),
        shard_size=cfg["devices"] if cfg["strategy"].endswith("hsdp") else None,
        sync_every=cfg["sync_every"],
        fragments=cfg["fragments"],
        sync_delay=cfg["sync_delay"],
        reduce_dtype=cfg["reduce_dtype"],
        error_feedback=cfg["error_feedback"],
        outer_optimizer=cfg["outer_optimizer"],
        micro_batch=cfg["batch_size"],
    )


def emulated(link: float | None, step_seconds: float | None = None, gloo: bool = True) -> Any:
    """The benchmark's cluster at a link rate (unthrottled: no link limit)."""
    rate = math.inf if link is None else link * 1e6 / 8
    return replace(
        CLUSTERS["emulated-4x2"],
        inter_bandwidth=rate,
        intra_bandwidth=math.inf,
        inter_latency=0.0,
        intra_latency=0.0,
        step_seconds=step_seconds,
        gloo_reduce_scatter=gloo,
    )


def analyze(results: dict[str, Any], compute: dict[str, float] | None = None) -> dict[str, Any]:
    """Per-run numbers, then per configuration over the repeats.

    Args:
        results: A sweep's JSON.
        compute: Each strategy's no-sync compute time per step for the planner, where the sweep did not measure it
            (its unthrottled runs); by default the sweep's own.
    """
    model = MODELS["xs"]
    runs = []
    for run in results["runs"]:
        config, repeat = config_and_repeat(run["name"])
        derived = analyze_run(run)
        steps = run["config"]["max_steps"]
        link_step = (run["link_tx_train"] - run["link_tx_val"] - run.get("link_tx_finish", 0)) / steps
        runs.append(
            {
                "name": run["name"],
                "config": config,
                "repeat": repeat,
                "link": link_of(config),
                "kind": kind_of(config),
                "step_time": derived["step_time"],
                # Whole run, the end-of-fit sync included: rank 0 waits there for the slowest group, so this is the
                # slowest group's pace (rank 0's own clock is group 0's alone, and without syncs groups drift apart).
                "run_pace": (run["train_seconds"] + run.get("finish_seconds", 0.0)) / steps,
                # FSDP and HSDP (one group) never sync: no in-run utilization to speak of.
                "inrun_utilization": derived["strategy_utilization_window"]
                if run["config"]["strategy"].startswith("fl_")
                else math.nan,
                "tokens_per_s": run["tokens_per_step"] / derived["step_time"],
                "link_bytes_per_step": link_step,
                "model_bytes_per_step": predict(model, emulated(link_of(config)), setup_of(run)).link_bytes_per_step,
                "cpu_seconds": run.get("cpu_seconds"),
                "model_state_bytes": run.get("model_state_bytes"),
                "maxrss_mib": run.get("maxrss_mib"),
                "load_before": run["loadavg_before"][0],
                "val_ppl": run["vals"][-1]["val_ppl"] if run["vals"] else math.nan,
                "setup": setup_of(run),
            }
        )
    by_name = {r["name"]: r for r in runs}
    for r in runs:
        r["utilization"] = _utilization(r, by_name)
    configs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        configs[r["config"]].append(r)
    summary = {name: _summarize(group) for name, group in configs.items()}
    _calibrate(summary, configs, model, compute)
    return {"runs": [{k: v for k, v in r.items() if k != "setup"} for r in runs], "configs": summary}


def _utilization(run: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> float:
    if not run["kind"].startswith("fl_") or "nosync" in run["kind"]:
        return math.nan
    strategy = run["kind"].split("-")[0]
    link = "unthrottled" if strategy == "fl_fsdp" else run["config"].rsplit("-", 1)[1]
    nosync = by_name.get(f"{strategy}-nosync-{link}-r{run['repeat']}")
    return nosync["run_pace"] / run["run_pace"] if nosync else math.nan


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of the finite values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _summarize(group: list[dict[str, Any]]) -> dict[str, Any]:
    first = group[0]
    measured = spread([r["link_bytes_per_step"] for r in group])
    return {
        "kind": first["kind"],
        "link": first["link"],
        "step_time": spread([r["step_time"] for r in group]),
        "tokens_per_s": spread([r["tokens_per_s"] for r in group]),
        "utilization": spread([r["utilization"] for r in group]),
        "inrun_utilization": spread([r["inrun_utilization"] for r in group]),
        "link_bytes_per_step": measured,
        "model_bytes_per_step": first["model_bytes_per_step"],
        # No-sync runs end before their first sync, which the model amortizes over `sync_every`: not comparable.
        "bytes_ratio": math.nan if "nosync" in first["kind"] else measured["median"] / first["model_bytes_per_step"],
        "run_pace": spread([r["run_pace"] for r in group]),
        "cpu_seconds_per_rank": spread([statistics.fmean(r["cpu_seconds"]) for r in group if r["cpu_seconds"]]),
        "model_state_bytes_rank0": first["model_state_bytes"][0] if first["model_state_bytes"] else None,
        "maxrss_mib_rank0": spread([r["maxrss_mib"][0] for r in group if r["maxrss_mib"]]),
        "val_ppl": spread([r["val_ppl"] for r in group]),
        "setup": first["setup"],
    }


def compute_times(summary: dict[str, Any]) -> dict[str, float]:
    """Each strategy's measured compute time per step: its unthrottled run without syncs (median)."""
    compute = {}
    for strategy in ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"):
        base = f"{strategy}-nosync-unthrottled" if strategy.startswith("fl_") else f"{strategy}-unthrottled"
        if base in summary:
            compute[strategy] = summary[base]["step_time"]["median"]
    return compute


def _calibrate(
    summary: dict[str, Any], configs: dict[str, list[dict[str, Any]]], model: Any, given: dict[str, float] | None = None
) -> None:
    """Planner predictions from each strategy's measured unthrottled no-sync step time and the link rate."""
    compute = {**(given or {}), **compute_times(summary)}
    for s in summary.values():
        setup = s.pop("setup")
        strategy = setup.strategy
        if strategy not in compute:
            continue
        predicted = predict(model, emulated(s["link"], step_seconds=compute[strategy]), setup)
        s["predicted_step_time"] = predicted.step_seconds
        s["predicted_tokens_per_s"] = predicted.tokens_per_second
        s["calibration_input"] = s["link"] is None and (s["kind"] in ("fsdp", "hsdp") or "nosync" in s["kind"])
        s["prediction_error"] = predicted.tokens_per_second / s["tokens_per_s"]["median"] - 1
        if strategy in ("fsdp", "hsdp") and s["link"] is not None:
            true_rs = predict(model, emulated(s["link"], gloo=False), setup)
            gloo_rs = predict(model, emulated(s["link"]), setup)
            extra = (gloo_rs.collective_seconds - true_rs.collective_seconds) if strategy == "fsdp" else 0.0
            corrected = s["step_time"]["median"] - extra
            s["tokens_per_s_true_reduce_scatter"] = predicted.sequences_per_step * model.seq_len / corrected


def targets(
    summary: dict[str, Any],
    grid: dict[str, Any] | None = None,
    race: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Issue 9's targets, each ``{"target", "measured", "bound", "met", "runs"}`` (plus what it was measured on).

    Args:
        summary: The throughput sweep's configurations.
        grid: The ``sync_grid`` sweep's configurations: more sync options for the utilization and byte targets.
        race: :func:`benchmarks.race_report.analyze`'s result; without it the race's row says "not run".
        defaults: The ``defaults`` sweep's configurations: the 8.04x target for the package's default sync, side by
            side with FSDP in that sweep.
    """
    out = []
    options = {**summary, **{f"{k} (sync_grid)": v for k, v in (grid or {}).items()}}
    at50 = {k: v for k, v in options.items() if v["kind"].startswith("fl_fsdp") and v["link"] == 50.0}
    best = max(at50.items(), key=lambda kv: _finite(kv[1]["utilization"]["median"]), default=None)
    out.append(
        {
            "target": "FL+FSDP compute utilization at 50 Mbit/s, sync_every=8, best sync option",
            "measured": best[1]["utilization"]["median"] if best else None,
            "bound": UTILIZATION_TARGET,
            "met": bool(best and best[1]["utilization"]["median"] >= UTILIZATION_TARGET),
            "runs": best[1]["utilization"]["n"] if best else 0,
            "configuration": best[0] if best else None,
            "spread": best[1]["utilization"] if best else None,
        }
    )
    best_inrun = max(at50.items(), key=lambda kv: _finite(kv[1]["inrun_utilization"]["median"]), default=None)
    out.append(
        {
            "target": "the same, as the strategy measures it in-run (1 - exposed sync time / time)",
            "measured": best_inrun[1]["inrun_utilization"]["median"] if best_inrun else None,
            "bound": UTILIZATION_TARGET,
            "met": bool(best_inrun and best_inrun[1]["inrun_utilization"]["median"] >= UTILIZATION_TARGET),
            "runs": best_inrun[1]["inrun_utilization"]["n"] if best_inrun else 0,
            "configuration": best_inrun[0] if best_inrun else None,
            "spread": best_inrun[1]["inrun_utilization"] if best_inrun else None,
        }
    )
    at20 = {k: v for k, v in summary.items() if v["kind"].startswith("fl_fsdp") and v["link"] == 20.0}
    fastest = max(at20, key=lambda k: _finite(at20[k]["tokens_per_s"]["median"]), default=None)
    comparisons = [(summary, "fl_fsdp-20mbit", "float32 outer traffic")]
    if fastest:
        comparisons.append((summary, fastest, f"fastest option: {fastest}"))
    if defaults:
        comparisons.append((defaults, "fl_fsdp-int4ef-20mbit", "the default sync, int4 + error feedback"))
    for sweep, config, option in comparisons:
        out += _speedup_rows(sweep.get("fsdp-20mbit"), sweep.get(config), option)
    if race is not None:
        out.append(race_report.target_row(race))
    else:
        out.append(
            {
                "target": race_report.RACE_TARGET,
                "measured": None,
                "bound": 1.0,
                "met": False,
                "runs": 0,
                "note": "not run: benchmarks/results/race.json is missing",
            }
        )
    errors = [abs(s["bytes_ratio"] - 1) for s in options.values() if math.isfinite(s["bytes_ratio"])]
    worst = max(options.items(), key=lambda kv: abs(_finite(kv[1]["bytes_ratio"], 1.0) - 1), default=None)
    out.append(
        {
            "target": "link bytes within 3% of the byte model, every strategy, dtype and link rate",
            "measured": max(errors) if errors else None,
            "bound": BYTES_TOLERANCE,
            "met": bool(errors and max(errors) <= BYTES_TOLERANCE),
            "runs": sum(s["link_bytes_per_step"]["n"] for s in options.values()),
            "worst": worst[0] if worst else None,
        }
    )
    return out


def _speedup_rows(fsdp: dict[str, Any] | None, fl: dict[str, Any] | None, option: str) -> list[dict[str, Any]]:
    """FL+FSDP's tokens/s over FSDP's from one sweep, against FSDP on gloo and corrected to a true reduce-scatter."""
    rows = []
    for corrected in (False, True):
        ratio, runs = None, 0
        if fl and fsdp:
            base = (
                fsdp.get("tokens_per_s_true_reduce_scatter", math.nan) if corrected else fsdp["tokens_per_s"]["median"]
            )
            ratio, runs = fl["tokens_per_s"]["median"] / base, min(fl["tokens_per_s"]["n"], fsdp["tokens_per_s"]["n"])
        how = "FSDP corrected to a true reduce-scatter" if corrected else "FSDP on gloo"
        rows.append(
            {
                "target": f"FL+FSDP / FSDP tokens/s at 20 Mbit/s ({option}; {how})",
                "measured": ratio,
                "bound": PAPER_FACTOR,
                "met": bool(ratio is not None and ratio >= PAPER_FACTOR),
                "runs": runs,
            }
        )
    return rows


def _finite(value: float, default: float = -math.inf) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else default


# -- tables --------------------------------------------------------------------------------------------------------


def _r(s: dict[str, float], fmt: str = "{:,.0f}") -> str:
    if not s["n"]:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _link(link: float | None) -> str:
    return "unthrottled" if link is None else f"{link:g} Mbit/s"


def _order(summary: dict[str, Any]) -> list[str]:
    links = [None, 200.0, 50.0, 20.0]
    return sorted(summary, key=lambda k: (links.index(summary[k]["link"]), summary[k]["kind"]))


def throughput_table(summary: dict[str, Any]) -> str:
    """Measured throughput, utilization and bytes beside the model, per configuration."""
    lines = [
        "| configuration | link | tokens/s median (min-max) | utilization vs no-sync run | in-run utilization |"
        " link MB/step | model MB/step | measured / model | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in _order(summary):
        s = summary[name]
        lines.append(
            f"| {s['kind']} | {_link(s['link'])} | {_r(s['tokens_per_s'])} | {_r(s['utilization'], '{:.2f}')} |"
            f" {_r(s['inrun_utilization'], '{:.2f}')} |"
            f" {s['link_bytes_per_step']['median'] / 1e6:.2f} | {s['model_bytes_per_step'] / 1e6:.2f} |"
            f" {'-' if math.isnan(s['bytes_ratio']) else format(s['bytes_ratio'], '.3f')} | {s['tokens_per_s']['n']} |"
        )
    return "\n".join(lines)


def calibration_table(summary: dict[str, Any]) -> str:
    """Planner prediction against the measured median, per configuration."""
    lines = [
        "| configuration | link | measured tokens/s (median) | predicted | error |",
        "|---|---|---|---|---|",
    ]
    for name in _order(summary):
        s = summary[name]
        if "predicted_tokens_per_s" not in s:
            continue
        error = "(input)" if s["calibration_input"] else f"{s['prediction_error']:+.1%}"
        lines.append(
            f"| {s['kind']} | {_link(s['link'])} | {s['tokens_per_s']['median']:,.0f} |"
            f" {s['predicted_tokens_per_s']:,.0f} | {error} |"
        )
    errors = [abs(s["prediction_error"]) for s in summary.values() if not s.get("calibration_input", True)]
    if errors:
        within = sum(e <= CALIBRATION_TOLERANCE for e in errors)
        lines.append(
            f"\nOver the {len(errors)} predictions (the inputs left out): largest error {max(errors):.1%}, median"
            f" {statistics.median(errors):.1%}; {within} of {len(errors)} within {CALIBRATION_TOLERANCE:.0%}."
        )
    return "\n".join(lines)


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The targets with what was measured."""
    lines = ["| target | measured | bound | met | runs |", "|---|---|---|---|---|"]
    for t in rows:
        measured = "not run" if t["measured"] is None else f"{t['measured']:.3g}"
        bound = "-" if t["bound"] is None else f"{t['bound']:g}"
        lines.append(f"| {t['target']} | {measured} | {bound} | {'yes' if t['met'] else '**no**'} | {t['runs']} |")
    return "\n".join(lines)


def memory_table(summary: dict[str, Any]) -> str:
    """Model-state bytes of rank 0 from the tensors themselves, beside its peak RSS (unthrottled runs)."""
    lines = [
        "| configuration | parameters | gradients | inner optimizer | anchor | outer optimizer | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in _order(summary):
        s = summary[name]
        state = s["model_state_bytes_rank0"]
        if s["link"] is not None or not state:
            continue
        kb = {k: f"{v / 1e6:.2f} MB" for k, v in state.items()}
        lines.append(
            f"| {s['kind']} | {kb['parameters']} | {kb['gradients']} | {kb['inner_optimizer']} | {kb['anchor']} |"
            f" {kb['outer_optimizer']} | {s['maxrss_mib_rank0']['median']:.0f} MiB |"
        )
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------------------------------


#: Where each link rate is drawn (Mbit/s); unthrottled at 1 Gbit/s.
_RATES = {None: 1000.0, 200.0: 200.0, 50.0: 50.0, 20.0: 20.0}
_LINK_AXIS = "link per node (Mbit/s; 1000 = unthrottled)"


def _spread_lines(ax: Any, summary: dict[str, Any], kinds: list[str], metric: str) -> None:
    """One line per configuration kind over the link rates: medians, with min-max bars."""
    for kind in kinds:
        points = sorted(
            (_RATES[s["link"]], s[metric]) for s in summary.values() if s["kind"] == kind and s[metric]["n"]
        )
        if not points:
            continue
        low = [p[1]["median"] - p[1]["min"] for p in points]
        high = [p[1]["max"] - p[1]["median"] for p in points]
        ax.errorbar([p[0] for p in points], [p[1]["median"] for p in points], yerr=[low, high], marker="o",
                    capsize=3, label=kind)  # fmt: skip


def _save(fig: Any, ax: Any, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot(summary: dict[str, Any], images: Path, prefix: str = "throughput") -> list[Path]:
    """Throughput vs bandwidth with spread bars; utilization per sync option; bytes against the model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
    kinds = sorted({s["kind"] for s in summary.values() if "nosync" not in s["kind"]})
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    _spread_lines(ax, summary, kinds, "tokens_per_s")
    ax.set(xscale="log", yscale="log", xlabel=_LINK_AXIS, ylabel="tokens/s")
    paths.append(_save(fig, ax, "Throughput, median and min-max of the repeats", images / f"{prefix}_vs_bandwidth.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    _spread_lines(ax, summary, [k for k in kinds if k.startswith("fl_")], "utilization")
    ax.axhline(UTILIZATION_TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set(xscale="log", xlabel=_LINK_AXIS, ylabel="no-sync pace / pace")
    paths.append(_save(fig, ax, "Compute utilization of the federated runs", images / f"{prefix}_utilization.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = _order(summary)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [summary[n]["link_bytes_per_step"]["median"] / 1e6 for n in names], 0.4,
           label="link counters (median)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [summary[n]["model_bytes_per_step"] / 1e6 for n in names], 0.4, label="byte model")
    ax.set_xticks(list(x), names, rotation=90, fontsize=6)
    ax.set(yscale="log", ylabel="MB per optimizer step (all nodes)")
    paths.append(_save(fig, ax, "Link bytes against the byte model", images / f"{prefix}_bytes.png"))
    plt.close("all")
    return paths


def plot_options(summary: dict[str, Any], images: Path, prefix: str = "sync_grid") -> list[Path]:
    """One link's sync options side by side: both utilizations (median, min-max bars); bytes against the model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
    names = [n for n in _order(summary) if "nosync" not in summary[n]["kind"]]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for offset, metric, label in ((-0.2, "utilization", "vs the no-sync run"), (0.2, "inrun_utilization", "in-run")):
        stats = [summary[n][metric] for n in names]
        err = [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
        ax.bar([i + offset for i in x], [s["median"] for s in stats], 0.4, yerr=err, capsize=3, label=label)
    ax.axhline(UTILIZATION_TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), [f"{summary[n]['kind']}\n{_link(summary[n]['link'])}" for n in names], fontsize=6)
    ax.set(ylabel="compute utilization")
    paths = [
        _save(fig, ax, "Sync options: compute utilization (median, min-max)", images / f"{prefix}_utilization.png")
    ]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar([i - 0.2 for i in x], [summary[n]["link_bytes_per_step"]["median"] / 1e6 for n in names], 0.4,
           label="link counters (median)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [summary[n]["model_bytes_per_step"] / 1e6 for n in names], 0.4, label="byte model")
    ax.set_xticks(list(x), [summary[n]["kind"] for n in names], rotation=60, fontsize=6)
    ax.set(ylabel="MB per optimizer step (all nodes)")
    paths.append(_save(fig, ax, "Sync options: link bytes against the byte model", images / f"{prefix}_bytes.png"))
    plt.close("all")
    return paths


# -- docs --------------------------------------------------------------------------------------------------------------


def replace_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- generated:name -->`` and ``<!-- /generated:name -->`` in ``path``.

    Raises:
        ValueError: If the markers are missing.
    """
    text = path.read_text()
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} section.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body.strip()}\n{end}{tail}")


def provenance(results: dict[str, Any], command: str | None = None) -> str:
    """Where the numbers come from."""
    m = results["machine"]
    dirty = "a clean tree" if m.get("git_dirty") is False else "uncommitted changes"
    return (
        f"Measured with `{command or m['command']}` at commit `{(m.get('git_commit') or '?')[:10]}` ({dirty}), torch"
        f" {m['torch']}, Lightning {m['lightning']}, Python {m['python']}, on {m['cpu_count']} cores of"
        f" {m['cpu_model']}. Regenerate these tables with `python -m benchmarks.throughput_report --write-docs`."
    )


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS / "throughput.json")
    parser.add_argument("--grid", type=Path, default=RESULTS / "sync_grid.json", help="the sync_grid sweep, if run")
    parser.add_argument("--defaults", type=Path, default=RESULTS / "defaults.json", help="the defaults sweep, if run")
    parser.add_argument("--race", type=Path, default=RESULTS / "race.json", help="the race to perplexity, if run")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the generated sections of the docs")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    analysis = analyze(results)
    grid_results = _load(args.grid)
    grid = analyze(grid_results) if grid_results else None
    race_results = _load(args.race)
    defaults_results = _load(args.defaults)
    compute = compute_times(analysis["configs"])
    defaults = analyze(defaults_results, compute) if defaults_results else None
    # The race is paced by the throughput sweep; options only the other sweeps measured take their pace from them.
    extra = {**(grid["configs"] if grid else {}), **(defaults["configs"] if defaults else {})}
    paces = {**extra, **analysis["configs"]}
    race = race_report.analyze(race_results, paces) if race_results else None
    rows = targets(analysis["configs"], grid and grid["configs"], race, defaults and defaults["configs"])
    (RESULTS / "throughput_summary.json").write_text(json.dumps(analysis, indent=1, default=str))
    if grid:
        (RESULTS / "sync_grid_summary.json").write_text(json.dumps(grid, indent=1, default=str))
    if defaults:
        (RESULTS / "defaults_summary.json").write_text(json.dumps(defaults, indent=1, default=str))
    if race:
        (RESULTS / "race_summary.json").write_text(json.dumps(race, indent=1, default=str))
    (RESULTS / "targets.json").write_text(json.dumps(rows, indent=1))
    tables = {
        "throughput": throughput_table(analysis["configs"]),
        "targets": targets_table(rows),
        "memory": memory_table(analysis["configs"]),
        "calibration": calibration_table(analysis["configs"]),
    }
    if grid:
        tables["sync_grid"] = throughput_table(grid["configs"])
    if defaults:
        tables["defaults"] = throughput_table(defaults["configs"])
    if race:
        tables["race"] = (
            f"{race_report.link_table(race)}\n\n<details><summary>Every moment compared</summary>\n\n"
            f"{race_report.wall_time_table(race)}\n\n</details>"
        )
        tables["race_budgets"] = race_report.budget_table(race)
    for name, table in tables.items():
        print(f"## {name}\n\n{table}\n")
    if not args.no_plots:
        paths = plot(analysis["configs"], IMAGES)
        paths += plot_options(grid["configs"], IMAGES) if grid else []
        paths += race_report.plot(race, IMAGES) if race else []
        for path in paths:
            print(f"plot: {path.relative_to(ROOT)}")
    if args.write_docs:
        note = provenance(results)
        for name in ("throughput", "memory"):
            replace_section(ROOT / "docs" / "benchmarks.md", name, f"{tables[name]}\n\n{note}")
        sources = [note] + [
            provenance(r, command)
            for r, command in (
                (grid_results, None),
                (defaults_results, None),
                (race_results, "python -m benchmarks.race"),
            )
            if r
        ]
        replace_section(ROOT / "docs" / "benchmarks.md", "targets", tables["targets"] + "\n\n" + "\n\n".join(sources))
        replace_section(ROOT / "docs" / "plan.md", "calibration", f"{tables['calibration']}\n\n{note}")
        if grid_results:
            replace_section(
                ROOT / "docs" / "benchmarks.md", "sync_grid", f"{tables['sync_grid']}\n\n{provenance(grid_results)}"
            )
        if defaults_results:
            note = provenance(defaults_results)
            replace_section(ROOT / "docs" / "benchmarks.md", "defaults", f"{tables['defaults']}\n\n{note}")
        if race_results:
            note = provenance(race_results, "python -m benchmarks.race")
            for name in ("race", "race_budgets"):
                replace_section(ROOT / "docs" / "benchmarks.md", name, f"{tables[name]}\n\n{note}")


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


if __name__ == "__main__":
    main()
