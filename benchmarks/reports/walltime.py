"""Wall time to a quality on the cluster: the recipe study's tokens to FSDP's final loss over the cluster's tokens/s.

Input: the recipe study's runs (tokens to a target loss, ``benchmarks/results/recipes/``) and the ``walltime`` preset
(``benchmarks/results/walltime.json``): the same model and batch per step (16 windows of 128 tokens) on 4 emulated
nodes of one rank, FSDP and FL+FSDP on every link. For each recipe and seed, the training tokens until its validation
loss first reaches FSDP's final loss (the same seed; linear between validations) over the tokens/s its configuration
trains at on a link (median over the preset's repeats) is the wall time to that loss; FSDP's own is its tokens to its
final loss over FSDP's tokens/s. A federation that needs more tokens than FSDP gets runs of 3x the tokens (``_x3``
recipes); a recipe that never reaches the loss has no wall time.

- ``ttt-wall-20mbit``: the best federation recipe's wall time to FSDP's final loss at 20 Mbit/s over FSDP's, the
  median over seeds of the best recipe, <= 0.30.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks import metrics
from benchmarks.reports.recipes import by_recipe, tokens_to

FSDP = "fsdp"
#: Each recipe of the study and the configuration of the walltime preset that trains as it does.
CONFIGURATION = {
    "fsdp": "walltime-fsdp",
    "fedavg_f32": "walltime-fedavg-f32",
    "fedavg_f32_x3": "walltime-fedavg-f32",
    "int4ef": "walltime-defaults",
    "int4ef_x3": "walltime-defaults",
}
LINKS: tuple[float | None, ...] = (None, 50.0, 20.0, 5.0)
BOUND = 0.30
TARGET_ID = "ttt-wall-20mbit"

Row = dict[str, Any]


def cluster_tokens_per_s(results: dict[str, Any]) -> dict[tuple[str, float | None], float]:
    """``{(configuration, link): median tokens/s over the repeats}`` of the walltime preset."""
    cells: dict[tuple[str, float | None], list[float]] = {}
    for run in results["runs"]:
        identity = metrics.identity(run)
        cells.setdefault((identity.configuration, identity.link_mbit), []).append(metrics.tokens_per_second(run))
    return {key: statistics.median(values) for key, values in cells.items()}


def tokens_to_fsdp(runs: dict[str, dict[int, dict[str, Any]]], recipe: str) -> dict[int, float | None]:
    """Per seed both ran: the recipe's tokens to FSDP's final loss of that seed (``None``: never reached)."""
    out: dict[int, float | None] = {}
    for seed, reference in runs.get(FSDP, {}).items():
        run = runs.get(recipe, {}).get(seed)
        if run is not None:
            out[seed] = tokens_to(run["curve"], reference["curve"][-1][1], run["tokens_per_step"])
    return out


def wall_seconds(
    study: list[dict[str, Any]], cluster: dict[tuple[str, float | None], float]
) -> dict[str, dict[float | None, dict[int, float | None]]]:
    """``{recipe: {link: {seed: seconds to FSDP's final loss}}}`` for every recipe with a cluster configuration."""
    runs = by_recipe(study)
    out: dict[str, dict[float | None, dict[int, float | None]]] = {}
    for recipe, configuration in CONFIGURATION.items():
        tokens = tokens_to_fsdp(runs, recipe)
        if not tokens:
            continue
        out[recipe] = {}
        for link in LINKS:
            pace = cluster.get((configuration, link))
            if pace:
                out[recipe][link] = {s: (None if t is None else t / pace) for s, t in tokens.items()}
    return out


def _median(per_seed: dict[int, float | None]) -> float | None:
    values = [v for v in per_seed.values() if v is not None]
    return statistics.median(values) if values and len(values) == len(per_seed) else None


def table(study: list[dict[str, Any]], results: dict[str, Any]) -> str:
    """Minutes to FSDP's final loss per recipe and link, and against FSDP's."""
    walls = wall_seconds(study, cluster_tokens_per_s(results))
    lines = [
        "| recipe | " + " | ".join(f"minutes at {metrics.link_label(link)} (vs FSDP)" for link in LINKS) + " |",
        "|---|" + "---|" * len(LINKS),
    ]
    for recipe, by_link in walls.items():
        cells = []
        for link in LINKS:
            mine, fsdp = _median(by_link.get(link, {})), _median(walls.get(FSDP, {}).get(link, {}))
            if mine is None:
                cells.append("not reached" if by_link.get(link) else "-")
            else:
                versus = f" ({mine / fsdp:.2f}x)" if fsdp else ""
                cells.append(f"{mine / 60:.1f}{versus}")
        lines.append(f"| `{recipe}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target(study: list[dict[str, Any]], results: dict[str, Any] | None) -> Row:
    """``ttt-wall-20mbit``: the best federation recipe's wall time to FSDP's final loss over FSDP's, 20 Mbit/s."""
    what = "wall time to FSDP's final loss at 20 Mbit/s, the best federation recipe over FSDP (median over seeds)"
    row: Row = {"id": TARGET_ID, "target": what, "measured": None, "bound": BOUND, "met": False, "runs": 0}
    if results is None:
        return {**row, "note": "not run: benchmarks/results/walltime.json is missing"}
    walls = wall_seconds(study, cluster_tokens_per_s(results))
    fsdp = _median(walls.get(FSDP, {}).get(20.0, {}))
    federated = {r: _median(by_link.get(20.0, {})) for r, by_link in walls.items() if r != FSDP}
    reached = {r: w for r, w in federated.items() if w is not None}
    if fsdp is None or not reached:
        return {**row, "note": "no federation recipe reached FSDP's final loss (3x its tokens at most)"}
    best = min(reached, key=lambda r: reached[r])
    ratio = reached[best] / fsdp
    return {**row, "measured": ratio, "met": ratio <= BOUND, "runs": len(walls[best][20.0]), "recipe": best,
            "minutes": {"fsdp": fsdp / 60, best: reached[best] / 60}}  # fmt: skip


def plot(study: list[dict[str, Any]], results: dict[str, Any], path: Path) -> Path:
    """Minutes to FSDP's final loss by link, one bar per recipe that reached it (the others named in a corner)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walls = wall_seconds(study, cluster_tokens_per_s(results))
    medians = {recipe: [_median(by_link.get(link, {})) for link in LINKS] for recipe, by_link in walls.items()}
    shown = {recipe: values for recipe, values in medians.items() if any(v is not None for v in values)}
    figure, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(shown))
    for i, (recipe, values) in enumerate(shown.items()):
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        bars = ax.bar(xs, [v / 60 for v in values if v is not None], width, label=recipe, color=f"C{i}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    missing = sorted(set(medians) - set(shown))
    if missing:
        note = f"never reached it in FSDP's tokens: {', '.join(missing)}"
        ax.text(0.01, 0.97, note, transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(LINKS))], [metrics.link_label(link) for link in LINKS])
    ax.set_ylabel("minutes to FSDP's final validation loss")
    ax.set_yscale("log")
    ax.set_title("wall time to a quality on the emulated cluster (4 nodes x 1 rank)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
