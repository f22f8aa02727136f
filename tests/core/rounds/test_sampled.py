"""Sampled participation (``Sampled(..., outer_step=True)``): against the reference, idle groups, exact resume."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Sampled
from lightning_fedshard.checkpoint import upgrades
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.rounds import EagerRound, PlainRound, build_round
from lightning_fedshard.core.step.fragments import cut_fragments
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.transaction import SyncKind, SyncTransaction
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from tests.core.rounds.toy import ReferenceGroup, initial
from tests.reference import federate

UNITS = 3  # shards per rank, two values each
NAMES = [f"u{u}" for u in range(UNITS)]


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    """Group ``g``'s optimizer step ``step`` (0-based): a pull towards its own target plus a push."""
    return [x - 0.3 * (x - (g + 1) * (u + 1)) + 0.05 * math.sin(step + g) for u, x in enumerate(w)]


def _initial() -> list[Tensor]:
    return initial(UNITS)


def _federation(comm: Any, topology: Sampled, **options: Any) -> Federation:
    """A federation running ``topology``'s sampled participation with ``options`` (eager updates or the plain round)."""
    fed = Federation(FederationConfig(outer_topology=topology, **options), comm)
    expected = EagerRound if options.get("eager_updates") else PlainRound  # the sample is a participation rule
    assert type(fed.round) is expected
    return fed


def _run(
    topology: Sampled,
    groups: int,
    steps: int,
    stop_at: int | None = None,
    resume: list[dict[str, Any]] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Every group trains by `_update`; per group its weights after every step, the final weights and anchor."""
    options = {"reduce_dtype": "float32", **options}

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = _initial()
        first = 1
        if resume is not None:
            for shard, saved in zip(shards, resume[g]["shards"]):
                shard.copy_(saved)
        fed = _federation(comm, topology, **options)
        fed.start(shards, step=0)
        if resume is not None:
            fed.load_state_dict(resume[g]["state"])
            fed.load_group_state_dict(resume[g]["group"])
            first = resume[g]["step"] + 1
        history = {}
        for step in range(first, steps + 1):
            for shard, new in zip(shards, _update(g, step - 1, shards)):
                shard.copy_(new)
            fed.maybe_sync(step)
            history[step] = [s.clone() for s in shards]
            if step == stop_at:
                state, group = fed.state_dict(), fed.group_state_dict()
                return {"state": state, "group": group, "shards": history[step], "step": step}
        fed.finish(steps)
        return {"history": history, "final": [s.clone() for s in shards], "anchor": fed.outer.anchor}

    return InProcessGroups(groups).run(work)


def _reference(topology: Sampled, groups: int, steps: int, outer: str, fragments: int, **options: Any) -> dict:
    parts = [[NAMES[u] for u in part] for part in cut_fragments([2] * UNITS, fragments)]
    return federate(
        dict(zip(NAMES, _initial())),
        [ReferenceGroup(g, _update, NAMES) for g in range(groups)],
        sync_every=4,
        outer=outer,
        max_steps=steps,
        fragments=parts,
        participants=lambda r: topology.sample(r, groups),
        **options,
    )


@pytest.mark.parametrize(
    ("outer", "fragments", "sync_delay"),
    [("fedavg", 1, 0), ("nesterov", 1, 0), ("fedavg", 2, 0), ("nesterov", 2, 0), ("nesterov", 2, 1)]
    + [("nesterov", 1, "eager"), ("nesterov", 2, "eager"), ("fedavg", 2, "eager")],
)
def test_sampled_outer_step_matches_the_reference(outer, fragments, sync_delay):
    """Also with eager updates: each sum in flight is the mean over its sync's sample, whose groups take their share."""
    topology = Sampled(groups_per_round=2, seed=3, outer_step=True)
    eager = sync_delay == "eager"
    delay = 0 if eager else sync_delay
    options = dict(sync_every=4, outer_optimizer=outer, fragments=fragments, sync_delay=delay, eager_updates=eager)
    results = _run(topology, groups=4, steps=14, **options)  # ends mid-round: a final step over every group
    want = _reference(topology, 4, 14, outer, fragments, sync_delay=delay, eager=eager)
    assert len({tuple(topology.sample(r, 4)) for r in range(3)}) > 1  # the sample changes between rounds
    for g, result in enumerate(results):
        for step in range(1, 14):  # the reference records each group's weights before the next (0-based) step
            assert_close(torch.cat(result["history"][step]), want["groups_before"][step][g], atol=1e-6, rtol=1e-6)
        assert_close(torch.cat(result["final"]), torch.cat(list(want["final"].values())), atol=1e-6, rtol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(result["final"], results[0]["final"]))  # the consensus


@pytest.mark.parametrize("move", [1e6, float("nan")])
def test_a_group_left_out_of_the_round_adds_nothing(move):
    topology = Sampled(groups_per_round=2, seed=1, outer_step=True)
    (left_out, *_) = [g for g in range(4) if g not in topology.sample(0, 4)]
    config = FederationConfig(sync_every=2, reduce_dtype="float32", outer_topology=topology)

    def work(g: int, comm: Any, moved: bool) -> tuple[list[Tensor], list[Tensor]]:
        shards = _initial()
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        for step in (1, 2):
            for shard, new in zip(shards, _update(g, step - 1, shards)):
                shard.copy_(new + (move if moved and g == left_out and step == 2 else 0.0))
            fed.maybe_sync(step)
        return [a.clone() for a in fed.outer.anchor], [s.clone() for s in shards]

    quiet = InProcessGroups(4).run(lambda g, comm: work(g, comm, moved=False))
    moved = InProcessGroups(4).run(lambda g, comm: work(g, comm, moved=True))
    for (anchor, shards), (quiet_anchor, _) in zip(moved, quiet):
        assert all(torch.equal(a, b) for a, b in zip(anchor, quiet_anchor))
        assert all(torch.equal(s, a) for s, a in zip(shards, anchor))  # every group restarts from the anchor


def test_the_drift_and_norm_leave_idle_groups_out():
    topology = Sampled(groups_per_round=2, seed=0, outer_step=True)
    a, b = topology.sample(0, 4)
    config = FederationConfig(sync_every=1, reduce_dtype="float32", outer_topology=topology)

    def work(g: int, comm: Any) -> Any:
        shards = [torch.zeros(3)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        shards[0].add_(float(g + 1))  # pseudo-gradient -(g + 1) everywhere
        return fed.maybe_sync(1)

    for stats in InProcessGroups(4).run(work):
        assert stats.drift == pytest.approx(abs(a - b) / 2 * 3**0.5)  # the two sampled groups around their mean
        assert stats.outer_grad_norm == pytest.approx((a + b + 2) / 2 * 3**0.5)
        assert stats.num_syncs == 1 and stats.kind == "outer step"


@pytest.mark.parametrize(
    ("outer", "fragments", "sync_delay", "stop_at"),
    [("fedavg", 1, 0, 6), ("nesterov", 2, 1, 7), ("nesterov", 2, 0, 5), ("nesterov", 2, "eager", 7)],
)
def test_resume_mid_round_is_exact(outer, fragments, sync_delay, stop_at):
    topology = Sampled(groups_per_round=2, seed=3, outer_step=True)
    eager = sync_delay == "eager"
    sync_delay = 0 if eager else sync_delay
    options = dict(sync_every=4, outer_optimizer=outer, fragments=fragments, sync_delay=sync_delay, eager_updates=eager)
    straight = _run(topology, groups=4, steps=13, **options)
    saved = _run(topology, groups=4, steps=13, stop_at=stop_at, **options)
    if sync_delay:
        assert all(s["state"]["pending"]["idle"] for s in saved)  # a sum in flight that leaves groups out
    if eager:
        assert all(any(p["idle"] for p in s["state"]["eager"].values()) for s in saved)  # eager sums leave groups out
    resumed = _run(topology, groups=4, steps=13, resume=saved, **options)
    for a, b in zip(straight, resumed):
        for step in range(stop_at + 1, 14):
            assert all(torch.equal(x, y) for x, y in zip(a["history"][step], b["history"][step]))
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))
        assert all(torch.equal(x, y) for x, y in zip(a["anchor"], b["anchor"]))


