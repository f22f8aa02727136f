"""Groups of a few named tensors that train by a given rule: the reference's view of the groups a test runs."""

from __future__ import annotations

from collections.abc import Callable

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
