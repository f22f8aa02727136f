"""How a sync mode says that it does not run an option, or runs it but advises against it.

Standard library only: the elastic options declare one too.
"""

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


@dataclass(frozen=True)
class Advice:
    """Why a sync mode runs an option but advises against it: the pair trains, worse than either option alone.

    Attributes:
        reason: One clause saying why, with what was measured, for the warning and the compatibility table.
    """

    reason: str
