"""A tiny regression model and data set whose samples carry their index, so tests know who saw what."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

IN, HIDDEN, OUT = 6, 10, 3


def make_net(hidden: int | None = None) -> nn.Sequential:
    h = hidden or HIDDEN
    return nn.Sequential(nn.Linear(IN, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, OUT))


def loss_fn(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(net(x), y)


class IndexedRegression(Dataset):
    def __init__(self, n: int = 512, seed: int = 123) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN, generator=g)
        w = torch.randn(IN, OUT, generator=g)
        self.y = torch.sin(self.x @ w) + 0.1 * torch.randn(n, OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, Tensor, Tensor]:
        return i, self.x[i], self.y[i]
