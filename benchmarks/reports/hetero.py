"""Groups of different speeds: the barrier and a per-group pace against what the hardware offers.

Input: ``python -m benchmarks.run --preset hetero`` (``benchmarks/results/hetero.json``): 4 one-rank groups under CPU
quotas that make the last one half as fast, per repeat (interleaved) a run without syncs, the barrier (every group
trains every step and waits), a per-group pace (``Pace()``, measured) and every group fast.

- **committed tokens/s** of a run: the tokens its groups trained (a skipped step trains none) over its training time
  (validation and the end-of-fit sync left out).
- **attainable** of a repeat: the sum of each group's own pace in the run without syncs (its steps' tokens over its
  own clock at its last step; no sync made it wait).
- ``hetero-pace``: the pace run's committed tokens/s over the attainable of the same repeat, median over repeats (the
  barrier's beside it).
- ``hetero-efficiency``: how much of what the hardware offers the paced run gets, against what the all-fast run gets of
  its own: (the pace run's committed tokens/s over the attainable) over (the all-fast run's committed tokens/s over
  its own attainable, the sum of each group's pace in the all-fast run without syncs), the same repeat, median. The
  syncs cost both alike, so no sync mode is asked to beat what it costs when every group is fast.
- ``planner-hetero``: the planner's formulas (``lightning_fedshard.plan.hetero``) fed with each group's own seconds per
  step (the run without syncs), the exposed seconds of a sync (median of the all-fast run's) and the run's rounds (a
  measured pace's first round is the barrier's), against the barrier's and the pace's measured committed tokens/s:
  the larger relative error, median over repeats.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lightning_fedshard.plan.hetero import heterogeneous_pace

PACE_BOUND = 0.95
EFFICIENCY_BOUND = 0.95
PLANNER_BOUND = 0.15
TARGET_IDS = ("hetero-pace", "hetero-efficiency", "planner-hetero")
KINDS = ("hetero-nosync", "hetero-barrier", "hetero-pace", "hetero-allfast", "hetero-allfast-nosync")

Row = dict[str, Any]


def group_tokens_per_step(run: dict[str, Any]) -> float:
    """Tokens one group trains in a step it does not skip."""
    return run["tokens_per_step"] / len(run["trained_steps"])


def committed_tokens_per_s(run: dict[str, Any]) -> float:
    """Tokens the groups trained over the run's training time."""
    return sum(run["trained_steps"]) * group_tokens_per_step(run) / run["train_seconds"]


def own_paces(run: dict[str, Any]) -> list[float]:
    """Each group's own tokens/s in a run without syncs: its steps over its slowest rank's clock at its last step."""
    groups = len(run["trained_steps"])
    seconds = [
        max(s for s, g in zip(run["own_train_seconds"], run["group_of_rank"]) if g == group) for group in range(groups)
    ]
    return [steps * group_tokens_per_step(run) / s for steps, s in zip(run["trained_steps"], seconds)]


