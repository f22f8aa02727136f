"""Which sync options compose, derived from what each sync mode declares it refuses.

A *switch* is one option set away from its default (``fragments > 1``, ``eager_updates``, an outer topology, ...).
Each sync mode (a round, a codec, or the elastic federation) declares the switches it refuses, with a
:class:`Refusal`: why, and whether the pair is impossible or only not built yet; and the switches it runs with but
advises against, with an :class:`Advice` that says what was measured. A configuration is refused when a switch it sets
refuses another one it sets; everything else composes. :func:`check_compatible` raises for the first such pair, naming
only the two options at fault, and warns for each pair advised against; :func:`compatibility_table` renders the same
declarations as the table in the docs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.options.outer_topology import Gossip, Hierarchical, Mixing, Sampled, resolve_outer_topology
from lightning_fedshard.core.options.refusal import Advice
from lightning_fedshard.core.rounds.base import Refusal
from lightning_fedshard.core.rounds.eager import EagerRound
from lightning_fedshard.core.rounds.mixing import MixingRound
from lightning_fedshard.core.rounds.sites import HierarchicalRound
from lightning_fedshard.core.step.participation import Paced, SampledGroups
from lightning_fedshard.core.wire.codecs import SparseLoCo

#: A :class:`~lightning_fedshard.core.config.FederationConfig` (which imports this module, so it is not
#: imported here).
Config = Any


@dataclass(frozen=True)
class Switch:
    """One option away from its default.

    Attributes:
        name: The key the modes' declarations use.
        label: How the docs' table names it.
        is_set: Whether a configuration sets it.
        given: How a configuration wrote it, for messages (e.g. ``"`fragments=4`"``).
        default: What dropping it means, for messages.
    """

    name: str
    label: str
    is_set: Callable[[Config], bool]
    given: Callable[[Config], str]
    default: str


def _topology(config: Config) -> Any:
    return resolve_outer_topology(config.outer_topology)


def _is_mixing(cls: type) -> Callable[[Config], bool]:
    def is_set(config: Config) -> bool:
        topology = _topology(config)
        return isinstance(topology, Mixing) and config.mixing is not None and _mixing_kind(topology) is cls

    return is_set


def _samples_outer_steps(config: Config) -> bool:
    topology = _topology(config)
    return isinstance(topology, Sampled) and topology.outer_step


def _mixing_kind(topology: Mixing) -> type:
    for cls in (Gossip, Sampled):
        if isinstance(topology, cls):
            return cls
    return Mixing


def _given(name: str) -> Callable[[Config], str]:
    return lambda config: f"`{name}={getattr(config, name)!r}`"


#: Every switch, in the table's order.
SWITCHES: tuple[Switch, ...] = (
    Switch("fragments", "fragments > 1", lambda c: c.fragments > 1, _given("fragments"), "leave `fragments=1`"),
    Switch("sync_delay", "sync_delay > 0", lambda c: c.sync_delay > 0, _given("sync_delay"), "leave `sync_delay=0`"),
    Switch(
        "merge_alpha", "merge_alpha > 0", lambda c: bool(c.merge_alpha), _given("merge_alpha"), "leave `merge_alpha=0`"
    ),
    Switch(
        "eager_updates",
        "eager_updates",
        lambda c: c.eager_rule is not None,
        _given("eager_updates"),
        "leave `eager_updates=False`",
    ),
    Switch(
        "hierarchical",
        "Hierarchical",
        lambda c: isinstance(_topology(c), Hierarchical),
        _given("outer_topology"),
        "use `outer_topology='all'`",
    ),
    Switch("gossip", "Gossip", _is_mixing(Gossip), _given("outer_topology"), "use `outer_topology='all'`"),
    Switch("sampled", "Sampled", _is_mixing(Sampled), _given("outer_topology"), "use `outer_topology='all'`"),
    Switch(
        "sampled_outer_step",
        "Sampled(outer_step=True)",
        _samples_outer_steps,
        _given("outer_topology"),
        "use `outer_topology='all'`",
    ),
    Switch("mixing", "Mixing", _is_mixing(Mixing), _given("outer_topology"), "use `outer_topology='all'`"),
    Switch(
        "elastic",
        "elastic",
        lambda c: c.elastic is not None,
        lambda c: "`elastic=Elastic(...)`",
        "leave `elastic=None`",
    ),
    Switch("pace", "Pace", lambda c: c.pace is not None, _given("pace"), "leave `pace=None`"),
    Switch(
        "outer_momentum",
        "stateful outer optimizer (nesterov)",
        lambda c: c.outer_optimizer != "fedavg",
        _given("outer_optimizer"),
        "use `outer_optimizer='fedavg'`",
    ),
    Switch(
        "skip_group",
        "on_nonfinite='skip_group'",
        lambda c: c.on_nonfinite == "skip_group",
        _given("on_nonfinite"),
        "leave `on_nonfinite='raise'`",
    ),
    Switch(
        "lossy_dtype",
        "lossy reduce_dtype (int4, int8, sparse, bfloat16, float16)",
        lambda c: c.reduce_dtype is not None and not c.codec.exact,
        _given("reduce_dtype"),
        "leave `reduce_dtype` unset",
    ),
    Switch(
        "sparseloco",
        "SparseLoCo reduce_dtype",
        lambda c: isinstance(c.codec, SparseLoCo),
        _given("reduce_dtype"),
        "use another `reduce_dtype`",
    ),
)

#: The sync modes that declare what they refuse, by the switch that selects them.
MODES: Mapping[str, Mapping[str, Refusal]] = {
    "eager_updates": EagerRound.refuses,
    "hierarchical": HierarchicalRound.refuses,
    "gossip": MixingRound.refuses,
    "sampled": MixingRound.refuses,
    "mixing": MixingRound.refuses,
    "sampled_outer_step": SampledGroups.refuses,
    "elastic": Elastic.refuses,
    "pace": Paced.refuses,
    "sparseloco": SparseLoCo.refuses,
}

#: The sync modes that run with some switches but advise against them, by the switch that selects them.
ADVICE: Mapping[str, Mapping[str, Advice]] = {
    "sparseloco": SparseLoCo.advises_against,
}

#: Switches that are alternatives of one option: never set together, so not a pair of the table.
ALTERNATIVES: tuple[frozenset[str], ...] = (
    frozenset({"hierarchical", "gossip", "sampled", "sampled_outer_step", "mixing"}),
)


def refusal(a: str, b: str) -> tuple[str, Refusal] | None:
    """Whether switches ``a`` and ``b`` compose: ``None``, or the mode that refuses the other, and why."""
    for mode, other in ((a, b), (b, a)):
        declared = MODES.get(mode, {}).get(other)
        if declared is not None:
            return mode, declared
    return None


def advice(a: str, b: str) -> tuple[str, Advice] | None:
    """Whether a mode advises against switches ``a`` and ``b`` together: ``None``, or the mode, and why."""
    for mode, other in ((a, b), (b, a)):
        declared = ADVICE.get(mode, {}).get(other)
        if declared is not None:
            return mode, declared
    return None


def check_compatible(config: Config) -> None:
    """Raise ``ValueError`` for the first pair of switches ``config`` sets that a mode refuses; warn of the others.

    The message names the two options as given, says which to drop, and whether the pair is impossible (and why) or
    not built yet. A pair that a mode runs but advises against gets a ``UserWarning`` that says what was measured.
    """
    on = [s for s in SWITCHES if s.is_set(config)]
    for i, first in enumerate(on):
        for second in on[i + 1 :]:
            _warn_if_advised_against(config, first, second)
            found = refusal(first.name, second.name)
            if found is not None:
                raise ValueError(_refusal_message(config, first, second, *found))


def _refusal_message(config: Config, first: Switch, second: Switch, mode: str, why: Refusal) -> str:
    chosen, refused = (first, second) if mode == first.name else (second, first)
    kind = "cannot be combined" if why.impossible else "are not built to run together yet"
    return (
        f"{chosen.given(config)} and {refused.given(config)} {kind}: {why.reason}. Drop one of them"
        f" ({refused.default}, or {chosen.default}); docs/configuration.md lists which options compose."
    )


def _warn_if_advised_against(config: Config, first: Switch, second: Switch) -> None:
    advised = advice(first.name, second.name)
    if advised is None:
        return
    mode, why = advised
    chosen, other = (first, second) if mode == first.name else (second, first)
    warnings.warn(
        f"{chosen.given(config)} with {other.given(config)} runs, but is not advised: {why.reason}."
        " docs/configuration.md lists which options compose.",
        UserWarning,
        stacklevel=5,
    )


def compatibility_table() -> str:
    """The Markdown table of which switches compose, from the modes' declarations (as docs/configuration.md shows it).

    ``ok`` composes; ``not advised`` runs, worse than either option alone (measured); ``no`` is impossible; ``not
    yet`` is not built yet; ``-`` are alternatives of one option. The reasons follow the table, one line per refused
    or advised-against pair.
    """
    names = [s.name for s in SWITCHES]
    labels = {s.name: s.label for s in SWITCHES}
    head = "| | " + " | ".join(f"`{labels[n]}`" for n in names) + " |"
    rows = [head, "|" + "---|" * (len(names) + 1)]
    reasons = []
    for a in names:
        cells = []
        for b in names:
            cell, reason = _pair(a, b, labels)
            cells.append(cell)
            if reason is not None and names.index(a) < names.index(b):
                reasons.append(reason)
        rows.append(f"| `{labels[a]}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(reasons) + "\n"


def _pair(a: str, b: str, labels: Mapping[str, str]) -> tuple[str, str | None]:
    """The table's cell for switches ``a`` and ``b``, and the line of reasons under the table, if any."""
    if a == b or any({a, b} <= group for group in ALTERNATIVES):
        return "-", None
    found, advised = refusal(a, b), advice(a, b)
    if found is not None:
        mode, why = found
        state = "impossible" if why.impossible else "not built yet"
        line = f"- `{labels[mode]}` with `{labels[b if mode == a else a]}` ({state}): {why.reason}."
        return ("no" if why.impossible else "not yet"), line
    if advised is not None:
        mode, advise = advised
        return (
            "not advised",
            f"- `{labels[mode]}` with `{labels[b if mode == a else a]}` (runs, not advised): {advise.reason}.",
        )
    return "ok", None


def refused_pairs() -> list[tuple[str, str]]:
    """Every pair of switches (in table order) that a mode refuses."""
    names = [s.name for s in SWITCHES]
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if not any({a, b} <= group for group in ALTERNATIVES) and refusal(a, b) is not None
    ]


def advised_pairs() -> list[tuple[str, str]]:
    """Every pair of switches (in table order) that runs but that a mode advises against."""
    names = [s.name for s in SWITCHES]
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if refusal(a, b) is None and advice(a, b) is not None
    ]
