"""An independent, single-process reference implementation of FL+FSDP / FL+HSDP.

It keeps one full model per federation group (no sharding, no process groups, no code from the package): a group's
gradient is the mean of its ranks' gradients (what FSDP's reduce-scatter and HSDP's all-reduce compute), each group
steps its own inner optimizer, and the anchor takes hand-written outer SGD steps (optional Nesterov momentum) on the
mean pseudo-gradient.

Without options the anchor syncs as a whole every ``sync_every`` steps and once more at the last step. With
streaming fragments, delay and merge the schedule is, for ``H = sync_every``, ``P = len(fragments)`` and
``K = H / P``:

- every fragment has its own slice of the anchor and its own outer optimizer state;
- after every optimizer step ``s`` with ``s % K == 0`` fragment ``(s / K - 1) % P`` lands: its pseudo-gradient is
  ``anchor_f - local_{g,f}`` with ``local_{g,f}`` group g's weights of that fragment right after step
  ``s - sync_delay`` (a snapshot); the mean over groups is the outer gradient, the outer optimizer steps ``anchor_f``
  and every group's weights of the fragment become ``anchor_new + merge_alpha * (local_now - anchor_new)``, with
  ``local_now`` the weights after step ``s`` (not the snapshot);
- after the last step ``T``, snapshots whose landing lies beyond ``T`` are dropped, and every fragment takes one
  synchronous outer step on ``anchor_f - local_{g,f}`` after step ``T`` and every group's weights of it become the new
  anchor (no merge) - except a fragment that landed at ``T`` with ``merge_alpha == 0``: its groups already hold its
  anchor, so it is left as it is. A fragment that landed at ``T`` with ``merge_alpha > 0`` holds merged weights that
  differ between groups; ``final_landing`` says what it does (see `federate`). Either way every group ends with the
  consensus, which is the returned ``final``.

`federate` runs that schedule over any groups that can train one step, report and load weights (`Group`): the toy
network in `reference_run`, or scripted groups with known updates in ``tests/test_reference.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from tests.toy import IndexedRegression, loss_fn, make_net

FinalLanding = Literal["sync", "reset"]


@dataclass
class Outer:
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    buffers: dict[str, Tensor] = field(default_factory=dict)

    def step(self, anchor: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for k, d in delta.items():
            update = d
            if self.momentum:
                buf = d.clone() if k not in self.buffers else self.momentum * self.buffers[k] + d
                self.buffers[k] = buf
                update = d + self.momentum * buf if self.nesterov else buf
            anchor[k] = anchor[k] - self.lr * update


OUTERS: dict[str, dict[str, Any]] = {"nesterov": dict(lr=0.7, momentum=0.9, nesterov=True), "fedavg": dict(lr=1.0)}


class Group(Protocol):
    """One federation group as the outer loop sees it: it trains, shows its weights and takes new ones."""

    def train_step(self, step: int) -> None:
        """Run optimizer step ``step`` (0-based) in place."""

    def weights(self) -> dict[str, Tensor]:
        """The group's current weights by name (may share storage with the model)."""

    def load(self, weights: dict[str, Tensor]) -> None:
        """Overwrite the named weights (a subset of the names) with copies of the given values."""


@dataclass(frozen=True)
class Sync:
    """One outer step of one fragment.

    ``kind`` is ``"landing"`` for a scheduled landing and ``"final"`` for the synchronous step at the end of training.
    ``outer_grad`` is the mean pseudo-gradient the fragment's outer optimizer stepped on.
    """

    step: int
    fragment: int
    kind: Literal["landing", "final"]
    outer_grad: dict[str, Tensor]


