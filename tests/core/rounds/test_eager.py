"""Eager updates (core.outer / core.federation): the rule against two hand-written references, resume, overlap."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups

UNITS = 3  # shards per rank, two values each


def _update(g: int, step: int, w: list[Tensor]) -> list[Tensor]:
    """One 'training step' of group g: a pull towards its own target plus a push; depends on where the group is."""
    return [x - 0.3 * (x - (g + 1) * (u + 1)) + 0.05 * step * (g - 0.5) for u, x in enumerate(w)]


def _nesterov(lr: float, momentum: float):
    """A hand-written outer step (SGD with Nesterov momentum as torch defines it) with its own buffers."""
    buffers: dict[int, Tensor] = {}

    def step(key: int, anchor: Tensor, grad: Tensor) -> Tensor:
        if momentum == 0:
            return anchor - lr * grad
        buf = grad.clone() if key not in buffers else momentum * buffers[key] + grad
        buffers[key] = buf
        return anchor - lr * (grad + momentum * buf)

    return step


def _reference(
    groups: int, fragments: list[list[int]], sync_every: int, steps: int, lr: float, momentum: float, own: float = 0.0
):
    """The documented rule with explicit per-group start points: returns every group's weights after each step.

    ``own`` is the weight of a group's own pseudo-gradient in its start point: ``1 / groups`` if 0 (its share).
    """
    own = own or 1.0 / groups
    every = sync_every // len(fragments)
    anchor = [torch.zeros(2) for _ in range(UNITS)]
    weights = [[a.clone() for a in anchor] for _ in range(groups)]
    starts = [[a.clone() for a in anchor] for _ in range(groups)]
    outer = [_nesterov(lr, momentum) for _ in fragments]
    in_flight: dict[int, list[Tensor]] = {}  # fragment -> mean pseudo-gradient per unit, summing since its sync
    landed_at: dict[int, int] = {}
    history = []

    def land(f: int) -> None:
        if f in in_flight:
            for u, mean in zip(fragments[f], in_flight.pop(f)):
                anchor[u] = outer[f](u, anchor[u], mean)

    for step in range(1, steps + 1):
        weights = [_update(g, step, w) for g, w in enumerate(weights)]
        if step % every == 0:
            f = (step // every - 1) % len(fragments)
            deltas = [[starts[g][u] - weights[g][u] for u in fragments[f]] for g in range(groups)]
            land(f)
            in_flight[f] = [torch.stack(d).mean(0) for d in zip(*deltas)]
            for g in range(groups):
                for u, d in zip(fragments[f], deltas[g]):
                    starts[g][u] = anchor[u] - lr * own * d
                    weights[g][u] = starts[g][u].clone()
            landed_at[f] = step
        history.append([[w.clone() for w in ws] for ws in weights])
    for f, units in enumerate(fragments):  # the end: land what is in flight, then sync what was trained since
        trained = landed_at.get(f) != steps
        deltas = [[starts[g][u] - weights[g][u] for u in units] for g in range(groups)]
        land(f)
        if trained:
            for u, d in zip(units, zip(*deltas)):
                anchor[u] = outer[f](u, anchor[u], torch.stack(d).mean(0))
        for g in range(groups):
            for u in units:
                weights[g][u] = anchor[u].clone()
    return history, weights


def _paper_fedavg(groups: int, sync_every: int, steps: int) -> list[list[list[Tensor]]]:
    """The eager update as the paper writes it, for plain averaging with one fragment: every group keeps its own outer
    weights and steps them with ``(1/G) d_g(t) + (1/G) sum_{k != g} d_k(t-1)``."""
    outer = [[torch.zeros(2) for _ in range(UNITS)] for _ in range(groups)]
    weights = [[o.clone() for o in outer[g]] for g in range(groups)]
    previous: list[list[Tensor]] | None = None
    history = []
    for step in range(1, steps + 1):
        weights = [_update(g, step, w) for g, w in enumerate(weights)]
        if step % sync_every == 0:
            deltas = [[outer[g][u] - weights[g][u] for u in range(UNITS)] for g in range(groups)]
            for g in range(groups):
                for u in range(UNITS):
                    others = sum(previous[k][u] for k in range(groups) if k != g) if previous else 0.0
                    outer[g][u] = outer[g][u] - (deltas[g][u] + others) / groups
                    weights[g][u] = outer[g][u].clone()
            previous = deltas
        history.append([[w.clone() for w in ws] for ws in weights])
    return history


def _run(config: FederationConfig, groups: int, steps: int, stop_at: int | None = None, resume: Any = None):
    """Every group trains by `_update` under ``config``; returns per group its history and final weights."""

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = [torch.zeros(2) for _ in range(UNITS)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        first = 1
        if resume is not None:
            saved = resume[g]
            for shard, value in zip(shards, saved["shards"]):
                shard.copy_(value)
            fed.load_state_dict(saved["state"])
            fed.load_group_state_dict(saved["group_state"])
            first = saved["step"] + 1
        history, anchors = [], []
        for step in range(first, steps + 1):
            new = _update(g, step, shards)
            for shard, value in zip(shards, new):
                shard.copy_(value)
            fed.maybe_sync(step)
            history.append([s.clone() for s in shards])
            anchors.append([a.clone() for a in fed.outer.anchor])
            if step == stop_at:
                state, group_state = fed.state_dict(), fed.group_state_dict()
                fed.finish_pending()
                return {"shards": [s.clone() for s in shards], "state": state, "group_state": group_state, "step": step}
        fed.finish(steps)
        return {"history": history, "anchors": anchors, "final": [s.clone() for s in shards]}

    return InProcessGroups(groups).run(work)


def _eager(**options: Any) -> FederationConfig:
    return FederationConfig(eager_updates=True, reduce_dtype="float32", **options)


NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize(
    ("fragments", "cut", "outer", "lr", "momentum"),
    [
        (1, [[0, 1, 2]], "fedavg", 1.0, 0.0),
        (1, [[0, 1, 2]], NESTEROV, 0.7, 0.9),
        (3, [[0], [1], [2]], NESTEROV, 0.7, 0.9),
    ],
)
@pytest.mark.parametrize("steps", [9, 12])  # the end between syncs, and right at one
def test_eager_updates_follow_the_documented_rule(fragments, cut, outer, lr, momentum, steps):
    config = _eager(sync_every=3 * fragments, fragments=fragments, outer_optimizer=outer)
    results = _run(config, groups=3, steps=steps)
    history, final = _reference(3, cut, 3 * fragments, steps, lr, momentum)
    for g, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["history"], history)):
            for a, b in zip(got, want[g]):
                assert_close(a, b, atol=1e-5, rtol=1e-6, msg=f"group {g} after step {step + 1}")
        for a, b in zip(result["final"], final[g]):
            assert_close(a, b, atol=1e-5, rtol=1e-6)
    # The anchor is the consensus: the same in every group at every step; the groups end on it, bit for bit.
    for step in range(steps):
        for g in range(1, 3):
            assert all(torch.equal(a, b) for a, b in zip(results[g]["anchors"][step], results[0]["anchors"][step]))
    assert all(torch.equal(a, b) for r in results for a, b in zip(r["final"], results[0]["final"]))
    # ... and the groups do differ in between (each starts from its own share of the sum in flight)
    assert not torch.equal(results[0]["history"][steps - 2][0], results[1]["history"][steps - 2][0])


@pytest.mark.parametrize("fragments", [1, 3])
def test_the_local_rule_restarts_from_the_whole_own_pseudo_gradient(fragments):
    cut = [[0, 1, 2]] if fragments == 1 else [[0], [1], [2]]
    config = _eager(sync_every=3 * fragments, fragments=fragments, outer_optimizer=NESTEROV)
    config = FederationConfig(**{**config.__dict__, "eager_updates": "local"})
    results = _run(config, groups=3, steps=10)
    history, final = _reference(3, cut, 3 * fragments, 10, 0.7, 0.9, own=1.0)
    for g, result in enumerate(results):
        for got, want in zip(result["history"], history):
            assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-6) for a, b in zip(got, want[g]))
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-6) for a, b in zip(result["final"], final[g]))
    assert "eager updates (local" in config.describe()


def test_eager_fedavg_is_the_papers_update():
    """With plain averaging the shared-anchor form is exactly the paper's per-group outer weights."""
    results = _run(_eager(sync_every=2, outer_optimizer="fedavg"), groups=3, steps=8)
    paper = _paper_fedavg(3, 2, 8)
    for g, result in enumerate(results):
        for got, want in zip(result["history"], paper):
            for a, b in zip(got, want[g]):
                assert_close(a, b, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("reduce_dtype", ["float32", "int4", "sparse"])
def test_eager_resume_with_sums_in_flight_is_exact(reduce_dtype):
    config = FederationConfig(
        eager_updates=True, sync_every=4, fragments=2, outer_optimizer="nesterov", reduce_dtype=reduce_dtype
    )
    straight = _run(config, groups=2, steps=11)
    saved = _run(config, groups=2, steps=11, stop_at=7)  # both fragments have a sum in flight after step 7
    assert all(len(s["state"]["eager"]) == 2 for s in saved)
    resumed = _run(config, groups=2, steps=11, resume=saved)
    for a, b in zip(straight, resumed):
        assert len(b["history"]) == 4
        for x, y in zip(a["history"][7:], b["history"]):
            assert all(torch.equal(u, v) for u, v in zip(x, y))
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))


