"""The kinds of sync round, one object each, and the one the federation runs for its options.

- :class:`~lightning_fedshard.core.rounds.plain.PlainRound`: fragments land in turn, optionally overlapped with a few
  steps (``sync_delay``), merged (``merge_alpha``), with error feedback in a buffer or in the weights;
- :class:`~lightning_fedshard.core.rounds.eager.EagerRound`: each sum overlaps with the whole next round;
- :class:`~lightning_fedshard.core.rounds.sites.HierarchicalRound`: sites average often around the federation's round;
- :class:`~lightning_fedshard.core.rounds.mixing.MixingRound`: gossip, sampled and matrix mixes of the weights.

Sampled outer steps (the mean of a round's sampled groups) are the plain or the eager round with a participation rule
(:class:`~lightning_fedshard.core.step.participation.SampledGroups`), not a round of their own.

:mod:`~lightning_fedshard.core.rounds.options` derives from their declarations which options compose.
"""

from __future__ import annotations

from lightning_fedshard.core.options.outer_topology import Hierarchical, Mixing, Sampled, resolve_outer_topology
from lightning_fedshard.core.rounds.base import Host, Refusal, Round
from lightning_fedshard.core.rounds.eager import EagerRound
from lightning_fedshard.core.rounds.mixing import MixingRound
from lightning_fedshard.core.rounds.plain import PlainRound
from lightning_fedshard.core.rounds.sites import HierarchicalRound

__all__ = [
    "EagerRound",
    "HierarchicalRound",
    "MixingRound",
    "PlainRound",
    "Refusal",
    "Round",
    "build_round",
]


def build_round(federation: Host) -> Round:
    """The round that runs ``federation.config``'s options (validated by the config against the declarations)."""
    config = federation.config
    topology = resolve_outer_topology(config.outer_topology)
    period = config.outer_period
    inner: Round = EagerRound(federation, period) if config.eager_rule is not None else PlainRound(federation, period)
    if isinstance(topology, Sampled) and topology.outer_step:
        return inner  # the sample is the federation's participation rule
    if isinstance(topology, Hierarchical):
        return HierarchicalRound(federation, topology, inner)
    if isinstance(topology, Mixing):
        assert isinstance(inner, PlainRound)
        return MixingRound(federation, topology, inner)
    return inner
