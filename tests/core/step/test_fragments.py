"""Streaming fragments and overlapped syncs in the core: the cut, the schedule, the rule, and real overlap."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.step.fragments import cut_fragments, landing_fragment, starting_fragment
from lightning_fedshard.core.transport.inprocess import InProcessGroups


def test_cut_is_contiguous_balanced_and_keeps_every_fragment_non_empty():
    assert cut_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert cut_fragments([30, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert cut_fragments([1, 1, 100], 3) == [[0], [1], [2]]
    assert cut_fragments([5, 5, 5], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"`fragments=4` is more than the model's 3 FSDP unit\(s\)"):
        cut_fragments([1, 1, 1], 4)


def test_schedule_lands_fragments_in_turn_and_starts_them_sync_delay_steps_early():
    # sync_every 8, 2 fragments: one lands every 4 steps, alternating; with delay 1 each starts one step earlier
    landings = {s: landing_fragment(s, 8, 2) for s in range(1, 17)}
    assert {s: f for s, f in landings.items() if f is not None} == {4: 0, 8: 1, 12: 0, 16: 1}
    assert [s for s in range(1, 17) if starting_fragment(s, 8, 2, 1) is not None] == [3, 7, 11, 15]
    assert starting_fragment(3, 8, 2, 0) is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(sync_every=8, fragments=3), r"`sync_every=8` must be divisible by `fragments=3`"),
        (
            dict(sync_every=8, fragments=2, sync_delay=4),
            r"`sync_delay` must be an integer in \[0, .* = \[0, 4\), got 4",
        ),
        (dict(sync_delay=-1), r"got -1"),
        (dict(merge_alpha=1.5), r"`merge_alpha` must be a number in \[0, 1\], got 1.5"),
        (dict(merge_alpha=float("nan")), r"`merge_alpha` must be a number in \[0, 1\], got nan"),
        (dict(fragments=0), r"`fragments` must be a positive integer, got 0"),
        (dict(reduce_dtype="int2"), r"Unsupported `reduce_dtype='int2'`"),
        (dict(reduce_dtype="int8", quant_block_size=0), r"`quant_block_size` must be a positive integer, got 0"),
        (dict(reduce_dtype="bfloat16", error_feedback=True), r"`error_feedback=True` needs a lossy `reduce_dtype`"),
    ],
)
def test_streaming_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        FederationConfig(**options)


def _run(groups: InProcessGroups, config: FederationConfig, steps: int, finish: bool = True) -> list[Any]:
    """Two units per rank; group g adds (g + 1) * step to every weight after each optimizer step."""

    def work(g: int, comm: Any) -> tuple[list[Tensor], list[int]]:
        shards = [torch.zeros(2), torch.zeros(2)]
        fed = Federation(config, comm)
        fed.start(shards, step=0)
        landed = []
        for step in range(1, steps + 1):
            for shard in shards:
                shard.add_((g + 1) * step)
            stats = fed.maybe_sync(step)
            if stats is not None:
                landed.append((step, stats.fragment))
        if finish:
            fed.finish(steps)
        return [s.clone() for s in shards], landed

    return groups.run(work)


def test_two_fragments_with_delay_and_alpha_follow_the_rule():
    """Hand-computed: fedavg, 2 groups adding 1*step and 2*step, sync_every 4, 2 fragments, delay 1, alpha 0.5."""
    config = FederationConfig(sync_every=4, fragments=2, sync_delay=1, merge_alpha=0.5, outer_optimizer="fedavg")
    (w0, landed0), (w1, _) = _run(InProcessGroups(2), config, steps=4, finish=False)
    assert landed0 == [(2, 0), (4, 1)]
    # fragment 0 (unit 0): snapshot after step 1: group g holds (g+1)*1 -> mean 1.5 = new anchor.
    # after step 2 group g holds (g+1)*3 -> merged: 1.5 + 0.5*((g+1)*3 - 1.5); then step 3, 4 add (g+1)*7
    assert_close(w0[0], torch.full((2,), 1.5 + 0.5 * (3 - 1.5) + 7))
    assert_close(w1[0], torch.full((2,), 1.5 + 0.5 * (6 - 1.5) + 14))
    # fragment 1 (unit 1): snapshot after step 3: (g+1)*6 -> mean 9; after step 4 it holds (g+1)*10 -> 9 + 0.5*(...)
    assert_close(w0[1], torch.full((2,), 9 + 0.5 * (10 - 9)))
    assert_close(w1[1], torch.full((2,), 9 + 0.5 * (20 - 9)))


def test_finish_brings_every_fragment_to_the_consensus():
    config = FederationConfig(sync_every=4, fragments=2, sync_delay=1, merge_alpha=0.5, outer_optimizer="nesterov")
    for steps in (3, 4, 5):  # stopped with a sum in flight, right at a landing, and between
        (w0, _), (w1, _) = _run(InProcessGroups(2), config, steps=steps)
        for a, b in zip(w0, w1):
            assert torch.equal(a, b), f"groups differ after finish at step {steps}"


def test_one_fragment_no_delay_is_the_plain_outer_step():
    config = FederationConfig(sync_every=2, outer_optimizer="nesterov")
    (w0, landed), _ = _run(InProcessGroups(2), config, steps=4, finish=False)
    assert landed == [(2, 0), (4, 0)]
    # step 2: mean of (g+1)*3 = 4.5 -> delta = -4.5, Nesterov: a1 = 0 - 0.7 * 1.9 * -4.5 = 5.985
    # step 4: groups hold a1 + (g+1)*7 -> mean delta = -10.5, buf = 0.9 * -4.5 - 10.5 = -14.55;
    # a2 = a1 - 0.7 * (-10.5 + 0.9 * -14.55)
    a1 = 0.7 * 1.9 * 4.5
    a2 = a1 - 0.7 * (-10.5 + 0.9 * (0.9 * -4.5 - 10.5))
    assert_close(w0[0], torch.full((2,), a2))


class _SlowComm:
    """Wraps a thread communicator: the sum of the pseudo-gradient (from the background thread) takes `delay` seconds
    and records when it ran; the few numbers of the NaN flags and statistics (from the caller's thread) do not."""

    def __init__(self, inner: Any, delay: float, log: list[tuple[str, float]]) -> None:
        self._inner, self._delay, self._log = inner, delay, log
        self.num_groups, self.group_index = inner.num_groups, inner.group_index

    def participants(self) -> tuple[int, ...]:
        return self._inner.participants()

    def joined(self) -> bool:
        return False

    def sum_over_groups(self, tensor: Tensor) -> None:
        if not threading.current_thread().name.startswith("fedshard-outer"):
            self._inner.sum_over_groups(tensor)
            return
        self._log.append(("reduce_start", time.perf_counter()))
        time.sleep(self._delay)
        self._inner.sum_over_groups(tensor)
        self._log.append(("reduce_end", time.perf_counter()))

    def sum_stats_over_groups(self, tensor: Tensor) -> None:
        self._inner.sum_stats_over_groups(tensor)

    def sum_in_group(self, tensor: Tensor) -> None:
        self._inner.sum_in_group(tensor)

    def should_commit(self) -> bool:
        return self._inner.should_commit()

    num_replicas, replica_index = 1, 0

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        time.sleep(self._delay)
        self._inner.all_to_all(output, input)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        self._inner.all_gather(output, input)


class _HeldSum(_SlowComm):
    """The background sum of the pseudo-gradient says when it starts, then waits until the training loop lets it finish.

    A sync that waited for the sum would wait for the loop itself: after ``patience`` seconds the sum goes on anyway
    and ``starved`` tells, so the test fails instead of hanging.
    """

    def __init__(self, inner: Any, patience: float = 30.0) -> None:
        super().__init__(inner, 0.0, [])
        self.started, self.go, self.ended = threading.Event(), threading.Event(), threading.Event()
        self.patience, self.starved, self.seconds = patience, False, 0.0

    def sum_over_groups(self, tensor: Tensor) -> None:
        if not threading.current_thread().name.startswith("fedshard-outer"):
            self._inner.sum_over_groups(tensor)
            return
        start = time.perf_counter()
        self.started.set()
        self.starved = not self.go.wait(self.patience)
        self._inner.sum_over_groups(tensor)
        self.seconds = time.perf_counter() - start
        self.ended.set()


def test_the_sum_really_runs_while_training_goes_on():
    config = FederationConfig(sync_every=4, sync_delay=2, outer_optimizer="fedavg", reduce_dtype="float32")
    hold = 0.3  # the least time the sum takes: step 3's "compute" lets it finish only at its end

    def work(g: int, comm: Any) -> dict[str, Any]:
        held = _HeldSum(comm)
        shards = [torch.zeros(3)]
        fed = Federation(config, held)
        fed.start(shards, step=0)
        seen: dict[str, Any] = {}
        for step in range(1, 5):
            shards[0].add_(g + 1.0)
            if step == 3:  # "compute" of step 3, while the sum started after step 2 travels
                seen["started"] = held.started.wait(30)
                time.sleep(hold)
                seen["running"] = not held.ended.is_set()
                held.go.set()
                held.ended.wait(30)
            stats = fed.maybe_sync(step)
            if stats is not None:
                seen["exposed"] = stats.exposed_seconds
        return {**seen, "starved": held.starved, "sum_seconds": held.seconds}

    for seen in InProcessGroups(2).run(work):
        assert not seen["starved"], "the sync after step 2 waited for the sum instead of going on with training"
        assert seen["started"] and seen["running"], "the sum did not run while step 3 trained"
        # the landing after step 4 found the sum done: the time it ran in the background is not exposed
        assert seen["sum_seconds"] >= hold and seen["exposed"] < seen["sum_seconds"], seen


def test_quantized_outer_traffic_is_accepted_with_its_options():
    from lightning_fedshard.core.wire.reducers import AllReduceSum, ScatterGatherSum

    config = FederationConfig(reduce_dtype="int4", quant_block_size=64, error_feedback=True)
    reducer = config.reducer()
    assert isinstance(reducer, ScatterGatherSum) and config.compressed and config.reduce_torch_dtype == torch.float32
    assert reducer.codec.block_size == 64
    assert isinstance(FederationConfig(reduce_dtype="bfloat16").reducer(), AllReduceSum)
    # the residuals wait with the anchor: in host memory unless the anchor lives on the device
    assert reducer.feedback.device == "cpu"
    assert FederationConfig(reduce_dtype="int8", anchor_device="device").reducer().feedback.device is None


def test_error_feedback_defaults_to_on_for_quantized_traffic_only():
    assert FederationConfig().reducer().feedback is not None  # the default: int4 with error feedback
    assert FederationConfig(reduce_dtype="int8", error_feedback=False).reducer().feedback is None
    assert not hasattr(FederationConfig(reduce_dtype="float32").reducer(), "feedback")  # no residual to carry
    with pytest.raises(ValueError, match="needs a lossy `reduce_dtype`"):
        FederationConfig(reduce_dtype="float32", error_feedback=True)


@pytest.mark.parametrize(("reduce_dtype", "qmax"), [("int8", 127), ("int4", 7)])
def test_quantized_syncs_stay_within_the_bound_of_float32(reduce_dtype, qmax):
    """Three fedavg syncs of 2 groups whose drifts do not depend on the weights: the pseudo-gradients are the same in
    both runs, so the quantized result may differ from float32 by at most the sum of the per-sync bounds."""
    drifts = torch.randn(2, 6, 300, generator=torch.Generator().manual_seed(0))  # group, step, value

    def run(dtype: str) -> list[Tensor]:
        config = FederationConfig(sync_every=2, reduce_dtype=dtype, quant_block_size=32, outer_optimizer="fedavg")

        def work(g: int, comm: Any) -> Tensor:
            shard = torch.zeros(300)
            fed = Federation(config, comm)
            fed.start([shard], step=0)
            for step in range(1, 7):
                shard.add_(drifts[g, step - 1])
                fed.maybe_sync(step)
            return shard.clone()

        return InProcessGroups(2).run(work)

    exact, quantized = run("float32"), run(reduce_dtype)
    assert torch.equal(quantized[0], quantized[1]), "groups differ after a quantized sync"
    # per sync, the mean's error is at most the mean over groups of their block scales, <= max |pseudo-gradient| / qmax
    bound = sum(drifts[:, s : s + 2].sum(1).abs().max() for s in (0, 2, 4)) / qmax
    error = (quantized[0] - exact[0]).abs().max()
    assert 0 < error <= bound, f"{reduce_dtype}: error {error:.2e}, bound {bound:.2e}"


def test_a_checkpoint_taken_while_a_quantized_sum_travels_holds_the_residuals_it_leaves():
    """Error feedback updates the residuals from the background thread: the group state must wait for the sum."""
    config = FederationConfig(sync_every=4, sync_delay=2, reduce_dtype="int8", error_feedback=True)

    def work(g: int, comm: Any) -> tuple[Any, Any]:
        shards = [torch.zeros(300)]
        fed = Federation(config, _SlowComm(comm, 0.3, []))
        fed.start(shards, step=0)
        for step in (1, 2):
            shards[0].add_(torch.randn(300, generator=torch.Generator().manual_seed(10 * g + step)))
            fed.maybe_sync(step)  # the sum of the fragment landing at step 4 starts after step 2
        saved = fed.group_state_dict()["reducers"][0]
        assert fed.pending is not None
        fed.pending.result()
        return saved, fed.outer.reducers[0].state_dict()

    for saved, after in InProcessGroups(2).run(work):
        assert saved["residual"] is not None, "the residuals were read before the sum in flight finished"
        assert torch.equal(saved["residual"], after["residual"])
