"""Issue 8's targets from a ``sync_options`` sweep: utilization, bytes per sync and perplexity of each sync option.

Reads the results JSON written by ``python -m benchmarks.run --preset sync_options`` (nothing runs a model) and
prints the tables of docs/benchmarks.md ("Sync options (issue 8)"); ``--summary`` also writes every derived number
as JSON, ``--plot`` draws the utilization figure::

    python -m benchmarks.sync_report benchmarks/results/sync_options.json \\
        --summary benchmarks/results/sync_options_summary.json --plot docs/images/sync_options_utilization.png

Definitions (all per run, then median and min-max over the repeats):

- **pace window**: optimizer steps ``first_sync + 1 .. max_steps`` (steps 9-40 with ``sync_every=8``,
  ``max_steps=40``): whole rounds after the first sync, so every configuration has the same number of syncs per step
  in it (one per fragment per round) and lazy initialization is left out. Step time = clock difference / steps.
- **utilization**: step time of the same repeat's ``nosync`` run (no outer step during training) / step time of
  the run. Runs of one repeat ran minutes apart at most (round robin), so both saw similar machine load.
- **strategy utilization**: mean over the syncs that land in the window of ``fedshard/compute_utilization`` as the
  strategy logged it on rank 0 (compute / (compute + exposed sync time) over the round the sync closes).
- **bytes per round**: bytes of one sync of every fragment (= one sync of the whole model), all ranks together:
  from the strategy's ``fedshard/sync_bytes`` (summed over ranks), and from the link counters (every node's upload:
  the training window minus validation and the end-of-fit syncs, / the number of rounds); for runs without overlap
  also the mean of the per-sync link windows.
- **perplexity**: the validation at the end of training (step ``max_steps``, consensus weights).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

#: Targets of issue 8.
UTILIZATION_TARGET = 0.95
BYTES_TARGETS = {"int8": 0.27, "int4_ef": 0.14}
PPL_TARGETS = {"int8": 0.01, "int4_ef": 0.03}

LABELS = {
    "nosync": "no sync (sync_every > max_steps)",
    "float32": "float32 (default)",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "int4_ef": "int4 + error feedback",
    "frag4": "fragments=4",
    "frag4_d1": "fragments=4, sync_delay=1",
    "int8_frag4_d1": "int8, fragments=4, sync_delay=1",
    "int4_ef_frag4_d1": "int4 + EF, fragments=4, sync_delay=1",
}


def option_and_repeat(name: str) -> tuple[str, int]:
    option, _, repeat = name.rpartition("-r")
    return option, int(repeat)


def analyze_run(run: dict[str, Any]) -> dict[str, Any]:
    """The derived numbers of one run."""
    cfg = run["config"]
    clocks = {0: 0.0, **{s["step"]: s["clock"] for s in run["steps"]}}
    max_steps = cfg["max_steps"]
    sync_every = cfg["sync_every"]
    # One whole round after the first sync; a run of a single round (sync_every == max_steps) is measured whole; the
    # no-sync run uses the same window as the others.
    first = sync_every if sync_every < max_steps else (0 if sync_every == max_steps else 8)
    window = range(first + 1, max_steps + 1)
    step_time = (clocks[max_steps] - clocks[first]) / len(window)
    durations = {s: clocks[s] - clocks[s - 1] for s in window}
    interval = sync_every // cfg["fragments"]
    landing = {s for s in window if s % interval == 0} if sync_every <= max_steps else set()
    starting = {s - cfg["sync_delay"] for s in landing} if cfg["sync_delay"] else set()
    quiet = [d for s, d in durations.items() if s not in landing and s not in starting]
    window_seconds = clocks[max_steps] - clocks[first]
    rounds_in_run = max_steps // sync_every if sync_every <= max_steps else 0
    rounds_in_window = len(window) // sync_every if sync_every <= max_steps else 0

    rank0 = [s for s in run["strategy_syncs"][0] if s["when"] == "train"]
    in_window = [s for s in rank0 if s["step"] in window]
    utilizations = [s["compute_utilization"] for s in in_window if s["compute_utilization"] is not None]
    logged_bytes_window = sum(
        s["sync_bytes"] for r in run["strategy_syncs"] for s in r if s["step"] in window and s["when"] == "train"
    )
    exposed_window = sum(s["sync_exposed_seconds"] for s in in_window)
    link_training_syncs = run["link_tx_train"] - run["link_tx_val"] - run["link_tx_finish"]
    per_sync_windows = [s["tx_bytes"] for s in run["syncs"]]
    return {
        "name": run["name"],
        "step_time": step_time,
        "window_steps": [window.start, window.stop - 1],
        "quiet_step_time_median": statistics.median(quiet) if quiet else math.nan,
        "quiet_step_time_mean": statistics.fmean(quiet) if quiet else math.nan,
        # In-run: the run's own steps without any sync work against all its steps; with one fragment only (7 of 8
        # steps). With 4 fragments every other step lands, and the steps right after a landing ran faster than the
        # no-sync run's steps (ranks leave a sync aligned), which makes the ratio meaningless.
        "inrun_utilization": statistics.fmean(quiet) / step_time
        if quiet and landing and cfg["fragments"] == 1
        else math.nan,
        "strategy_utilization_mean": statistics.fmean(utilizations) if utilizations else math.nan,
        # The same as the strategy's figure, aggregated over the window: 1 - exposed sync time / window time.
        "strategy_utilization_window": 1 - exposed_window / window_seconds if landing else math.nan,
        "exposed_seconds_per_round": sum(s["sync_exposed_seconds"] for s in in_window) / rounds_in_window
        if rounds_in_window
        else math.nan,
        "sync_seconds_per_round": sum(s["sync_seconds"] for s in in_window) / rounds_in_window
        if rounds_in_window
        else math.nan,
        "logged_bytes_per_round": logged_bytes_window / rounds_in_window if rounds_in_window else math.nan,
        "link_bytes_per_round": link_training_syncs / rounds_in_run if rounds_in_run else math.nan,
        "link_bytes_training_syncs": link_training_syncs,
        "link_bytes_per_sync_window": statistics.fmean(per_sync_windows)
        if per_sync_windows and cfg["fragments"] == 1 and cfg["sync_delay"] == 0
        else math.nan,
        "num_landings_in_window": len(in_window),
        "final_ppl": run["vals"][-1]["val_ppl"] if run["vals"] else math.nan,
        "train_seconds": run["train_seconds"],
        "wall_seconds": run["driver"]["wall_seconds"],
        "load_before": run["loadavg_before"],
        "load_after": run["loadavg_after"],
    }


def _spread(values: list[float]) -> dict[str, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run and per configuration (over repeats): utilization, bytes, perplexity, against the targets.

    Args:
        results: Results JSONs of ``sync_options`` sweeps (their runs are pooled; names must not repeat).
    """
    raw = [run for result in results for run in result["runs"]]
    runs = {r["name"]: analyze_run(r) for r in raw}
    if len(runs) != len(raw):
        raise ValueError("The results hold two runs of the same name.")
    by_repeat: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for name, run in runs.items():
        option, repeat = option_and_repeat(name)
        by_repeat[repeat][option] = run
    for in_repeat in by_repeat.values():
        base = in_repeat.get("nosync")
        f32 = in_repeat.get("float32")
        for run in in_repeat.values():
            run["utilization"] = base["step_time"] / run["step_time"] if base else math.nan
            for key in ("logged_bytes_per_round", "link_bytes_per_round", "link_bytes_per_sync_window"):
                run[f"{key}_vs_float32"] = run[key] / f32[key] if f32 else math.nan
            run["ppl_vs_float32"] = run["final_ppl"] / f32["final_ppl"] - 1 if f32 else math.nan
    options = [o for o in LABELS if any(option_and_repeat(n)[0] == o for n in runs)]
    per_option: dict[str, dict[str, Any]] = {}
    for option in options:
        mine = [r for n, r in runs.items() if option_and_repeat(n)[0] == option]
        keys = [k for k, v in mine[0].items() if isinstance(v, float)]
        per_option[option] = {key: _spread([r[key] for r in mine]) for key in keys}
        per_option[option]["final_ppl_values"] = sorted({round(r["final_ppl"], 4) for r in mine})
        per_option[option]["load_1min"] = _spread([(r["load_before"][0] + r["load_after"][0]) / 2 for r in mine])
    nosync = per_option.get("nosync", {}).get("step_time")
    for option, spread in per_option.items():
        # Ratio of the median step times: each median pools the repeats of one configuration separately, so one
        # noisy no-sync run does not move every ratio of its repeat.
        spread["utilization_of_medians"] = nosync["median"] / spread["step_time"]["median"] if nosync else math.nan
    failed = [f["name"] for result in results for f in result.get("failed", [])]
    return {"runs": runs, "options": per_option, "failed": failed, "targets": targets(per_option)}


