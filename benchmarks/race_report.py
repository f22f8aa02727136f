"""Issue 9's race to perplexity, scored at equal wall time on every link and at equal tokens.

Reads ``benchmarks/results/race.json`` (``python -m benchmarks.race``: every run unthrottled, since perplexity per
optimizer step does not depend on the link) and the throughput sweep's per-configuration summary (median pace per
link). :mod:`benchmarks.throughput_report` calls this module, so its one command regenerates everything.

Definitions:

- A **curve** is a strategy (or FL+FSDP with one sync option) trained with a schedule sized to a step budget. At each
  budget its learning rate is the best of those tried with seed 0; its score is the **mean** final validation
  perplexity over the seeds at that learning rate (min-max beside it). HSDP has FSDP's curve: both compute the same
  update from the same global batch (the race's ``hsdp_check`` run measures how close they are).
- A budget of ``S`` steps costs ``S x pace`` seconds on a link, where the pace is the throughput sweep's median
  ``(train + end-of-fit sync seconds) / steps`` of that configuration on that link: syncs and the wait for the
  slowest group included, validation excluded (every strategy validates the same windows).
- **At wall time T** a strategy is scored by the best mean perplexity among its budgets that finish within ``T``
  (the best run it could have planned for ``T``). The times compared on a link are every moment one of the budgets
  finishes, up to the largest budget of the fastest of the four strategies there (beyond it the fastest would have
  had budgets the race did not run). FL+FSDP's sync options ran at its largest budget only; they take part with that
  one model, which can only understate them.
- The **target** on a link holds when at every such time at which FSDP or HSDP has a model, the best federated
  curve's mean perplexity is below the best of FSDP's and HSDP's. ``measured`` is the worst ratio
  (federated / baseline) over the links and times; the bound is 1.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

BASELINES = ("fsdp", "hsdp")
STRATEGIES = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
#: Race curve -> the throughput configurations (without the link) that train along it.
PACED_AS: dict[str, tuple[str, ...]] = {
    "fsdp": ("fsdp", "hsdp"),
    "fl_fsdp": ("fl_fsdp",),
    "fl_hsdp": ("fl_hsdp",),
    "fl_fsdp-int8": ("fl_fsdp-int8",),
    "fl_fsdp-int4ef-f4-d1": ("fl_fsdp-int4ef-f4-d1",),
    "fl_fsdp-int4ef": ("fl_fsdp-int4ef",),
    "fl_fsdp-bf16": ("fl_fsdp-bf16",),
}
RACE_TARGET = (
    "best federated strategy below the best of FSDP/HSDP in mean validation perplexity at equal wall time on every"
    " link <= 200 Mbit/s (3 seeds, tuned learning rates)"
)
RACE_LINKS: tuple[float | None, ...] = (None, 200.0, 50.0, 20.0)
TARGET_LINKS: tuple[float, ...] = (200.0, 50.0, 20.0)


def curve_of(run: dict[str, Any]) -> str:
    strategy, _, option = run["kind"]
    return f"{strategy}-{option}" if option else strategy


def final_ppl(run: dict[str, Any]) -> float:
    last = run["vals"][-1]
    if last["step"] != run["config"]["max_steps"]:
        raise ValueError(f"run {run['name']!r} has no validation at its last step")
    return float(last["val_ppl"])


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def budgets(race: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per curve and step budget: the learning rates tried (seed 0), the chosen one, and the seeds' perplexity.

    An option's curve has no tuning of its own: it runs at FL+FSDP's learning rate, so it is chosen from its runs.
    """
    by_budget: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for run in race["runs"]:
        by_budget[(curve_of(run), run["config"]["max_steps"])].append(run)
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (curve, steps), runs in sorted(by_budget.items()):
        if curve == "hsdp":
            continue
        tuned = {r["config"]["lr"]: final_ppl(r) for r in runs if r["config"]["seed"] == 0}
        lr = min(tuned, key=tuned.__getitem__)
        seeds = sorted((r["config"]["seed"], final_ppl(r)) for r in runs if r["config"]["lr"] == lr)
        out[curve][steps] = {
            "lr": lr,
            "tried": dict(sorted(tuned.items())),
            "lr_at_edge": lr in (min(tuned), max(tuned)) and len(tuned) > 1,
            "seeds": [ppl for _, ppl in seeds],
            "ppl": _stats([ppl for _, ppl in seeds]),
        }
    return dict(out)


def hsdp_check(race: dict[str, Any]) -> dict[str, Any] | None:
    """HSDP's run against FSDP's run of the same budget, learning rate and seed."""
    for run in race["runs"]:
        if curve_of(run) != "hsdp":
            continue
        cfg = run["config"]
        twin = next(
            (
                r
                for r in race["runs"]
                if curve_of(r) == "fsdp"
                and r["config"]["max_steps"] == cfg["max_steps"]
                and r["config"]["lr"] == cfg["lr"]
                and r["config"]["seed"] == cfg["seed"]
            ),
            None,
        )
        if twin is not None:
            hsdp, fsdp = final_ppl(run), final_ppl(twin)
            return {"steps": cfg["max_steps"], "lr": cfg["lr"], "hsdp": hsdp, "fsdp": fsdp, "rel": hsdp / fsdp - 1}
    return None


