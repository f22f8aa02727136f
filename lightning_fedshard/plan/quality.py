"""How many tokens a setup needs to reach plain FSDP's quality, relative to FSDP, where a study measured it.

The planner predicts time per token; how many tokens a setup needs to reach a quality depends on its sync options
too (the federation trains apart between syncs, a coarser codec, a delayed outer step). The recipe study
(docs/benchmarks/recipes.md) measured that factor for a few options at one setting: the *tokens to target*
of each recipe, the target being plain FSDP's final validation loss after the study's tokens (FSDP's factor is 1),
paired by seed. A federation that needs more tokens than FSDP gets a longer run of the same setting (3x the tokens),
and its factor comes from that run. Where a seed of a recipe never reached FSDP's final loss, its factor is the one
at the looser target it did reach, its own final loss (the factor at the real target is larger; ``looser`` says so).
A setup with the same sync options gets that factor; any other setup has none (not measured, not guessed). The
factors are written to :mod:`lightning_fedshard.plan.measured` by the benchmarks report.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedshard.plan.measured import FACTORS, STUDY
from lightning_fedshard.plan.specs import TrainSetup


@dataclass(frozen=True)
class TokensToTarget:
    """A measured tokens-to-target factor.

    Attributes:
        factor: Tokens to FSDP's final loss over FSDP's own (the median over seeds).
        recipe: The study's recipe it was measured with.
        per_seed: Each seed's factor.
        looser: Some seed's factor is at its own final loss, a looser target than FSDP's final loss (which it did
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
