"""The recipe study's evidence: tokens to a target loss, final losses, curves and targets (from the results alone).

A run's validation curve is ``[step, val_loss]`` as Lightning's CSV log has it (its ``step`` column is the optimizer
step count less one at a validation). The *tokens to target* of a run is the number of training tokens (all groups)
it took to first reach a target validation loss, linearly interpolated between two validations; the target is a
reference run's final validation loss *of the same seed* (runs are paired by seed: same initial weights, same data
order). A run that never reaches the target gets no ratio, only how far above it ended.

    PYTHONPATH=. python -m benchmarks.reports.recipes          # prints the table and the targets
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.recipes import GROUPS, LR, RECIPES, RESULTS, STEPS, load_results

#: The simulator's exactness against the Trainer (``python -m benchmarks.sim_exact``).
EXACT_RESULTS = RESULTS.parent / "sim_exact.json"
#: The reference of the ratios: float32 plain averaging, and FSDP with the same batch.
REFERENCE = "fedavg_f32"
FSDP = "fsdp"
#: The 8-rank emulated cluster's unthrottled pace with no sync, tokens/s (medians of 3 in throughput.json:
#: fl_fsdp-nosync 5,882 and fl_hsdp-nosync 6,669; the larger is the reference), at 4,096 tokens a step.
CLUSTER_NOSYNC_TOKENS_PER_S = 6669.0
#: (target id, what, recipe, against, bound) of the tokens-to-target targets.
RATIO_TARGETS = (
    ("ttt-int4", "tokens to target of int4 + error feedback against float32", "int4ef", REFERENCE, 1.02),
    (
        "ttt-overlap-1",
        "tokens to target of a one-inner-step overlap against none (float32, Nesterov 0.7)",
        "overlap1_f32",
        "nesterov_f32",
        1.01,
    ),
    (
        "ttt-eager",
        "tokens to target of eager updates (own share, Nesterov 0.5) against no overlap (Nesterov 0.7)",
        "eager_f32",
        "nesterov_f32",
        1.05,
    ),
)
#: Every target of the study, in the order of the table.
TARGET_IDS = (
    "sim-exact", "sim-speed", "ttt-int4", "ttt-overlap-1", "ttt-eager", "ttt-sparse", "ttt-outer", "hetero-ppl",
)  # fmt: skip
#: Groups of different speeds: the paced recipe against the same defaults with every group fast.
PACED, ALL_FAST = "paced_int4ef", "int4ef"
#: The outer optimizers tried, all float32: the default's ratio is against the best of them.
OUTER_RECIPES = ("fedavg_f32", "nesterov_f32", "nesterov1_f32")
DEFAULT_OUTER = "fedavg_f32"
#: The sparse recipes (each under 0.01x float32's bytes): the best of them is held against float32.
SPARSE_RECIPES = ("sparse", "sparseloco_selected", "sparseloco_all")


def steps_done(logged_step: float) -> float:
    """Optimizer steps completed at a validation logged at ``logged_step``."""
    return logged_step + 1


def tokens_to(curve: Sequence[Sequence[float]], target: float, tokens_per_step: int) -> float | None:
    """Tokens until the curve first reaches ``target`` (interpolated between validations), ``None`` if never."""
    previous: tuple[float, float] | None = None
    for step, loss in curve:
        done = steps_done(step)
        if loss <= target:
            if previous is None or previous[1] == loss:
                return done * tokens_per_step
            (s0, l0), s1 = previous, done
            return (s0 + (l0 - target) / (l0 - loss) * (s1 - s0)) * tokens_per_step
        previous = (done, loss)
    return None


def loss_at(curve: Sequence[Sequence[float]], tokens: float, tokens_per_step: float) -> float | None:
    """The validation loss after ``tokens`` training tokens (linear between validations); ``None`` beyond the curve."""
    points = [(steps_done(step) * tokens_per_step, loss) for step, loss in curve]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[-1][1] if points and abs(points[-1][0] - tokens) < 1e-9 else None


def paced_perplexity_ratios(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[int, float]:
    """Per seed both ran: the paced run's final perplexity over the all-fast run's at the same committed tokens."""
    import math

    out = {}
    for seed, paced in runs.get(PACED, {}).items():
        fast = runs.get(ALL_FAST, {}).get(seed)
        if fast is None:
            continue
        tokens = steps_done(paced["curve"][-1][0]) * paced["tokens_per_step"]
        reference = loss_at(fast["curve"], tokens, fast["tokens_per_step"])
        if reference is not None:
            out[seed] = math.exp(paced["curve"][-1][1] - reference)
    return out


def by_recipe(results: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{recipe: {seed: result}}``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for result in results:
        out.setdefault(result["recipe"], {})[result["seed"]] = result
    return out


def ratios(runs: dict[str, dict[int, dict[str, Any]]], recipe: str, against: str) -> dict[int, float | None]:
    """Per seed both ran: ``recipe``'s tokens to ``against``'s final loss over ``against``'s own tokens to it."""
    out: dict[int, float | None] = {}
    for seed, (run, reference, own) in _paired(runs, recipe, against).items():
        tokens = tokens_to(run["curve"], reference["curve"][-1][1], run["tokens_per_step"])
        out[seed] = None if tokens is None or not own else tokens / own
    return out


