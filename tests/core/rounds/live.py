"""Elastic federations in one process: threads whose groups an elastic communicator's view relabels.

Thread ``t`` runs the live group ``labels[t]`` of the planned ones; the participants of a sync are the live groups in
ring order; a group that replaces another took the federation's state (the anchor) and joins a sync, adding nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard import Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups


class Live:
    """One thread's communicator as an elastic federation shows it: live groups that change at optimizer steps.

    Args:
        inner: The thread's communicator (the sums meet over every thread).
        thread: The thread's index.
        labels: ``(first step, live groups in ring order)`` pairs, ascending: from that step on, thread ``t`` runs
            group ``live[t]``.
        joined_at: By group, the optimizer step after which the sync it joins (adding nothing) begins.
        sites: With sites, sums over a site as an elastic communicator does: a row per planned site of the size,
            summed over the whole ring; this group keeps its site's.
        planned: The planned groups.
    """

    def __init__(
        self,
        inner: Any,
        thread: int,
        labels: list[tuple[int, tuple[int, ...]]],
        joined_at: dict[int, int] | None = None,
        sites: list[list[int]] | None = None,
        planned: int = 4,
    ) -> None:
        self.inner, self.thread, self.labels, self.joined_at = inner, thread, labels, joined_at or {}
        self.sites, self.planned = sites, planned
        self.sums_sites_on_fed_ring = sites is not None
        self.step = 0
        self.asked: dict[int, int] = {}  # optimizer step -> times the participants were asked
        self.on_participants: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def live(self) -> tuple[int, ...]:
        return [live for first, live in self.labels if first <= self.step][-1]

    @property
    def group_index(self) -> int:
        return self.live()[self.thread]

    def participants(self) -> tuple[int, ...]:
        self.asked[self.step] = self.asked.get(self.step, 0) + 1
        if self.on_participants is not None:
            self.on_participants()
        return self.live()

    def joined(self) -> bool:
        return self.joined_at.get(self.group_index) == self.step

    def sum_over_site(self, tensor: Tensor, size: int) -> None:
        """A row per planned site of ``size`` groups, summed over the whole ring; this group keeps its site's."""
        sites = self.sites if self.sites is not None and size == len(self.sites[0]) else None
        blocks = Hierarchical({1: size, 2: self.planned}, sites=sites).blocks(size, self.planned)
        (row,) = [i for i, block in enumerate(blocks) if self.group_index in block]
        rows = torch.zeros(len(blocks), tensor.numel())
        rows[row] = tensor.reshape(-1)
        self.inner.sum_over_groups(rows.view(-1))
        tensor.copy_(rows[row].view_as(tensor))


def update(g: int, step: int, shards: list[Tensor]) -> None:
    """Group ``g``'s optimizer step ``step``, in place: a pull towards its own target plus a push."""
    for u, shard in enumerate(shards):
        shard.sub_(0.3 * (shard - (g + 1) * (u + 1)) - 0.05 * float(torch.tensor(step + g).sin()))


def run_live(
    config: FederationConfig,
    labels: list[tuple[int, tuple[int, ...]]],
    joined_at: dict[int, int],
    steps: int,
    sites: list[list[int]] | None = None,
    stop_at: int | None = None,
    resume: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every thread trains by `update` for ``steps`` steps; a thread whose group changes at a label's first step
    takes the anchor (the federation's state) there. Per thread: its weights after every step, the statistics of
    every sync that landed, the final weights and anchor; or, with ``stop_at``, its state after that step."""
    first = 1 if resume is None else resume[0]["step"] + 1
    relabelled = {start: [t for t, (a, b) in enumerate(zip(labels[0][1], live)) if a != b] for start, live in labels}

    def work(t: int, comm: Any) -> dict[str, Any]:
        view = Live(comm, t, labels, joined_at, sites)
        shards = [torch.full((2,), float(u)) for u in range(3)]
        fed = Federation(config, view)
        fed.groups_may_join = True
        fed.start(shards, step=0)
        if resume is not None:
            for shard, saved in zip(shards, resume[t]["shards"]):
                shard.copy_(saved)
            fed.load_state_dict(resume[t]["state"])
            fed.load_group_state_dict(resume[t]["group"])
        history, landed = {}, {}
        for step in range(first, steps + 1):
            view.step = step
            if t in relabelled.get(step, ()):  # the new group took the federation's state
                fed.outer.copy_anchor_to_shards()
            update(view.group_index, step, shards)
            stats = fed.maybe_sync(step)
            if stats is not None:
                landed[step] = stats
            history[step] = [s.clone() for s in shards]
            if step == stop_at:
                saved = {"state": fed.state_dict(), "group": fed.group_state_dict(), "shards": history[step]}
                return {**saved, "step": step}
        fed.finish(steps)
        return {"history": history, "landed": landed, "final": [s.clone() for s in shards], "anchor": fed.outer.anchor}

    return InProcessGroups(len(labels[0][1])).run(work)


def assert_resumed_exactly(straight: list[dict[str, Any]], resumed: list[dict[str, Any]], stop_at: int) -> None:
    """Bit for bit: every thread's weights after every step from ``stop_at + 1`` on, its final weights and anchor."""
    for a, b in zip(straight, resumed):
        for step in sorted(a["history"]):
            if step > stop_at:
                assert all(torch.equal(x, y) for x, y in zip(a["history"][step], b["history"][step])), step
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))
        assert all(torch.equal(x, y) for x, y in zip(a["anchor"], b["anchor"]))
    assert all(torch.equal(x, y) for x, y in zip(straight[0]["final"], straight[1]["final"]))  # the consensus
