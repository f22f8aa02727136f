"""The one model a federated strategy holds: wrapped once, every process starting from the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_fedshard.core.backends.sharding import UNSHARDED
from lightning_fedshard.federated_model import FederatedModel


class _Mesh:
    """Records what would be broadcast from the first rank."""

    def __init__(self) -> None:
        self.broadcast: list[tuple[str, int]] = []

    def broadcast_shards(self, shards: list[torch.Tensor]) -> None:
        self.broadcast.append(("shards", len(shards)))

    def broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.broadcast.append(("buffers", len(buffers)))


def _model() -> tuple[FederatedModel, _Mesh]:
    mesh = _Mesh()
    model: Any = mesh
    return FederatedModel(UNSHARDED, "fl_fsdp", lambda: model), mesh


def test_the_model_is_wrapped_once_and_its_weights_and_buffers_broadcast():
    model, mesh = _model()
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    assert model.wrap(net, lambda m: m) is net and model.holds(net[0]) and model.wrapped
    assert mesh.broadcast == [("shards", 4), ("buffers", 3)]
    assert model.wrap(net, lambda m: m) is net and len(mesh.broadcast) == 2  # set up again: kept as it is
    with pytest.raises(RuntimeError, match="`fl_fsdp` federates one model, and one was set up already"):
        model.wrap(torch.nn.Linear(1, 1), lambda m: m)
    model.release()
    assert not model.wrapped and model.optimizers == []


def test_a_skipped_group_restarts_its_optimizers_and_fragments_name_their_parameters():
    model, _ = _model()
    net = model.wrap(torch.nn.Linear(2, 3), lambda m: m)
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    model.set_optimizers([optimizer])
    model.restart_optimizers()
    assert not optimizer.state
    assert model.fragment_parameter_names([[0], [1]]) == [["weight"], ["bias"]]
    assert model.fragment_summary([[0, 1]]) == "0: units 0-1, 9 local values, 2 parameter(s) from 'weight'"