def test_eager_excludes_delay_and_merge():
    message = (
        r"^`eager_updates=True` and `sync_delay=1` cannot be combined: eager updates already overlap each sum with a"
        r" whole round\. Drop one of them \(leave `sync_delay=0`, or leave `eager_updates=False`\)"
    )
    with pytest.raises(ValueError, match=message):  # names only the options at fault: not the default merge_alpha
        FederationConfig(eager_updates=True, sync_every=4, sync_delay=1)
    with pytest.raises(ValueError, match=r"^`eager_updates=True` and `merge_alpha=0.5` cannot be combined"):
        FederationConfig(eager_updates=True, merge_alpha=0.5)
    with pytest.raises(ValueError, match=r"`eager_updates` must be False, True, or one of \['share', 'local'\], got 1"):
        FederationConfig(eager_updates=1)
    assert FederationConfig(eager_updates=True).eager_rule == FederationConfig(eager_updates="share").eager_rule


class _GatedSums:
    """A thread communicator whose all-to-all (the background sum) waits for a permit from the group's training loop.

    A sync that waited for a sum still held back would wait for a permit only the loop itself can give: the gate then
    records it as starved (after ``patience`` seconds) and lets the sum through, so the test fails instead of hanging.
    """

    def __init__(self, inner: Any, patience: float = 30.0) -> None:
        self._inner, self._patience = inner, patience
        self._permits = threading.Semaphore(0)
        self.passed = 0  # sums let through, in order
        self.starved = 0  # sums that found no permit: a sync waited for them

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def release(self, count: int = 1) -> None:
        self._permits.release(count)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        if not self._permits.acquire(timeout=self._patience):
            self.starved += 1
        self._inner.all_to_all(output, input)
        self.passed += 1


