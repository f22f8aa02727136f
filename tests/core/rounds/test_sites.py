"""Sites around the federation's round: fragments, delay, merge and eager updates against the reference, and resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.rounds import EagerRound, HierarchicalRound, PlainRound
from lightning_fedshard.core.step.fragments import cut_fragments
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.toy import ReferenceGroup, initial, snapshot, start_or_resume
from tests.reference import federate

GROUPS, UNITS = 4, 3
NAMES = [f"u{u}" for u in range(UNITS)]
LEVELS = {2: 2, 8: 4}


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    """Group ``g``'s optimizer step ``step`` (0-based): a pull of its own strength and a nonlinear push."""
    return [x - (0.2 + 0.1 * g) * (x - (g + 1) * (u + 1)) + 0.05 * torch.sin(x + step) for u, x in enumerate(w)]


def _initial() -> list[Tensor]:
    return initial(UNITS)


CASES = {
    "fragments, delay, merge": dict(fragments=2, sync_delay=1, merge_alpha=0.5, outer_optimizer="nesterov"),
    "delay, fedavg": dict(sync_delay=3),
    "eager, fragments": dict(fragments=2, eager_updates=True, outer_optimizer="nesterov"),
    "eager, sites apart": dict(eager_updates=True, sites=[[0, 3], [1, 2]]),
}


def _config(options: dict[str, Any]) -> FederationConfig:
    options = dict(options)
    topology = Hierarchical(LEVELS, sites=options.pop("sites", None))
    return FederationConfig(num_groups=GROUPS, sync_every=2, reduce_dtype="float32", outer_topology=topology, **options)


def _run(options: dict[str, Any], steps: int, stop_at: int | None = None, resume: list | None = None) -> list[Any]:
    config = _config(options)

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = _initial()
        fed, first = start_or_resume(config, comm, shards, None if resume is None else resume[g])
        for step in range(first, steps + 1):
            for shard, new in zip(shards, _update(g, step - 1, shards)):
                shard.copy_(new)
            fed.maybe_sync(step)
            if step == stop_at:
                return snapshot(fed, shards, step)
        fed.finish(steps)
        return {"final": [s.clone() for s in shards], "anchor": [a.detach().clone() for a in fed.outer.anchor]}

    return InProcessGroups(GROUPS, site_blocks=config.site_blocks(GROUPS)).run(work)


def _reference(options: dict[str, Any], steps: int) -> dict[str, Any]:
    fragments = options.get("fragments", 1)
    return federate(
        dict(zip(NAMES, _initial())),
        [ReferenceGroup(g, _update, NAMES) for g in range(GROUPS)],
        sync_every=max(LEVELS),
        outer=options.get("outer_optimizer", "fedavg"),
        max_steps=steps,
        fragments=[[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, fragments)],
        sync_delay=options.get("sync_delay", 0),
        merge_alpha=options.get("merge_alpha", 0.0),
        final_landing="reset",
        eager=options.get("eager_updates", False),
        hierarchical=LEVELS,
        sites=options.get("sites"),
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("steps", [13, 16, 21])  # 21: a round after a second landing of an eager fragment
def test_sites_around_the_federations_round_equal_the_reference(case, steps):
    options = CASES[case]
    ref = _reference(options, steps)
    for result in _run(options, steps):
        assert_close(torch.cat(result["final"]), torch.cat([ref["final"][n] for n in NAMES]), rtol=0, atol=1e-5)


def test_the_round_inside_the_sites_is_the_one_the_options_choose():
    assert isinstance(_federation_round(CASES["fragments, delay, merge"]).inner, PlainRound)
    assert isinstance(_federation_round(CASES["eager, fragments"]).inner, EagerRound)


def _federation_round(options: dict[str, Any]) -> HierarchicalRound:
    round = Federation(_config(options), None).round  # type: ignore[arg-type]
    assert isinstance(round, HierarchicalRound)
    return round


@pytest.mark.parametrize("case", ["fragments, delay, merge", "eager, fragments"])
def test_resume_between_site_syncs_with_sums_in_flight_is_exact(case):
    """After step 7 the sites differ, and a sum is in flight (delayed landing, or eager sums of both fragments)."""
    options = CASES[case]
    straight = _run(options, 13)
    saved = _run(options, 13, stop_at=7)
    assert not torch.equal(saved[0]["shards"][0], saved[2]["shards"][0])  # the two sites hold different weights
    assert saved[0]["state"]["pending"] is not None or saved[0]["state"]["eager"]
    resumed = _run(options, 13, resume=saved)
    for got, want in zip(resumed, straight):
        for a, b in zip(got["final"] + got["anchor"], want["final"] + want["anchor"]):
            assert torch.equal(a, b)
