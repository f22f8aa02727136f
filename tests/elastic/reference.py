"""An independent single-process reference of an elastic federation whose groups come and go.

One full copy of the toy network per round and contributing group, no package code: what a run recorded as the groups
of each sync (who took part, who joined, whether it was lost) is replayed with hand-written FedAvg:

- a group's round starts from the anchor of the last committed sync it took part in, or of the sync it joined at: a
  lost sync leaves the anchor and every group's weights as they were, so the next committed sync sums the training of
  both rounds;
- in the round, a group takes SGD steps on its own part of the data: rank ``r`` of group ``g`` (``W`` ranks per group,
  ``G`` planned groups) reads batch ``t`` of a shuffling ``DistributedSampler`` with ``num_replicas = G * W`` and
  ``rank = g * W + r``, whatever job runs the group - the data follows the optimizer step; the group's gradient is the
  mean of its ranks'; the learning rate is the cosine schedule of step ``t``;
- a committed sync averages ``anchor - weights`` over the groups that took part and did not join at that sync, and the
  anchor takes that step (FedAvg: outer SGD with learning rate 1); groups that joined add nothing;
- with sampled participation (``groups_per_round``, ``seed``) only the groups at the round's sampled positions among
  the sync's groups (in ring order) add: ``randperm`` of ``torch.Generator`` seeded ``seed * 1_000_003 + round``, the
  first ``groups_per_round`` positions, where the sync after step ``s`` is of round ``(s - 1) // sync_every``.

With eager updates (one fragment, the share rule; :func:`replay_eager`) a group's round starts from its own start: the
sum that starts at a sync adds ``start - weights`` over its contributors (its groups less those that joined then) and
divides by them, each contributor starts the next round at ``anchor - own / contributors`` and a group that joined at
the anchor; the sum lands a sync later unless that sync is lost (the anchor then stays, and the new sum starts all the
same). The consensus after a sync is the anchor once the sum in flight has landed.

With sites (:func:`replay_sites`, one rank per group) a group's round starts from what it held after the previous sync;
at a site sync (the largest period of ``levels`` dividing the step averages fewer groups than planned) each site's
groups that took part and did not join take the plain mean of their weights, a joining group takes its site's mean (or
keeps the anchor it healed when no group of its site adds), and the anchor stays; the outer step is FedAvg as above,
after which every group holds the anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

from tests.toy import IndexedRegression, loss_fn, make_net


def cosine_lr(step: int, total: int, base: float = 0.05) -> float:
    return base * 0.5 * (1 + math.cos(math.pi * step / total))


def group_batches(group: int, num_groups: int, ranks: int, steps: int, batch: int = 4) -> list[list[list[int]]]:
    """``[step][rank]`` -> sample indices that rank ``rank`` of group ``group`` reads at each step."""
    data = IndexedRegression()
    order = []
    for rank in range(ranks):
        sampler = DistributedSampler(data, num_replicas=num_groups * ranks, rank=group * ranks + rank, shuffle=True,
                                     seed=0)  # fmt: skip
        sampler.set_epoch(0)
        order.append(list(sampler))
    return [[order[r][t * batch : (t + 1) * batch] for r in range(ranks)] for t in range(steps)]


def initial_weights(seed: int = 0) -> dict[str, Tensor]:
    torch.manual_seed(seed)
    return {f"net.{k}": v.detach().clone() for k, v in make_net().state_dict().items()}


def _train_round(weights: dict[str, Tensor], batches: list[list[list[int]]], lrs: list[float]) -> dict[str, Tensor]:
    """SGD steps from ``weights``: one per entry of ``batches`` (each a list of the group's ranks' batches)."""
    data = IndexedRegression()
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v.clone() for k, v in weights.items()})
    for per_rank, lr in zip(batches, lrs):
        grads = None
        for indices in per_rank:
            net.zero_grad()
            x = torch.stack([data[i][1] for i in indices])
            y = torch.stack([data[i][2] for i in indices])
            loss_fn(net, x, y).backward()
            step = [p.grad.clone() for p in net.parameters()]
            grads = step if grads is None else [a + b for a, b in zip(grads, step)]
        with torch.no_grad():
            for p, g in zip(net.parameters(), grads):
                p -= lr * g / len(per_rank)
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def timeline(records: list[list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """One entry per sync step from the records of several groups, which must agree where they overlap."""
    merged: dict[int, dict[str, Any]] = {}
    for record in records:
        for sync in record:
            seen = {k: sync[k] for k in ("step", "members", "joined", "lost")}
            if sync["step"] in merged:
                assert merged[sync["step"]] == seen, (merged[sync["step"]], seen)
            merged[sync["step"]] = seen
    return merged


def sampled_positions(groups_per_round: int, seed: int, round: int, members: int) -> list[int]:
    """The positions among ``members`` groups that sampled participation draws for round ``round``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + round)
    return sorted(torch.randperm(members, generator=generator)[:groups_per_round].tolist())


