"""Side by side with torchft: its own DiLoCo against this package on the same cluster, model, data and links.

Input: the ``torchft`` preset (``python -m benchmarks.run --preset torchft``), 4 nodes x 1 rank, 64 steps, a sync
every 8; repeat ``r`` trains with seed ``r``. Per configuration and link:

- **tokens/s** over the pace window (steps 9-64, after the first sync; :func:`benchmarks.metrics.tokens_per_second`),
  from the clock each system records after every optimizer step;
- **link bytes per sync**: what crossed the emulated links during training (the driver's counters, all nodes),
  divided by the syncs (the outer steps; with fragments, the fragments' landings);
- **blocking per sync**: the median over the syncs of the optimizer step that synced, less the median of the steps
  that did not: the time a sync holds training back, measured the same way on both systems;
- **perplexity** after 64 steps, and paired by seed against torchft's DiLoCo with the same settings.

Run ``python -m benchmarks.reports.torchft [results.json]`` for the table (Markdown) and the plot
(``docs/images/torchft.png``).

The failure (``python -m benchmarks.torchft_kill``, ``torchft_kill.json``): one group killed at the same step on
each side; per side the medians over repeats of the survivors' stall, the committed tokens/s and the syncs lost
(:func:`kill_rows`).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import metrics, records
from benchmarks.harness.sweep import RESULTS

#: Each of this package's configurations, and the torchft configuration it is paired with.
PAIRS = {
    "fl_fsdp-torchft-same": "torchft-diloco",
    "fl_fsdp-defaults": "torchft-diloco",
    "fl_fsdp-torchft-streaming": "torchft-streaming",
    "fl_fsdp-torchft-same-elastic": "torchft-diloco",
    "fl_fsdp-defaults-elastic": "torchft-diloco",
}
#: What each configuration guarantees: torchft's side and our elastic side vote to commit every sync through a
#: quorum at the lighthouse and go on without a group that fails; our one-job side does neither (a failed group ends
#: the job, which resumes from a checkpoint).
GUARANTEES = {
    "torchft-diloco": "fault-tolerant (quorum, commit vote)",
    "torchft-streaming": "fault-tolerant (quorum, commit vote)",
    "fl_fsdp-torchft-same-elastic": "fault-tolerant (quorum, commit vote)",
    "fl_fsdp-defaults-elastic": "fault-tolerant (quorum, commit vote)",
}
ONE_JOB = "one job (a failure ends it; resume from a checkpoint)"

Row = dict[str, Any]
#: The failure runs' results (:mod:`benchmarks.torchft_kill`).
KILL_RESULTS = RESULTS / "torchft_kill.json"
#: Where the plot goes, for the docs.
IMAGE = RESULTS.parents[1] / "docs" / "images" / "torchft.png"


def step_seconds(run: dict[str, Any]) -> dict[int, float]:
    """Seconds of every optimizer step after the first, from the clocks recorded after each."""
    clocks = {s["step"]: s["clock"] for s in run["steps"]}
    return {step: clocks[step] - clocks[step - 1] for step in sorted(clocks) if step - 1 in clocks}


def blocking_per_sync(run: dict[str, Any]) -> float:
    """Median seconds of a step that synced, less the median of the steps that did not (see the module)."""
    seconds = step_seconds(run)
    synced = {s["step"] for s in run["syncs"]}
    with_sync = [t for step, t in seconds.items() if step in synced]
    without = [t for step, t in seconds.items() if step not in synced]
    if not with_sync or not without:
        return float("nan")
    return statistics.median(with_sync) - statistics.median(without)


def link_bytes_per_sync(run: dict[str, Any]) -> float:
    """Bytes that crossed the links during training, all nodes, per sync."""
    sent = run.get("link_tx_train", run["driver"]["link_tx_total"])
    return float(sent) / max(1, len(run["syncs"]))


def rows(runs: list[dict[str, Any]]) -> list[Row]:
    """One row per configuration and link: medians over repeats, with min and max, and the paired perplexity."""
    cells: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    for run in runs:
        identity = metrics.identity(run)
        cells.setdefault((identity.configuration, identity.link_mbit), []).append(run)
    out = []
    for (configuration, link), group in sorted(cells.items(), key=lambda c: (metrics.link_order(c[0][1]), c[0][0])):
        pace = metrics.spread(metrics.tokens_per_second(r) for r in group)
        row: Row = {
            "configuration": configuration,
            "link": metrics.link_label(link),
            "repeats": len(group),
            "tokens_per_s": pace,
            "link_mb_per_sync": statistics.median(link_bytes_per_sync(r) for r in group) / 1e6,
            "blocking_s": statistics.median(blocking_per_sync(r) for r in group),
            "ppl": metrics.spread(metrics.final_ppl(r) for r in group),
        }
        baseline = PAIRS.get(configuration)
        if baseline is not None and (baseline, link) in cells:
            theirs = {r["config"]["seed"]: r for r in cells[(baseline, link)]}
            pairs = [(r, theirs[r["config"]["seed"]]) for r in group if r["config"]["seed"] in theirs]
            row["pace_vs_torchft"] = statistics.median(
                metrics.tokens_per_second(a) / metrics.tokens_per_second(b) for a, b in pairs
            )
            row["ppl_vs_torchft"] = statistics.median(metrics.final_ppl(a) / metrics.final_ppl(b) - 1 for a, b in pairs)
        out.append(row)
    return out


def table(out: list[Row]) -> str:
    """The rows as a Markdown table."""
    header = ["configuration", "guarantees", "link", "tokens/s (median [min, max])", "link MB / sync",
              "blocking / sync (s)", "perplexity", "ours / torchft: pace", "ours / torchft: perplexity"]  # fmt: skip
    return _markdown(
        header,
        [
            [
                row["configuration"],
                GUARANTEES.get(row["configuration"], ONE_JOB),
                row["link"],
                _spread(row["tokens_per_s"], ",.0f"),
                f"{row['link_mb_per_sync']:.2f}",
                f"{row['blocking_s']:.2f}",
                f"{row['ppl']['median']:.1f}",
                _ratio(row.get("pace_vs_torchft")),
                _percent(row.get("ppl_vs_torchft")),
            ]
            for row in out
        ],
    )


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``rows`` under ``header``."""
    lines = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"]
    return "\n".join(lines + [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows])


