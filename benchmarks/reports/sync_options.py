"""The sync options side by side (the ``sync_grid`` sweep) and the default sync against FSDP (``defaults``).

Both are sweeps of the throughput sweep's shape, summed up by :mod:`benchmarks.reports.sweep`; this module draws the
sync grid's figures: both utilization measures per option, and each option's link bytes against the byte model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.metrics import link_label
from benchmarks.reports import plotting
from benchmarks.reports.sweep import ordered

_MEASURES = (("utilization", "vs the no-sync run"), ("inrun_utilization", "in-run"))


def options(summary: dict[str, Any]) -> list[str]:
    """The configurations that sync, in table order."""
    return [key for key in ordered(summary) if "nosync" not in summary[key]["kind"]]


def plot(summary: dict[str, Any], images: Path, prefix: str = "sync_grid") -> list[Path]:
    """Both utilizations per option (median, min-max bars), and each option's link bytes against the byte model."""
    names = options(summary)
    x = range(len(names))
    fig, ax = plotting.figure()
    for offset, (metric, label) in zip((-0.2, 0.2), _MEASURES):
        stats = [summary[n][metric] for n in names]
        err = [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
        ax.bar([i + offset for i in x], [s["median"] for s in stats], 0.4, yerr=err, capsize=3, label=label)
    plotting.target_line(ax)
    ax.set_xticks(list(x), [f"{summary[n]['kind']}\n{link_label(summary[n]['link'])}" for n in names], fontsize=6)
    ax.set(ylabel="compute utilization")
    title = "Sync options: compute utilization (median, min-max)"
    paths = [plotting.save(fig, ax, title, images / f"{prefix}_utilization.png")]

    fig, ax = plotting.figure()
    plotting.bytes_bars(ax, summary, names, [summary[n]["kind"] for n in names])
    ax.tick_params(axis="x", labelrotation=60, labelsize=6)
    title = "Sync options: link bytes against the byte model"
    paths.append(plotting.save(fig, ax, title, images / f"{prefix}_bytes.png"))
    return paths