def test_eager_sums_run_for_a_whole_round_while_other_fragments_land():
    """With 2 fragments a sum is always in flight when the other fragment lands and runs its statistics.

    Each sum is held back until the loop has come back from the next landing (the other fragment's): no sync waits for
    it, and it still lands in time (only the end of training waits for the last ones).
    """
    config = FederationConfig(eager_updates=True, sync_every=4, fragments=2, reduce_dtype="int8")
    gates: list[_GatedSums] = []
    held: list[list[int]] = [[], []]  # sums let through by the end of each landing

    def work(g: int, comm: Any) -> list[Tensor]:
        shards = [torch.zeros(300) for _ in range(2)]
        gate = _GatedSums(comm)
        gates.append(gate)
        fed = Federation(config, gate)
        fed.start(shards, step=0)
        for step in range(1, 13):
            for shard in shards:
                shard.add_(g + step)
            fed.maybe_sync(step)  # fragments land at 2, 4, ..., 12, each starting a sum
            if step % 2 == 0:
                held[g].append(gate.passed)
                if step > 2:  # the other fragment has landed since the sum started 2 steps ago: let that one go
                    gate.release()
        gate.release(10)  # the end of training waits for the sums in flight and sums the last rounds at once
        fed.finish(12)
        return shards

    results = InProcessGroups(2).run(work)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert [gate.starved for gate in gates] == [0, 0], "a sync waited for a sum in flight"
    # the landing at step 2k + 2 took the sum started at 2k - 2 (one round earlier): the sums let through by then are
    # exactly the k - 1 released, none of those still held back
    assert held == [[0, 0, 1, 2, 3, 4]] * 2


def test_validation_between_syncs_sees_every_round_trained_so_far():
    """The consensus with sums in flight is the anchor each fragment will have when its sum lands: at a sync step it
    is what ``finish`` leaves every group with, and entering it changes nothing of the run."""
    config = _eager(sync_every=4, fragments=2, outer_optimizer="nesterov")

    def work(g: int, comm: Any) -> dict[str, Any]:
        shards = [torch.zeros(2) for _ in range(UNITS)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        for step in range(1, 9):
            for shard, value in zip(shards, _update(g, step, shards)):
                shard.copy_(value)
            fed.maybe_sync(step)
        with fed.consensus_weights():
            seen = [s.clone() for s in shards]
        fed.finish(8)  # fragment 1 synced at 8: nothing trained since, so the end only lands the sums in flight
        return {"seen": seen, "final": [s.clone() for s in shards]}

    results = InProcessGroups(2).run(work)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["seen"][1:], r["final"][1:]))  # fragment 1: units 1, 2
    straight = _run(config, groups=2, steps=11)
    resumed_after_validation = InProcessGroups(2).run(
        lambda g, comm: _validate_midway_then_continue(config, g, comm, steps=11, validate_at=6)
    )
    for a, b in zip(straight, resumed_after_validation):
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b))


def _validate_midway_then_continue(config: FederationConfig, g: int, comm: Any, steps: int, validate_at: int):
    shards = [torch.zeros(2) for _ in range(UNITS)]
    fed = Federation(config, comm)
    fed.start(shards, step=0)
    for step in range(1, steps + 1):
        for shard, value in zip(shards, _update(g, step, shards)):
            shard.copy_(value)
        fed.maybe_sync(step)
        if step == validate_at:
            with fed.consensus_weights():
                pass
    fed.finish(steps)
    return [s.clone() for s in shards]