def federate(
    initial: dict[str, Tensor],
    groups: Sequence[Group],
    *,
    sync_every: int,
    outer: str,
    max_steps: int,
    fragments: list[list[str]] | None = None,
    sync_delay: int = 0,
    merge_alpha: float = 0.0,
    final_landing: FinalLanding = "sync",
    eager: bool = False,
    hierarchical: dict[int, int] | None = None,
    sites: list[list[int]] | None = None,
    mixing: Callable[[int], Tensor] | None = None,
    participants: Callable[[int], list[int]] | None = None,
    roundtrip: Callable[[Tensor], Tensor] | None = None,
    paced: Callable[[int], Sequence[int]] | None = None,
    merge: str = "tokens",
) -> dict[str, object]:
    """Train ``groups`` (all holding ``initial``) for ``max_steps`` optimizer steps under the outer schedule above.

    Args:
        initial: the starting anchor; it is not modified.
        groups: the federation groups, all holding ``initial`` already.
        sync_every: ``H``; every fragment lands once every ``H`` steps.
        outer: a name from `OUTERS`; every fragment builds its own optimizer from it.
        max_steps: ``T``, the number of optimizer steps.
        fragments: the names of ``initial`` per fragment, in landing order; ``None`` is one fragment with every name.
        sync_delay: ``d`` in ``[0, K)``: a landing at ``s`` takes its pseudo-gradient from the weights after ``s - d``.
        merge_alpha: in ``[0, 1]``: after a landing a group keeps this share of its own progress on the fragment.
        final_landing: what a fragment does at the end when it landed at ``T`` with ``merge_alpha > 0``: ``"sync"``
            (its groups hold merged weights that are not its anchor, so like every other fragment it takes the final
            synchronous outer step, its outer optimizer stepping twice at ``T``) or ``"reset"`` (no second outer
            step: its groups are reset to the anchor of the landing at ``T``, i.e. the last merge is skipped).
        eager: eager updates instead (see `_federate_eager`; no delay, no merge).
        hierarchical: ``{period: groups}``: a hierarchical outer topology (see `_federate_hierarchical`). With
            fragments, a delay or a merge the federation's schedule above runs with the largest period as ``H``
            (``sync_every`` is ignored), and after every step, once that step's landing (if any) is done, the sites of
            the level that decides the step (if it is below the whole federation) replace their weights by their plain
            mean (see `_site_means`).
        sites: with ``hierarchical``, the groups of each site, when they are not consecutive.
        mixing: ``round -> G x G`` matrix: a mixing outer topology instead (see `_federate_mixing`; ``"fedavg"``).
        roundtrip: with ``mixing``, a lossy codec's encode-then-decode of a flat float32 vector (the messages').
        participants: ``round -> group indices``: sampled participation. The landing after step ``s`` belongs to round
            ``(s - 1) // sync_every``, and its mean runs over the snapshots of that round's groups only; every group
            still loads the merged anchor. The final steps at the end average every group.
        paced: ``round -> steps per group``: a per-group pace. Round ``r`` is the steps ``r H .. r H + H - 1``
            (0-based); group ``g`` trains the first ``paced(r)[g]`` of them and skips the others. Each group counts
            the steps it trained since a fragment last landed (a landing resets the count, whatever the merge), and a
            landing's outer gradient weighs each group's ``anchor - snapshot`` by the count at its snapshot:
            ``merge="tokens"``: ``c_g / sum c``; ``merge="normalized"``: ``(mean c / c_g) / G`` (0 for ``c_g = 0``).
            With ``participants`` too, the sums and means run over the round's sampled groups.

    Returns:
        ``anchors``: the full anchor after every outer step, by optimizer step (``0``: the initial anchor; at ``T``
        after the final steps); ``final``: the consensus every group holds at the end; ``groups_before``: every
        group's weights, flattened in name order, before every step (by 0-based step); ``syncs``: every `Sync` in
        order.
    """
    parts = _check_fragments(list(initial), fragments)
    streaming = len(parts) > 1 or sync_delay or merge_alpha or eager or paced is not None
    pace_every = sync_every  # a pace's rounds are `sync_every` steps, whatever the landings' period
    if hierarchical is not None and streaming:
        sync_every = max(hierarchical)
    every = _check_schedule(sync_every, len(parts), sync_delay, merge_alpha, final_landing)
    trained_in = None if paced is None else _trained_in(paced, pace_every, len(groups))
    if hierarchical is not None and not streaming:
        return _federate_hierarchical(initial, groups, hierarchical, outer, max_steps, sites)
    if mixing is not None:
        if sync_delay or roundtrip is not None:
            schedule = (parts, every, sync_every, max_steps, sync_delay)
            return _federate_messages(initial, groups, mixing, *schedule, roundtrip, paced, merge)
        return _federate_mixing(initial, groups, mixing, parts, every, sync_every, outer, max_steps, paced, merge)
    if eager:
        if sync_delay or merge_alpha:
            raise ValueError("eager updates take no `sync_delay` or `merge_alpha`.")
        rounds = None if participants is None else (lambda done: participants((done - 1) // sync_every))
        pace = (paced, pace_every, merge) if paced is not None else None
        return _federate_eager(initial, groups, parts, every, outer, max_steps, hierarchical, sites, rounds, pace)
    anchor = {k: v.clone() for k, v in initial.items()}
    outers = [Outer(**OUTERS[outer]) for _ in parts]
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    groups_before: dict[int, list[Tensor]] = {}
    syncs: list[Sync] = []
    in_flight: dict[int, list[dict[str, Tensor]]] = {}  # landing step -> each group's snapshot of that fragment
    landed = -1
    counts = [[0] * len(parts) for _ in groups]  # per group and fragment: steps trained since its last landing
    counted: dict[int, list[int]] = {}  # landing step -> each group's count at its snapshot
    for step in range(max_steps):
        groups_before[step] = [torch.cat([v.reshape(-1) for v in g.weights().values()]) for g in groups]
        for g, group in enumerate(groups):
            if paced is None or step % pace_every < paced(step // pace_every)[g]:
                group.train_step(step)
                counts[g] = [c + 1 for c in counts[g]]
        done = step + 1
        if (done + sync_delay) % every == 0:
            f = _landing_fragment(done + sync_delay, every, len(parts))
            in_flight[done + sync_delay] = [_slice(g.weights(), parts[f], clone=True) for g in groups]
            counted[done + sync_delay] = [counts[g][f] for g in range(len(groups))]
        if done % every == 0:
            landed = _landing_fragment(done, every, len(parts))
            keys = parts[landed]
            snapshots, trained = in_flight.pop(done), counted.pop(done)
            if participants is not None:  # the round's sample; a pace weighs it by the steps its groups trained
                chosen = participants((done - 1) // sync_every)
                snapshots, trained = [snapshots[g] for g in chosen], [trained[g] for g in chosen]
            weights = None if paced is None else _pace_weights(trained, merge)
            grad = _outer_step(anchor, outers[landed], snapshots, keys, weights)
            syncs.append(Sync(done, landed, "landing", grad))
            for g in groups:
                g.load(_merge(anchor, g.weights(), keys, merge_alpha))
            for g in range(len(groups)):
                counts[g][landed] = 0
            anchors[done] = _copy(anchor)
        if hierarchical is not None:
            _site_means(groups, hierarchical, sites, done, trained_in=trained_in)
    # End of training: reductions still in flight are dropped; every fragment whose groups may not hold its anchor
    # takes one synchronous outer step on its current pseudo-gradient and every group restarts from the result.
    if max_steps > 0:
        landed_at_end = landed if max_steps % every == 0 else -1
        for f, keys in enumerate(parts):
            if f == landed_at_end and (merge_alpha == 0 or final_landing == "reset"):
                for g in groups:
                    g.load(_slice(anchor, keys))
                continue
            weights = None if paced is None else _pace_weights([c[f] for c in counts], merge)
            grad = _outer_step(anchor, outers[f], [_slice(g.weights(), keys) for g in groups], keys, weights)
            syncs.append(Sync(max_steps, f, "final", grad))
            for g in groups:
                g.load(_slice(anchor, keys))
        anchors[max_steps] = _copy(anchor)
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before, "syncs": syncs}


def _everyone_meets(
    anchor: dict[str, Tensor],
    opt: Outer,
    groups: Sequence[Group],
    step: int,
    kind: str,
    syncs: list[Sync],
    anchors: dict[int, dict[str, Tensor]],
) -> None:
    """The whole federation meets: the anchor takes the outer step on every group, and every group restarts from it."""
    syncs.append(Sync(step, 0, kind, _outer_step(anchor, opt, [g.weights() for g in groups], list(anchor))))
    for g in groups:
        g.load(_copy(anchor))
    anchors[step] = _copy(anchor)


def _site_means(
    groups: Sequence[Group],
    levels: dict[int, int],
    sites: list[list[int]] | None,
    done: int,
    starts: list[dict[str, Tensor]] | None = None,
    start_keys: Sequence[str] = (),
    trained_in: Callable[[int, int], list[int]] | None = None,
) -> None:
    """After step ``done``: if the largest period of ``levels`` dividing it averages fewer than all groups, every block
    of that many groups (consecutive in the order ``sites`` lists them) takes its plain mean, and so do the blocks'
    ``starts`` (eager updates' round starts) under ``start_keys``.

    With ``trained_in`` (a pace: ``(first, end) -> steps each group trained among the 0-based steps [first, end)``)
    the means weigh each group by the steps it trained since the previous multiple of the smallest period (its
    site's or the federation's last sync); a plain mean when no group of the block trained."""
    due = [period for period in levels if done % period == 0]
    if not due or levels[max(due)] >= len(groups):
        return
    size = levels[max(due)]
    order = [g for site in sites for g in site] if sites else list(range(len(groups)))
    trained = None if trained_in is None else trained_in(done - min(levels), done)
    for start in range(0, len(groups), size):
        members = order[start : start + size]
        counts = None if trained is None else [trained[g] for g in members]
        mean = _block_mean([groups[g].weights() for g in members], list(groups[0].weights()), counts)
        for g in members:
            groups[g].load({k: v.clone() for k, v in mean.items()})
        if starts is not None and start_keys:
            start_mean = _block_mean([starts[g] for g in members], list(start_keys), counts)
            for g in members:
                starts[g].update({k: v.clone() for k, v in start_mean.items()})


def _block_mean(members: list[dict[str, Tensor]], keys: list[str], counts: list[int] | None) -> dict[str, Tensor]:
    """The plain mean of ``members`` under ``keys``, or weighted by ``counts`` when any is positive."""
    if counts is None or sum(counts) == 0:
        return {k: torch.stack([m[k] for m in members]).mean(0) for k in keys}
    return {k: sum(c / sum(counts) * m[k] for c, m in zip(counts, members)) for k in keys}  # type: ignore[misc]


def _trained_in(paced: Callable[[int], Sequence[int]], every: int, num_groups: int) -> Callable[[int, int], list[int]]:
    """``(first, end) -> steps each group trained among the 0-based steps [first, end)`` of a pace (see `federate`)."""

    def trained_in(first: int, end: int) -> list[int]:
        return [sum(s % every < paced(s // every)[g] for s in range(first, end)) for g in range(num_groups)]

    return trained_in


def _federate_hierarchical(
    initial: dict[str, Tensor],
    groups: Sequence[Group],
    levels: dict[int, int],
    outer: str,
    max_steps: int,
    sites: list[list[int]] | None = None,
) -> dict[str, object]:
    """After step ``s`` the largest period of ``levels`` dividing ``s`` decides: blocks of that many consecutive groups
    (consecutive in the order ``sites`` lists them, if given) replace their weights by the blocks' plain mean, or, when
    the block spans every group, the anchor takes the outer step on the mean of ``anchor - weights`` and every group
    restarts from it. At the end, unless the last step was such a step, one more outer step."""
    order = [g for site in sites for g in site] if sites else list(range(len(groups)))
    anchor = {k: v.clone() for k, v in initial.items()}
    opt = Outer(**OUTERS[outer])
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    syncs: list[Sync] = []
    last_global = 0
    for step in range(max_steps):
        for group in groups:
            group.train_step(step)
        done = step + 1
        due = [period for period in levels if done % period == 0]
        if not due:
            continue
        size = levels[max(due)]
        if size < len(groups):
            for start in range(0, len(groups), size):
                block = [groups[g] for g in order[start : start + size]]
                mean = {k: torch.stack([g.weights()[k] for g in block]).mean(0) for k in anchor}
                for g in block:
                    g.load({k: v.clone() for k, v in mean.items()})
            continue
        _everyone_meets(anchor, opt, groups, done, "landing", syncs, anchors)
        last_global = done
    if max_steps > 0 and last_global != max_steps:
        _everyone_meets(anchor, opt, groups, max_steps, "final", syncs, anchors)
    return {"anchors": anchors, "final": anchor, "groups_before": {}, "syncs": syncs}


def _federate_mixing(
    initial: dict[str, Tensor],
    groups: Sequence[Group],
    mixing: Callable[[int], Tensor],
    parts: list[list[str]],
    every: int,
    sync_every: int,
    outer: str,
    max_steps: int,
    paced: Callable[[int], Sequence[int]] | None = None,
    merge: str = "tokens",
) -> dict[str, object]:
    """After step ``s`` with ``s % K == 0`` (``K = H / P``) fragment ``(s / K - 1) % P`` mixes: group ``i``
    takes ``sum_j W_ij theta_j`` of it for ``W = mixing((s - 1) // H)``, computed here in float64; a uniform ``W``
    is the plain outer step of that fragment (everyone restarts from the mean). At the end every fragment that did not
    just take such a step takes one: every group holds the plain mean of all groups.

    With ``paced`` (as `federate` takes it, rounds of ``H`` steps) a group trains its share of each round, a mix
    weighs column ``j`` by the steps group ``j`` trained in the last ``H`` steps (`_paced_rows`), and the plain outer
    steps weigh the groups by ``merge`` and the steps each trained since the fragment's last one."""
    if outer != "fedavg":
        raise ValueError("a mixing topology takes plain means: outer='fedavg'.")
    anchor = {k: v.clone() for k, v in initial.items()}
    opt = Outer(**OUTERS[outer])
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    syncs: list[Sync] = []
    met_at = [0] * len(parts)
    groups_before: dict[int, list[Tensor]] = {}
    trained_in = None if paced is None else _trained_in(paced, sync_every, len(groups))

    def meet(f: int, step: int, kind: str) -> None:
        weights = None if trained_in is None else _pace_weights(trained_in(met_at[f], step), merge)
        syncs.append(Sync(step, f, kind, _outer_step(anchor, opt, [g.weights() for g in groups], parts[f], weights)))
        for g in groups:
            g.load(_slice(anchor, parts[f], clone=True))
        met_at[f] = step

    for step in range(max_steps):
        groups_before[step] = [torch.cat([v.reshape(-1) for v in g.weights().values()]) for g in groups]
        for g, group in enumerate(groups):
            if paced is None or step % sync_every < paced(step // sync_every)[g]:
                group.train_step(step)
        done = step + 1
        if done % every:
            continue
        f = _landing_fragment(done, every, len(parts))
        keys = parts[f]
        matrix = mixing((done - 1) // sync_every).double()
        if torch.equal(matrix, torch.full_like(matrix, 1.0 / len(groups))):
            meet(f, done, "landing")
            anchors[done] = _copy(anchor)
            continue
        if trained_in is not None:
            matrix = _paced_rows(matrix, trained_in(max(0, done - sync_every), done))
        weights = [_copy(g.weights()) for g in groups]  # copies: the groups are overwritten one by one below
        for i, g in enumerate(groups):
            g.load({
                k: sum(float(matrix[i, j]) * w[k].double() for j, w in enumerate(weights)).to(anchor[k].dtype)
                for k in keys
            })  # fmt: skip
    if max_steps > 0:
        for f in range(len(parts)):
            if met_at[f] != max_steps:
                meet(f, max_steps, "final")
        anchors[max_steps] = _copy(anchor)
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before, "syncs": syncs}


def _paced_rows(matrix: Tensor, trained: list[int]) -> Tensor:
    """Row ``i`` of ``matrix`` reweighed by the steps each group trained: ``W_ij t_j / sum_k W_ik t_k`` (float64); a
    row whose partners trained nothing keeps its weights."""
    out = matrix.clone()
    for i in range(matrix.shape[0]):
        mass = sum(float(matrix[i, k]) * trained[k] for k in range(matrix.shape[0]))
        if mass > 0:
            for j in range(matrix.shape[0]):
                out[i, j] = float(matrix[i, j]) * trained[j] / mass
    return out


def _federate_messages(
    initial: dict[str, Tensor],
    groups: Sequence[Group],
    mixing: Callable[[int], Tensor],
    parts: list[list[str]],
    every: int,
    sync_every: int,
    max_steps: int,
    sync_delay: int,
    roundtrip: Callable[[Tensor], Tensor] | None,
    paced: Callable[[int], Sequence[int]] | None = None,
    merge: str = "tokens",
) -> dict[str, object]:
    """Message mixes: the landing after step ``s`` (fragment ``f``, ``W = mixing((s - 1) // H)``) uses each group's
    message ``m_j``, taken after step ``s - sync_delay``: its weights of ``f`` (flattened in float32), or with
    ``roundtrip`` the round trip of its weights less the anchor. Each group adds ``sum_j W_ij m_j - m_i`` (float64)
    to its weights of ``f`` after step ``s``; a uniform ``W`` also sets the anchor of ``f`` to the mean of the messages
    (plus the anchor with ``roundtrip``). Messages whose landing lies beyond ``T`` are dropped. At the end every
    fragment takes one plain outer step (fedavg: every group holds the plain mean).

    With ``paced`` (rounds of ``H`` steps) a group trains its share of each round, ``W``'s columns weigh by the steps
    each group trained in the ``H`` steps before its message was taken (`_paced_rows`), and the end weighs the groups
    by ``merge`` and the steps each trained since the start."""
    anchor = {k: v.clone() for k, v in initial.items()}
    opt = Outer(**OUTERS["fedavg"])
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    syncs: list[Sync] = []
    groups_before: dict[int, list[Tensor]] = {}
    in_flight: dict[int, list[Tensor]] = {}  # landing step -> every group's message
    counted: dict[int, list[int]] = {}  # landing step -> the steps each group trained before its message
    flat = _flattener(initial)
    trained_in = None if paced is None else _trained_in(paced, sync_every, len(groups))

    def messages(keys: list[str], taken: int, landing: int) -> list[Tensor]:
        if trained_in is not None:
            counted[landing] = trained_in(max(0, taken - sync_every), taken)
        sent = [flat(g.weights(), keys) for g in groups]
        if roundtrip is None:
            return sent
        reference = flat(anchor, keys)
        return [roundtrip(m - reference) for m in sent]

    for step in range(max_steps):
        groups_before[step] = [torch.cat([v.reshape(-1) for v in g.weights().values()]) for g in groups]
        for g, group in enumerate(groups):
            if paced is None or step % sync_every < paced(step // sync_every)[g]:
                group.train_step(step)
        done = step + 1
        if done % every == 0:
            keys = parts[_landing_fragment(done, every, len(parts))]
            sent = in_flight.pop(done) if sync_delay else messages(keys, done, done)
            matrix = mixing((done - 1) // sync_every).double()
            uniform = torch.equal(matrix, torch.full_like(matrix, 1.0 / len(groups)))
            if trained_in is not None:
                matrix = _paced_rows(matrix, counted.pop(done))
            for i, g in enumerate(groups):
                mixed = sum(float(matrix[i, j]) * m.double() for j, m in enumerate(sent))
                g.load(_unflat(g.weights(), keys, flat(g.weights(), keys).double() + mixed - sent[i].double()))
            if uniform:
                mean = sum(float(matrix[0, j]) * m.double() for j, m in enumerate(sent))
                base = torch.zeros_like(mean) if roundtrip is None else flat(anchor, keys).double()
                anchor.update(_unflat(anchor, keys, base + mean))
                anchors[done] = _copy(anchor)
        landing = done + sync_delay
        if sync_delay and landing % every == 0 and landing <= max_steps:
            in_flight[landing] = messages(parts[_landing_fragment(landing, every, len(parts))], done, landing)
    if max_steps > 0:
        weights = None if trained_in is None else _pace_weights(trained_in(0, max_steps), merge)
        for f, keys in enumerate(parts):
            outer_grad = _outer_step(anchor, opt, [g.weights() for g in groups], keys, weights)
            syncs.append(Sync(max_steps, f, "final", outer_grad))
            for g in groups:
                g.load(_slice(anchor, keys, clone=True))
        anchors[max_steps] = _copy(anchor)
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before, "syncs": syncs}


def _flattener(initial: dict[str, Tensor]) -> Callable[[dict[str, Tensor], list[str]], Tensor]:
    """Flatten a fragment's tensors in float32, in the order of ``initial`` (the shards' order)."""
    order = list(initial)

    def flat(weights: dict[str, Tensor], keys: list[str]) -> Tensor:
        return torch.cat([weights[k].detach().reshape(-1).float() for k in order if k in keys])

    return flat


def _unflat(like: dict[str, Tensor], keys: list[str], values: Tensor) -> dict[str, Tensor]:
    """The fragment's tensors of ``values`` (laid out as `_flattener` does), in ``like``'s shapes and dtypes."""
    out, offset = {}, 0
    for k in like:
        if k in keys:
            n = like[k].numel()
            out[k] = values[offset : offset + n].reshape(like[k].shape).to(like[k].dtype)
            offset += n
    return out


def _federate_eager(
    initial: dict[str, Tensor],
    groups: Sequence[Group],
    parts: list[list[str]],
    every: int,
    outer: str,
    max_steps: int,
    hierarchical: dict[int, int] | None = None,
    sites: list[list[int]] | None = None,
    sampled: Callable[[int], list[int]] | None = None,
    pace: tuple[Callable[[int], Sequence[int]], int, str] | None = None,
) -> dict[str, object]:
    """Eager updates: fragment ``f`` syncs after every step ``s`` with ``(s / K - 1) % P == f``; group g keeps the
    weights ``start_g`` it began the fragment's round from, and at the sync

    - its pseudo-gradient is ``d_g = start_g - local_g``;
    - the mean of the ``d_g`` of the fragment's previous round (summed meanwhile) lands: the outer optimizer steps the
      one shared anchor on it;
    - the group starts the next round from ``anchor - lr * d_g / G`` (its own share of the mean now in flight).

    At the end every fragment lands what it has in flight and, if it trained since its last sync, takes one more
    synchronous outer step on the mean of ``d_g``; every group then holds the anchor.

    With ``sampled`` (``step -> group indices``) a sync's mean in flight runs over the groups sampled at that sync, of
    which there are ``k``: they start from ``anchor - lr * d_g / k``, the others from the anchor. The end takes every
    group.

    With ``pace`` (``(paced, H, merge)`` as `federate` takes them) group ``g`` trains the first ``paced(r)[g]`` steps
    of each round of ``H`` steps; a sync's mean in flight is ``sum_g w_g d_g`` over its groups, with ``w_g`` from the
    steps each trained since the fragment's last sync (`_pace_weights`), and a group starts from
    ``anchor - lr * w_g * d_g``, its term of that mean. The end weighs every group the same way.

    With ``hierarchical`` levels, after every step (and its sync, if any) the sites of the level that decides the step,
    if below the whole federation, take the plain mean of their weights and of the ``start_g`` of the fragments that
    synced at least once (where each group began its round).
    """
    anchor = {k: v.clone() for k, v in initial.items()}
    outers = [Outer(**OUTERS[outer]) for _ in parts]
    lr = OUTERS[outer]["lr"]
    starts = [_copy(anchor) for _ in groups]
    in_flight: dict[int, dict[str, Tensor]] = {}
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    groups_before: dict[int, list[Tensor]] = {}
    syncs: list[Sync] = []
    last_sync = [0] * len(parts)
    counts = [[0] * len(parts) for _ in groups]  # per group and fragment: steps trained since its last sync

    def weights(chosen: list[int], f: int) -> list[float]:
        if pace is None:
            return [1.0 / len(chosen)] * len(chosen)
        return _pace_weights([counts[g][f] for g in chosen], pace[2])

    for step in range(max_steps):
        groups_before[step] = [torch.cat([v.reshape(-1) for v in g.weights().values()]) for g in groups]
        for g, group in enumerate(groups):
            if pace is None or step % pace[1] < pace[0](step // pace[1])[g]:
                group.train_step(step)
                counts[g] = [c + 1 for c in counts[g]]
        done = step + 1
        if done % every == 0:
            f = _landing_fragment(done, every, len(parts))
            deltas = [{k: start[k] - g.weights()[k] for k in parts[f]} for start, g in zip(starts, groups)]
            if f in in_flight:
                mean = in_flight.pop(f)
                outers[f].step(anchor, mean)
                syncs.append(Sync(done, f, "landing", mean))
            chosen = sampled(done) if sampled is not None else list(range(len(groups)))
            w = dict(zip(chosen, weights(chosen, f)))
            if pace is None:
                in_flight[f] = {k: torch.stack([deltas[g][k] for g in chosen]).mean(0) for k in parts[f]}
            else:
                in_flight[f] = {k: sum(w[g] * deltas[g][k] for g in chosen) for k in parts[f]}  # type: ignore[misc]
            for g, (start, group, delta) in enumerate(zip(starts, groups, deltas)):
                if g in chosen and pace is None:
                    start.update({k: anchor[k] - lr * delta[k] / len(chosen) for k in parts[f]})
                elif g in chosen:
                    start.update({k: anchor[k] - lr * w[g] * delta[k] for k in parts[f]})
                else:  # left out of the sample: no share of the mean in flight
                    start.update({k: anchor[k].clone() for k in parts[f]})
                group.load(_slice(start, parts[f], clone=True))
            for g in range(len(groups)):
                counts[g][f] = 0
            last_sync[f] = done
            anchors[done] = _copy(anchor)
        if hierarchical is not None:
            synced = [k for f, keys in enumerate(parts) if last_sync[f] for k in keys]
            trained_in = None if pace is None else _trained_in(pace[0], pace[1], len(groups))
            _site_means(groups, hierarchical, sites, done, starts, synced, trained_in)
    for f, keys in enumerate(parts):
        deltas = [{k: start[k] - g.weights()[k] for k in keys} for start, g in zip(starts, groups)]
        if f in in_flight:
            mean = in_flight.pop(f)
            outers[f].step(anchor, mean)
            syncs.append(Sync(max_steps, f, "landing", mean))
        if last_sync[f] != max_steps:
            if pace is None:
                mean = {k: torch.stack([d[k] for d in deltas]).mean(0) for k in keys}
            else:
                w_all = weights(list(range(len(groups))), f)
                mean = {k: sum(c * d[k] for c, d in zip(w_all, deltas)) for k in keys}  # type: ignore[misc]
            outers[f].step(anchor, mean)
            syncs.append(Sync(max_steps, f, "final", mean))
        for g in groups:
            g.load(_slice(anchor, keys))
    anchors[max_steps] = _copy(anchor)
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before, "syncs": syncs}


def _check_fragments(names: list[str], fragments: list[list[str]] | None) -> list[list[str]]:
    if fragments is None:
        return [names]
    parts = [[k.removeprefix("net.") if k not in names else k for k in part] for part in fragments]
    flat = [k for part in parts for k in part]
    if any(not part for part in parts) or sorted(flat) != sorted(names):
        raise ValueError(f"`fragments` must split the names {names} into non-empty disjoint parts, got {fragments}.")
    return parts


def _check_schedule(sync_every: int, num_fragments: int, sync_delay: int, merge_alpha: float, final: str) -> int:
    if sync_every < 1 or sync_every % num_fragments:
        raise ValueError(f"`sync_every={sync_every}` must be a positive multiple of {num_fragments} fragments.")
    every = sync_every // num_fragments
    if not 0 <= sync_delay < every:
        raise ValueError(f"`sync_delay={sync_delay}` must lie in [0, {every}).")
    if not 0 <= merge_alpha <= 1:
        raise ValueError(f"`merge_alpha={merge_alpha}` must lie in [0, 1].")
    if final not in ("sync", "reset"):
        raise ValueError(f"`final_landing={final!r}` must be 'sync' or 'reset'.")
    return every


def _landing_fragment(step: int, every: int, num_fragments: int) -> int:
    return (step // every - 1) % num_fragments


def _outer_step(
    anchor: dict[str, Tensor],
    opt: Outer,
    local: list[dict[str, Tensor]],
    keys: list[str],
    weights: list[float] | None = None,
) -> dict[str, Tensor]:
    """Step ``anchor`` on the keys of one fragment with the mean over groups of ``anchor - local``; return that mean.

    With ``weights`` (one per group) the mean is ``sum_g weights[g] (anchor - local_g)``.
    """
    if weights is None:
        delta = {k: anchor[k] - torch.stack([w[k] for w in local]).mean(0) for k in keys}
    else:
        delta = {k: sum(c * (anchor[k] - w[k]) for c, w in zip(weights, local)) for k in keys}  # type: ignore[misc]
    opt.step(anchor, delta)
    return delta


def _pace_weights(counts: list[int], merge: str) -> list[float]:
    """Each group's weight in a paced merge, from the steps each trained (see `federate`)."""
    total = sum(counts)
    if merge == "tokens":
        return [c / total for c in counts]
    mean = total / len(counts)
    return [0.0 if c == 0 else mean / c / len(counts) for c in counts]


def _merge(anchor: dict[str, Tensor], local: dict[str, Tensor], keys: list[str], alpha: float) -> dict[str, Tensor]:
    if alpha == 0:  # exactly the anchor, bit for bit (no 0 * (local - anchor) that could carry a NaN or a -0)
        return _slice(anchor, keys)
    return {k: anchor[k] + alpha * (local[k] - anchor[k]) for k in keys}


def _slice(weights: dict[str, Tensor], keys: list[str], clone: bool = False) -> dict[str, Tensor]:
    return {k: weights[k].detach().clone() if clone else weights[k] for k in keys}


def _copy(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in weights.items()}


def _inner_optimizer(net: nn.Module, inner: str, lr: float) -> torch.optim.Optimizer:
    if inner == "sgd":
        return torch.optim.SGD(net.parameters(), lr=lr)
    return torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


class NetGroup:
    """A federation group of the toy network: its ranks' micro-batches, its gradient is their mean."""

    def __init__(
        self,
        anchor: dict[str, Tensor],
        ranks: list[int],
        micro_batches: list[list[list[int]]],
        data: IndexedRegression,
        *,
        inner: str,
        lr: float,
        accumulate: int,
    ) -> None:
        self.net = make_net()
        self.net.load_state_dict(anchor)
        self.opt = _inner_optimizer(self.net, inner, lr)
        self.ranks, self.micro_batches, self.data, self.accumulate = ranks, micro_batches, data, accumulate

    def train_step(self, step: int) -> None:
        self.opt.zero_grad()
        for rank in self.ranks:
            for m in range(step * self.accumulate, (step + 1) * self.accumulate):
                idx = torch.tensor(self.micro_batches[rank][m])
                loss = loss_fn(self.net, self.data.x[idx], self.data.y[idx]) / (self.accumulate * len(self.ranks))
                loss.backward()
        self.opt.step()

    def weights(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.net.state_dict().items()}

    def load(self, weights: dict[str, Tensor]) -> None:
        self.net.load_state_dict(weights, strict=False)


def reference_run(
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
    fragments: list[list[str]] | None = None,
    sync_delay: int = 0,
    merge_alpha: float = 0.0,
    final_landing: FinalLanding = "sync",
    eager: bool = False,
    hierarchical: dict[int, int] | None = None,
    sites: list[list[int]] | None = None,
    mixing: Callable[[int], Tensor] | None = None,
    participants: Callable[[int], list[int]] | None = None,
    roundtrip: Callable[[Tensor], Tensor] | None = None,
    paced: Callable[[int], Sequence[int]] | None = None,
    merge: str = "tokens",
) -> dict[str, object]:
    """``micro_batches[rank]`` lists the sample indices of every micro-batch that rank trained on, in order.

    ``fragments`` names the parameters per fragment, with or without the LightningModule's ``net.`` prefix; the
    schedule options are those of `federate`. Without them this is the plain algorithm (one sync of everything every
    ``sync_every`` steps and at the last step). Returns the anchor after every outer step (by optimizer step), the
    final consensus, each group's weights before every step and every `Sync` (see `federate`).
    """
    data = IndexedRegression()
    anchor = {k.removeprefix("net."): v.clone().double().float() for k, v in initial.items()}
    nets = [NetGroup(anchor, ranks, micro_batches, data, inner=inner, lr=lr, accumulate=accumulate) for ranks in groups]
    return federate(
        anchor,
        nets,
        sync_every=sync_every,
        outer=outer,
        max_steps=max_steps,
        fragments=fragments,
        sync_delay=sync_delay,
        merge_alpha=merge_alpha,
        final_landing=final_landing,
        eager=eager,
        hierarchical=hierarchical,
        sites=sites,
        mixing=mixing,
        participants=participants,
        roundtrip=roundtrip,
        paced=paced,
        merge=merge,
    )


def roundtrip_of(codec: Any) -> Callable[[Tensor], Tensor]:
    """A codec's encode-then-decode of one flat float32 vector (what a partner reads of a message), by its public API.

    A float codec casts; a chunk codec pads the vector to whole blocks, writes it as one piece and reads it back.
    """

    def roundtrip(values: Tensor) -> Tensor:
        if hasattr(codec, "torch_dtype"):
            return values.to(codec.torch_dtype).float()
        padded = codec.padded_length(values.numel(), 1)
        buffer = torch.cat([values, values.new_zeros(padded - values.numel())])
        return codec.decode_pieces(codec.encode_pieces(buffer, 1), padded).reshape(-1)[: values.numel()]

    return roundtrip
