"""The outer step tuned by H and M, the examples' critical batch, and the paper's regime (the recipe study's runs).

- **The outer step by H and M**: float32 traffic, 4 groups at ``sync_every`` 8 and 32 and one group of 4 ranks (the
  FSDP batch) at 32, each cell an outer optimizer: plain averaging, SGD without momentum, Nesterov at several learning
  rates. A cell's *effective step* is ``lr / (1 - momentum)``: what the outer optimizer moves for a steady
  pseudo-gradient. Every cell is held against plain averaging at its H and against FSDP, by tokens to their final loss.
- **The critical batch**: FSDP at 1x, 4x and 16x the study's batch per step at the same token budget, each at half,
  once and twice the study's inner learning rate; a batch is past the critical one when its best learning rate ends
  clearly above the smaller batch's best.

Targets (``targets.json``; 2 seeds each where the recipes ran, missed with the reason where not):

- ``outer-lr-trend``: the effective step of the best cell at H=32 over the best's at H=8, every cell with plain
  averaging included (the literature: the tuned outer learning rate grows with H), >= 1; the narrower measure over the
  Nesterov cells alone is reported beside it.
- ``tuned-outer-h32``: at H=32 and 4 groups, the best Nesterov cell's tokens to plain averaging's final loss over
  averaging's own, <= 0.90.
- ``m1-vs-fsdp``: one group with the best outer Nesterov step at H=32: its tokens to FSDP's final loss over FSDP's,
  <= 0.95.
- ``fed-vs-fsdp-loss``: the best 4-group recipe's final loss (any inner learning rate or outer step tried) over
  FSDP's at its best inner learning rate, at equal tokens (median over seeds), <= 1.03.
- ``paper-regime``: above the critical batch (a 4x global batch per step), the better federation of 4 groups at the
  critical batch each (:data:`~benchmarks.recipes.PAPER_REGIME`): its tokens to the final loss of FSDP's best run
  at 4x (its best inner learning rate) over FSDP's own, <= 0.90.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.recipes import CRITICAL_BATCH, GROUP_TUNING, LR, OUTER_SWEEP, PAPER_REGIME, RECIPES
from benchmarks.reports.recipes import at_own_final, by_recipe, ratios

Runs = dict[str, dict[int, dict[str, Any]]]
Row = dict[str, Any]

FSDP = "fsdp"
#: The cells of the sweep by (groups, sync_every): the study's own H=8 recipes and the sweep's.
_OUTER_CELLS = (*OUTER_SWEEP, *(r for r in GROUP_TUNING if r.name.startswith(("sgd", "h32_", "m1_"))))
CELLS: dict[tuple[int, int], tuple[str, ...]] = {
    (4, 8): (
        "fedavg_f32",
        "sgd07_f32",
        "sgd12_f32",
        "sgd15_f32",
        "nesterov02_f32",
        "nesterov05m05_f32",
        "nesterov_f32",
        "nesterov1_f32",
    ),
    (4, 32): tuple(r.name for r in _OUTER_CELLS if r.sync_every == 32 and r.groups == 4),
    (1, 32): tuple(r.name for r in _OUTER_CELLS if r.groups == 1),
}
#: FSDP at the study's batch per step, at each inner learning rate tried.
FSDP_1X = ("fsdp", "fsdp_b1_lr0p0025", "fsdp_b1_lr0p01")
#: Plain averaging at each H (4 groups): what the H's cells are held against.
AVERAGING = {8: "fedavg_f32", 32: "h32_fedavg_f32"}
BOUNDS = {
    "outer-lr-trend": 1.0,
    "tuned-outer-h32": 0.90,
    "m1-vs-fsdp": 0.95,
    "fed-vs-fsdp-loss": 1.03,
    "paper-regime": 0.90,
}
#: FSDP at 4x the study's batch per step (every inner learning rate tried), and the federations of the paper's regime.
FSDP_4X = tuple(r.name for r in (*CRITICAL_BATCH, *PAPER_REGIME) if r.groups == 1 and r.ranks_per_group == 16)
PAPER_FEDERATIONS = tuple(r.name for r in PAPER_REGIME if r.groups > 1)
TARGET_IDS = tuple(BOUNDS)


def outer(name: str) -> tuple[float, float]:
    """A recipe's outer ``(lr, momentum)``: plain averaging is ``(1, 0)``."""
    given = RECIPES[name].options.get("outer")
    if given is None:
        return 1.0, 0.0
    return float(given[0]), float(given[1]) if len(given) > 1 else 0.9


def effective_step(name: str) -> float:
    """``lr / (1 - momentum)``: the step of the outer optimizer for a steady pseudo-gradient."""
    lr, momentum = outer(name)
    return lr / (1 - momentum)


def finals(runs: Runs, name: str) -> dict[int, float]:
    """Every seed's final validation loss of a recipe."""
    return {seed: run["curve"][-1][1] for seed, run in runs.get(name, {}).items()}


