"""Plots of a benchmark sweep (matplotlib, PNG): the figures embedded in ``docs/benchmarks.md``.

python -m benchmarks.plot benchmarks/results/full.json benchmarks/results/full
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from benchmarks.report import (  # noqa: E402
    LABELS,
    link_label,
    links,
    load,
    main_comparison,
    summarize,
)

COLORS = {"fsdp": "tab:red", "hsdp": "tab:orange", "fl_fsdp": "tab:blue", "fl_hsdp": "tab:green"}


def _curve(ax: Axes, run: dict[str, Any], x: str, **style: Any) -> None:
    vals = run["vals"]
    ax.plot([v[x] for v in vals], [v["val_ppl"] for v in vals], marker="o", markersize=3, **style)


def ppl_vs_time(runs: list[dict[str, Any]], path: Path) -> None:
    """Time-to-perplexity, one panel per link rate (the paper's main figure)."""
    rates = links(runs)
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), sharey=True, squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for run in main_comparison(runs):
            if run["driver"]["link_mbit"] == rate:
                strategy = run["config"]["strategy"]
                _curve(ax, run, "clock", label=LABELS[strategy], color=COLORS[strategy])
        ax.set_title(f"link {link_label(rate)}")
        ax.set_xlabel("training wall time [s]")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("validation perplexity")
    axes[0][0].legend()
    _save(fig, path)


def ppl_vs_tokens(runs: list[dict[str, Any]], path: Path) -> None:
    """Perplexity against training tokens: the bandwidth-independent view (statistical efficiency)."""
    slowest = links(runs)[-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for run in main_comparison(runs):
        if run["driver"]["link_mbit"] == slowest:
            strategy = run["config"]["strategy"]
            _curve(left, run, "tokens", label=LABELS[strategy], color=COLORS[strategy])
    left.set_title(f"strategies (link {link_label(slowest)})")
    for run in runs:
        cfg = run["config"]
        if cfg["strategy"].startswith("fl_") and run["driver"]["link_mbit"] == slowest:
            label = f"{LABELS[cfg['strategy']]} H={cfg['sync_every']} {cfg['outer_optimizer']}"
            style = "-" if cfg["outer_optimizer"] == "nesterov" else "--"
            _curve(right, run, "tokens", label=label, linestyle=style)
    right.set_title("sync_every and outer optimizer")
    for ax in (left, right):
        ax.set_xlabel("training tokens")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    left.set_ylabel("validation perplexity")
    _save(fig, path)


def throughput_vs_bandwidth(
    runs: list[dict[str, Any]], path: Path, repeats: list[dict[str, Any]] | None = None
) -> None:
    """Tokens per second of every strategy at every link rate; the unthrottled run is the compute-only bound.

    ``repeats`` (runs of the same configurations measured again) are drawn as hollow markers: their spread shows
    how much the machine's load moved single measurements.
    """
    rates = links(runs)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    positions = range(len(rates))
    for strategy, label in LABELS.items():
        by_rate = {
            r["driver"]["link_mbit"]: summarize(r).tokens_per_s
            for r in main_comparison(runs)
            if r["config"]["strategy"] == strategy
        }
        ax.plot(
            positions,
            [by_rate.get(rate, math.nan) for rate in rates],
            marker="o",
            label=label,
            color=COLORS[strategy],
        )
    for run in main_comparison(repeats or []):
        strategy = run["config"]["strategy"]
        x = rates.index(run["driver"]["link_mbit"])
        ax.plot([x], [summarize(run).tokens_per_s], marker="o", fillstyle="none", color=COLORS[strategy])
    if repeats:
        ax.plot([], [], marker="o", fillstyle="none", linestyle="", color="gray", label="repeated run")
    ax.set_xticks(list(positions), [link_label(rate) for rate in rates])
    ax.set_xlabel("inter-node link bandwidth (each direction)")
    ax.set_ylabel("training tokens / s (all ranks)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    _save(fig, path)


def bytes_per_step(runs: list[dict[str, Any]], path: Path) -> None:
    """Link bytes per optimizer step (left) and per outer step against the analytic minimum (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.2]})
    main = main_comparison(runs)
    rates = links(main)
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        values = []
        for strategy in LABELS:
            match = [r for r in main if r["config"]["strategy"] == strategy and r["driver"]["link_mbit"] == rate]
            values.append(summarize(match[0]).link_bytes_per_step / 1e6 if match else math.nan)
        left.bar([k + i * width for k in range(len(LABELS))], values, width, label=link_label(rate))
    left.set_xticks([k + width * (len(rates) - 1) / 2 for k in range(len(LABELS))], list(LABELS.values()))
    left.set_yscale("log")
    left.set_ylabel("MB into inter-node links / optimizer step")
    left.legend(fontsize=7)
    left.grid(alpha=0.3, axis="y", which="both")
    federated = [r for r in runs if r["syncs"]]
    names = [
        f"{LABELS[r['config']['strategy']]} H={r['config']['sync_every']} {r['config']['outer_optimizer']}, "
        f"{link_label(r['driver']['link_mbit'])}"
        for r in federated
    ]
    ratios = [summarize(r).sync_ratio for r in federated]
    ys = range(len(federated))
    right.axvspan(0.9, 1.1, color="tab:green", alpha=0.12, label="target: within 10%")
    right.axvline(1.0, color="black", linewidth=0.8)
    right.barh(list(ys), ratios, 0.6, color="tab:blue")
    for y, ratio in zip(ys, ratios):
        right.text(ratio + 0.005, y, f"{ratio:.3f}", va="center", fontsize=7)
    right.set_yticks(list(ys), names, fontsize=7)
    right.set_xlim(0.85, 1.15)
    right.set_xlabel("link bytes per outer step / analytic minimum")
    right.legend(fontsize=7, loc="lower right")
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results_file: Path, out_dir: Path, repeat_file: Path | None = None) -> list[Path]:
    """Draw every figure of the sweep in ``results_file`` into ``out_dir``; return the files.

    Args:
        results_file: Results JSON of :mod:`benchmarks.run`.
        out_dir: Folder for the PNG files.
        repeat_file: Optional results of some of the same runs measured again (shown in the throughput plot).
    """
    runs = load(results_file)["runs"]
    repeats = load(repeat_file)["runs"] if repeat_file is not None else []
    paths = [out_dir / name for name in FIGURES]
    ppl_vs_time(runs, paths[0])
    ppl_vs_tokens(runs, paths[1])
    throughput_vs_bandwidth(runs, paths[2], repeats)
    bytes_per_step(runs, paths[3])
    return paths


FIGURES = ("ppl_vs_time.png", "ppl_vs_tokens.png", "throughput_vs_bandwidth.png", "bytes_per_step.png")


def main() -> None:
    parser = argparse.ArgumentParser(description="Plot a benchmark results JSON.")
    parser.add_argument("results", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repeat", type=Path, help="results of repeated runs, drawn as hollow markers")
    args = parser.parse_args()
    for path in plot_all(args.results, args.out_dir, args.repeat):
        print(path)


if __name__ == "__main__":
    main()
