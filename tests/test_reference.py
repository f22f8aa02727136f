"""Hand-computed checks of the independent reference (``tests/reference.py``) itself.

Most cases use two scripted groups over two scalar weights ``a`` and ``b``, starting at 0, whose every optimizer step
adds a known amount: group 0 adds (a, b) += (1, 2), group 1 adds (3, 4). Numbers are dyadic, so float64 is exact
for fedavg. ``fragments=[["a"], ["b"]]`` with ``sync_every=4`` makes ``K = 2``: ``a`` lands at steps 2, 6, ...,
``b`` at 4, 8, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

from tests.reference import OUTERS, NetGroup, Outer, federate, reference_run
from tests.toy import IndexedRegression, loss_fn, make_net

A_B = [["a"], ["b"]]


@dataclass
class Scripted:
    """A group whose optimizer step adds ``per_step`` to its weights."""

    per_step: dict[str, float]
    w: dict[str, Tensor] = field(default_factory=lambda: {"a": torch.tensor(0.0), "b": torch.tensor(0.0)})

    def train_step(self, step: int) -> None:
        self.w = {k: v + self.per_step[k] for k, v in self.w.items()}

    def weights(self) -> dict[str, Tensor]:
        return self.w

    def load(self, weights: dict[str, Tensor]) -> None:
        self.w.update({k: v.clone() for k, v in weights.items()})


def _groups() -> list[Scripted]:
    return [Scripted({"a": 1.0, "b": 2.0}), Scripted({"a": 3.0, "b": 4.0})]


def _run(groups: list[Scripted], **kwargs: object) -> dict:
    initial = {"a": torch.tensor(0.0, dtype=torch.float64), "b": torch.tensor(0.0, dtype=torch.float64)}
    for g in groups:
        g.w = {k: v.clone() for k, v in initial.items()}
    options: dict = dict(sync_every=4, outer="fedavg", max_steps=8, fragments=A_B) | kwargs
    return federate(initial, groups, **options)


def _anchors(result: dict) -> dict[int, tuple[float, float]]:
    return {step: (w["a"].item(), w["b"].item()) for step, w in result["anchors"].items()}


def _schedule(result: dict) -> list[tuple[int, int, str]]:
    return [(s.step, s.fragment, s.kind) for s in result["syncs"]]


def _assert_consensus(groups: list[Scripted], result: dict) -> None:
    for g in groups:
        for k, v in result["final"].items():
            assert torch.equal(g.w[k], v), f"a group does not hold the consensus of {k}"


# -- the schedule --------------------------------------------------------------------------------------------------


def test_two_fragments_land_alternately():
    groups = _groups()
    result = _run(groups)
    # a: (2, 6) after step 2 -> 4; (4+2, 4+6) after step 6 -> 12; final (12+2, 12+6) -> 16
    # b: (8, 16) after step 4 -> 12; (12+8, 12+16) after step 8 -> 24, landed at T = 8: no final step
    assert _anchors(result) == {0: (0, 0), 2: (4, 0), 4: (4, 12), 6: (12, 12), 8: (16, 24)}
    assert _schedule(result) == [
        (2, 0, "landing"),
        (4, 1, "landing"),
        (6, 0, "landing"),
        (8, 1, "landing"),
        (8, 0, "final"),
    ]
    assert result["syncs"][0].outer_grad == {"a": torch.tensor(-4.0, dtype=torch.float64)}
    # after step 2 (= before step index 2) only a is shared; b has drifted apart
    assert [w.tolist() for w in result["groups_before"][2]] == [[4, 4], [4, 8]]
    _assert_consensus(groups, result)


def test_each_fragment_has_its_own_nesterov_state():
    result = _run(_groups(), outer="nesterov")
    # a at 2: grad -4, buf -4, update -4 + 0.9 * -4 = -7.6, anchor 0.7 * 7.6 = 5.32
    # a at 6: groups 5.32 + (4, 12), grad -8, buf -3.6 - 8 = -11.6, update -8 - 10.44 = -18.44, anchor 18.228
    # a final at 8: groups 18.228 + (2, 6), grad -4, buf -10.44 - 4 = -14.44, update -4 - 12.996, anchor 30.1252
    # b at 4: grad -12, buf -12, update -22.8, anchor 15.96
    # b at 8: groups 15.96 + (8, 16), grad -12, buf -22.8, update -12 - 20.52 = -32.52, anchor 38.724 (no final step)
    expected = {2: (5.32, 0), 4: (5.32, 15.96), 6: (18.228, 15.96), 8: (30.1252, 38.724)}
    for step, (a, b) in expected.items():
        assert _anchors(result)[step] == pytest.approx((a, b), abs=1e-12), step


def test_sync_delay_takes_the_pseudo_gradient_from_the_snapshot():
    groups = _groups()
    result = _run(groups, sync_delay=1)
    # a lands at 2 from step 1: (1, 3) -> 2; groups restart at 2, so step 5 gives (2+3, 2+9) -> 8; final (10, 14) -> 12
    # b lands at 4 from step 3: (6, 12) -> 9; step 7 gives (9+6, 9+12) -> 18
    assert _anchors(result) == {0: (0, 0), 2: (2, 0), 4: (2, 9), 6: (8, 9), 8: (12, 18)}
    assert _schedule(result) == [
        (2, 0, "landing"),
        (4, 1, "landing"),
        (6, 0, "landing"),
        (8, 1, "landing"),
        (8, 0, "final"),
    ]
    # with alpha = 0 the groups drop their progress after the snapshot
    assert [w.tolist() for w in result["groups_before"][4]] == [[4, 9], [8, 9]]
    _assert_consensus(groups, result)


@pytest.mark.parametrize(("final_landing", "b_final"), [("sync", 21.0), ("reset", 19.5)])
def test_merge_alpha_keeps_half_of_the_local_progress(final_landing, b_final):
    groups = _groups()
    result = _run(groups, sync_delay=1, merge_alpha=0.5, final_landing=final_landing)
    # a at 2: snapshot (1, 3) -> 2; now (2, 6) -> merged 2 + (0, 4) / 2 = (2, 4)
    # a at 6: snapshot (5, 13) -> 9; now (6, 16) -> merged (7.5, 12.5); final: now (9.5, 18.5) -> 14
    # b at 4: snapshot (6, 12) -> 9; now (8, 16) -> merged (8.5, 12.5)
    # b at 8: snapshot (14.5, 24.5) -> 19.5; now (16.5, 28.5) -> merged (18, 24)
    #   "sync": grad 19.5 - 21 -> 21;  "reset": the groups take 19.5 back
    assert _anchors(result) == {0: (0, 0), 2: (2, 0), 4: (2, 9), 6: (9, 9), 8: (14, b_final)}
    assert [w.tolist() for w in result["groups_before"][2]] == [[2, 4], [4, 8]]  # a merged from now, not the snapshot
    assert [w.tolist() for w in result["groups_before"][4]] == [[4, 8.5], [10, 12.5]]
    finals = [(s.fragment, s.outer_grad) for s in result["syncs"] if s.kind == "final"]
    if final_landing == "sync":
        assert finals == [
            (0, {"a": torch.tensor(-5.0, dtype=torch.float64)}),
            (1, {"b": torch.tensor(-1.5, dtype=torch.float64)}),
        ]
    else:
        assert [f for f, _ in finals] == [0]
    _assert_consensus(groups, result)


def test_merge_alpha_weighs_the_local_weights():
    # a at 2 (no delay): (2, 6) -> 4; a quarter of the local progress stays: 4 + (-2, 2) / 4 = (3.5, 4.5)
    result = _run(_groups(), merge_alpha=0.25, max_steps=3)
    assert [w.tolist() for w in result["groups_before"][2]] == [[3.5, 4], [4.5, 8]]


def test_a_stop_between_snapshot_and_landing_drops_the_reduction():
    groups = _groups()
    # sync_every=6, 2 fragments: K = 3, a lands at 3 from step 1, b would land at 6 from step 4; stop at 5
    result = _run(groups, sync_every=6, sync_delay=2, max_steps=5)
    # a at 3: snapshot (1, 3) -> 2; groups restart at 2, then (4, 8) after step 5 -> final 6
    # b: the snapshot (8, 16) -> 12 of step 4 is dropped; final from step 5: (10, 20) -> 15
    assert _anchors(result) == {0: (0, 0), 3: (2, 0), 5: (6, 15)}
    assert _schedule(result) == [(3, 0, "landing"), (5, 0, "final"), (5, 1, "final")]
    _assert_consensus(groups, result)


def test_no_landing_before_the_end():
    result = _run(_groups(), max_steps=1)
    assert _anchors(result) == {0: (0, 0), 1: (2, 3)}
    assert _schedule(result) == [(1, 0, "final"), (1, 1, "final")]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(sync_every=3), "multiple of 2 fragments"),
        (dict(sync_delay=2), r"`sync_delay=2` must lie in \[0, 2\)"),
        (dict(sync_delay=-1), "sync_delay"),
        (dict(merge_alpha=1.5), "merge_alpha"),
        (dict(fragments=[["a"], []]), "non-empty disjoint"),
        (dict(fragments=[["a"], ["a"]]), "non-empty disjoint"),
        (dict(fragments=[["a"]]), "non-empty disjoint"),
        (dict(final_landing="keep"), "final_landing"),
    ],
)
def test_bad_options_are_rejected(options, match):
    with pytest.raises(ValueError, match=match):
        _run(_groups(), **options)


# -- the toy network: defaults are the old algorithm, bit for bit ---------------------------------------------------


def _old_reference_run(
    initial: dict[str, Tensor],
    micro_batches: list[list[list[int]]],
    groups: list[list[int]],
    *,
    sync_every: int,
    outer: str,
    inner: str,
    lr: float,
    accumulate: int,
    max_steps: int,
) -> dict[str, object]:
    """``reference_run`` as it was before fragments, delay and merge (a verbatim copy of its algorithm)."""
    data = IndexedRegression()
    anchor = {k.removeprefix("net."): v.clone().double().float() for k, v in initial.items()}
    nets = []
    for _ in groups:
        net = make_net()
        net.load_state_dict(anchor)
        nets.append(net)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.SGD(net.parameters(), lr=lr)
        if inner == "sgd"
        else torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        for net in nets
    ]
    outer_opt = Outer(**OUTERS[outer])
    anchors: dict[int, dict[str, Tensor]] = {0: {k: v.clone() for k, v in anchor.items()}}
    groups_before: dict[int, list[Tensor]] = {}
    for step in range(max_steps):
        groups_before[step] = [torch.cat([p.detach().reshape(-1) for p in net.parameters()]) for net in nets]
        for g, ranks in enumerate(groups):
            opts[g].zero_grad()
            for rank in ranks:
                for m in range(step * accumulate, (step + 1) * accumulate):
                    idx = torch.tensor(micro_batches[rank][m])
                    loss = loss_fn(nets[g], data.x[idx], data.y[idx]) / (accumulate * len(ranks))
                    loss.backward()
            opts[g].step()
        done = step + 1
        if done % sync_every == 0 or done == max_steps:
            states = [{k: v.detach() for k, v in net.state_dict().items()} for net in nets]
            delta = {k: anchor[k] - torch.stack([s[k] for s in states]).mean(0) for k in anchor}
            outer_opt.step(anchor, delta)
            for net in nets:
                net.load_state_dict(anchor)
            anchors[done] = {k: v.clone() for k, v in anchor.items()}
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before}


def _toy_inputs(max_steps: int, accumulate: int) -> tuple[dict[str, Tensor], list[list[list[int]]]]:
    torch.manual_seed(0)
    initial = {f"net.{k}": v for k, v in make_net().state_dict().items()}
    order = torch.randperm(512, generator=torch.Generator().manual_seed(1)).tolist()
    per_rank = max_steps * accumulate
    micro_batches = [
        [order[(r * per_rank + m) * 4 : (r * per_rank + m + 1) * 4] for m in range(per_rank)] for r in range(4)
    ]
    return initial, micro_batches


def _assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


TOY_CASES = [
    dict(sync_every=2, outer="fedavg", inner="sgd", lr=0.1, accumulate=2, max_steps=7),
    dict(sync_every=3, outer="nesterov", inner="adamw", lr=0.01, accumulate=1, max_steps=6),
]


@pytest.mark.parametrize("case", TOY_CASES)
def test_defaults_reproduce_the_old_function_bit_for_bit(case):
    initial, micro_batches = _toy_inputs(case["max_steps"], case["accumulate"])
    groups = [[0, 1], [2, 3]]
    old = _old_reference_run(initial, micro_batches, groups, **case)
    for new in (
        reference_run(initial, micro_batches, groups, **case),
        reference_run(initial, micro_batches, groups, **case, fragments=[list(initial)]),  # one explicit fragment
    ):
        assert new["anchors"].keys() == old["anchors"].keys()
        for step in old["anchors"]:
            _assert_same(new["anchors"][step], old["anchors"][step])
        _assert_same(new["final"], old["final"])
        assert new["groups_before"].keys() == old["groups_before"].keys()
        for step, weights in old["groups_before"].items():
            assert all(torch.equal(x, y) for x, y in zip(new["groups_before"][step], weights, strict=True))
    moved = max((old["final"][k] - initial[f"net.{k}"]).abs().max().item() for k in old["final"])
    assert moved > 1e-2, "nothing trained: the comparison would be empty"


def test_toy_fragments_land_one_slice_at_a_time():
    case = dict(sync_every=4, outer="nesterov", inner="adamw", lr=0.01, accumulate=1, max_steps=7)
    initial, micro_batches = _toy_inputs(case["max_steps"], case["accumulate"])
    first = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    fragments = [first, ["net.4.weight", "net.4.bias"]]
    options: dict = dict(fragments=fragments, sync_delay=1, merge_alpha=0.5)
    result = reference_run(initial, micro_batches, [[0, 1], [2, 3]], **case, **options)
    assert [(s.step, s.fragment, s.kind) for s in result["syncs"]] == [
        (2, 0, "landing"),
        (4, 1, "landing"),
        (6, 0, "landing"),
        (7, 0, "final"),
        (7, 1, "final"),
    ]
    anchors = result["anchors"]
    for step, landed in [(2, first), (4, fragments[1]), (6, first)]:
        before = anchors[max(s for s in anchors if s < step)]
        for k, v in anchors[step].items():
            assert torch.equal(v, before[k]) != (f"net.{k}" in landed), f"{k} at step {step}"
    _assert_same(anchors[7], result["final"])
    # names without the LightningModule prefix mean the same fragments
    plain = [[k.removeprefix("net.") for k in part] for part in fragments]
    _assert_same(
        reference_run(initial, micro_batches, [[0, 1], [2, 3]], **case, **options | {"fragments": plain})["final"],
        result["final"],
    )


def test_net_group_load_is_partial():
    # the fragment loads must leave the other names alone
    torch.manual_seed(0)
    anchor = make_net().state_dict()
    group = NetGroup(anchor, [0], [[[0, 1]]], IndexedRegression(), inner="sgd", lr=0.1, accumulate=1)
    before = {k: v.clone() for k, v in group.weights().items()}
    group.load({"4.bias": torch.zeros(3)})
    assert torch.equal(group.weights()["4.bias"], torch.zeros(3))
    for k in before.keys() - {"4.bias"}:
        assert torch.equal(group.weights()[k], before[k])