def targets(options: dict[str, Any]) -> dict[str, Any]:
    """Each target of issue 8: measured values and a verdict.

    Utilization has two measures that disagree when the machine's load moves between runs: the between-run ratio
    (the target's definition) and the strategy's in-run figure. The verdict is "met" when both medians reach the
    target, "missed" when both fall short, and "not resolved" otherwise.
    """
    out: dict[str, Any] = {}
    synced = {o: v for o, v in options.items() if o != "nosync"}
    if synced:
        measures = {}
        for key in ("utilization", "strategy_utilization_window"):
            best = max(synced, key=lambda o: _median_or(synced[o][key], -math.inf))
            measures[key] = {"best": best, **synced[best][key]}
        best = max(synced, key=lambda o: synced[o]["utilization_of_medians"])
        measures["utilization_of_medians"] = {"best": best, "value": synced[best]["utilization_of_medians"]}
        both = [measures[k]["median"] >= UTILIZATION_TARGET for k in ("utilization", "strategy_utilization_window")]
        verdict = "met" if all(both) else "missed" if not any(both) else "not resolved"
        out["utilization"] = {**measures, "target": UTILIZATION_TARGET, "verdict": verdict}
    for option, limit in BYTES_TARGETS.items():
        if option in options:
            logged = options[option]["logged_bytes_per_round_vs_float32"]["median"]
            link = options[option]["link_bytes_per_sync_window_vs_float32"]["median"]
            met = logged <= limit and link <= limit
            out[f"bytes_{option}"] = {"logged": logged, "link": link, "target": limit, "verdict": _verdict(met)}
    for option, limit in PPL_TARGETS.items():
        if option in options:
            value = options[option]["ppl_vs_float32"]["median"]
            out[f"ppl_{option}"] = {"relative": value, "target": limit, "verdict": _verdict(abs(value) <= limit)}
    return out


