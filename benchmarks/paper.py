"""The seed paper's experiment as the paper ran it, scaled to the examples' model, on the simulator.

The paper (its public code: the ``FL+DP`` branch of ``alpha-unito/xffl``, ``examples/EuroPar``) trains Llama-3.1-8B from
scratch for 64 optimizer steps (6 of warm-up, then cosine to 0), AdamW (0.9, 0.95), weight decay 0.1, at one learning
rate for every method, one seed; FSDP takes the whole global batch per step, FL+FSDP splits it into 128 groups, FL+HSDP
into 16, and both average every 8 steps. Here: the examples' ``xs`` Llama from scratch on Shakespeare, the same
schedule, a global batch of 128 windows of 128 tokens per step (8x the examples' critical batch of 16 windows), about
1 M tokens per run, the final consensus validated on 512 held-out windows. The rules that decide whether the paper's
result reproduces are written in docs/benchmarks/paper.md, before the first run.

Arms (3 seeds each): FSDP with all 128 windows per step at the shared learning rate (0.005) and at 0.5x, 2x, 4x; the
federation in 128 groups of 1 window (FL+FSDP's ratio), 16 of 8 (FL+HSDP's), 4 of 32, each at the shared rate and at
0.5x and 2x, H=8, plain averaging; on the 16-group arm an outer SGD step of 0.7 and an outer Nesterov (0.2, 0.9). The
longer variant: the same tokens in 256 steps of 32 windows (4x the critical batch), FSDP at three rates against 4 and
16 groups. Run from the repository root::

    PYTHONPATH=. python -m benchmarks.paper [--only ...] [--seeds 0 1 2] [--parallel 2]

Each run's result goes to ``benchmarks/results/paper/<recipe>-s<seed>.json`` (as the recipe study's do), and every
invocation of this command to ``invocations.jsonl`` there.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.recipes import LR, Recipe
from benchmarks.recipes import main as run_study

RESULTS = Path(__file__).parent / "results" / "paper"
SEEDS = (0, 1, 2)
STEPS, WARMUP = 64, 6
GLOBAL_WINDOWS = 128  # per optimizer step: 8x the examples' critical batch of 16 windows
VAL_WINDOWS = 512
#: The learning rate every method shares, as in the paper: the study's, the best FSDP rate at the critical batch.
SHARED_LR = LR


def _name(base: str, lr: float) -> str:
    return f"{base}_lr{lr:g}".replace(".", "p")


def fsdp(lr: float, steps: int = STEPS, windows: int = GLOBAL_WINDOWS) -> Recipe:
    """Plain FSDP: one group taking all ``windows`` per step (as 4-window ranks)."""
    base = "paper_fsdp" if steps == STEPS else f"paper{steps}_fsdp"
    what = f"FSDP, {windows} windows per step, {steps} steps, inner lr {lr:g}"
    return Recipe(_name(base, lr), what, {}, groups=1, ranks_per_group=windows // 4, steps=steps, lr=lr,
                  val_every=steps // 4, val_windows=VAL_WINDOWS, warmup_fraction=WARMUP / STEPS)  # fmt: skip


def federation(groups: int, lr: float, steps: int = STEPS, windows: int = GLOBAL_WINDOWS,
               outer: tuple[float, float] | None = None, label: str = "") -> Recipe:  # fmt: skip
    """``groups`` groups sharing ``windows`` per step, H=8, float32 traffic; plain averaging unless ``outer``."""
    per_group = windows // groups
    batch = min(per_group, 4)
    base = f"paper_fed{groups}" if steps == STEPS else f"paper{steps}_fed{groups}"
    step = "plain averaging" if outer is None else f"outer SGD ({outer[0]:g}, momentum {outer[1]:g})"
    options: dict[str, object] = {"reduce_dtype": "float32", **({"outer": outer} if outer is not None else {})}
    what = f"{groups} groups of {per_group} windows per step, {steps} steps, inner lr {lr:g}, H=8, {step}"
    return Recipe(_name(base + label, lr), what, options, groups=groups, ranks_per_group=per_group // batch,
                  steps=steps, lr=lr, val_every=steps // 4, batch=batch, val_windows=VAL_WINDOWS,
                  warmup_fraction=WARMUP / STEPS)  # fmt: skip


ARMS = (
    *(fsdp(SHARED_LR * f) for f in (0.5, 1, 2, 4)),
    *(federation(groups, SHARED_LR * f) for groups in (128, 16, 4) for f in (0.5, 1, 2)),
    federation(16, SHARED_LR, outer=(0.7, 0.0), label="_sgd07"),
    federation(16, SHARED_LR, outer=(0.2, 0.9), label="_nesterov02"),
)
#: The same tokens in 256 steps of 32 windows: whether the gap closes as the batch nears the critical one.
LONGER = (
    *(fsdp(SHARED_LR * f, steps=256, windows=32) for f in (0.5, 1, 2)),
    *(federation(groups, SHARED_LR, steps=256, windows=32) for groups in (16, 4)),
)
RECIPES = {recipe.name: recipe for recipe in (*ARMS, *LONGER)}


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module): run what is missing, two runs at a time."""
    run_study(
        argv,
        recipes=RECIPES,
        results=RESULTS,
        module="benchmarks.paper",
        seeds=SEEDS,
        description=(__doc__ or "").splitlines()[0],
    )


if __name__ == "__main__":
    main()