def _label(link: float | None) -> str:
    return "unthrottled" if link is None else f"{link:g}mbit"


def entries(curves: dict[str, dict[int, dict[str, Any]]], configs: dict[str, Any], link: float | None) -> list[dict]:
    """Every (configuration, budget) that can be placed on ``link``'s time axis: its finishing time and score."""
    out = []
    for curve, by_steps in curves.items():
        for kind in PACED_AS.get(curve, ()):
            summary = configs.get(f"{kind}-{_label(link)}")
            if summary is None:
                continue
            pace = summary["run_pace"]["median"]
            for steps, b in by_steps.items():
                out.append({"kind": kind, "steps": steps, "seconds": steps * pace, "pace": pace, **b})
    return out


def at_time(items: list[dict[str, Any]], seconds: float) -> dict[str, dict[str, Any]]:
    """Per configuration, its best-scoring budget that finishes within ``seconds``."""
    best: dict[str, dict[str, Any]] = {}
    for e in items:
        if e["seconds"] <= seconds * (1 + 1e-9) and (
            e["kind"] not in best or e["ppl"]["mean"] < best[e["kind"]]["ppl"]["mean"]
        ):
            best[e["kind"]] = e
    return best


def race_on_link(curves: dict[str, Any], configs: dict[str, Any], link: float | None) -> dict[str, Any]:
    """The race on one link: each moment a budget finishes, every configuration's best model by then."""
    items = entries(curves, configs, link)
    if not items:
        return {"link": link, "times": []}
    # The sync options ran at one budget only: beyond it they are scored by that model (which can only understate
    # them), so the horizon is set by the four strategies' full budget ladders.
    ladders = {e["kind"] for e in items} & set(STRATEGIES)
    horizon = min(
        max(e["seconds"] for e in items if e["kind"] == kind) for kind in ladders or {e["kind"] for e in items}
    )
    times = []
    for seconds in sorted({e["seconds"] for e in items if e["seconds"] <= horizon * (1 + 1e-9)}):
        scored = at_time(items, seconds)
        fed = [e for kind, e in scored.items() if kind.startswith("fl_")]
        base = [e for kind, e in scored.items() if kind in BASELINES]
        best_fed = min(fed, key=lambda e: e["ppl"]["mean"], default=None)
        best_base = min(base, key=lambda e: e["ppl"]["mean"], default=None)
        times.append(
            {
                "seconds": seconds,
                "scores": {kind: {"steps": e["steps"], **e["ppl"]} for kind, e in scored.items()},
                "best_federated": best_fed and best_fed["kind"],
                "best_baseline": best_base and best_base["kind"],
                "ratio": (best_fed["ppl"]["mean"] if best_fed else math.inf) / best_base["ppl"]["mean"]
                if best_base
                else None,
            }
        )
    return {"link": link, "horizon": horizon, "times": times, "entries": items}