def median_final(runs: Runs, name: str) -> float | None:
    values = list(finals(runs, name).values())
    return statistics.median(values) if values else None


def best(runs: Runs, names: tuple[str, ...], seeds: int = 2) -> str | None:
    """The recipe of ``names`` with the lowest median final loss among those every seed ran."""
    ran = [n for n in names if len(runs.get(n, {})) >= seeds]
    return min(ran, key=lambda n: median_final(runs, n) or float("inf")) if ran else None


def _ratio_text(runs: Runs, name: str, against: str) -> str:
    per_seed = ratios(runs, name, against)
    if not per_seed:
        return "-"
    above = at_own_final(runs, name, against)
    shown = [
        f"{v:.2f}" if v is not None else (f">1 ({above[s]:.2f}*)" if s in above else "not reached")
        for s, v in sorted(per_seed.items())
    ]
    return " / ".join(shown)


def outer_table(results: list[dict[str, Any]]) -> str:
    """Every cell of the sweep: its outer step, final loss per seed and tokens to averaging's and FSDP's final loss."""
    runs = by_recipe(results)
    lines = [
        "| groups | H | recipe | outer (lr, momentum) | effective step | final loss (seed 0 / 1)"
        " | tokens to averaging's final loss (same H) | tokens to FSDP's final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (groups, h), names in CELLS.items():
        for name in names:
            if name not in runs:
                continue
            lr, momentum = outer(name)
            shown = " / ".join(f"{v:.3f}" for _, v in sorted(finals(runs, name).items()))
            against = AVERAGING.get(h) if groups > 1 else FSDP
            lines.append(
                f"| {groups} | {h} | `{name}` | {lr:g}, {momentum:g} | {effective_step(name):g} | {shown} |"
                f" {_ratio_text(runs, name, against) if against and name != against else '-'} |"
                f" {_ratio_text(runs, name, FSDP)} |"
            )
    fsdp = " / ".join(f"{v:.3f}" for _, v in sorted(finals(runs, FSDP).items()))
    lines.append(f"| FSDP | - | `{FSDP}` | - | - | {fsdp} | - | 1 |")
    return "\n".join(lines) + (
        "\n\nTokens to a target: the recipe's tokens to the reference's final loss of the same seed over the"
        " reference's own (below 1: faster); `>1 (x*)`: the target was not reached, x is the ratio at the recipe's"
        " own final loss, a looser target."
    )


def critical_batch_table(results: list[dict[str, Any]]) -> str:
    """FSDP's final loss at the study's token budget, by batch per step and inner learning rate (each seed run)."""
    runs = by_recipe(results)
    rates = (LR / 2, LR, 2 * LR)
    lines = ["| batch per step | steps | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|---|---|---|---|"]
    for multiple in (1, 4, 16):
        cells = []
        for lr in rates:
            name = FSDP if (multiple, lr) == (1, LR) else _batch_name(multiple, lr)
            cells.append(" / ".join(f"{v:.3f}" for _, v in sorted(finals(runs, name).items())) or "-")
        lines.append(f"| {16 * multiple} windows ({multiple}x) | {1200 // multiple} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _batch_name(multiple: int, lr: float) -> str:
    (found,) = [r.name for r in CRITICAL_BATCH if r.ranks_per_group == 4 * multiple and r.lr == lr]
    return found


def targets(results: list[dict[str, Any]]) -> list[Row]:
    """The tuning targets (missed with the reason where their recipes did not run)."""
    runs = by_recipe(results)
    return [_trend(runs), _tuned_h32(runs), _m1_vs_fsdp(runs), _fed_vs_fsdp(runs), _paper_regime(runs)]


def _trend(runs: Runs) -> Row:
    what = (
        "the best outer step's effective step (lr / (1 - momentum)) at H=32 over the best's at H=8, 4 groups, every"
        " cell (plain averaging included); beside it the narrower measure over the Nesterov cells alone"
    )
    h8, h32 = (best(runs, CELLS[(4, h)]) for h in (8, 32))
    n8, n32 = (best(runs, tuple(n for n in CELLS[(4, h)] if outer(n)[1] > 0)) for h in (8, 32))
    if h8 is None or h32 is None:
        return _row("outer-lr-trend", what, None, runs=0, note="the sweep's cells have not run with 2 seeds")
    measured = effective_step(h32) / effective_step(h8)
    narrow = effective_step(n32) / effective_step(n8) if n8 is not None and n32 is not None else None
    return _row(
        "outer-lr-trend",
        what,
        measured,
        runs=2,
        best_h8=h8,
        best_h32=h32,
        nesterov_only=narrow,
        nesterov_best_h8=n8,
        nesterov_best_h32=n32,
    )


def _tuned_h32(runs: Runs) -> Row:
    what = "tokens to plain averaging's final loss of the best outer Nesterov cell at H=32 (4 groups)"
    nesterov = tuple(n for n in CELLS[(4, 32)] if outer(n)[1] > 0)
    return _ratio_row("tuned-outer-h32", what, runs, best(runs, nesterov), AVERAGING[32])


def _m1_vs_fsdp(runs: Runs) -> Row:
    what = "tokens to FSDP's final loss of one group with the best outer Nesterov step at H=32"
    return _ratio_row("m1-vs-fsdp", what, runs, best(runs, CELLS[(1, 32)]), FSDP)


def _fed_vs_fsdp(runs: Runs) -> Row:
    what = (
        "final loss of the best 4-group recipe (any inner learning rate or outer step tried, 2 seeds) over FSDP's at"
        " its best inner learning rate, at equal tokens (median over seeds)"
    )
    four = tuple(n for n, r in RECIPES.items() if r.groups == 4 and "pace" not in r.options and _fsdps_tokens(n))
    chosen, fsdp = best(runs, four), _best_seeded(runs, FSDP_1X)
    if chosen is None or fsdp is None:
        return _row("fed-vs-fsdp-loss", what, None, runs=0, note="not run")
    theirs = finals(runs, fsdp)
    per_seed = {s: v / theirs[s] for s, v in finals(runs, chosen).items() if s in theirs}
    measured = statistics.median(per_seed.values())
    return _row("fed-vs-fsdp-loss", what, measured, runs=len(per_seed), recipe=chosen, against=fsdp,
                per_seed={str(k): v for k, v in sorted(per_seed.items())})  # fmt: skip


def _fsdps_tokens(name: str) -> bool:
    """Whether a recipe trains as many tokens as FSDP's run (not a longer run, not another batch per step)."""
    recipe, fsdp = RECIPES[name], RECIPES[FSDP]
    return recipe.steps == fsdp.steps and recipe.tokens_per_step == fsdp.tokens_per_step


def _paper_regime(runs: Runs) -> Row:
    what = (
        "above the critical batch (64 windows per step, 4x): tokens to the final loss of FSDP's best 4x run of the"
        " better federation of 4 groups of 16 windows each, over FSDP's own (median over the seeds both ran)"
    )
    fsdp, federation = _best_seeded(runs, FSDP_4X), _best_seeded(runs, PAPER_FEDERATIONS)
    return _ratio_row("paper-regime", what, runs, federation, fsdp or FSDP_4X[0])


def _best_seeded(runs: Runs, names: tuple[str, ...]) -> str | None:
    """The best of ``names`` among those with 2 seeds, else among those with one (medians over equal seed counts)."""
    return best(runs, names, seeds=2) or best(runs, names, seeds=1)


def paper_regime_table(results: list[dict[str, Any]]) -> str:
    """The paper's regime: FSDP at 4x per step (each inner lr) and the federations, final loss and tokens to FSDP's."""
    runs = by_recipe(results)
    fsdp = _best_seeded(runs, FSDP_4X)
    lines = ["| recipe | what | final loss (by seed) | tokens to FSDP 4x's best final loss |", "|---|---|---|---|"]
    for name in (*FSDP_4X, *PAPER_FEDERATIONS):
        values = finals(runs, name)
        against = "-" if fsdp is None or name == fsdp or not values else _ratio_text(runs, name, fsdp)
        shown = " / ".join(f"{v:.3f}" for _, v in sorted(values.items())) or "-"
        lines.append(f"| `{name}` | {RECIPES[name].what} | {shown} | {against} |")
    return "\n".join(lines)


def _ratio_row(target_id: str, what: str, runs: Runs, recipe: str | None, against: str) -> Row:
    if recipe is None or against not in runs:
        return _row(target_id, what, None, runs=0, note="its recipes have not run with 2 seeds")
    per_seed = ratios(runs, recipe, against)
    reached = [v for v in per_seed.values() if v is not None]
    measured = statistics.median(reached) if reached and len(reached) == len(per_seed) else None
    above = at_own_final(runs, recipe, against)
    note = None
    if measured is None:
        shown = ", ".join(f"seed {s}: {v:.2f}" for s, v in sorted(above.items()))
        note = f"not reached by every seed; the ratio at the looser target each such seed reached: {shown}"
    return _row(target_id, what, measured, runs=len(per_seed), recipe=recipe, against=against, note=note,
                per_seed={str(k): v for k, v in sorted(per_seed.items())})  # fmt: skip


def _row(target_id: str, what: str, measured: float | None, runs: int, **extra: Any) -> Row:
    bound = BOUNDS[target_id]
    if measured is None:
        met = False
    else:
        met = measured >= bound if target_id == "outer-lr-trend" else measured <= bound
    extra = {k: v for k, v in extra.items() if v is not None}
    return {"id": target_id, "target": what, "measured": measured, "bound": bound, "met": met, "runs": runs, **extra}
