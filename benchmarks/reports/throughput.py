"""The throughput sweep: the strategies on every link, the planner's calibration, model state per rank, plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.metrics import link_label
from benchmarks.reports import plotting
from benchmarks.reports.sweep import ordered

#: A prediction within this relative error of the measured tokens/s counts as calibrated.
CALIBRATION_TOLERANCE = 0.15
#: Where each link rate is drawn (Mbit/s); unthrottled at 1 Gbit/s.
_RATES = {None: 1000.0, 200.0: 200.0, 50.0: 50.0, 20.0: 20.0}
_LINK_AXIS = "link per node (Mbit/s; 1000 = unthrottled)"
_STATE = ("parameters", "gradients", "inner_optimizer", "anchor", "outer_optimizer", "residuals")


def calibration_errors(summary: dict[str, Any]) -> list[float]:
    """The planner's absolute relative errors on every configuration that was not one of its inputs."""
    return [abs(s["prediction_error"]) for s in summary.values() if not s.get("calibration_input", True)]


def calibration_table(summary: dict[str, Any]) -> str:
    """Planner prediction against the measured median, per configuration."""
    lines = ["| configuration | link | measured tokens/s (median) | predicted | error |", "|---|---|---|---|---|"]
    for key in ordered(summary):
        s = summary[key]
        if "predicted_tokens_per_s" not in s:
            continue
        error = "(input)" if s["calibration_input"] else f"{s['prediction_error']:+.1%}"
        lines.append(
            f"| {s['kind']} | {link_label(s['link'])} | {s['tokens_per_s']['median']:,.0f} |"
            f" {s['predicted_tokens_per_s']:,.0f} | {error} |"
        )
    if errors := calibration_errors(summary):
        within = sum(e <= CALIBRATION_TOLERANCE for e in errors)
        lines.append(
            f"\nOver the {len(errors)} predictions (the inputs left out): largest error {max(errors):.1%}, median"
            f" {statistics.median(errors):.1%}; {within} of {len(errors)} within {CALIBRATION_TOLERANCE:.0%}."
        )
    return "\n".join(lines)


def memory_table(summary: dict[str, Any]) -> str:
    """Model-state bytes of rank 0 from the tensors themselves, beside its peak RSS (unthrottled runs)."""
    lines = [
        "| configuration | parameters | gradients | inner optimizer | anchor | outer optimizer"
        " | error-feedback residuals | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in ordered(summary):
        s = summary[key]
        state = s["model_state_bytes_rank0"]
        if s["link"] is not None or not state:
            continue
        cells = " | ".join(f"{state[k] / 1e6:.2f} MB" if k in state else "-" for k in _STATE)
        lines.append(f"| {s['kind']} | {cells} | {s['maxrss_mib_rank0']['median']:.0f} MiB |")
    return "\n".join(lines)


def _lines(ax: Any, summary: dict[str, Any], kinds: list[str], metric: str) -> None:
    """One line per configuration over the link rates: medians, with min-max bars."""
    for kind in kinds:
        points = sorted(
            (_RATES[s["link"]], s[metric]) for s in summary.values() if s["kind"] == kind and s[metric]["n"]
        )
        if points:
            plotting.errorbars(ax, [p[0] for p in points], [p[1] for p in points], label=kind)


def plot(summary: dict[str, Any], images: Path, prefix: str = "throughput") -> list[Path]:
    """Throughput against bandwidth and utilization (medians, min-max bars); link bytes against the byte model."""
    kinds = sorted({s["kind"] for s in summary.values() if "nosync" not in s["kind"]})
    fig, ax = plotting.figure()
    _lines(ax, summary, kinds, "tokens_per_s")
    ax.set(xscale="log", yscale="log", xlabel=_LINK_AXIS, ylabel="tokens/s")
    paths = [
        plotting.save(fig, ax, "Throughput, median and min-max of the repeats", images / f"{prefix}_vs_bandwidth.png")
    ]

    fig, ax = plotting.figure()
    _lines(ax, summary, [k for k in kinds if k.startswith("fl_")], "utilization")
    plotting.target_line(ax)
    ax.set(xscale="log", xlabel=_LINK_AXIS, ylabel="no-sync pace / pace")
    paths.append(
        plotting.save(fig, ax, "Compute utilization of the federated runs", images / f"{prefix}_utilization.png")
    )

    names = ordered(summary)
    fig, ax = plotting.figure()
    plotting.bytes_bars(ax, summary, names, names)
    ax.tick_params(axis="x", labelrotation=90, labelsize=6)
    ax.set(yscale="log")
    paths.append(plotting.save(fig, ax, "Link bytes against the byte model", images / f"{prefix}_bytes.png"))
    return paths
