"""Error feedback: what a lossy codec dropped is kept and added to the next value sent from the same place.

Any reducer whose codec rounds (int8/int4, later others) can use it. A reducer names each place it encodes (a *slot*):
the quantized sum uses ``"residual"`` for a rank's own input and ``"sum_residual"`` for the chunk it sums. Each slot
keeps ``intended - sent`` of its last call and adds it to its next input, so nothing is lost, only delayed (measured in
:mod:`~lightning_fedshard.core.wire.reducers`). The residuals wait on ``device``: in host memory with the federation's
default ``anchor_device="cpu"``, so that error feedback costs no accelerator memory. They are part of checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class ErrorFeedback:
    """Residuals of a lossy encoding, one per slot.

    Args:
        device: Where residuals wait between calls (``None``: on the device of the values they came from).
        slots: The slot names, in the order :meth:`state_dict` lists them.
    """

    def __init__(self, device: torch.device | str | None = None, slots: tuple[str, ...] = ()) -> None:
        self.device = device
        self.residuals: dict[str, Tensor | None] = dict.fromkeys(slots)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r}, slots={tuple(self.residuals)})"

    def get(self, slot: str) -> Tensor | None:
        """The residual held for ``slot`` (``None`` before its first call)."""
        return self.residuals.get(slot)

    def add_to(self, slot: str, out: Tensor) -> None:
        """``out += residual`` of ``slot`` (flattened), if one is held."""
        residual = self.residuals.get(slot)
        if residual is not None:
            out += residual.to(out.device).reshape(-1)

    def keep(self, slot: str, intended: Tensor, sent: Tensor) -> None:
        """Hold ``intended - sent`` (shaped like ``intended``) for ``slot``'s next call."""
        self.residuals[slot] = (intended - sent.view(intended.shape)).to(self.device or intended.device)

    def reset(self) -> None:
        """Drop every residual (e.g. when the vector or the ring it is summed over changes)."""
        self.residuals = dict.fromkeys(self.residuals)

    def state_dict(self) -> dict[str, Any]:
        """A copy of every slot's residual (``None`` where none is held)."""
        return {slot: None if r is None else r.detach().clone() for slot, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (onto :attr:`device` when it is set)."""
        for slot in self.residuals:
            residual = state.get(slot)
            self.residuals[slot] = residual if residual is None or self.device is None else residual.to(self.device)
