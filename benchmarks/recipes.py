"""The recipe study: sync recipes compared at a horizon that decides (>= 150 outer rounds), on the simulator.

Every run is the examples' Llama (``xs``) on Shakespeare, 4 groups of one rank training 4 windows of 128 tokens per
step each (16 windows per step in all), an outer sync every 8 steps, 1,200 steps (150 outer rounds, 2.46 M tokens),
validated every 50 steps. Run from the repository root::

    PYTHONPATH=. python -m benchmarks.recipes --work /tmp/fedshard-recipes [--only fedavg_f32 int4ef] [--seeds 0 1]

Each (recipe, seed) runs in a process of its own, two at a time (one per core, ``OMP_NUM_THREADS=1``); its result
(the validation curve from Lightning's CSV log, tokens, wall and CPU time, the settings and the command) goes to
``benchmarks/results/recipes/<recipe>-s<seed>.json``. A run whose result is there is not run again; an interrupted run
resumes from its last checkpoint under ``--work`` (the simulator refuses a checkpoint written with other settings, and
a result file written with other settings is an error, never overwritten silently). ``benchmarks.reports.recipes``
turns the results into tokens-to-target ratios, the table and the plot of docs/benchmarks/recipes.md.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.invocations import record_invocation
from lightning_fedshard.core.options.pace import Pace
from lightning_fedshard.core.wire.codecs import SparseLoCo

RESULTS = Path(__file__).parent / "results" / "recipes"

GROUPS = 4
BATCH = 4  # windows per group and step
SEQ_LEN = 128
SYNC_EVERY = 8
STEPS = 1200
VAL_EVERY = 50
VAL_WINDOWS = 128
LR = 0.005
SEEDS = (0, 1)
CHECKPOINT_EVERY = 100


def _nesterov(lr: float, momentum: float = 0.9) -> Callable[..., Any]:
    """The outer step of a recipe's ``outer=(lr, momentum)``: Nesterov SGD, or plain SGD at ``momentum=0``."""
    import torch

    if momentum == 0:
        return functools.partial(torch.optim.SGD, lr=lr)
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=True)


@dataclass(frozen=True)
class Recipe:
    """One configuration of the study: federation options, and the groups' shape (FSDP: one group of 4 ranks)."""

    name: str
    what: str
    options: dict[str, Any] = field(default_factory=dict)
    groups: int = GROUPS
    ranks_per_group: int = 1
    steps: int = STEPS
    sync_every: int = SYNC_EVERY
    lr: float = LR
    val_every: int = VAL_EVERY
    batch: int = BATCH  # windows per rank and step
    val_windows: int = VAL_WINDOWS
    warmup_fraction: float = 0.1  # of the steps, then cosine to 0

    def federation(self) -> Any:
        """The options as the simulator takes them (outer optimizers given by name and learning rate)."""
        from lightning_fedshard.core.config import FederationConfig

        options = dict(self.options)
        outer = options.pop("outer", None)
        if outer is not None:
            options["outer_optimizer"] = _nesterov(*outer)
        return FederationConfig(num_groups=self.groups, sync_every=self.sync_every, **options)

    @property
    def trained_share(self) -> float:
        """The share of the groups' steps they train (below 1 with a per-group pace whose slow groups skip steps)."""
        pace = self.options.get("pace")
        if pace is None:
            return 1.0
        from lightning_fedshard.core.options.pace import PaceSchedule

        steps = PaceSchedule(pace, self.groups, self.sync_every).steps(0)
        return sum(steps) / (self.groups * self.sync_every)

    @property
    def tokens_per_step(self) -> float:
        """Tokens the groups train per optimizer step (committed: a skipped step trains none), on average."""
        return self.groups * self.ranks_per_group * self.batch * SEQ_LEN * self.trained_share

    def settings(self) -> dict[str, Any]:
        """Everything that decides a run's result (a result file of other settings is never overwritten).

        The warm-up is named only where it is not the study's 10%, so the study's results on record keep matching.
        """
        settings = {
            "options": {k: repr(v) for k, v in sorted(self.options.items())},
            "groups": self.groups,
            "ranks_per_group": self.ranks_per_group,
            "batch": self.batch,
            "seq_len": SEQ_LEN,
            "sync_every": self.sync_every,
            "steps": self.steps,
            "val_every": self.val_every,
            "val_windows": self.val_windows,
            "lr": self.lr,
        }
        if self.warmup_fraction != 0.1:
            settings["warmup_fraction"] = self.warmup_fraction
        return settings