def _paced_steps(speeds: Sequence[float], group: int, period: int) -> int:
    return min(period, max(1, round(period * speeds[group] / max(speeds))))


def replay(
    syncs: dict[int, dict[str, Any]],
    num_groups: int,
    ranks: int,
    total: int,
    initial: dict[str, Tensor],
    sampled: tuple[int, int] | None = None,
    sync_every: int = 4,
    paced: Sequence[float] | None = None,
) -> dict[int, dict[str, Tensor]]:
    """The anchor after every committed sync of the timeline ``syncs`` (see `timeline`); every group starts at 0.

    ``sampled``: ``(groups_per_round, seed)`` of sampled participation, whose rounds are ``sync_every`` steps long.
    ``paced``: the planned groups' speeds of a per-group pace: in every round group ``g`` trains the first
    ``clamp(round(sync_every v_g / max v), 1, sync_every)`` steps (a skipped step passes its batch and learning rate),
    and the merge weighs each contributor by the steps it trained.
    """
    anchor = {k: v.clone() for k, v in initial.items()}
    batches = {g: group_batches(g, num_groups, ranks, total) for g in range(num_groups)}
    lrs = [cosine_lr(t, total) for t in range(total)]
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    previous = 0
    start: dict[int, int] = {}  # the step each group's round started at, from the anchor
    last_sync = 0  # of any sync, lost or not: a pace weighs by the steps trained since
    for step in sorted(syncs):
        sync = syncs[step]
        start.update(dict.fromkeys(sync["joined"], step))  # healed to the anchor at this sync
        members = sync["members"]
        if sampled is not None:
            members = [members[p] for p in sampled_positions(*sampled, (step - 1) // sync_every, len(members))]
        contributors = [g for g in members if g not in sync["joined"]]
        if sync["lost"]:  # the round carries on to the next sync
            last_sync = step
            continue
        if step == previous or not contributors:
            start.update(dict.fromkeys(sync["members"], step))
            previous = last_sync = step
            continue
        deltas, counts = [], []
        for g in contributors:
            trained = [
                t
                for t in range(start.get(g, previous), step)
                if paced is None or t % sync_every < _paced_steps(paced, g, sync_every)
            ]
            weights = _train_round(anchor, [batches[g][t] for t in trained], [lrs[t] for t in trained])
            deltas.append({k: anchor[k] - weights[k] for k in anchor})
            counts.append(len([t for t in trained if t >= last_sync]))
        shares = [c / sum(counts) if paced is not None else 1.0 / len(deltas) for c in counts]
        anchor = {k: anchor[k] - sum(share * d[k] for share, d in zip(shares, deltas)) for k in anchor}
        anchors[step] = _copy(anchor)
        start.update(dict.fromkeys(sync["members"], step))
        previous = last_sync = step
    return anchors


def replay_eager(
    syncs: dict[int, dict[str, Any]], num_groups: int, ranks: int, total: int, initial: dict[str, Tensor]
) -> dict[int, dict[str, Tensor]]:
    """The consensus after every sync of the timeline ``syncs`` with eager updates and FedAvg (see the module).

    ``syncs[step]``: ``members`` and ``joined`` of the sum that started then, ``lost``: whether the sum that landed then
    was lost. Every group starts at 0 from ``initial``; a group trains from the sync it is a member of to the next.
    """
    anchor = _copy(initial)
    batches = {g: group_batches(g, num_groups, ranks, total) for g in range(num_groups)}
    lrs = [cosine_lr(t, total) for t in range(total)]
    starts = {g: _copy(anchor) for g in syncs[min(syncs)]["members"]}
    consensus: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    in_flight: dict[str, Tensor] | None = None
    previous = 0
    for step in sorted(syncs):
        sync = syncs[step]
        own = {}
        for g in sync["members"]:
            if g not in sync["joined"]:
                weights = _train_round(starts[g], batches[g][previous:step], lrs[previous:step])
                own[g] = {k: starts[g][k] - weights[k] for k in anchor}
        if in_flight is not None and not sync["lost"]:
            anchor = {k: anchor[k] - in_flight[k] for k in anchor}
        in_flight = {k: sum(d[k] for d in own.values()) / len(own) for k in anchor}
        starts = {g: _copy(anchor) for g in sync["members"]}
        for g, d in own.items():
            starts[g] = {k: anchor[k] - d[k] / len(own) for k in anchor}
        consensus[step] = {k: anchor[k] - in_flight[k] for k in anchor}
        previous = step
    return consensus


def replay_sites(
    syncs: dict[int, dict[str, Any]],
    num_groups: int,
    total: int,
    initial: dict[str, Tensor],
    levels: dict[int, int],
    sites: list[list[int]],
) -> dict[int, dict[str, Tensor]]:
    """The anchor after every committed outer step of ``syncs``, with site syncs between them.

    ``levels``: ``{period: groups}``; ``sites``: the planned groups of each site of the level below the federation.
    """
    anchor = _copy(initial)
    held = {g: _copy(initial) for g in range(num_groups)}  # what each group holds after the last sync
    batches = {g: group_batches(g, num_groups, 1, total) for g in range(num_groups)}
    lrs = [cosine_lr(t, total) for t in range(total)]
    anchors: dict[int, dict[str, Tensor]] = {0: _copy(anchor)}
    previous = 0
    for step in sorted(s for s in syncs if s > 0):
        sync = syncs[step]
        members, joined = sync["members"], sync["joined"]
        if sync["lost"]:  # every group goes back to the anchor
            held = {g: _copy(anchor) for g in range(num_groups)}
            previous = step
            continue
        trained = {
            g: _copy(anchor) if g in joined else _train_round(held[g], batches[g][previous:step], lrs[previous:step])
            for g in members
        }
        size = levels[max(p for p in levels if step % p == 0)]
        if size < num_groups:  # a site sync
            for site in sites:
                adding = [g for g in site if g in members and g not in joined]
                for g in site:
                    if g in members:
                        held[g] = _mean([trained[a] for a in adding]) if adding else trained[g]
        else:
            adding = [g for g in members if g not in joined]
            if adding:
                anchor = {k: anchor[k] - sum(anchor[k] - trained[g][k] for g in adding) / len(adding) for k in anchor}
            held = {g: _copy(anchor) for g in range(num_groups)}
            anchors[step] = _copy(anchor)
        previous = step
    return anchors


def replay_gossip(
    syncs: dict[int, dict[str, Any]],
    num_groups: int,
    total: int,
    initial: dict[str, Tensor],
    matrix: Any,
    sync_every: int = 4,
) -> tuple[dict[int, dict[int, dict[str, Tensor]]], dict[str, Tensor]]:
    """Every group's weights after every mix of ``syncs``, and the final consensus (one rank per group, float32).

    ``matrix(round, n)``: the mixing matrix of round ``round`` over ``n`` live groups, by position in ring order. A
    committed mix gives group at position ``p`` the weights ``sum_q W_pq theta_q`` (a group that joined then adds
    nothing: its column is left out and every row renormalized; alone in its row it keeps the anchor it healed); a
    lost one changes nothing. The end of training is the plain mean over the groups of the last sync.
    """
    held = {g: _copy(initial) for g in range(num_groups)}
    batches = {g: group_batches(g, num_groups, 1, total) for g in range(num_groups)}
    lrs = [cosine_lr(t, total) for t in range(total)]
    after: dict[int, dict[int, dict[str, Tensor]]] = {}
    previous = 0
    members: list[int] = []
    for step in sorted(s for s in syncs if s > 0):
        sync = syncs[step]
        members, joined = sync["members"], sync["joined"]
        trained = {
            g: _copy(initial) if g in joined else _train_round(held[g], batches[g][previous:step], lrs[previous:step])
            for g in members
        }
        if sync["lost"]:
            held.update(trained)
        else:
            weights = matrix((step - 1) // sync_every, len(members)).double()
            weights[:, [p for p, g in enumerate(members) if g in joined]] = 0.0
            for p, g in enumerate(members):
                total_weight = float(weights[p].sum())
                if total_weight == 0:
                    held[g] = trained[g]
                    continue
                held[g] = {
                    k: sum(float(weights[p, q]) / total_weight * trained[h][k].double() for q, h in enumerate(members))
                    .to(initial[k].dtype)
                    for k in initial
                }  # fmt: skip
        after[step] = {g: _copy(held[g]) for g in members}
        previous = step
    last = {g: _train_round(held[g], batches[g][previous:total], lrs[previous:total]) for g in members}
    final = {k: sum(last[g][k].double() for g in members) / len(members) for k in initial}
    return after, {k: v.to(initial[k].dtype) for k, v in final.items()}


def _mean(weights: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: sum(w[k] for w in weights) / len(weights) for k in weights[0]}


def _copy(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in weights.items()}


__all__ = [
    "cosine_lr",
    "group_batches",
    "initial_weights",
    "replay",
    "replay_eager",
    "replay_gossip",
    "replay_sites",
    "sampled_positions",
    "timeline",
]
