"""The race to perplexity, scored at equal wall time on every link and at equal tokens.

Reads the race's results (``python -m benchmarks.race``: every run unthrottled, since perplexity per optimizer step
does not depend on the link) and the sweeps' per-configuration summaries (median pace per link).

Definitions:

- A **curve** is a configuration trained with a schedule sized to a step budget. At each budget its learning rate is
  the best of those tried with seed 0; its score is the **mean** final validation perplexity over the seeds at that
  learning rate (min-max beside it). HSDP has FSDP's curve: both compute the same update from the same global batch
  (the race's ``hsdp_check`` run measures how close they are).
- A budget of ``S`` steps costs ``S x pace`` seconds on a link, where the pace is the sweeps' median run pace of
  that configuration on that link (:func:`benchmarks.metrics.run_pace`: syncs and the wait for the slowest group
  included, validation excluded; every strategy validates the same windows).
- **At wall time T** a configuration is scored by the best mean perplexity among its budgets that finish within
  ``T`` (the best run it could have planned for ``T``). The times compared on a link are every moment one of the
  budgets finishes, up to the largest budget of the fastest of the four strategies there (beyond it the fastest
  would have had budgets the race did not run). FL+FSDP's sync options ran at its largest budget only; they take part
  with that one model, which can only understate them.
- The **target** on a link holds when at every such time at which FSDP or HSDP has a model, the best federated
  curve's mean perplexity is below the best of FSDP's and HSDP's. ``measured`` is the worst ratio (federated /
  baseline) over the links and times; the bound is 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.metrics import final_ppl, identity, link_label, spread
from benchmarks.reports import plotting
from benchmarks.reports.sweep import config_key

BASELINES = ("fsdp", "hsdp")
STRATEGIES = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
RACE_LINKS: tuple[float | None, ...] = (None, 200.0, 50.0, 20.0)
TARGET_LINKS: tuple[float, ...] = (200.0, 50.0, 20.0)
RACE_TARGET = (
    "best federated strategy below the best of FSDP/HSDP in mean validation perplexity at equal wall time on every"
    " link <= 200 Mbit/s (3 seeds, tuned learning rates)"
)
#: Entries within this relative distance of a moment count as finished by then (clock rounding).
_EPS = 1e-9


def paced_as(curve: str) -> tuple[str, ...]:
    """The sweep configurations that train along a race curve: HSDP shares FSDP's curve."""
    return BASELINES if curve == "fsdp" else (curve,)