def _outer_cell(name: str, outer: tuple[float, float] | None, sync_every: int, groups: int = GROUPS) -> Recipe:
    """One cell of the outer-step sweep: float32 traffic, outer SGD ``(lr, momentum)`` (``None``: averaging)."""
    if outer is None:
        what = "plain averaging"
    elif outer[1] == 0:
        what = f"outer SGD {outer[0]:g} without momentum"
    else:
        what = f"outer Nesterov ({outer[0]:g}, {outer[1]:g}), an effective step of {outer[0] / (1 - outer[1]):g}"
    shape = f"{groups} groups" if groups > 1 else "one group of 4 ranks (the FSDP batch)"
    options: dict[str, Any] = {"reduce_dtype": "float32", **({"outer": outer} if outer is not None else {})}
    ranks = 1 if groups > 1 else GROUPS
    return Recipe(name, f"float32, {what}, sync every {sync_every}, {shape}", options, groups=groups,
                  ranks_per_group=ranks, sync_every=sync_every)  # fmt: skip


#: The outer step by H and the number of groups M (docs/benchmarks/recipes.md, "The outer step by H and M").
OUTER_SWEEP = (
    _outer_cell("sgd07_f32", (0.7, 0.0), 8),
    _outer_cell("nesterov02_f32", (0.2, 0.9), 8),
    _outer_cell("nesterov05m05_f32", (0.5, 0.5), 8),
    _outer_cell("h32_fedavg_f32", None, 32),
    _outer_cell("h32_sgd07_f32", (0.7, 0.0), 32),
    _outer_cell("h32_nesterov01_f32", (0.1, 0.9), 32),
    _outer_cell("h32_nesterov02_f32", (0.2, 0.9), 32),
    _outer_cell("h32_nesterov04_f32", (0.4, 0.9), 32),
    _outer_cell("h32_nesterov07_f32", (0.7, 0.9), 32),
    _outer_cell("m1_h32_nesterov02", (0.2, 0.9), 32, groups=1),
    _outer_cell("m1_h32_nesterov04", (0.4, 0.9), 32, groups=1),
    _outer_cell("m1_h32_nesterov07", (0.7, 0.9), 32, groups=1),
)


def _fsdp_batch(multiple: int, lr: float) -> Recipe:
    """Plain FSDP (one group) with ``multiple`` times the study's 16 windows per step, at the same token budget."""
    name = f"fsdp_b{multiple}_lr{lr:g}".replace(".", "p")
    what = f"FSDP, {16 * multiple} windows per step ({multiple}x), {STEPS // multiple} steps, inner lr {lr:g}"
    steps = STEPS // multiple
    val_every = VAL_EVERY if steps % VAL_EVERY == 0 else steps // 5  # the last validation at the last step
    return Recipe(name, what, {}, groups=1, ranks_per_group=GROUPS * multiple, steps=steps, lr=lr,
                  val_every=val_every)  # fmt: skip


#: The examples' critical batch: FSDP's loss at the study's token budget for 1x, 4x and 16x its batch per step, each
#: at half, once and twice the study's inner learning rate (1x at once is the study's ``fsdp``).
CRITICAL_BATCH = tuple(
    _fsdp_batch(multiple, lr) for multiple in (1, 4, 16) for lr in (LR / 2, LR, 2 * LR) if (multiple, lr) != (1, LR)
)


