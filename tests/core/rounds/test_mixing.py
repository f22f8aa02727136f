"""Mixings by fragment: each fragment mixes in turn with its round's matrix; against the reference, and resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Gossip, Mixing, Sampled
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.step.fragments import cut_fragments
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.toy import ReferenceGroup, initial, snapshot, start_or_resume
from tests.reference import federate, roundtrip_of

GROUPS, UNITS, SYNC_EVERY = 4, 3, 4
NAMES = [f"u{u}" for u in range(UNITS)]
TOPOLOGIES = {
    "gossip": Gossip(peers=1, seed=2),
    "sampled": Sampled(groups_per_round=2, seed=1),
    "ring, then uniform": Mixing(
        lambda r: (
            [[0.25] * 4] * 4
            if r % 2
            else [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
        )
    ),
}


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    return [x - (0.2 + 0.1 * g) * (x - (g + 1) * (u + 1)) + 0.05 * torch.sin(x + step) for u, x in enumerate(w)]


def _initial() -> list[Tensor]:
    return initial(UNITS)


def _run(
    topology: Any, steps: int, stop_at: int | None = None, resume: list | None = None, **options: Any
) -> list[Any]:
    config = FederationConfig(num_groups=GROUPS, sync_every=SYNC_EVERY, fragments=2, outer_topology=topology, **options)

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = _initial()
        fed, first = start_or_resume(config, comm, shards, None if resume is None else resume[g])
        after = {}
        for step in range(first, steps + 1):
            for shard, new in zip(shards, _update(g, step - 1, shards)):
                shard.copy_(new)
            fed.maybe_sync(step)
            after[step] = torch.cat(shards).clone()
            if step == stop_at:
                return snapshot(fed, shards, step)
        fed.finish(steps)
        return {"final": [s.clone() for s in shards], "after": after}

    return InProcessGroups(GROUPS).run(work)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
@pytest.mark.parametrize("steps", [13, 16])
def test_fragments_mix_in_turn_and_equal_the_reference(name, steps):
    topology = TOPOLOGIES[name]
    ref = federate(
        dict(zip(NAMES, _initial())),
        [ReferenceGroup(g, _update, NAMES) for g in range(GROUPS)],
        sync_every=SYNC_EVERY,
        outer="fedavg",
        max_steps=steps,
        fragments=[[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, 2)],
        mixing=lambda r: topology.weights(r, GROUPS),
    )
    for result in _run(topology, steps):
        assert_close(torch.cat(result["final"]), torch.cat([ref["final"][n] for n in NAMES]), rtol=0, atol=1e-5)


def test_resume_between_two_fragments_mixes_is_exact():
    topology = TOPOLOGIES["gossip"]
    straight = _run(topology, 13)
    saved = _run(topology, 13, stop_at=6)  # fragment 0 mixed after 2 and 6, fragment 1 after 4: the groups differ
    assert not torch.equal(saved[0]["shards"][1], saved[1]["shards"][1])
    for got, want in zip(_run(topology, 13, resume=saved), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))


#: Message mixes: taken a step before they land, encoded against the anchor, or both.
MESSAGES = {
    "delayed": dict(sync_delay=1),
    "int4": dict(reduce_dtype="int4"),
    "sparse, delayed": dict(reduce_dtype="sparse", sync_delay=1),
}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
@pytest.mark.parametrize("messages", list(MESSAGES))
def test_message_mixes_equal_the_reference_after_every_step(name, messages):
    topology, options, steps = TOPOLOGIES[name], MESSAGES[messages], 15
    config = FederationConfig(num_groups=GROUPS, outer_topology=topology, **options)
    ref = federate(
        dict(zip(NAMES, _initial())),
        [ReferenceGroup(g, _update, NAMES) for g in range(GROUPS)],
        sync_every=SYNC_EVERY,
        outer="fedavg",
        max_steps=steps,
        fragments=[[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, 2)],
        mixing=lambda r: topology.weights(r, GROUPS),
        sync_delay=options.get("sync_delay", 0),
        roundtrip=None if config.codec.exact else roundtrip_of(config.codec),
    )
    results = _run(topology, steps, **options)
    for step in range(1, steps):
        for g, result in enumerate(results):
            assert_close(result["after"][step], ref["groups_before"][step][g], rtol=0, atol=1e-5)
    for result in results:
        assert_close(torch.cat(result["final"]), torch.cat([ref["final"][n] for n in NAMES]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("reduce_dtype", ["int4", "sparse"])
def test_an_encoded_mix_moves_the_groups_but_not_their_mean(reduce_dtype):
    """Each group keeps what its encoding dropped in its own weights, so the columns' sum of 1 keeps the mean."""
    results = _run(TOPOLOGIES["gossip"], 8, reduce_dtype=reduce_dtype)
    for landing in (2, 4, 6, 8):
        before = [
            torch.cat(_update(g, landing - 1, list(r["after"][landing - 1].split(2)))) for g, r in enumerate(results)
        ]
        after = [r["after"][landing] for r in results]
        assert not all(torch.equal(a, b) for a, b in zip(before, after))
        assert_close(torch.stack(after).mean(0), torch.stack(before).mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("messages", ["delayed", "sparse, delayed"])
def test_resume_with_a_mix_in_flight_is_exact(messages):
    topology, options = TOPOLOGIES["gossip"], MESSAGES[messages]
    straight = _run(topology, 13, **options)
    saved = _run(topology, 13, stop_at=5, **options)  # fragment 0's messages, taken after step 5, land after 6
    assert saved[0]["group_state"]["mix"] is not None
    for got, want in zip(_run(topology, 13, resume=saved, **options), straight):
        assert all(torch.equal(a, b) for a, b in zip(got["final"], want["final"]))
        assert all(torch.equal(got["after"][s], want["after"][s]) for s in range(6, 14))
