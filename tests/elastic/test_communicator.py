"""The elastic communicator's sums over a site (a row per planned site, summed over the whole fed ring), its seams.

No torchft here: the communicator is built but never connects, and its ring sum is replaced by the groups' sum.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.elastic import ElasticCommunicator

SITES = {2: ((0, 2), (1, 3))}


def _communicator(group: int) -> ElasticCommunicator:
    local = InProcessGroups(1).run(lambda g, c: c)[0]
    return ElasticCommunicator(Elastic(group=group), group, local, dict, site_blocks=SITES)


def test_a_site_sums_its_live_groups_in_its_row_of_one_sum_over_the_ring():
    live = (0, 1, 2)  # group 3 is gone
    tensors = {g: torch.full((2, 3), float(g + 1)) for g in live}
    sent: dict[int, Tensor] = {}
    communicators = {g: _communicator(g) for g in live}
    for g, communicator in communicators.items():
        communicator.sum_over_groups = lambda t, g=g: sent.__setitem__(g, t.clone())  # type: ignore[method-assign]
        communicator.sum_over_site(tensors[g].clone(), 2)  # records what goes on the ring
    for g in live:
        assert sent[g].shape == (2 * 6,)  # a [sites, numel] tensor: one row per site, the others zero
        rows = sent[g].view(2, 6)
        assert torch.equal(rows[g % 2], tensors[g].reshape(-1)) and not rows[1 - g % 2].any()
    total = sum(sent.values())
    for g, communicator in communicators.items():
        communicator.sum_over_groups = lambda t: t.copy_(total)  # type: ignore[method-assign]
        tensor = tensors[g].clone()
        communicator.sum_over_site(tensor, 2)
        assert torch.equal(tensor, torch.full((2, 3), 4.0 if g in (0, 2) else 2.0))  # 1 + 3; group 1 alone


def test_a_size_without_sites_is_refused():
    with pytest.raises(ValueError, match=r"has no sites of 4 groups \(it has \[2\]\)"):
        _communicator(0).sum_over_site(torch.zeros(2), 4)


def test_each_on_sum_hook_is_called_with_the_collectives_name_before_the_sum_starts():
    communicator = _communicator(0)
    calls: list[str] = []

    class Collectives:
        def sum(self, tensor: Tensor) -> None:
            calls.append("summed")

    communicator._collectives = Collectives()  # type: ignore[assignment]
    communicator.on_sum.extend([lambda name: calls.append(f"first {name}"), lambda name: calls.append(name)])
    communicator.sum_over_groups(torch.zeros(2))
    assert calls == ["first sum_over_groups", "sum_over_groups", "summed"]


def test_a_communicator_that_never_connected_has_no_heal_server():
    assert _communicator(0).heal_server is None
