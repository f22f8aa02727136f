"""Mixes in an elastic federation: a matrix over the live groups by ring position, a joining group renormalized out."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard import Gossip
from lightning_fedshard.core.config import FederationConfig
from tests.core.rounds.live import assert_resumed_exactly, run_live, update

PLANNED, SYNC_EVERY, STEPS = 4, 4, 14
#: Groups (0, 1, 2) until group 1 is gone before step 6; group 3 takes its thread (healed: the anchor).
LABELS = [(0, (0, 1, 2)), (6, (0, 3, 2))]


def _config(**options: Any) -> FederationConfig:
    return FederationConfig(
        num_groups=PLANNED, sync_every=SYNC_EVERY, outer_topology=Gossip(peers=1, seed=4), reduce_dtype="float32",
        **options,
    )  # fmt: skip


def _run(sync_delay: int, **kwargs: Any) -> list[dict[str, Any]]:
    return run_live(_config(sync_delay=sync_delay), LABELS, {3: 8 - sync_delay}, STEPS, **kwargs)


def _reference(sync_delay: int) -> tuple[dict[int, list[Tensor]], Tensor]:
    """Every thread's weights after every step, and the final consensus, computed here in float64.

    At a landing after step ``s`` the messages are the weights after ``s - sync_delay``; the matrix is Gossip's for
    the number of live groups, by position; a group that joined at the sync sends nothing, every row is renormalized
    over the others, and the joining group takes its row's mix (or keeps the anchor when its row has no one else).
    Each other group adds ``sum_q W_pq m_q - m_p``. The end is the plain mean over the live groups.
    """
    topology = Gossip(peers=1, seed=4)
    anchor = [torch.full((2,), float(u), dtype=torch.float64) for u in range(3)]
    held = [[a.clone() for a in anchor] for _ in range(3)]
    history: dict[int, list[Tensor]] = {}
    messages: list[list[Tensor]] | None = None
    joining: set[int] = set()
    for step in range(1, STEPS + 1):
        live = [groups for first, groups in LABELS if first <= step][-1]
        for t, g in enumerate(live):
            if step == 6 and t == 1:
                held[t] = [a.clone() for a in anchor]
            update(g, step, held[t])
        start = step + sync_delay
        if start % SYNC_EVERY == 0 and sync_delay == 0:
            messages, joining = (
                [[w.clone() for w in ws] for ws in held],
                {t for t, g in enumerate(live) if g == 3 and step == 8},
            )
        if step % SYNC_EVERY == 0:
            assert messages is not None
            matrix = topology.weights((step - 1) // SYNC_EVERY, len(live)).clone()
            for q in joining:
                matrix[:, q] = 0.0
            for p in range(len(live)):
                total = matrix[p].sum()
                if total > 0:
                    matrix[p] /= total
            for p in range(len(live)):
                if matrix[p].sum() == 0:
                    continue  # a joining group alone in its row keeps the anchor
                mixed = [sum(float(matrix[p, q]) * messages[q][u] for q in range(len(live))) for u in range(3)]
                base = (
                    [torch.zeros(2, dtype=torch.float64)] * 3
                    if p in joining
                    else [h - m for h, m in zip(held[p], messages[p])]
                )
                held[p] = [b + m for b, m in zip(base, mixed)]
            messages = None
        if sync_delay and start % SYNC_EVERY == 0:
            messages = [[w.clone() for w in ws] for ws in held]
            joining = {t for t, g in enumerate(live) if g == 3 and step == 8 - sync_delay}
        history[step] = [torch.cat(ws) for ws in held]
    final = torch.stack([torch.cat(ws) for ws in held]).mean(0)
    return history, final


@pytest.mark.parametrize("sync_delay", [0, 1])
def test_a_gossip_among_the_live_groups_renormalizes_a_joining_group_out_and_equals_the_reference(sync_delay):
    history, final = _reference(sync_delay)
    results = _run(sync_delay)
    assert results[1]["landed"][8].joined_groups == (3,)  # group 3 joined the mix that landed at step 8
    assert Gossip(peers=1, seed=4).weights(1, 3)[1, 1] < 1  # and took its partner's weights there
    for t, result in enumerate(results):
        for step in range(1, STEPS + 1):
            assert_close(torch.cat(result["history"][step]).double(), history[step][t], rtol=0, atol=1e-5)
        assert_close(torch.cat(result["final"]).double(), final, rtol=0, atol=1e-5)


def test_a_mix_in_flight_while_the_live_groups_changed_resumes_exactly():
    straight = _run(1)
    saved = _run(1, stop_at=7)
    assert all(s["group"]["mix"]["participants"] == [0, 3, 2] for s in saved)  # a mix in flight, group 3 joined it
    assert_resumed_exactly(straight, _run(1, resume=saved), 7)