def test_a_pending_sync_keeps_its_idle_groups_through_a_checkpoint():
    outer: Any = object()  # the transaction's outer step is only asked when the sync votes
    transaction = SyncTransaction.restored(outer, SyncKind.outer_step(0), 3, participants=(0, 1, 2), idle=(2,))
    pending = PendingSync(transaction=transaction, own_sq=0.0, bytes_sent=0, clock=0.0)
    pending._result = torch.zeros(2)
    state = pending.state_dict()
    assert pending.contributors == 2 and pending.absent(2) and not pending.absent(1)
    restored = PendingSync.from_state_dict(state, torch.device("cpu"), outer)
    assert restored.idle == (2,) and restored.transaction.kind == SyncKind.outer_step(0) and restored.started_at == 3
    del state["idle"], state["kind"]  # written before sampled rounds existed: upgraded to no idle group
    assert PendingSync.from_state_dict(upgrades.pending_sum(state, 3), torch.device("cpu"), outer).idle == ()


def test_the_option_shows_in_the_topology_and_the_config():
    sampled = Sampled(groups_per_round=2, seed=1, outer_step=True)
    assert repr(sampled) == "Sampled(groups_per_round=2, seed=1, outer_step=True)"
    assert repr(Sampled(2, seed=1)) == "Sampled(groups_per_round=2, seed=1)"
    assert sampled == Sampled(2, 1, outer_step=True) and sampled != Sampled(2, 1)
    assert len({sampled, Sampled(2, 1, outer_step=True), Sampled(2, 1)}) == 2
    assert sampled.describe() == "2 sampled groups per outer step"
    assert Sampled(groups_per_round=1, outer_step=True).groups_per_round == 1  # FedAvg may sample one client
    with pytest.raises(ValueError, match="groups_per_round"):
        Sampled(groups_per_round=1)
    with pytest.raises(ValueError, match="`outer_step=1`"):
        Sampled(2, outer_step=1)  # type: ignore[arg-type]
    config = FederationConfig(sync_every=2, reduce_dtype="float32", outer_topology=sampled)
    assert config.mixing is None  # a shared anchor, no mix
    assert FederationConfig(outer_topology="all").effective_reduce_dtype == "int4"
    assert FederationConfig(outer_topology=Sampled(2)).effective_reduce_dtype == "float32"  # the mix stays as it was
    assert type(build_round(Federation(config, InProcessGroups(2).run(lambda g, c: c)[0]))) is PlainRound
