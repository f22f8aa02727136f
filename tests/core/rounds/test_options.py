"""Which options compose: every refused pair is refused with its two names, every accepted option changes the result."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_fedshard import Gossip, Hierarchical, Mixing, Pace, Sampled, SparseLoCo
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.rounds.options import (
    ALTERNATIVES,
    SWITCHES,
    advice,
    advised_pairs,
    compatibility_table,
    refusal,
    refused_pairs,
)
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError
from lightning_fedshard.core.transport.inprocess import InProcessGroups

GROUPS, STEPS, UNITS = 4, 14, 3
RING = [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]

#: Each switch set on its own, on top of the base options (4 one-shard groups, sync every 4, float32).
PROBES: dict[str, dict[str, Any]] = {
    "fragments": dict(fragments=2),
    "sync_delay": dict(sync_delay=1),
    "merge_alpha": dict(merge_alpha=0.5),
    "eager_updates": dict(eager_updates=True),
    "hierarchical": dict(outer_topology=Hierarchical({4: 2, 8: 4})),
    "gossip": dict(outer_topology=Gossip(peers=1, seed=1)),
    "sampled": dict(outer_topology=Sampled(groups_per_round=2, seed=1)),
    "sampled_outer_step": dict(outer_topology=Sampled(groups_per_round=2, seed=1, outer_step=True)),
    "mixing": dict(outer_topology=Mixing(RING)),
    "elastic": dict(elastic=Elastic(lighthouse="http://localhost:29510", group=0)),
    "outer_momentum": dict(outer_optimizer="nesterov"),
    "skip_group": dict(on_nonfinite="skip_group"),
    "lossy_dtype": dict(reduce_dtype="int8"),
    "sparseloco": dict(reduce_dtype=SparseLoCo(top_k=1, chunk_size=2)),
    "pace": dict(pace=Pace(speeds=(1.0, 1.0, 1.0, 0.5))),
}
#: Switches that choose how the syncs run (each a mode whose accepted options are walked below).
MODES = ("plain", "eager_updates", "hierarchical", "gossip", "sampled", "sampled_outer_step", "mixing", "pace")
#: Modes that are also a switch of the plain round.
PLAIN_SWITCHES = ("pace",)
BASE = dict(num_groups=GROUPS, sync_every=4, reduce_dtype="float32")


def test_every_switch_has_a_probe():
    assert set(PROBES) == {s.name for s in SWITCHES}


def _options(*switches: str) -> dict[str, Any]:
    options = dict(BASE)
    for name in switches:
        options.update(PROBES[name])
    return options


@pytest.mark.parametrize(("a", "b"), refused_pairs())
def test_a_refused_pair_is_refused_naming_only_its_two_options(a, b):
    with pytest.raises(ValueError) as error:
        FederationConfig(**_options(a, b))
    message = str(error.value)
    mode, why = refusal(a, b)
    assert why.reason in message
    assert ("cannot be combined" if why.impossible else "are not built to run together yet") in message
    head = re.split(r" cannot be combined| are not built to run together yet", message)[0]
    named = re.findall(r"`(\w+)=", head)  # the options before the reason
    assert len(named) == 2, message


def test_the_table_marks_every_pair_once_and_refuses_at_most_what_it_lists():
    table = compatibility_table()
    # one reason per refused or advised-against pair
    assert table.count("\n- `") + 1 == len(refused_pairs()) + len(advised_pairs()) + 1
    for a, b in refused_pairs() + advised_pairs():
        assert not any({a, b} <= group for group in ALTERNATIVES)
    assert table.count("(runs, not advised)") == len(advised_pairs())


@pytest.mark.parametrize(("a", "b"), advised_pairs())
def test_a_pair_advised_against_runs_and_warns_with_what_was_measured(a, b):
    mode, why = advice(a, b)
    with pytest.warns(UserWarning, match="runs, but is not advised") as caught:
        FederationConfig(**_options(a, b))
    assert why.reason in str(caught[0].message)


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    """Group ``g``'s optimizer step ``step``: a pull of its own strength towards its own target, and a nonlinear push.

    The groups' pulls differ and the push is nonlinear, so averaging does not commute with training: when and what the
    groups average shows in the result.
    """
    return [
        x - (0.2 + 0.1 * g) * (x - (g + 1) * (u + 1)) + 0.05 * torch.sin(x + step) + 0.01 * u for u, x in enumerate(w)
    ]


def _train(options: dict[str, Any], nan_at: int | None = None) -> list[Tensor] | str:
    """Every group trains by `_update` for `STEPS` steps and finishes; the groups' final weights, or the error."""
    config = FederationConfig(**options)

    def work(g: int, comm: Any) -> Tensor:
        shards = [torch.full((2,), float(u)) for u in range(UNITS)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        for step in range(1, STEPS + 1):
            if fed.trains(step):  # with a per-group pace a slow group skips the last steps of a round
                for shard, new in zip(shards, _update(g, step - 1, shards)):
                    shard.copy_(new)
            if step == nan_at and g == 1:
                shards[0][0] = float("nan")
            fed.maybe_sync(step)
        fed.finish(STEPS)
        return torch.cat([s.clone() for s in shards])

    try:
        return InProcessGroups(GROUPS).run(work)
    except NonFiniteOuterGradientError as error:
        return f"raised: {type(error).__name__}"


def _accepted() -> list[tuple[str, str]]:
    """Every (mode, switch) where the mode runs the switch; the elastic switch is walked on its own (below)."""
    pairs = []
    for mode in MODES:
        for switch in PROBES:
            if switch == mode or switch == "elastic":
                continue
            if switch in MODES and switch not in PLAIN_SWITCHES and mode not in PLAIN_SWITCHES:
                continue  # two modes: walked from the mode that is also a plain switch (a pace), if it runs both
            if mode != "plain" and refusal(mode, switch) is not None:
                continue
            pairs.append((mode, switch))
    return pairs


@pytest.mark.parametrize(("mode", "switch"), _accepted())
def test_every_option_a_mode_accepts_changes_what_it_computes(mode, switch):
    """Nothing is accepted and then ignored: the option set on its own changes the groups' final weights."""
    base = () if mode == "plain" else (mode,)
    without, with_it = _options(*base), _options(*base, switch)
    nan_at = 5 if switch == "skip_group" else None  # the policy acts on a group whose weights hold NaN
    before, after = _train(without, nan_at), _train(with_it, nan_at)
    if switch == "skip_group":  # the broken group was left out and restarted: every group ends finite
        assert not isinstance(after, str), after
        assert all(bool(torch.isfinite(weights).all()) for weights in after), f"{mode}: non-finite after skip_group"
    if isinstance(before, str) or isinstance(after, str):
        assert before != after, (before, after)
        return
    difference = max(float((x - y).abs().max()) for x, y in zip(before, after))
    assert difference > 1e-4, f"{switch} changed nothing under {mode}"


def _elastic_pairs() -> list[str]:
    """Every switch an elastic federation runs (in one process: threads whose live groups a view relabels)."""
    return [s for s in PROBES if s != "elastic" and refusal("elastic", s) is None]


@pytest.mark.parametrize("probation", [0, 1])
@pytest.mark.parametrize("switch", _elastic_pairs())
def test_every_option_an_elastic_federation_accepts_runs_through_a_change_of_members(switch, probation):
    """Three live groups of four planned; group 1 is gone before step 6 and group 3 takes its place, joining the sync
    that lands after step 8 (adding nothing; with a probation, nor to the next sync). Every option the elastic
    federation accepts runs through it: the replacement is recorded as joined, and every live group ends on one finite
    consensus."""
    from tests.core.rounds.live import run_live

    options = _options("elastic", switch)
    options["elastic"] = Elastic(lighthouse="http://localhost:29510", group=0, probation=probation)
    config = FederationConfig(**options)
    joined = 8 - config.sync_delay
    results = run_live(config, [(0, (0, 1, 2)), (6, (0, 3, 2))], {3: joined}, STEPS)
    finals = [torch.cat(result["final"]) for result in results]
    assert all(bool(torch.isfinite(final).all()) for final in finals), switch
    assert all(torch.equal(final, finals[0]) for final in finals), f"{switch}: the groups end apart"
    joins = {g for result in results for stats in result["landed"].values() for g in stats.joined_groups}
    assert joins == {3}, (switch, joins)