def _spread(spread: dict[str, float] | None, fmt: str) -> str:
    """``median [min, max]`` in ``fmt``, or ``-``."""
    if spread is None:
        return "-"
    return f"{spread['median']:{fmt}} [{spread['min']:{fmt}}, {spread['max']:{fmt}}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def plot(out: list[Row], path: Path) -> None:
    """Tokens/s by link, a line per configuration (median, with min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(row["link"] for row in out))  # the rows' order: unthrottled, then the fastest link
    fig, ax = plt.subplots(figsize=(7, 4))
    for configuration in sorted({row["configuration"] for row in out}):
        mine = {row["link"]: row["tokens_per_s"] for row in out if row["configuration"] == configuration}
        xs = [i for i, link in enumerate(links) if link in mine]
        medians = [mine[links[i]]["median"] for i in xs]
        errors = [
            [mine[links[i]]["median"] - mine[links[i]]["min"] for i in xs],
            [mine[links[i]]["max"] - mine[links[i]]["median"] for i in xs],
        ]
        style = "--" if configuration.startswith("torchft") else "-"
        ax.errorbar(xs, medians, yerr=errors, label=configuration, linestyle=style, marker="o", capsize=3)
    ax.set_xticks(range(len(links)), links)
    ax.set_ylabel("tokens/s (4 nodes x 1 rank)")
    ax.set_title("torchft's DiLoCo and lightning_fedshard, same model, data and links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kill_rows(results: dict[str, Any]) -> list[Row]:
    """One row per side of the failure runs: medians [min, max] over repeats."""
    out = []
    for side in ("torchft", "fedshard"):
        mine = [run["result"] for run in results["runs"] if run["side"] == side]
        if not mine:
            continue
        stalls = [r["stall_seconds"] for r in mine if r["stall_seconds"] is not None]
        out.append(
            {
                "side": side,
                "repeats": len(mine),
                "stall_s": metrics.spread(stalls) if stalls else None,
                "committed_tokens_per_s": metrics.spread(r["committed_tokens_per_s"] for r in mine),
                "lost_syncs": statistics.median(r["lost_syncs"] for r in mine),
            }
        )
    return out


def kill_table(out: list[Row]) -> str:
    """The failure rows as a Markdown table."""
    header = ["system", "repeats", "survivors' stall (s, median [min, max])", "committed tokens/s (median [min, max])",
              "syncs lost"]  # fmt: skip
    return _markdown(
        header,
        [
            [
                row["side"],
                str(row["repeats"]),
                _spread(row["stall_s"], ".2f"),
                _spread(row["committed_tokens_per_s"], ",.0f"),
                f"{row['lost_syncs']:g}",
            ]
            for row in out
        ],
    )


def main(argv: list[str] | None = None) -> None:
    """Print the table of a results file (default: the preset's) and draw the plot beside it; then the failure
    table, if its results exist."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else RESULTS / "torchft.json"
    out = rows(records.load(path)["runs"])  # the latest invocation's runs of each cell
    print(table(out))
    plot(out, IMAGE)
    print(f"plot: {IMAGE}")
    if KILL_RESULTS.exists():
        print()
        print(kill_table(kill_rows(json.loads(KILL_RESULTS.read_text()))))


if __name__ == "__main__":
    main()


# -- targets -------------------------------------------------------------------------------------------------------

PACE_SAME_TEXT = "our tokens/s / torchft's DiLoCo's, same algorithm and settings (float32, outer Nesterov), each link"
PPL_SAME_TEXT = "perplexity after 64 steps, same settings, paired by seed against torchft's DiLoCo"
PACE_DEFAULT_TEXT = "our defaults' tokens/s / torchft's float32 DiLoCo's at 20 Mbit/s"
KILL_TEXT = "our survivors' stall / torchft's, one group killed at the same step"
PACE_SAME_ELASTIC_TEXT = (
    "our tokens/s as an elastic federation (quorum and commit vote, as torchft) / torchft's DiLoCo's, same algorithm"
    " and settings, each link"
)
PACE_DEFAULT_ELASTIC_TEXT = "our defaults' tokens/s as an elastic federation / torchft's float32 DiLoCo's at 20 Mbit/s"
DEFAULT_LINK = 20.0
TARGET_IDS = (
    "torchft-pace-same",
    "torchft-ppl-same",
    "torchft-pace-default",
    "torchft-kill-stall",
    "torchft-pace-same-elastic",
    "torchft-pace-default-elastic",
    "lightning-step-overhead",
)
OVERHEAD_TEXT = (
    "our rank's CPU seconds per step over torchft's loop's (rank 0 / node 0), same algorithm, model and batch,"
    " unthrottled, paired by repeat"
)


def targets(results: dict[str, Any] | None, kill_results: dict[str, Any] | None = None) -> list[Row]:
    """The rows ``torchft-pace-same``, ``torchft-ppl-same``, ``torchft-pace-default`` and ``torchft-kill-stall``."""
    kill = kill_target(kill_results)
    if results is None:
        return [
            _row("torchft-pace-same", PACE_SAME_TEXT, math.nan, 1.0, False, 0),
            _row("torchft-ppl-same", PPL_SAME_TEXT, math.nan, 0.01, False, 0),
            _row("torchft-pace-default", PACE_DEFAULT_TEXT, math.nan, 1.5, False, 0),
            kill,
            _row("torchft-pace-same-elastic", PACE_SAME_ELASTIC_TEXT, math.nan, 1.0, False, 0),
            _row("torchft-pace-default-elastic", PACE_DEFAULT_ELASTIC_TEXT, math.nan, 1.5, False, 0),
            _row("lightning-step-overhead", OVERHEAD_TEXT, math.nan, 1.03, False, 0),
        ]
    out = rows(results["runs"])
    same = [r for r in out if r["configuration"] == "fl_fsdp-torchft-same" and "pace_vs_torchft" in r]
    by_link = {r["link"]: r["pace_vs_torchft"] for r in same}
    worst = min(by_link.values(), default=math.nan)
    runs = sum(2 * r["repeats"] for r in same)
    rows_out = [_row("torchft-pace-same", PACE_SAME_TEXT, worst, 1.0, worst >= 1.0, runs, per_link=by_link)]
    gaps = {r["link"]: r["ppl_vs_torchft"] for r in same}
    gap = max((abs(g) for g in gaps.values()), default=math.nan)
    rows_out.append(_row("torchft-ppl-same", PPL_SAME_TEXT, gap, 0.01, gap <= 0.01, runs, per_link=gaps))
    default = [
        r for r in out if r["configuration"] == "fl_fsdp-defaults" and r["link"] == metrics.link_label(DEFAULT_LINK)
    ]
    ratio = default[0]["pace_vs_torchft"] if default and "pace_vs_torchft" in default[0] else math.nan
    rows_out.append(
        _row(
            "torchft-pace-default",
            PACE_DEFAULT_TEXT,
            ratio,
            1.5,
            ratio >= 1.5,
            2 * default[0]["repeats"] if default else 0,
        )
    )
    return [*rows_out, kill, *_elastic_rows(out), overhead_row(results["runs"])]


def cpu_per_step(run: dict[str, Any]) -> float:
    """Rank 0's (node 0's) CPU seconds per optimizer step, validation included on both sides."""
    return float(run["cpu_seconds"][0]) / run["config"]["max_steps"]


def overhead_row(runs: list[dict[str, Any]]) -> Row:
    """``lightning-step-overhead``: our rank's CPU per step over torchft's, the same seed, unthrottled."""
    ours: dict[int, float] = {}
    theirs: dict[int, float] = {}
    for run in runs:
        identity = metrics.identity(run)
        if identity.link_mbit is None and run.get("cpu_seconds"):
            side = {"fl_fsdp-torchft-same": ours, "torchft-diloco": theirs}.get(identity.configuration)
            if side is not None:
                side[run["config"]["seed"]] = cpu_per_step(run)
    ratios = [ours[seed] / theirs[seed] for seed in ours if seed in theirs]
    ratio = statistics.median(ratios) if ratios else math.nan
    return _row("lightning-step-overhead", OVERHEAD_TEXT, ratio, 1.03, ratio <= 1.03, 2 * len(ratios),
                per_repeat=ratios)  # fmt: skip


def _elastic_rows(out: list[Row]) -> list[Row]:
    """Our side as an elastic federation, with the same guarantees as torchft's: every link, and the default at 20."""
    same = [r for r in out if r["configuration"] == "fl_fsdp-torchft-same-elastic" and "pace_vs_torchft" in r]
    by_link = {r["link"]: r["pace_vs_torchft"] for r in same}
    worst = min(by_link.values(), default=math.nan)
    runs = sum(2 * r["repeats"] for r in same)
    rows = [_row("torchft-pace-same-elastic", PACE_SAME_ELASTIC_TEXT, worst, 1.0, worst >= 1.0, runs, per_link=by_link)]
    default = [r for r in out if r["configuration"] == "fl_fsdp-defaults-elastic"
               and r["link"] == metrics.link_label(DEFAULT_LINK) and "pace_vs_torchft" in r]  # fmt: skip
    ratio = default[0]["pace_vs_torchft"] if default else math.nan
    rows.append(_row("torchft-pace-default-elastic", PACE_DEFAULT_ELASTIC_TEXT, ratio, 1.5, ratio >= 1.5,
                     2 * default[0]["repeats"] if default else 0))  # fmt: skip
    return rows


def kill_target(results: dict[str, Any] | None) -> Row:
    """``torchft-kill-stall``: the median of our survivors' stalls over the median of torchft's.

    When torchft's survivors did not stall at all (a sync that fails at once costs them a round of training, not
    time: see the committed tokens/s), the target is met only if ours did not either (within 0.05 s).
    """
    sides = {row["side"]: row for row in kill_rows(results)} if results is not None else {}
    if not {"torchft", "fedshard"} <= sides.keys() or any(sides[s]["stall_s"] is None for s in sides):
        return _row("torchft-kill-stall", KILL_TEXT, math.nan, 1.0, False, 0, note="not run yet")
    ours, theirs = sides["fedshard"]["stall_s"]["median"], sides["torchft"]["stall_s"]["median"]
    ratio = ours / theirs if theirs > 0.05 else (1.0 if ours <= 0.05 else math.inf)
    runs = sides["fedshard"]["repeats"] + sides["torchft"]["repeats"]
    pace = {side: sides[side]["committed_tokens_per_s"]["median"] for side in sides}
    return _row(
        "torchft-kill-stall", KILL_TEXT, ratio, 1.0, ratio <= 1.0, runs, stall_s={"ours": ours, "torchft": theirs},
        committed_tokens_per_s=pace,
    )  # fmt: skip


def _row(target_id: str, target: str, measured: float, bound: float, met: bool, runs: int, **more: Any) -> Row:
    value = None if math.isnan(measured) else measured
    return {"id": target_id, "target": target, "measured": value, "bound": bound, "met": met, "runs": runs, **more}
