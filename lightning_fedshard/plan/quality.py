"""How many tokens a setup needs to reach a loss, relative to float32 plain averaging, where a study measured it.

The planner predicts time per token; a sync option may also change how many tokens a run needs (a coarser codec,
a delayed outer step). The recipe study (docs/benchmarks.md, "The recipe study") measured that factor for a few
options at one setting: the *tokens to target* of each recipe against float32 plain averaging, paired by seed. Where a
seed of a recipe never reached float32's final loss, its factor is the one at the looser target it did reach, its own
final loss (the factor at the real target is larger; ``looser`` says so). A setup with the same sync options gets that
factor; any other setup has none (not measured, not guessed). The factors are written to
:mod:`lightning_fedshard.plan.measured` by the benchmarks report.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedshard.plan.measured import FACTORS, STUDY
from lightning_fedshard.plan.specs import TrainSetup


@dataclass(frozen=True)
class TokensToTarget:
    """A measured tokens-to-target factor.

    Attributes:
        factor: Tokens to the target loss over float32 plain averaging's (the median over seeds).
        recipe: The study's recipe it was measured with.
        per_seed: Each seed's factor.
        looser: Some seed's factor is at its own final loss, a looser target than float32's final loss (which it did
            not reach): the factor at the real target is larger.
        study: The study, in words (model, groups, horizon, seeds).
    """

    factor: float
    recipe: str
    per_seed: tuple[float, ...]
    looser: bool = False
    study: str = STUDY


def option_key(setup: TrainSetup) -> tuple[object, ...]:
    """The sync options a factor depends on: sharded data parallelism alone, or the federation's sync options."""
    if not setup.federated:
        return ("fsdp",)
    f = setup.federation
    outer = f.outer_optimizer if isinstance(f.outer_optimizer, str) else "custom"
    return (f.sync_every, f.fragments, str(f.effective_reduce_dtype), f.sync_delay, f.eager_rule, outer)


def tokens_to_target(setup: TrainSetup) -> TokensToTarget | None:
    """The measured factor of ``setup``'s sync options, or ``None`` where none was measured."""
    found = FACTORS.get(option_key(setup))
    if found is None:
        return None
    factor, recipe, per_seed, looser = found
    return TokensToTarget(factor, recipe, tuple(per_seed), looser)