def at_own_final(runs: dict[str, dict[int, dict[str, Any]]], recipe: str, against: str) -> dict[int, float]:
    """Per seed where ``recipe`` never reached ``against``'s final loss: the ratio at the looser target it did reach,
    its own final loss (its tokens to it over ``against``'s tokens to it); the ratio at the real target is larger."""
    out: dict[int, float] = {}
    for seed, (run, reference, _) in _paired(runs, recipe, against).items():
        if tokens_to(run["curve"], reference["curve"][-1][1], run["tokens_per_step"]) is not None:
            continue
        own_final = run["curve"][-1][1]
        tokens = tokens_to(run["curve"], own_final, run["tokens_per_step"])
        theirs = tokens_to(reference["curve"], own_final, reference["tokens_per_step"])
        if tokens and theirs:
            out[seed] = tokens / theirs
    return out


def _paired(
    runs: dict[str, dict[int, dict[str, Any]]], recipe: str, against: str
) -> dict[int, tuple[dict[str, Any], dict[str, Any], float | None]]:
    """``{seed: (run, reference run, the reference's own tokens to its final loss)}`` for the seeds both ran."""
    out = {}
    for seed, reference in runs.get(against, {}).items():
        run = runs.get(recipe, {}).get(seed)
        if run is not None:
            own = tokens_to(reference["curve"], reference["curve"][-1][1], reference["tokens_per_step"])
            out[seed] = (run, reference, own)
    return out


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def analyze(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every recipe's ratios (against float32 fedavg and against FSDP) and final losses, per seed and as spreads."""
    runs = by_recipe(results)
    rows = {}
    for name in RECIPES:
        if name not in runs:
            continue
        finals = {seed: r["curve"][-1][1] for seed, r in runs[name].items()}
        rows[name] = {
            "seeds": sorted(runs[name]),
            "final_loss": finals,
            "final_spread": spread(list(finals.values())),
            "vs_fedavg": ratios(runs, name, REFERENCE),
            "vs_fsdp": ratios(runs, name, FSDP),
            "own_final_fedavg": at_own_final(runs, name, REFERENCE),
            "own_final_fsdp": at_own_final(runs, name, FSDP),
        }
    return {"recipes": rows, "speed": study_speed(results)}


def study_speed(results: list[dict[str, Any]]) -> dict[str, float] | None:
    """Tokens/s of all runs together over the time at least one of them ran (the union of their wall times).

    Only runs that were not resumed count (a resumed run's wall time covers its remainder only). Runs made on other
    days add their own time, not the days between.
    """
    whole = [r for r in results if not r.get("resumed")]
    if not whole:
        return None
    tokens = sum(r["tokens_per_step"] * steps_done(r["curve"][-1][0]) for r in whole)
    busy = _union_seconds([(r["finished_at"] - r["wall_seconds"], r["finished_at"]) for r in whole])
    per_run = [r["tokens_per_step"] * steps_done(r["curve"][-1][0]) / r["wall_seconds"] for r in whole]
    return {
        "tokens_per_s": tokens / busy,
        "per_run_median": statistics.median(per_run),
        "runs": len(whole),
        "hours": busy / 3600,
    }


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _ratio_cell(per_seed: dict[int, float | None], above: dict[int, float]) -> str:
    if not per_seed:
        return "-"
    shown = ", ".join(
        (f"not reached ({above[seed]:.2f} at its own final loss)" if seed in above else "not reached")
        if v is None
        else f"{v:.3f}"
        for seed, v in sorted(per_seed.items())
    )
    reached = [v for v in per_seed.values() if v is not None]
    if len(reached) < len(per_seed):
        return f"not reached by every seed ({shown})"
    return f"**{statistics.median(reached):.3f}** ({shown})"


def table(analysis: dict[str, Any]) -> str:
    """The study's Markdown table: one row per recipe."""
    lines = [
        "| recipe | what | tokens to float32 fedavg's final loss (median; per seed) | tokens to FSDP's final loss"
        " | final val loss, median [min, max] |",
        "|---|---|---|---|---|",
    ]
    for name, row in analysis["recipes"].items():
        final = row["final_spread"]
        lines.append(
            f"| `{name}` | {RECIPES[name].what} | {_ratio_cell(row['vs_fedavg'], row['own_final_fedavg'])}"
            f" | {_ratio_cell(row['vs_fsdp'], row['own_final_fsdp'])}"
            f" | {final['median']:.4f} [{final['min']:.4f}, {final['max']:.4f}] |"
        )
    return "\n".join(lines)


def section(results: list[dict[str, Any]]) -> str:
    """The generated section of docs/benchmarks/recipes.md: the table and the study's pace."""
    analysis = analyze(results)
    speed = analysis["speed"]
    runs = f"{len(results)} runs of {len(analysis['recipes'])} recipes"
    pace = (
        f" The study's runs trained {speed['tokens_per_s']:,.0f} tokens/s together ({speed['runs']} runs that were not"
        f" resumed, two at a time on 2 cores, {speed['hours']:.2f} h; one run alone: median"
        f" {speed['per_run_median']:,.0f} tokens/s)."
        if speed
        else ""
    )
    return (
        f"{table(analysis)}\n\n{runs}; results in `benchmarks/results/recipes/`, one file per run with its command"
        f" (`PYTHONPATH=. python -m benchmarks.recipes`).{pace}"
    )


def targets(results: list[dict[str, Any]], exactness: float | None = None, modes: int = 0) -> list[dict[str, Any]]:
    """The study's rows of ``targets.json`` (those it has results for)."""
    analysis = analyze(results)
    runs = by_recipe(results)
    rows: list[dict[str, Any]] = []
    what = "simulator against the Trainer strategy, every mode (largest weight difference)"
    rows.append(_row("sim-exact", what, exactness, 1e-6, runs=modes))
    speed = analysis.get("speed")
    what = "tokens/s of the study's runs together against the 8-rank cluster's no-sync pace"
    measured = speed["tokens_per_s"] / CLUSTER_NOSYNC_TOKENS_PER_S if speed else None
    rows.append(_row("sim-speed", what, measured, 1.5, runs=speed["runs"] if speed else 0, detail=speed))
    for target_id, what, recipe, against, bound in RATIO_TARGETS:
        rows.append(_ratio_row(target_id, what, runs, recipe, against, bound))
    finals = analysis["recipes"]
    sparse = _best(finals, SPARSE_RECIPES)
    what = f"tokens to target of the best sparse recipe ({sparse}, by final loss) against float32"
    rows.append(_ratio_row("ttt-sparse", what, runs, sparse, REFERENCE, 1.10))
    best = _best(finals, OUTER_RECIPES)
    what = f"tokens to target of the default outer optimizer ({DEFAULT_OUTER}) against the best tried ({best})"
    against = best if DEFAULT_OUTER in finals else "not run"
    rows.append(_ratio_row("ttt-outer", what, runs, DEFAULT_OUTER, against, 1.0))
    paced = paced_perplexity_ratios(runs)
    what = "validation perplexity at equal committed tokens, one of 4 groups half as fast (Pace), against all fast"
    measured = statistics.median(paced.values()) if paced else None
    rows.append(
        _row("hetero-ppl", what, measured, 1.02, runs=len(paced), per_seed={str(k): v for k, v in paced.items()})
    )
    return rows


def _best(finals: dict[str, Any], names: Sequence[str]) -> str:
    """The one of ``names`` with the lowest median final loss (``"not run"`` if none ran)."""
    tried = [name for name in names if name in finals]
    return min(tried, key=lambda n: finals[n]["final_spread"]["median"]) if tried else "not run"


def _ratio_row(
    target_id: str, what: str, runs: dict[str, dict[int, dict[str, Any]]], recipe: str, against: str, bound: float
) -> dict[str, Any]:
    per_seed = ratios(runs, recipe, against)
    reached = [v for v in per_seed.values() if v is not None]
    measured = statistics.median(reached) if per_seed and len(reached) == len(per_seed) else None
    row = _row(
        target_id, what, measured, bound, runs=len(per_seed), per_seed={str(k): v for k, v in sorted(per_seed.items())}
    )
    if measured is None and per_seed:
        above = at_own_final(runs, recipe, against)
        row["at_own_final"] = {str(k): v for k, v in sorted(above.items())}
        shown = ", ".join(f"seed {k}: {v:.2f}" for k, v in sorted(above.items()))
        row["note"] = (
            "not reached by every seed within the run's length; the ratio at the looser target each such seed"
            f" reached, its own final loss: {shown}"
        )
        row["met"] = False
    return row


def _row(target_id: str, what: str, measured: float | None, bound: float, runs: int, **extra: Any) -> dict[str, Any]:
    if measured is None:
        met = False
    else:
        met = measured >= bound if target_id == "sim-speed" else measured <= bound
    return {
        "id": target_id,
        "target": what,
        "measured": measured,
        "bound": bound,
        "met": bool(met),
        "runs": runs,
        **extra,
    }


#: The planner's measured factors, written from the study (``lightning_fedshard.plan.quality`` reads them).
MEASURED_MODULE = Path(__file__).parents[2] / "lightning_fedshard" / "plan" / "measured.py"


#: The planner's target: FSDP's final validation loss after the study's tokens, the quality plain sharded data
#: parallelism reaches (a federation may take longer runs of the same setting, e.g. ``_x3``, to reach it).
PLANNER_REFERENCE = "fsdp"


def planner_factors(
    results: list[dict[str, Any]],
) -> dict[tuple[object, ...], tuple[float, str, tuple[float, ...], bool]]:
    """``{option key: (median factor, recipe, per-seed factors, looser)}`` of every recipe the planner can express.

    A recipe's factor per seed is its tokens to FSDP's final loss over FSDP's own (FSDP is 1); where a seed never
    reached that loss within the run, the factor at the looser target it did reach, its own final loss
    (:func:`at_own_final`; ``looser`` is then true: the factor at the real target is larger). Its options must be ones
    the planner sets (a named codec, ``"fedavg"`` or ``"nesterov"`` at its default learning rate, or plain FSDP).
    Where recipes share a key (the same setting run for more tokens), the one every seed of which reached the target
    wins, then the one with more seeds.
    """
    runs = by_recipe(results)
    out: dict[tuple[object, ...], tuple[float, str, tuple[float, ...], bool]] = {}
    for name, recipe in RECIPES.items():
        key = _planner_key(recipe)
        factor = _planner_factor(runs, name) if key is not None else None
        if key is None or factor is None:
            continue
        if key not in out or _preference(factor) > _preference(out[key]):
            out[key] = factor
    return out


def _preference(factor: tuple[float, str, tuple[float, ...], bool]) -> tuple[bool, int]:
    """Of two factors for one setting: a factor at the real target before a looser one, then more seeds."""
    _, _, per_seed, looser = factor
    return not looser, len(per_seed)


def _planner_factor(
    runs: dict[str, dict[int, dict[str, Any]]], name: str
) -> tuple[float, str, tuple[float, ...], bool] | None:
    reached = ratios(runs, name, PLANNER_REFERENCE)
    if not reached:
        return None
    above = at_own_final(runs, name, PLANNER_REFERENCE)
    per_seed = {seed: value if value is not None else above.get(seed) for seed, value in reached.items()}
    if any(v is None for v in per_seed.values()):
        return None  # a seed that did not even reach its own final loss against the reference: nothing measured
    values = tuple(round(float(v), 4) for _, v in sorted(per_seed.items()) if v is not None)
    return round(statistics.median(values), 4), name, values, bool(above)


#: Recipe options the planner's keys carry (a recipe with any other, e.g. a pace, is not the planner's setup).
PLANNER_OPTIONS = frozenset({"reduce_dtype", "outer", "sync_delay", "eager_updates", "fragments"})


def _planner_key(recipe: Any) -> tuple[object, ...] | None:
    if recipe.groups == 1:  # plain FSDP at the study's batch and schedule; one group with an outer step is not it
        plain = not recipe.options and (recipe.ranks_per_group, recipe.lr, recipe.steps) == (GROUPS, LR, STEPS)
        return ("fsdp",) if plain else None
    if set(recipe.options) - PLANNER_OPTIONS:
        return None
    if (recipe.ranks_per_group, recipe.lr) != (1, LR) or recipe.steps % STEPS:
        return None  # another batch per group or inner learning rate: not the setting the factors hold for
    outer = recipe.options.get("outer")
    if outer not in (None, (0.7,)):
        return None  # a learning rate the planner's names do not carry
    config = recipe.federation()
    dtype = config.effective_reduce_dtype
    if not isinstance(dtype, str):
        return None
    return (
        config.sync_every,
        config.fragments,
        dtype,
        config.sync_delay,
        config.eager_rule,
        "nesterov" if outer else "fedavg",
    )


def write_planner_factors(results: list[dict[str, Any]], path: Path = MEASURED_MODULE) -> Path:
    """Write :func:`planner_factors` as the Python module the planner imports."""
    study = (
        f"the recipe study of docs/benchmarks/recipes.md: the examples' Llama (1.38 M parameters) on Shakespeare,"
        f" {GROUPS_DESCRIPTION}, {len({r['seed'] for r in results})} seed(s) paired; the target: FSDP's final loss"
        f" after as many tokens (one group of 4 ranks, the same 2,048 tokens a step), which some federations reach"
        f" only in runs of 3x the tokens"
    )
    factors = planner_factors(results)
    lines = [
        '"""Tokens-to-target factors measured by the recipe study (written by ``python -m benchmarks.report``)."""',
        "",
        f"STUDY = {_literal(study)}  # noqa: E501",
        "#: {option key: (median factor, recipe, per-seed factors, measured at the recipe's own final loss)}",
        "FACTORS: dict[tuple[object, ...], tuple[float, str, tuple[float, ...], bool]] = {",
        *(_fit_line(f"    {_literal(k)}: {_literal(v)},") for k, v in sorted(factors.items(), key=lambda kv: kv[1][1])),
        "}",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def _fit_line(line: str) -> str:
    """A generated line, marked for the linter when it is longer than the project's 120 characters."""
    return f"{line}  # noqa: E501" if len(line) > 120 else line


def _literal(value: Any) -> str:
    """``repr`` as the formatter writes it (strings in double quotes), for a generated module."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


#: The study's setting the factors hold for, in words.
GROUPS_DESCRIPTION = "4 groups of one rank, 2,048 tokens a step, sync every 8, 1,200 steps (150 outer rounds)"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Every run's validation curve against training tokens, one colour per recipe, one line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = by_recipe(results)
    figure, (whole, tail) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = plt.get_cmap("tab10")
    for i, (name, seeds) in enumerate(runs.items()):
        for seed, run in sorted(seeds.items()):
            tokens = [steps_done(s) * run["tokens_per_step"] / 1e6 for s, _ in run["curve"]]
            losses = [loss for _, loss in run["curve"]]
            style = dict(color=colours(i % 10), linestyle="-" if seed == 0 else "--", linewidth=1.2)
            whole.plot(tokens, losses, label=name if seed == min(seeds) else None, **style)
            tail.plot(tokens, losses, **style)
    for ax in (whole, tail):
        ax.set_xlabel("training tokens (millions, all groups)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    longest = max(steps_done(r["curve"][-1][0]) * r["tokens_per_step"] for r in results)
    tail.set_xlim(left=0.5 * longest / 1e6)
    tail.set_ylim(top=min(r["curve"][len(r["curve"]) // 2][1] for r in results) + 0.1)
    tail.set_title("second half")
    whole.set_title("recipe study: 4 groups, sync every 8, 1,200 steps (solid: seed 0, dashed: seed 1)")
    whole.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main() -> None:
    """Print the study's table and targets from the results on record."""
    results = load_results()
    analysis = analyze(results)
    print(table(analysis))
    for row in targets(results):
        print(row)


if __name__ == "__main__":
    main()