def _median_or(spread: dict[str, float], default: float) -> float:
    return default if math.isnan(spread["median"]) else spread["median"]


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


def _range(s: dict[str, float], fmt: str = "{:.2f}") -> str:
    if s["n"] == 0:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _mb(s: dict[str, float]) -> dict[str, float]:
    return {**s, "median": s["median"] / 1e6, "min": s["min"] / 1e6, "max": s["max"] / 1e6}


def markdown(summary: dict[str, Any]) -> str:
    """The tables of the docs section."""
    opts = summary["options"]
    lines = [
        "| configuration | step time s | utilization vs no-sync run | ratio of medians | vs own quiet steps | "
        "strategy's compute_utilization | exposed s / round | MB / round logged | MB / round link | "
        "vs float32 logged / link | final ppl | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for option, s in opts.items():
        ratio = "-"
        if option not in ("nosync", "float32"):
            ratio = (
                f"{s['logged_bytes_per_round_vs_float32']['median']:.3f} / "
                f"{s['link_bytes_per_round_vs_float32']['median']:.3f}"
            )
        lines.append(
            f"| {LABELS[option]} | {_range(s['step_time'], '{:.3f}')} | "
            f"{'1 (reference)' if option == 'nosync' else _range(s['utilization'])} | "
            f"{s['utilization_of_medians']:.2f} | "
            f"{_range(s['inrun_utilization'])} | {_range(s['strategy_utilization_window'])} | "
            f"{_range(s['exposed_seconds_per_round'])} | {_range(_mb(s['logged_bytes_per_round']))} | "
            f"{_range(_mb(s['link_bytes_per_round']))} | {ratio} | "
            f"{', '.join(f'{p:.2f}' for p in s['final_ppl_values'])} | {_range(s['load_1min'], '{:.0f}')} |"
        )
    lines += ["", *per_repeat_table(summary), "", "| target | measured | verdict |", "|---|---|---|"]
    t = summary["targets"]
    if "utilization" in t:
        u = t["utilization"]
        between, inrun, pooled = u["utilization"], u["strategy_utilization_window"], u["utilization_of_medians"]
        lines.append(
            f"| utilization >= {u['target']} of the no-sync pace (best combination) | between runs: "
            f"{LABELS[between['best']]} {_range(between)}; ratio of medians: {LABELS[pooled['best']]} "
            f"{pooled['value']:.2f}; in run (strategy): {LABELS[inrun['best']]} {_range(inrun)} | {u['verdict']} |"
        )
    for option in BYTES_TARGETS:
        if (b := t.get(f"bytes_{option}")) is not None:
            lines.append(
                f"| {LABELS[option]} bytes / sync <= {b['target']} x float32 | logged {b['logged']:.3f}, "
                f"link {b['link']:.3f} | {b['verdict']} |"
            )
    for option in PPL_TARGETS:
        if (p := t.get(f"ppl_{option}")) is not None:
            lines.append(
                f"| {LABELS[option]} ppl within {p['target']:.0%} of float32 | {p['relative']:+.3%} | {p['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def per_repeat_table(summary: dict[str, Any]) -> list[str]:
    """Utilization against the no-sync run of the same repeat, one column per repeat (the noise, run by run)."""
    runs = summary["runs"]
    repeats = sorted({option_and_repeat(n)[1] for n in runs})
    options = [o for o in LABELS if any(option_and_repeat(n)[0] == o for n in runs)]
    head = "| configuration | " + " | ".join(f"repeat {r}" for r in repeats) + " |"
    lines = [head, "|---|" + "---|" * len(repeats)]
    for option in options:
        cells = []
        for repeat in repeats:
            run = runs.get(f"{option}-r{repeat}")
            if run is None:
                cells.append("failed")
            elif option == "nosync":
                cells.append(
                    f"{run['step_time']:.3f} s/step, load {(run['load_before'][0] + run['load_after'][0]) / 2:.0f}"
                )
            else:
                cells.append(
                    f"{run['utilization']:.2f} (load {(run['load_before'][0] + run['load_after'][0]) / 2:.0f})"
                )
        lines.append(f"| {LABELS[option]} | " + " | ".join(cells) + " |")
    return lines


def plot(summary: dict[str, Any], path: Path) -> None:
    """Utilization of every configuration: each repeat (dots), its median (bar), and the strategy's own figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    names = [o for o in summary["options"] if o != "nosync"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for offset, key, label, color in (
        (-0.15, "utilization", "no-sync run's step time / step time (same repeat)", "tab:blue"),
        (0.15, "strategy_utilization_window", "strategy's compute_utilization (in run)", "tab:gray"),
    ):
        for x, option in enumerate(names):
            values = [r[key] for n, r in runs.items() if option_and_repeat(n)[0] == option]
            ax.scatter(
                [x + offset] * len(values), values, s=14, color=color, alpha=0.55, label=label if x == 0 else None
            )
            median = summary["options"][option][key]["median"]
            ax.plot([x + offset - 0.1, x + offset + 0.1], [median, median], color=color, linewidth=2.5)
    ax.axhline(UTILIZATION_TARGET, color="tab:red", linestyle="--", linewidth=1, label=f"target {UTILIZATION_TARGET}")
    ax.set_xticks(list(range(len(names))))
    ax.set_xticklabels([LABELS[n].replace(", ", "\n").replace(" + ", "\n+ ") for n in names], fontsize=7)
    ax.set_ylabel("compute utilization")
    ax.set_title(
        "FL+FSDP, 4 nodes x 2 ranks, 50 Mbit/s, sync_every=8: every repeat (dots) and the median (bar)", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description="Issue 8's targets from a sync_options results JSON.")
    parser.add_argument("results", type=Path, nargs="+", help="results JSON(s) of sync_options sweeps")
    parser.add_argument("--summary", type=Path, help="write every derived number here (JSON)")
    parser.add_argument("--plot", type=Path, help="draw the utilization figure here (PNG)")
    args = parser.parse_args()
    summary = summarize([json.loads(path.read_text()) for path in args.results])
    summary["sources"] = [str(path) for path in args.results]
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(summary, args.plot)
    print(markdown(summary))


if __name__ == "__main__":
    main()
