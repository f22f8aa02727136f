"""How a sync mode says that it does not run an option (standard library only: the elastic options declare one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """Why a round does not run an option.

    Attributes:
        reason: One clause saying why, for the error message and the compatibility table.
        impossible: ``True`` when the two cannot be combined by their nature; ``False`` when the combination is only
            not built yet.
    """

    reason: str
    impossible: bool = False