def _paper_federation(name: str, what: str, options: dict[str, Any], sync_every: int = SYNC_EVERY) -> Recipe:
    """4 groups of 16 windows per step (64 in all, 4x FSDP's batch) for the study's tokens (300 steps)."""
    what = f"4 groups of 16 windows per step (64 in all, 4x), {what}, H={sync_every}, 300 steps"
    return Recipe(name, what, options, ranks_per_group=4, steps=STEPS // 4, sync_every=sync_every)


#: The paper's regime: a global batch above the examples' critical batch (4x FSDP's, 64 windows per step), where a
#: federation of 4 groups keeps each group's batch at 16 windows (1x, the best batch per step at this token budget),
#: against FSDP taking all 64 per step; the same tokens (300 steps). FSDP 4x's best inner lr was the lowest tried
#: (0.0025), so it gets a lower one too; the groups take the 1x batch's best (0.005). At H=8 the federation never
#: reached FSDP's loss, so shorter horizons (H=4, H=2: more agreement for more traffic) follow.
PAPER_REGIME = (
    _fsdp_batch(4, LR / 4),
    _paper_federation("paper_fed4_fedavg", "float32, plain averaging", {"reduce_dtype": "float32"}),
    _paper_federation("paper_fed4_int4ef", "int4 + error feedback (the defaults)", {}),
    _paper_federation("paper_fed4_fedavg_h4", "float32, plain averaging", {"reduce_dtype": "float32"}, 4),
    _paper_federation("paper_fed4_fedavg_h2", "float32, plain averaging", {"reduce_dtype": "float32"}, 2),
)

#: The wall time to FSDP's final loss: the federation gets up to 3x FSDP's tokens where it needs more to reach that
#: loss (float32 averaging and the defaults, the two that ended lowest at H=8); eager updates on the best outer step.
LONGER = (
    Recipe("fedavg_f32_x3", "float32, plain averaging, 3,600 steps (3x the study's tokens)",
           {"reduce_dtype": "float32"}, steps=3 * STEPS),
    Recipe("int4ef_x3", "int4 + error feedback, plain averaging (the defaults), 3,600 steps", {}, steps=3 * STEPS),
    Recipe("eager_fedavg_f32", "float32, eager updates (own share applied at once), plain averaging",
           {"reduce_dtype": "float32", "eager_updates": True}),
)  # fmt: skip


def _inner_lr(lr: float) -> Recipe:
    """Float32 plain averaging at H=8 with the groups' own inner learning rate (each group trains 4 windows a step)."""
    name = f"fedavg_f32_lr{lr:g}".replace(".", "p")
    return Recipe(name, f"float32, plain averaging, the groups' inner lr {lr:g}", {"reduce_dtype": "float32"}, lr=lr)


#: The federation's inner step tuned for its own batch (each group 4 windows per step, FSDP's lr was for 16), outer
#: SGD steps above 1 without momentum, and momentum 0.5 at H=32 with 4 groups and with one (cells not run before).
GROUP_TUNING = (
    *(_inner_lr(lr) for lr in (0.0025, 0.0035, 0.007)),
    _outer_cell("sgd12_f32", (1.2, 0.0), 8),
    _outer_cell("sgd15_f32", (1.5, 0.0), 8),
    _outer_cell("h32_nesterov1m05_f32", (1.0, 0.5), 32),
    _outer_cell("m1_h32_nesterov1m05", (1.0, 0.5), 32, groups=1),
)

RECIPES = {
    r.name: r
    for r in (
        Recipe("fedavg_f32", "float32, plain averaging (outer SGD lr 1.0)", {"reduce_dtype": "float32"}),
        Recipe("nesterov_f32", "float32, outer Nesterov (0.7, 0.9)", {"reduce_dtype": "float32", "outer": (0.7,)}),
        Recipe("nesterov1_f32", "float32, outer Nesterov (1.0, 0.9)", {"reduce_dtype": "float32", "outer": (1.0,)}),
        Recipe("int4ef", "int4 + error feedback, plain averaging (the defaults)", {}),
        Recipe("int4ef_nesterov", "int4 + error feedback, outer Nesterov (0.7, 0.9)", {"outer": (0.7,)}),
        Recipe("sparse", "sparse top-1/64, 2-bit values, error feedback, plain averaging", {"reduce_dtype": "sparse"}),
        Recipe(
            "eager_f32",
            "float32, eager updates (own share applied at once), outer Nesterov (0.5, 0.9)",
            {"reduce_dtype": "float32", "eager_updates": True, "outer": (0.5,)},
        ),
        Recipe(
            "overlap1_f32",
            "float32, outer Nesterov (0.7, 0.9), the sum overlapped with one inner step (sync_delay=1)",
            {"reduce_dtype": "float32", "sync_delay": 1, "outer": (0.7,)},
        ),
        Recipe("fsdp", "FSDP: one group of 4 ranks, the same 16 windows per step", {}, groups=1, ranks_per_group=4),
        Recipe(
            "sparseloco_selected",
            "SparseLoCo / Covenant: top 64 of 4096, 2-bit table, feedback decay 0.95, median clip, mean where selected",
            {"reduce_dtype": SparseLoCo()},
        ),
        Recipe(
            "sparseloco_all",
            "SparseLoCo / Covenant as its paper writes the mean: over all groups (1/R)",
            {"reduce_dtype": SparseLoCo(mean="all")},
        ),
        Recipe(
            "paced_int4ef",
            "the defaults with the last group half as fast: it trains 4 of every 8 steps (Pace), merged by tokens",
            {"pace": Pace(speeds=(1.0, 1.0, 1.0, 0.5))},
        ),
        *OUTER_SWEEP,
        *CRITICAL_BATCH,
        *PAPER_REGIME,
        *LONGER,
        *GROUP_TUNING,
    )
}


def run_one(recipe: Recipe, seed: int, work: Path, module: str = "benchmarks.recipes") -> dict[str, Any]:
    """Run (or resume) one simulation and return its result (the validation curve and what it cost)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_fedshard.examples import LlamaLM, ShakespeareDataModule
    from lightning_fedshard.simulate import Simulator

    root = work / f"{recipe.name}-s{seed}"
    L.seed_everything(seed, verbose=False)
    model = LlamaLM(
        size="xs", vocab_size=4096, max_seq_len=SEQ_LEN, lr=recipe.lr, warmup_fraction=recipe.warmup_fraction,
        init_seed=seed,
    )  # fmt: skip
    data = ShakespeareDataModule(
        seq_len=SEQ_LEN, batch_size=recipe.batch, vocab_size=4096, max_val_windows=recipe.val_windows, seed=seed,
        resumable=True,
    )  # fmt: skip
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=CHECKPOINT_EVERY)
    simulator = Simulator(
        recipe.federation(),
        ranks_per_group=recipe.ranks_per_group,
        accelerator="cpu",
        max_steps=recipe.steps,
        val_check_interval=recipe.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[checkpoints],
        logger=CSVLogger(root, name="csv", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = root / "ckpt" / "last.ckpt"
    resumed = last.exists()
    start, cpu = time.time(), _cpu_seconds()
    metrics = root / "csv" / "version_0" / "metrics.csv"
    before = _validation_curve(metrics)  # Lightning's CSVLogger starts the file over when a run resumes
    fitted = simulator.fit(model, datamodule=data, ckpt_path=str(last) if last.exists() else None)
    merged = {step: loss for step, loss in before + _validation_curve(metrics)}
    curve = [[step, merged[step]] for step in sorted(merged)]
    final = _final_validation(fitted, curve, recipe.steps)
    wall, cpu = time.time() - start, _cpu_seconds() - cpu
    tokens_per_step = recipe.tokens_per_step
    return {
        "recipe": recipe.name,
        "what": recipe.what,
        "seed": seed,
        "settings": recipe.settings(),
        "tokens_per_step": tokens_per_step,
        "curve": curve + final,  # [step, val_loss] pairs
        "final_val_loss": (curve + final)[-1][1] if curve or final else None,
        "final_added": bool(final),
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "resumed": resumed,  # the wall and CPU time then count from the resume
        "finished_at": time.time(),
        "command": f"PYTHONPATH=. python -m {module} --only {recipe.name} --seeds {seed}",
    }


def _final_validation(fitted: Any, curve: list[list[float]], steps: int) -> list[list[float]]:
    """The validation after the last step, when the schedule missed it: ``[[steps - 1, val_loss]]``, else ``[]``.

    With more ranks per group than a training epoch's batches divide into, Lightning steps on a partial accumulation
    at each epoch's end, so a ``val_check_interval`` counted in batches drifts off the optimizer steps and can miss
    the last one; the study's final loss must be the last step's.
    """
    if curve and curve[-1][0] == steps - 1:
        return []
    return [[steps - 1, float(fitted.validate()[0]["val_loss"])]]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _validation_curve(metrics: Path) -> list[list[float]]:
    """``[step, val_loss]`` of every validation in Lightning's CSV log (none if there is no log yet)."""
    seen: dict[int, float] = {}
    if not metrics.exists():
        return []
    with metrics.open() as f:
        for row in csv.DictReader(f):
            if row.get("val_loss"):
                seen[int(row["step"])] = float(row["val_loss"])
    return [[step, seen[step]] for step in sorted(seen)]


def result_path(name: str, seed: int, results: Path | None = None) -> Path:
    """Where the result of one run goes (in ``results``, default: the study's folder)."""
    return (RESULTS if results is None else results) / f"{name}-s{seed}.json"


def load_results() -> list[dict[str, Any]]:
    """Every result on record whose settings are the study's current ones."""
    results = []
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        recipe = RECIPES.get(result["recipe"])
        if recipe is not None and result["settings"] == recipe.settings():
            results.append(result)
    return results


def pending(
    names: list[str], seeds: list[int], recipes: dict[str, Recipe] | None = None, results: Path | None = None
) -> list[tuple[str, int]]:
    """The runs still to do, seed-major (every recipe's first seed before any second one).

    Raises:
        ValueError: If a result on record was written with other settings: remove it (or rename the recipe) first.
    """
    todo = []
    for seed in seeds:
        for name in names:
            path = result_path(name, seed, results)
            if not path.exists():
                todo.append((name, seed))
                continue
            if json.loads(path.read_text())["settings"] != (recipes or RECIPES)[name].settings():
                raise ValueError(f"{path} holds a run with other settings than recipe {name!r}; remove it to rerun.")
    return todo


def main(
    argv: list[str] | None = None,
    recipes: dict[str, Recipe] | None = None,
    results: Path | None = None,
    module: str = "benchmarks.recipes",
    description: str | None = None,
    seeds: tuple[int, ...] = SEEDS,
) -> None:
    """Command line entry point: run what is missing, two runs at a time.

    Every invocation (not the runs it starts) is appended to ``results/invocations.jsonl``: when, the command line,
    the commit, and the runs it found to do, so that no invocation is lost from the record, even one whose runs were
    replaced later.

    Args:
        argv: The command line (default: ``sys.argv``).
        recipes: The study's recipes, by name.
        results: Where each run's result goes.
        module: The module a run is started as (``python -m module --one RECIPE SEED``).
        description: The study's one-line description.
        seeds: The seeds run by default.
    """
    recipes, results = recipes or RECIPES, results or RESULTS
    parser = argparse.ArgumentParser(description=description or (__doc__ or "").splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(f"/tmp/fedshard-{module.rsplit('.', 1)[-1]}"),
                        help="checkpoints and logs")  # fmt: skip
    parser.add_argument("--only", nargs="*", choices=sorted(recipes), help="recipes to run (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, default=list(seeds))
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (one core each)")
    parser.add_argument("--one", nargs=2, metavar=("RECIPE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        name, seed = args.one[0], int(args.one[1])
        result = run_one(recipes[name], seed, args.work, module)
        results.mkdir(parents=True, exist_ok=True)
        result_path(name, seed, results).write_text(json.dumps(result, indent=1) + "\n")
        return
    todo = pending(args.only or list(recipes), args.seeds, recipes, results)
    runs = [f"{name}-s{seed}" for name, seed in todo]
    record_invocation(results / "invocations.jsonl", module, argv if argv is not None else sys.argv[1:], runs)
    print(f"{len(todo)} run(s) to do: {', '.join(f'{n}-s{s}' for n, s in todo)}", flush=True)
    running: list[tuple[str, subprocess.Popen[bytes]]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    while todo or running:
        while todo and len(running) < args.parallel:
            name, seed = todo.pop(0)
            log = args.work / f"{name}-s{seed}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", module, "--work", str(args.work), "--one", name, str(seed)]
            running.append((f"{name}-s{seed}", subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=-2)))
        time.sleep(5)
        for label, proc in list(running):
            if proc.poll() is not None:
                running.remove((label, proc))
                print(f"{label}: {'done' if proc.returncode == 0 else f'FAILED ({proc.returncode})'}", flush=True)


if __name__ == "__main__":
    main()
