"""One sweep, per run and per configuration over its repeats: pace, utilization, bytes against the byte model.

Shared by the throughput, sync-grid and defaults sweeps (the same shape of sweep). The byte model and the
predictions are the planner's (:func:`lightning_fedshard.plan.predict`) on the emulated cluster: ring collectives,
gloo's reduce-scatter as an all-reduce, the outer reducer's own byte count, each message framed as gloo sends it over
TCP. A run's modelled link bytes are the planner's collectives over its training window (its steps, and the syncs
that land in it) plus the harness's own messages (:mod:`benchmarks.reports.instrumentation`). **Calibration**: the
planner given only each strategy's measured no-sync compute time per step (its unthrottled no-sync run; FSDP and
HSDP have no syncs) and the link rate, against the measured median. **FSDP corrected to a true reduce-scatter**: the
measured step time minus the time the extra reduce-scatter bytes of gloo take on the link (the model's byte
difference / link rate).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from benchmarks import metrics
from benchmarks.harness.config import BASELINE_FEDERATION, BASELINES
from benchmarks.metrics import link_label, link_order, link_slug, spread
from benchmarks.presets import Configuration
from benchmarks.reports.instrumentation import harness_bytes
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan import CLUSTERS, MODELS, ClusterSpec, TrainSetup, predict

EMULATED_CLUSTER = "emulated-4x2"
STRATEGY_LABELS = {
    "fsdp": "FSDP",
    "hsdp": "HSDP",
    "fl_fsdp": "FL+FSDP",
    "fl_hsdp": "FL+HSDP",
    "torchft": "torchft DiLoCo (baseline)",
}


def setup_of(run: dict[str, Any]) -> TrainSetup:
    """The planner's setup of a benchmark run (float32 weights and gradients, as the benchmark trains)."""
    cfg = run["config"]
    return TrainSetup(cfg["strategy"], FederationConfig(**cfg["federation"]), micro_batch=cfg["batch_size"])


def emulated(link: float | None, step_seconds: float | None = None, gloo: bool = True) -> ClusterSpec:
    """The benchmark's cluster at a link rate (unthrottled: no link limit), for the planner."""
    rate = math.inf if link is None else link * 1e6 / 8
    return replace(
        CLUSTERS[EMULATED_CLUSTER],
        inter_bandwidth=rate,
        intra_bandwidth=math.inf,
        inter_latency=0.0,
        intra_latency=0.0,
        step_seconds=step_seconds,
        gloo_reduce_scatter=gloo,
    )


def landings_in_training(run: dict[str, Any]) -> int:
    """Syncs that land during a run's training: a fragment every ``sync_every / fragments`` steps (federated runs)."""
    cfg = run["config"]
    if not cfg["strategy"].startswith("fl_"):
        return 0
    fed = cfg["federation"]
    return cfg["max_steps"] * fed["fragments"] // fed["sync_every"]


def byte_model(run: dict[str, Any]) -> tuple[float, float]:
    """The model's link bytes per training step of a run, and the harness's share of them.

    The planner's step collectives every step and its sync collectives once per landing in the training window
    (for every configuration but the no-sync ones this is the planner's ``link_bytes_per_step``, which amortizes the
    syncs), plus the recorder's barriers and Lightning's SIGTERM broadcasts.
    """
    cfg = run["config"]
    cluster = emulated(metrics.identity(run).link_mbit)
    p = predict(MODELS[cfg["size"]], cluster, setup_of(run))
    steps, landings = cfg["max_steps"], landings_in_training(run)
    training = steps * sum(c.link_bytes * c.calls for c in p.step_collectives) + landings * p.link_bytes_per_sync
    mtu = cluster.tcp_mtu or 0
    flag_groups = run.get("sigterm_groups")  # absent in runs recorded while the flag went over the world
    harness = (
        harness_bytes(cluster.world_size, cluster.devices_per_node, steps, landings, mtu, flag_groups) if mtu else 0.0
    )
    return (training + harness) / steps, harness / steps