def budgets(race: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per curve and step budget: the learning rates tried (seed 0), the chosen one, and the seeds' perplexity.

    A sync option's curve has no tuning of its own: it runs at FL+FSDP's learning rate, so it is chosen from its runs.
    """
    by_budget: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for run in race["runs"]:
        by_budget[(identity(run).configuration, run["config"]["max_steps"])].append(run)
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (curve, steps), runs in sorted(by_budget.items()):
        if curve != "hsdp":
            out[curve][steps] = _budget(runs)
    return dict(out)


def _budget(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tuned = {r["config"]["lr"]: final_ppl(r) for r in runs if r["config"]["seed"] == 0}
    lr = min(tuned, key=tuned.__getitem__)
    seeds = [ppl for _, ppl in sorted((r["config"]["seed"], final_ppl(r)) for r in runs if r["config"]["lr"] == lr)]
    return {
        "lr": lr,
        "tried": dict(sorted(tuned.items())),
        "lr_at_edge": lr in (min(tuned), max(tuned)) and len(tuned) > 1,
        "seeds": seeds,
        "ppl": spread(seeds),
    }


def hsdp_check(race: dict[str, Any]) -> dict[str, Any] | None:
    """HSDP's run against FSDP's run of the same budget, learning rate and seed."""
    runs = {(identity(r).configuration, _budget_key(r)): r for r in race["runs"]}
    for (curve, key), run in runs.items():
        twin = runs.get(("fsdp", key)) if curve == "hsdp" else None
        if twin is not None:
            hsdp, fsdp = final_ppl(run), final_ppl(twin)
            steps, lr, _ = key
            return {"steps": steps, "lr": lr, "hsdp": hsdp, "fsdp": fsdp, "rel": hsdp / fsdp - 1}
    return None


def _budget_key(run: dict[str, Any]) -> tuple[int, float, int]:
    cfg = run["config"]
    return cfg["max_steps"], cfg["lr"], cfg["seed"]


def entries(curves: dict[str, dict[int, dict[str, Any]]], configs: dict[str, Any], link: float | None) -> list[dict]:
    """Every (configuration, budget) that can be placed on ``link``'s time axis: its finishing time and score."""
    out = []
    for curve, by_steps in curves.items():
        for kind in paced_as(curve):
            summary = configs.get(config_key(kind, link))
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
        done = e["seconds"] <= seconds * (1 + _EPS)
        if done and (e["kind"] not in best or e["ppl"]["mean"] < best[e["kind"]]["ppl"]["mean"]):
            best[e["kind"]] = e
    return best


def _horizon(items: list[dict[str, Any]]) -> float:
    # The sync options ran at one budget only: beyond it they are scored by that model (which can only understate
    # them), so the horizon is set by the four strategies' full budget ladders.
    ladders = {e["kind"] for e in items} & set(STRATEGIES) or {e["kind"] for e in items}
    return min(max(e["seconds"] for e in items if e["kind"] == kind) for kind in ladders)


def _moment(items: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    scored = at_time(items, seconds)
    fed = [e for kind, e in scored.items() if kind.startswith("fl_")]
    base = [e for kind, e in scored.items() if kind in BASELINES]
    best_fed = min(fed, key=lambda e: e["ppl"]["mean"], default=None)
    best_base = min(base, key=lambda e: e["ppl"]["mean"], default=None)
    ratio = None
    if best_base is not None:
        ratio = (best_fed["ppl"]["mean"] if best_fed else math.inf) / best_base["ppl"]["mean"]
    return {
        "seconds": seconds,
        "scores": {kind: {"steps": e["steps"], **e["ppl"]} for kind, e in scored.items()},
        "best_federated": best_fed and best_fed["kind"],
        "best_baseline": best_base and best_base["kind"],
        "ratio": ratio,
    }


def race_on_link(curves: dict[str, Any], configs: dict[str, Any], link: float | None) -> dict[str, Any]:
    """The race on one link: each moment a budget finishes, every configuration's best model by then."""
    items = entries(curves, configs, link)
    if not items:
        return {"link": link, "times": []}
    horizon = _horizon(items)
    moments = sorted({e["seconds"] for e in items if e["seconds"] <= horizon * (1 + _EPS)})
    return {"link": link, "horizon": horizon, "times": [_moment(items, t) for t in moments], "entries": items}


def analyze(race: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    """The race's budgets, the HSDP check and the race on every link (``configs``: the sweeps' summaries)."""
    curves = budgets(race)
    return {
        "curves": curves,
        "hsdp_check": hsdp_check(race),
        "links": [race_on_link(curves, configs, link) for link in RACE_LINKS],
        "runs": len(race["runs"]),
    }


def compared(analysis: dict[str, Any]) -> list[tuple[float, float | None, float]]:
    """``(ratio, link, seconds)`` of every moment on a target link at which a baseline has a model."""
    return [
        (t["ratio"], link["link"], t["seconds"])
        for link in analysis["links"]
        if link["link"] in TARGET_LINKS
        for t in link["times"]
        if t["ratio"] is not None
    ]


def min_seeds(analysis: dict[str, Any]) -> int:
    """The fewest seeds behind any budget's score."""
    return min((b["ppl"]["n"] for by in analysis["curves"].values() for b in by.values()), default=0)


# -- tables ----------------------------------------------------------------------------------------------------------


def _ppl(s: dict[str, float]) -> str:
    return f"{s['mean']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def budget_table(analysis: dict[str, Any]) -> str:
    """Equal tokens: per curve and budget, the learning rates tried and the seeds' perplexity at the chosen one."""
    lines = [
        "| curve | steps (x 32 sequences of 128 tokens) | learning rates tried: seed-0 perplexity | chosen |"
        " mean perplexity (min-max), seeds |",
        "|---|---|---|---|---|",
    ]
    for curve, by_steps in analysis["curves"].items():
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
        times = [t for t in link["times"] if t["ratio"] is not None]
        if not times:
            continue
        worst = max(times, key=lambda t: t["ratio"])
        best = min(times, key=lambda t: t["ratio"])
        ahead = sum(t["ratio"] < 1 for t in times)
        lines.append(
            f"| {link_label(link['link'])} | {len(times)} | {ahead} of {len(times)} | {_at(worst)} | {_at(best)} |"
            f" {_at(times[-1])} |"
        )
    return "\n".join(lines)


def _at(moment: dict[str, Any]) -> str:
    return f"{moment['ratio']:.3f} ({moment['seconds']:.0f})"


def wall_time_table(analysis: dict[str, Any]) -> str:
    """Per link and moment: the best federated and the best baseline model, and their ratio."""
    lines = [
        "| link | wall time (s) | best federated: mean ppl (min-max), steps | best of FSDP/HSDP | ratio |",
        "|---|---|---|---|---|",
    ]
    for link in analysis["links"]:
        for t in link["times"]:
            ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
            fed, base = _model(t, t["best_federated"]), _model(t, t["best_baseline"])
            lines.append(f"| {link_label(link['link'])} | {t['seconds']:.0f} | {fed} | {base} | {ratio} |")
    return "\n".join(lines)


def _model(moment: dict[str, Any], kind: str | None) -> str:
    if kind is None:
        return "no model yet"
    s = moment["scores"][kind]
    return f"{kind}: {_ppl(s)}, {s['steps']}"


# -- plots -----------------------------------------------------------------------------------------------------------


def plot(analysis: dict[str, Any], images: Path) -> list[Path]:
    """Perplexity against wall time per link (mean, min-max over seeds), and against tokens."""
    links = [link for link in analysis["links"] if link["times"]]
    fig, axes = plotting.plt.subplots(1, len(links), figsize=(4.2 * len(links), 4), squeeze=False)
    every_kind = sorted({e["kind"] for link in links for e in link["entries"]})
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(every_kind)}  # one color per configuration in every panel
    for ax, link in zip(axes[0], links):
        _time_panel(ax, link, colors)
    axes[0][0].set_ylabel("validation perplexity (annealed; mean, min-max of seeds)")
    fig.tight_layout()
    paths = [images / "race_ppl_vs_time.png"]
    images.mkdir(parents=True, exist_ok=True)
    fig.savefig(paths[0], dpi=110)
    plotting.plt.close(fig)

    fig, ax = plotting.figure((6, 4))
    for curve, by_steps in analysis["curves"].items():
        steps = sorted(by_steps)
        plotting.errorbars(ax, steps, [by_steps[s]["ppl"] for s in steps], centre="mean", markersize=3, label=curve)
    ax.set(xscale="log", yscale="log", xlabel="optimizer steps (= tokens / 4,096)", ylabel="validation perplexity")
    paths.append(
        plotting.save(
            fig, ax, "Equal tokens: each budget annealed, tuned learning rate", images / "race_ppl_vs_tokens.png"
        )
    )
    return paths


def _time_panel(ax: Any, link: dict[str, Any], colors: dict[str, str]) -> None:
    for kind in sorted({e["kind"] for e in link["entries"]}):
        points = sorted((e["seconds"], e["ppl"]) for e in link["entries"] if e["kind"] == kind)
        points = [p for p in points if p[0] <= link["horizon"] * (1 + _EPS)]
        if points:
            xs, stats = [p[0] for p in points], [p[1] for p in points]
            plotting.errorbars(ax, xs, stats, centre="mean", markersize=3, label=kind, color=colors[kind])
    ax.set(yscale="log", xlabel="wall time (s)", title=f"link {link_label(link['link'])}")
    ax.legend(fontsize=6)