def by_repeat(results: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{repeat: {configuration: run}}``."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for run in results["runs"]:
        identity = run["identity"]
        out.setdefault(identity["repeat"], {})[identity["configuration"]] = run
    return out


def ratios(results: dict[str, Any], kind: str) -> list[float]:
    """Per repeat with both runs: ``kind``'s committed tokens/s over the attainable pace."""
    values = []
    for runs in by_repeat(results).values():
        if kind in runs and "hetero-nosync" in runs:
            values.append(committed_tokens_per_s(runs[kind]) / sum(own_paces(runs["hetero-nosync"])))
    return values


def efficiencies(results: dict[str, Any]) -> list[float]:
    """Per repeat with the four runs: the pace's share of the attainable over the all-fast run's share of its own."""
    values = []
    needed = ("hetero-pace", "hetero-nosync", "hetero-allfast", "hetero-allfast-nosync")
    for runs in by_repeat(results).values():
        if all(kind in runs for kind in needed):
            paced = committed_tokens_per_s(runs["hetero-pace"]) / sum(own_paces(runs["hetero-nosync"]))
            fast = committed_tokens_per_s(runs["hetero-allfast"]) / sum(own_paces(runs["hetero-allfast-nosync"]))
            values.append(paced / fast)
    return values


def step_seconds(run: dict[str, Any]) -> list[float]:
    """Each group's own seconds per trained step in a run without syncs."""
    return [group_tokens_per_step(run) / pace for pace in own_paces(run)]


def exposed_sync_seconds(run: dict[str, Any]) -> float:
    """The median over syncs (and ranks) of the exposed seconds of a sync that landed during training."""
    seconds = [s["sync_exposed_seconds"] for rank in run["strategy_syncs"] for s in rank if s["when"] == "train"]
    return statistics.median(seconds) if seconds else 0.0


def planner_errors(results: dict[str, Any]) -> list[dict[str, float]]:
    """Per repeat with every run: the planner's relative error on the barrier's and the pace's tokens/s."""
    out = []
    for runs in by_repeat(results).values():
        if not all(kind in runs for kind in KINDS[:4]):
            continue
        nosync = runs["hetero-nosync"]
        config = runs["hetero-pace"]["config"]
        sync_every = config["federation"]["sync_every"]
        predicted = heterogeneous_pace(
            step_seconds(nosync),
            group_tokens_per_step(nosync),
            sync_every,
            sync_seconds=exposed_sync_seconds(runs["hetero-allfast"]),
            rounds=config["max_steps"] // sync_every,  # a measured pace: its first round is probed
        )
        barrier = predicted.barrier / committed_tokens_per_s(runs["hetero-barrier"]) - 1
        pace = predicted.pace / committed_tokens_per_s(runs["hetero-pace"]) - 1
        out.append({"barrier": barrier, "pace": pace, "worst": max(abs(barrier), abs(pace))})
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def analyze(results: dict[str, Any]) -> dict[str, Any]:
    """Every configuration's committed tokens/s and ratio to the attainable pace, as spreads over repeats."""
    out: dict[str, Any] = {}
    repeats = by_repeat(results)
    for kind in KINDS:
        paces = [committed_tokens_per_s(runs[kind]) for runs in repeats.values() if kind in runs]
        if paces:
            out[kind] = {"committed_tokens_per_s": _spread(paces)}
            if kind != "hetero-nosync" and ratios(results, kind):
                out[kind]["vs_attainable"] = _spread(ratios(results, kind))
    attainable = [sum(own_paces(runs["hetero-nosync"])) for runs in repeats.values() if "hetero-nosync" in runs]
    if attainable:
        out["attainable_tokens_per_s"] = _spread(attainable)
        groups = [own_paces(runs["hetero-nosync"]) for runs in repeats.values() if "hetero-nosync" in runs]
        out["own_paces"] = [statistics.median(g[i] for g in groups) for i in range(len(groups[0]))]
    schedules = [runs["hetero-pace"]["trained_steps"] for runs in repeats.values() if "hetero-pace" in runs]
    if schedules:
        out["pace_trained_steps"] = schedules
    return out


def targets(results: dict[str, Any] | None) -> list[Row]:
    """The ``hetero-pace`` and ``planner-hetero`` rows (not run without results)."""
    what = "committed tokens/s with one of 4 groups 2x slower (per-group pace) against the attainable pace"
    planner = "planner's relative error on the barrier's and the pace's tokens/s (the larger), heterogeneous preset"
    rows: list[Row] = []
    if results is None or not ratios(results, "hetero-pace"):
        rows.append(_not_run("hetero-pace", what, PACE_BOUND))
    else:
        pace = _spread(ratios(results, "hetero-pace"))
        barrier = ratios(results, "hetero-barrier")
        rows.append(
            {
                "id": "hetero-pace",
                "target": what,
                "measured": pace["median"],
                "bound": PACE_BOUND,
                "met": pace["median"] >= PACE_BOUND,
                "runs": pace["n"],
                "spread": pace,
                "barrier": _spread(barrier) if barrier else None,
            }
        )
    efficiency = efficiencies(results) if results is not None else []
    what = "the pace's share of the attainable over the all-fast run's share of its own attainable, same repeat"
    if not efficiency:
        rows.append(_not_run("hetero-efficiency", what, EFFICIENCY_BOUND))
    else:
        spread = _spread(efficiency)
        rows.append({"id": "hetero-efficiency", "target": what, "measured": spread["median"], "bound": EFFICIENCY_BOUND,
                     "met": spread["median"] >= EFFICIENCY_BOUND, "runs": spread["n"], "spread": spread})  # fmt: skip
    errors = planner_errors(results) if results is not None else []
    if not errors:
        rows.append(_not_run("planner-hetero", planner, PLANNER_BOUND))
    else:
        worst = statistics.median(e["worst"] for e in errors)
        rows.append(
            {
                "id": "planner-hetero",
                "target": planner,
                "measured": worst,
                "bound": PLANNER_BOUND,
                "met": worst <= PLANNER_BOUND,
                "runs": len(errors),
                "per_repeat": errors,
            }
        )
    return rows


def _not_run(target_id: str, what: str, bound: float) -> Row:
    return {"id": target_id, "target": what, "measured": None, "bound": bound, "met": False, "runs": 0}


def table(results: dict[str, Any]) -> str:
    """The sweep's Markdown table: committed tokens/s and the ratio to the attainable pace, per configuration."""
    analysis = analyze(results)
    lines = [
        "| configuration | committed tokens/s, median [min, max] | against the attainable pace | repeats |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        if kind not in analysis:
            continue
        row = analysis[kind]
        pace = row["committed_tokens_per_s"]
        ratio = row.get("vs_attainable")
        shown = "-" if ratio is None else f"**{ratio['median']:.3f}** [{ratio['min']:.3f}, {ratio['max']:.3f}]"
        lines.append(
            f"| `{kind}` | {pace['median']:,.0f} [{pace['min']:,.0f}, {pace['max']:,.0f}] | {shown} | {pace['n']} |"
        )
    if "attainable_tokens_per_s" in analysis:
        own = ", ".join(f"{p:,.0f}" for p in analysis["own_paces"])
        lines.append(
            f"\nAttainable: {analysis['attainable_tokens_per_s']['median']:,.0f} tokens/s (median; each group's own"
            f" pace without syncs: {own})."
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Each configuration's committed tokens/s (median, min-max bars) against the attainable pace."""
    from benchmarks.reports.plotting import figure, save

    repeats = by_repeat(results)
    fig, ax = figure()
    for i, kind in enumerate(KINDS):
        values = [committed_tokens_per_s(runs[kind]) for runs in repeats.values() if kind in runs]
        if values:
            median = statistics.median(values)
            ax.bar(i, median, 0.6, color="tab:blue" if "nosync" not in kind else "tab:grey")
            ax.errorbar(i, median, yerr=[[median - min(values)], [max(values) - median]], color="black", capsize=3)
    attainable = [sum(own_paces(runs["hetero-nosync"])) for runs in repeats.values() if "hetero-nosync" in runs]
    if attainable:
        ax.axhline(
            statistics.median(attainable), color="tab:red", linestyle="--", label="attainable (sum of own paces)"
        )
    ax.set_xticks(range(len(KINDS)), [k.removeprefix("hetero-") for k in KINDS], fontsize=8)
    ax.set(ylabel="committed tokens/s")
    return save(fig, ax, "Groups of different speeds: one of 4 groups at half the CPU", path)
