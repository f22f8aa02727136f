"""Norms and inner products of large flat tensors, in float32 chunks, for the sync statistics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def nbytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors among ``values``."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, Tensor))


def dot(a: Tensor, b: Tensor, chunk: int = 1 << 24) -> float:
    """Inner product of two float tensors of the same size, in float32 chunks (for logging)."""
    x, y = a.reshape(-1), b.reshape(-1)
    return sum(
        float(torch.dot(x[i : i + chunk].float(), y[i : i + chunk].to(x.device, torch.float32)))
        for i in range(0, x.numel(), chunk)
    )


def squared_norm(tensor: Tensor, chunk: int = 1 << 24) -> float:
    """Squared L2 norm for logging, in float32 chunks so a low-precision buffer is never copied whole."""
    flat = tensor.reshape(-1)
    return sum(
        float(torch.linalg.vector_norm(flat[i : i + chunk], dtype=torch.float32)) ** 2
        for i in range(0, flat.numel(), chunk)
    )
