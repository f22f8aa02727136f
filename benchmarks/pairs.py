"""Pairs of options that run together: does the pair train as well as each option alone? (on the simulator).

The recipe study's model and data (the examples' Llama ``xs`` on Shakespeare, 4 groups of one rank, 4 windows of 128
tokens per group and step, a sync every 8 steps), over a shorter horizon: 240 steps (30 outer rounds) of the
learning-rate schedule, validated every 50 steps (the last at step 200), 2 seeds. Each pair runs beside each of its
options alone, so a pair that trains worse than both shows it. What the runs decided is declared on the sync modes
(``refuses`` and ``advises_against``) with the numbers, and shown in the compatibility table of
docs/configuration.md. Run from the repository root::

    PYTHONPATH=. python -m benchmarks.pairs [--only sparseloco_eager] [--seeds 0 1]

Results go to ``benchmarks/results/pairs/<recipe>-s<seed>.json`` (the recipe study's format); a result on record is
not run again. The pairs refused since (SparseLoCo with outer Nesterov) were run before the refusal; their results
stay on record, and running them again now stops at the refusal.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.recipes import Recipe
from benchmarks.recipes import main as run_study
from lightning_fedshard.core.wire.codecs import SparseLoCo

RESULTS = Path(__file__).parent / "results" / "pairs"
STEPS = 240

PAIRS = {
    r.name: r
    for r in (
        Recipe("f32", "float32, plain averaging", {"reduce_dtype": "float32"}, steps=STEPS),
        Recipe("f32_nesterov", "float32, outer Nesterov (0.7, 0.9)", {"reduce_dtype": "float32", "outer": (0.7,)},
               steps=STEPS),
        Recipe("sparseloco", "SparseLoCo (its defaults), plain averaging", {"reduce_dtype": SparseLoCo()}, steps=STEPS),
        Recipe("sparseloco_nesterov", "SparseLoCo, outer Nesterov (0.7, 0.9)",
               {"reduce_dtype": SparseLoCo(), "outer": (0.7,)}, steps=STEPS),
        Recipe("sparseloco_nesterov_01", "SparseLoCo, outer Nesterov (0.1, 0.9): an effective outer step of 1",
               {"reduce_dtype": SparseLoCo(), "outer": (0.1,)}, steps=STEPS),
        Recipe("f32_eager", "float32, eager updates, plain averaging",
               {"reduce_dtype": "float32", "eager_updates": True}, steps=STEPS),
        Recipe("sparseloco_eager", "SparseLoCo, eager updates, plain averaging",
               {"reduce_dtype": SparseLoCo(), "eager_updates": True}, steps=STEPS),
        Recipe("sparseloco_eager_small", "SparseLoCo with chunks of 256 (top 4), eager updates, plain averaging",
               {"reduce_dtype": SparseLoCo(top_k=4, chunk_size=256), "eager_updates": True}, steps=STEPS),
        Recipe("sparseloco_small", "SparseLoCo with chunks of 256 (top 4), plain averaging",
               {"reduce_dtype": SparseLoCo(top_k=4, chunk_size=256)}, steps=STEPS),
    )
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module): run what is missing, two runs at a time."""
    run_study(
        argv, recipes=PAIRS, results=RESULTS, module="benchmarks.pairs", description=(__doc__ or "").splitlines()[0]
    )


if __name__ == "__main__":
    main()