def thread_cpu(run: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per rank (mean over ranks) of the training threads per step, of the background sum per landing
    in training, and of every other thread (gloo's, torch's pools) per step; NaN where the run did not record them.

    The split is over the whole training (validation included), as :class:`benchmarks.harness.threads.ThreadClock`
    measured it in every rank.
    """
    split = [r for r in run.get("thread_cpu_seconds") or [] if r]
    if not split:
        return {"training_cpu_per_step": math.nan, "background_cpu_per_sync": math.nan, "other_cpu_per_step": math.nan}
    steps, landings = run["config"]["max_steps"], landings_in_training(run)
    mean = {key: statistics.fmean(r[key] for r in split) for key in split[0]}
    return {
        "training_cpu_per_step": mean["training"] / steps,
        "background_cpu_per_sync": mean["background_sum"] / landings if landings else math.nan,
        "other_cpu_per_step": mean["other"] / steps,
    }


def config_key(configuration: str, link: float | None) -> str:
    """A configuration on a link: ``"fl_fsdp-int8-50mbit"``."""
    return f"{configuration}-{link_slug(link)}"


def analyze_run(run: dict[str, Any]) -> dict[str, Any]:
    """The measures of one run (see :mod:`benchmarks.metrics`), with the byte model's bytes per step."""
    ident = metrics.identity(run)
    setup = setup_of(run)
    model_bytes, harness = byte_model(run)
    return {
        "name": run["name"],
        "config": config_key(ident.configuration, ident.link_mbit),
        "repeat": ident.repeat,
        "link": ident.link_mbit,
        "kind": ident.configuration,
        "strategy": run["config"]["strategy"],
        "size": run["config"]["size"],
        "step_time": metrics.step_time(run),
        "run_pace": metrics.run_pace(run),
        "inrun_utilization": metrics.inrun_utilization(run),
        "effective_utilization": metrics.effective_utilization(run),
        "tokens_per_s": metrics.tokens_per_second(run),
        "link_bytes_per_step": metrics.link_bytes_per_step(run),
        "link_bytes_per_round": metrics.bytes_per_round(run),
        "model_bytes_per_step": model_bytes,
        "harness_bytes_per_step": harness,
        "cpu_seconds": run.get("cpu_seconds"),
        **thread_cpu(run),
        "model_state_bytes": run.get("model_state_bytes"),
        "maxrss_mib": run.get("maxrss_mib"),
        "load_before": run["loadavg_before"][0],
        "val_ppl": metrics.final_ppl(run),
        "reference": metrics.utilization_reference(run),
        "setup": setup,
    }


def analyze(results: dict[str, Any], compute: dict[str, float] | None = None) -> dict[str, Any]:
    """Per-run numbers, then per configuration over the repeats.

    Args:
        results: A sweep's results (:func:`benchmarks.records.load`).
        compute: Each strategy's no-sync compute time per step for the planner, where the sweep did not measure it
            (its unthrottled runs); by default the sweep's own.

    Returns:
        ``{"runs": [...], "configs": {"<configuration>-<link>": summary}}``.
    """
    runs = [analyze_run(run) for run in results["runs"]]
    by_cell = {(r["kind"], r["link"], r["repeat"]): r for r in runs}
    for r in runs:
        cell = r.pop("reference")
        reference = by_cell.get((*cell, r["repeat"])) if cell else None
        r["utilization"] = reference["run_pace"] / r["run_pace"] if reference else math.nan
        r["pace_ratio"] = r["tokens_per_s"] / reference["tokens_per_s"] if reference else math.nan
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[r["config"]].append(r)
    summary = {key: summarize(group) for key, group in groups.items()}
    calibrate(summary, compute)
    return {"runs": [{k: v for k, v in r.items() if k != "setup"} for r in runs], "configs": summary}


def summarize(group: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its repeats: the spread of every measure."""
    first = group[0]
    measured = spread(r["link_bytes_per_step"] for r in group)
    return {
        "kind": first["kind"],
        "link": first["link"],
        "strategy": first["strategy"],
        "size": first["size"],
        **{key: spread(r[key] for r in group) for key in SPREAD_KEYS},
        "link_bytes_per_step": measured,
        "model_bytes_per_step": first["model_bytes_per_step"],
        "harness_bytes_per_step": first["harness_bytes_per_step"],
        "bytes_ratio": measured["median"] / first["model_bytes_per_step"],
        "cpu_seconds_per_rank": spread(statistics.fmean(r["cpu_seconds"]) for r in group if r["cpu_seconds"]),
        "model_state_bytes_rank0": first["model_state_bytes"][0] if first["model_state_bytes"] else None,
        "maxrss_mib_rank0": spread(r["maxrss_mib"][0] for r in group if r["maxrss_mib"]),
        "setup": first["setup"],
    }


SPREAD_KEYS = (
    "step_time",
    "tokens_per_s",
    "utilization",
    "pace_ratio",
    "training_cpu_per_step",
    "background_cpu_per_sync",
    "other_cpu_per_step",
    "inrun_utilization",
    "effective_utilization",
    "run_pace",
    "link_bytes_per_round",
    "val_ppl",
)


def compute_times(summary: dict[str, Any]) -> dict[str, float]:
    """Each strategy's measured compute time per step: its unthrottled run without syncs (median)."""
    compute = {}
    for strategy in ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"):
        base = f"{strategy}-nosync" if strategy.startswith("fl_") else strategy
        if (key := config_key(base, None)) in summary:
            compute[strategy] = summary[key]["step_time"]["median"]
    return compute


def calibrate(summary: dict[str, Any], given: dict[str, float] | None = None) -> None:
    """Planner predictions from each strategy's measured unthrottled no-sync step time and the link rate, in place."""
    compute = {**(given or {}), **compute_times(summary)}
    for s in summary.values():
        setup = s.pop("setup")
        if setup.strategy in compute:
            _predict(s, setup, compute[setup.strategy])


def _predict(s: dict[str, Any], setup: TrainSetup, compute: float) -> None:
    model = MODELS[s["size"]]
    predicted = predict(model, emulated(s["link"], step_seconds=compute), setup)
    s["predicted_step_time"] = predicted.step_seconds
    s["predicted_tokens_per_s"] = predicted.tokens_per_second
    s["calibration_input"] = s["link"] is None and (s["strategy"] in ("fsdp", "hsdp") or "nosync" in s["kind"])
    s["prediction_error"] = predicted.tokens_per_second / s["tokens_per_s"]["median"] - 1
    if setup.strategy in ("fsdp", "hsdp") and s["link"] is not None:
        true_rs = predict(model, emulated(s["link"], gloo=False), setup)
        gloo_rs = predict(model, emulated(s["link"]), setup)
        extra = (gloo_rs.collective_seconds - true_rs.collective_seconds) if setup.strategy == "fsdp" else 0.0
        corrected = s["step_time"]["median"] - extra
        s["tokens_per_s_true_reduce_scatter"] = predicted.sequences_per_step * model.seq_len / corrected


def ordered(summary: dict[str, Any]) -> list[str]:
    """The configurations by link (unthrottled first, then the fastest), then by name."""
    return sorted(summary, key=lambda k: (link_order(summary[k]["link"]), summary[k]["kind"]))


def median_range(s: metrics.Spread, fmt: str = "{:,.0f}") -> str:
    """``"median (min-max)"``, or ``"-"`` without values."""
    if not s["n"]:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def sweep_table(summary: dict[str, Any]) -> str:
    """Measured throughput, utilization and bytes beside the model, per configuration."""
    lines = [
        "| configuration | link | tokens/s median (min-max) | utilization vs no-sync run | in-run utilization |"
        " effective utilization | link MB/step | model MB/step | measured / model | runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ordered(summary):
        s = summary[key]
        ratio = "-" if math.isnan(s["bytes_ratio"]) else format(s["bytes_ratio"], ".3f")
        lines.append(
            f"| {s['kind']} | {link_label(s['link'])} | {median_range(s['tokens_per_s'])} |"
            f" {median_range(s['utilization'], '{:.2f}')} | {median_range(s['inrun_utilization'], '{:.2f}')} |"
            f" {median_range(s['effective_utilization'], '{:.2f}')} | {s['link_bytes_per_step']['median'] / 1e6:.2f} |"
            f" {s['model_bytes_per_step'] / 1e6:.2f} |"
            f" {ratio} | {s['tokens_per_s']['n']} |"
        )
    return "\n".join(lines)


def configurations_table(configurations: Iterable[Configuration]) -> str:
    """What every configuration name means: its strategy and what it changes from the package's defaults."""
    lines = ["| configuration | strategy | changes from the package's defaults |", "|---|---|---|"]
    for c in configurations:
        baseline = BASELINE_FEDERATION if c.strategy in BASELINES else {}
        changes = {**baseline, **c.federation, **c.training}
        described = ", ".join(f"`{k}={v!r}`" for k, v in changes.items()) or "none"
        if c.retired is not None:
            described += f" (retired: {c.retired})"
        lines.append(f"| {c.name} | {STRATEGY_LABELS[c.strategy]} | {described} |")
    return "\n".join(lines)
