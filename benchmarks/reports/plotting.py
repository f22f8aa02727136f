"""The few drawing primitives of the reports' figures (matplotlib, PNG, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.metrics import UTILIZATION_TARGET, Spread  # noqa: E402

FIGSIZE = (7, 4.2)


def figure(size: tuple[float, float] = FIGSIZE) -> tuple[Any, Any]:
    """A new figure with one axes."""
    return plt.subplots(figsize=size)


def errorbars(ax: Any, xs: Sequence[float], spreads: Sequence[Spread], centre: str = "median", **style: Any) -> None:
    """Medians (or means: ``centre="mean"``) joined by a line, with min-max bars."""
    low = [s[centre] - s["min"] for s in spreads]
    high = [s["max"] - s[centre] for s in spreads]
    ax.errorbar(list(xs), [s[centre] for s in spreads], yerr=[low, high], marker="o", capsize=3, **style)


def bar_pair(
    ax: Any, labels: Sequence[str], left: Sequence[float], right: Sequence[float], names: Sequence[str]
) -> None:
    """Two bars per label, side by side (``names``: the legend of the left and the right bar)."""
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], list(left), 0.4, label=names[0])
    ax.bar([i + 0.2 for i in x], list(right), 0.4, label=names[1])
    ax.set_xticks(list(x), list(labels))


def bytes_bars(ax: Any, summary: dict[str, Any], keys: Sequence[str], labels: Sequence[str]) -> None:
    """Each configuration's link bytes per step (median) beside the byte model's, in MB."""
    measured = [summary[k]["link_bytes_per_step"]["median"] / 1e6 for k in keys]
    model = [summary[k]["model_bytes_per_step"] / 1e6 for k in keys]
    bar_pair(ax, labels, measured, model, ("link counters (median)", "byte model"))
    ax.set(ylabel="MB per optimizer step (all nodes)")


def target_line(ax: Any) -> None:
    """The utilization target, dashed."""
    ax.axhline(UTILIZATION_TARGET, color="grey", linestyle="--", linewidth=1)


def save(fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Title, legend, tight layout; write ``path`` and close the figure."""
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