def analyze(race: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    """The race's budgets, the HSDP check and the race on every link."""
    curves = budgets(race)
    return {
        "curves": curves,
        "hsdp_check": hsdp_check(race),
        "links": [race_on_link(curves, configs, link) for link in RACE_LINKS],
        "runs": len(race["runs"]),
    }


def target_row(analysis: dict[str, Any]) -> dict[str, Any]:
    """Issue 9's race target as a ``targets.json`` row."""
    ratios = [
        (t["ratio"], link["link"], t["seconds"])
        for link in analysis["links"]
        if link["link"] in TARGET_LINKS
        for t in link["times"]
        if t["ratio"] is not None
    ]
    worst = max(ratios, default=None)
    seeds = min((b["ppl"]["n"] for by in analysis["curves"].values() for b in by.values()), default=0)
    return {
        "target": RACE_TARGET,
        "measured": worst[0] if worst else None,
        "bound": 1.0,
        # Every target link must have a moment at which a baseline has a model: no link passes by having none.
        "met": {link for _, link, _ in ratios} == set(TARGET_LINKS) and all(r < 1 for r, _, _ in ratios) and seeds >= 3,
        "runs": analysis["runs"],
        "note": "measured: the worst ratio of mean perplexities (best federated / best of FSDP, HSDP) over the links"
        " and the moments compared"
        + (f"; reached on the {_label(worst[1])} link at {worst[2]:.0f} s" if worst else "")
        + f"; seeds per budget: at least {seeds}",
    }


# -- tables ----------------------------------------------------------------------------------------------------------


def _ppl(s: dict[str, float]) -> str:
    return f"{s['mean']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def budget_table(analysis: dict[str, Any]) -> str:
    """Equal tokens: per curve and budget, the learning rates tried and the seeds' perplexity at the chosen one."""
    curves = analysis["curves"]
    lines = [
        "| curve | steps (x 32 sequences of 128 tokens) | learning rates tried: seed-0 perplexity | chosen |"
        " mean perplexity (min-max), seeds |",
        "|---|---|---|---|---|",
    ]
    for curve, by_steps in curves.items():
        for steps, b in sorted(by_steps.items()):
            tried = ", ".join(f"{lr:g}: {ppl:.0f}" for lr, ppl in b["tried"].items())
            edge = " (edge)" if b["lr_at_edge"] else ""
            lines.append(f"| {curve} | {steps} | {tried} | {b['lr']:g}{edge} | {_ppl(b['ppl'])}, {b['ppl']['n']} |")
    return "\n".join(lines)


def link_table(analysis: dict[str, Any]) -> str:
    """Per link: how many moments were compared, the worst and best ratio, and the ratio at the horizon."""
    lines = [
        "| link | moments compared | federated ahead at | worst ratio (at s) | best ratio (at s) | ratio at the end |",
        "|---|---|---|---|---|---|",
    ]
    for link in analysis["links"]:
        compared = [t for t in link["times"] if t["ratio"] is not None]
        if not compared:
            continue
        worst = max(compared, key=lambda t: t["ratio"])
        best = min(compared, key=lambda t: t["ratio"])
        ahead = sum(t["ratio"] < 1 for t in compared)
        lines.append(
            f"| {_label(link['link'])} | {len(compared)} | {ahead} of {len(compared)} |"
            f" {worst['ratio']:.3f} ({worst['seconds']:.0f}) | {best['ratio']:.3f} ({best['seconds']:.0f}) |"
            f" {compared[-1]['ratio']:.3f} ({compared[-1]['seconds']:.0f}) |"
        )
    return "\n".join(lines)


def wall_time_table(analysis: dict[str, Any]) -> str:
    """Per link and moment: the best federated and the best baseline model, and their ratio."""
    lines = [
        "| link | wall time (s) | best federated: mean ppl (min-max), steps | best of FSDP/HSDP | ratio |",
        "|---|---|---|---|---|",
    ]
    for link in analysis["links"]:
        for t in link["times"]:
            fed, base = t["best_federated"], t["best_baseline"]

            def cell(kind: str | None, scores: dict[str, Any] = t["scores"]) -> str:
                if kind is None:
                    return "no model yet"
                s = scores[kind]
                return f"{kind}: {_ppl(s)}, {s['steps']}"

            ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
            lines.append(f"| {_label(link['link'])} | {t['seconds']:.0f} | {cell(fed)} | {cell(base)} | {ratio} |")
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------------------------------


def plot(analysis: dict[str, Any], images: Path) -> list[Path]:
    """Perplexity vs wall time per link (mean, min-max over seeds) and perplexity vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
    links = [link for link in analysis["links"] if link["times"]]
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 4), squeeze=False)
    every_kind = sorted({e["kind"] for link in links for e in link["entries"]})
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(every_kind)}  # one color per configuration in every panel
    for ax, link in zip(axes[0], links):
        kinds = sorted({e["kind"] for e in link["entries"]})
        for kind in kinds:
            points = sorted((e["seconds"], e["ppl"]) for e in link["entries"] if e["kind"] == kind)
            points = [p for p in points if p[0] <= link["horizon"] * (1 + 1e-9)]
            if not points:
                continue
            x = [p[0] for p in points]
            mean = [p[1]["mean"] for p in points]
            err = [[p[1]["mean"] - p[1]["min"] for p in points], [p[1]["max"] - p[1]["mean"] for p in points]]
            ax.errorbar(x, mean, yerr=err, marker="o", markersize=3, capsize=2, label=kind, color=colors[kind])
        ax.set(yscale="log", xlabel="wall time (s)", title=f"link {_label(link['link'])}")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("validation perplexity (annealed; mean, min-max of seeds)")
    fig.tight_layout()
    paths = [images / "race_ppl_vs_time.png"]
    fig.savefig(paths[0], dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    for curve, by_steps in analysis["curves"].items():
        stats = [b["ppl"] for _, b in sorted(by_steps.items())]
        err = [[p["mean"] - p["min"] for p in stats], [p["max"] - p["mean"] for p in stats]]
        steps = sorted(by_steps)
        ax.errorbar(steps, [p["mean"] for p in stats], yerr=err, marker="o", markersize=3, capsize=2, label=curve)
    ax.set(xscale="log", yscale="log", xlabel="optimizer steps (= tokens / 4,096)", ylabel="validation perplexity")
    ax.set_title("Equal tokens: each budget annealed, tuned learning rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(images / "race_ppl_vs_tokens.png")
    fig.savefig(paths[1], dpi=110)
    plt.close("all")
    return paths
