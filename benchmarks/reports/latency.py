"""Latency between nodes: what a round trip costs the training, with the groups apart between syncs.

Input: ``python -m benchmarks.run --preset latency`` (``benchmarks/results/latency.json``): the 4 x 2 cluster at
20 Mbit/s through the user-space relay (:mod:`benchmarks.harness.relay`), per repeat (interleaved) every configuration
at a round trip of 0 ms and of ``RTT_MS`` between nodes.

- ``rtt-no-sync-pace``: FL+FSDP without syncs (a group per node, so nothing crosses a node's link): its tokens/s at
  ``RTT_MS`` over its tokens/s at 0 ms, paired by repeat, median. Groups that met at every step (a world collective
  per step) would pay a round trip per step here.
- ``rtt-sync-model``: the measured seconds of one sync (the default int4 sum with error feedback, its landings in the
  pace window, median over them and the repeats) at ``RTT_MS`` against the planner's ``sync_seconds`` for the run's
  setup with a message between nodes taking half the round trip (``fedshard plan --rtt_ms``): the relative error.
- The table: every configuration's tokens/s at both round trips (median [min, max]) and FL+HSDP's over FSDP's.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import metrics
from benchmarks.reports.sweep import emulated, setup_of
from lightning_fedshard.plan import MODELS, predict

RTT_MS = 100.0
NO_SYNC_BOUND = 0.98
MODEL_BOUND = 0.15
TARGET_IDS = ("rtt-no-sync-pace", "rtt-sync-model")
#: The no-sync pace is judged on the 96-step runs (88 steps in the window; the 16-step runs' 8 are too few).
NO_SYNC, SYNCED = "fl_fsdp-nosync-long", "fl_fsdp-int4ef"

Row = dict[str, Any]


def cells(results: dict[str, Any]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """``{(configuration, round trip): runs}``."""
    out: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in results["runs"]:
        identity = run["identity"]
        out.setdefault((identity["configuration"], identity.get("rtt_ms", 0.0)), []).append(run)
    return out


def paired_ratio(results: dict[str, Any], configuration: str) -> list[float]:
    """Per repeat that ran both: the configuration's tokens/s at ``RTT_MS`` over at 0 ms."""
    by_repeat: dict[int, dict[float, float]] = {}
    for run in results["runs"]:
        identity = run["identity"]
        if identity["configuration"] == configuration:
            by_repeat.setdefault(identity["repeat"], {})[identity.get("rtt_ms", 0.0)] = metrics.tokens_per_second(run)
    return [r[RTT_MS] / r[0.0] for r in by_repeat.values() if RTT_MS in r and 0.0 in r]


def measured_sync_seconds(runs: list[dict[str, Any]]) -> list[float]:
    """Seconds of every sync that landed in the pace windows of ``runs`` (rank 0's view)."""
    return [s["sync_seconds"] for run in runs for s in metrics.landings_in_window(run)]


def predicted_sync_seconds(run: dict[str, Any], rtt_ms: float) -> float:
    """The planner's seconds of one sync of ``run``'s setup, a message between nodes taking half of ``rtt_ms``."""
    cluster = replace(emulated(metrics.identity(run).link_mbit), inter_latency=rtt_ms / 2 / 1000)
    return predict(MODELS[run["config"]["size"]], cluster, setup_of(run)).sync_seconds


def targets(results: dict[str, Any] | None) -> list[Row]:
    """The two latency targets (missed with the reason where the sweep was not run)."""
    if results is None:
        return [_row(t, None, 0, note="not run: benchmarks/results/latency.json is missing") for t in TARGET_IDS]
    ratios = paired_ratio(results, NO_SYNC)
    synced = cells(results).get((SYNCED, RTT_MS), [])
    measured = measured_sync_seconds(synced)
    rows = [_row("rtt-no-sync-pace", statistics.median(ratios) if ratios else None, len(ratios), per_repeat=ratios)]
    if measured and synced:
        predicted = predicted_sync_seconds(synced[0], RTT_MS)
        error = statistics.median(measured) / predicted - 1
        rows.append(_row("rtt-sync-model", error, len(synced), measured_s=statistics.median(measured),
                         predicted_s=predicted, syncs=len(measured)))  # fmt: skip
    else:
        rows.append(_row("rtt-sync-model", None, 0, note=f"no {SYNCED} run at {RTT_MS:g} ms"))
    return rows


def _row(target_id: str, measured: float | None, runs: int, **extra: Any) -> Row:
    if target_id == "rtt-no-sync-pace":
        what, bound = f"FL+FSDP's no-sync pace at a {RTT_MS:g} ms round trip over at 0 ms (20 Mbit/s)", NO_SYNC_BOUND
        met = measured is not None and measured >= bound
    else:
        what, bound = f"one sync's time at {RTT_MS:g} ms against the planner's prediction (relative error)", MODEL_BOUND
        met = measured is not None and abs(measured) <= bound
    return {"id": target_id, "target": what, "measured": measured, "bound": bound, "met": met, "runs": runs, **extra}


def table(results: dict[str, Any]) -> str:
    """Every configuration's tokens/s at 0 ms and at ``RTT_MS``, and FL+HSDP's over FSDP's at each."""
    found = cells(results)
    configurations = sorted({c for c, _ in found}, key=lambda c: (not c.startswith("fsdp"), c))
    rows = [
        f"| configuration (20 Mbit/s) | tokens/s at 0 ms | tokens/s at {RTT_MS:g} ms | {RTT_MS:g} ms over 0 ms |",
        "|---|---|---|---|",
    ]
    for configuration in configurations:
        paces = [[metrics.tokens_per_second(r) for r in found.get((configuration, rtt), [])] for rtt in (0.0, RTT_MS)]
        ratios = paired_ratio(results, configuration)
        rows.append(f"| {configuration} | {_spread(paces[0])} | {_spread(paces[1])} | {_spread(ratios, '.3f')} |")
    speedups = []
    for rtt in (0.0, RTT_MS):
        hsdp, fsdp = (_median(found.get((name, rtt), [])) for name in ("fl_hsdp-int4ef", "fsdp"))
        if hsdp and fsdp:
            speedups.append(f"{hsdp / fsdp:.2f}x at {rtt:g} ms")
    note = f"FL+HSDP (the default sync) over FSDP in tokens/s: {', '.join(speedups)}." if speedups else ""
    return "\n".join(rows) + (f"\n\n{note}" if note else "")


def _median(runs: list[dict[str, Any]]) -> float | None:
    return statistics.median(metrics.tokens_per_second(r) for r in runs) if runs else None


def _spread(values: list[float], fmt: str = ",.0f") -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def plot(results: dict[str, Any], path: Path) -> Path:
    """Every configuration's tokens/s at 0 ms and at ``RTT_MS`` (medians), side by side, on a log scale."""
    from benchmarks.reports.plotting import bar_pair, figure, save

    found = cells(results)
    configurations = sorted({c for c, _ in found}, key=lambda c: (not c.startswith("fsdp"), c))
    paces = [[_median(found.get((c, rtt), [])) or 0.0 for c in configurations] for rtt in (0.0, RTT_MS)]
    fig, ax = figure()
    labels = [c.replace("fl_fsdp-", "fl_fsdp\n") for c in configurations]
    bar_pair(ax, labels, paces[0], paces[1], ("0 ms", f"{RTT_MS:g} ms"))
    ax.set(ylabel="tokens/s (median of the repeats)", yscale="log")
    ax.tick_params(axis="x", labelsize=7)
    return save(fig, ax, f"A round trip between nodes, 20 Mbit/s links: 0 against {RTT_MS:g} ms", path)
