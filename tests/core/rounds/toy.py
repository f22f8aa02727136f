"""Groups of a few named tensors that train by a given rule: the reference's view of the groups a test runs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Update = Callable[[int, int, list[Tensor]], list[Tensor]]


def initial(units: int) -> list[Tensor]:
    """Unit ``u`` starts at ``u`` (two values each)."""
    return [torch.full((2,), float(u)) for u in range(units)]


class ReferenceGroup:
    """One group as `tests.reference.federate` drives it: trains by ``update`` (group, 0-based step, weights)."""

    def __init__(self, g: int, update: Update, names: list[str]) -> None:
        self.g, self.update, self.names = g, update, names
        self.w = dict(zip(names, initial(len(names))))

    def train_step(self, step: int) -> None:
        self.w = dict(zip(self.names, self.update(self.g, step, list(self.w.values()))))

    def weights(self) -> dict[str, Tensor]:
        return self.w

    def load(self, weights: dict[str, Tensor]) -> None:
        self.w.update({k: v.clone() for k, v in weights.items()})


def start_or_resume(config: Any, comm: Any, shards: list[Tensor], saved: dict[str, Any] | None) -> tuple[Any, int]:
    """A federation started on ``shards``; with ``saved`` (a :func:`snapshot`) the shards and both states restored.

    Returns the federation and the first step to train.
    """
    from lightning_fedshard.core.federation import Federation

    fed = Federation(config, comm)
    fed.start(shards, step=0)
    if saved is None:
        return fed, 1
    for shard, value in zip(shards, saved["shards"]):
        shard.copy_(value)
    fed.load_state_dict(saved["state"])
    fed.load_group_state_dict(saved["group_state"])
    return fed, saved["step"] + 1


def snapshot(fed: Any, shards: list[Tensor], step: int) -> dict[str, Any]:
    """What a resume needs of one group after ``step``: its shards, its federation state and its group state."""
    state = {"state": copy.deepcopy(fed.state_dict()), "group_state": copy.deepcopy(fed.group_state_dict())}
    return {**state, "shards": [s.clone() for s in shards], "step": step}
