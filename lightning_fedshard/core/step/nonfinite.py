"""What a sync does with a federation group whose pseudo-gradient (or weights) hold NaN or Inf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

#: What the outer step does with a group whose pseudo-gradient holds NaN or Inf.
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip_group")


class NonFiniteOuterGradientError(FloatingPointError):
    """A federation group's pseudo-gradient (or, at a site sync or a mix, its weights) holds NaN or Inf.

    Raised before anything changed: the anchor, the outer optimizer and every group's weights are as they were.

    Attributes:
        groups: Indices of the broken groups.
        num_syncs: Outer steps completed before this one.
        step: The optimizer step of the failed sync, when known.
        sync: Which kind of sync found them: ``"outer step"``, ``"site sync"`` or ``"mix"``.
        policy: The ``on_nonfinite`` policy in force: under ``"skip_group"`` the sync raises only when a broken group
            has no healthy group to take weights from.
    """

    def __init__(
        self,
        groups: Sequence[int],
        num_syncs: int,
        step: int | None = None,
        sync: str = "outer step",
        policy: str = "raise",
    ) -> None:
        self.groups = tuple(groups)
        self.num_syncs = num_syncs
        self.step = step
        self.sync = sync
        self.policy = policy
        where = f" at optimizer step {step}" if step is not None else ""
        if sync == "outer step":
            head = (
                "Non-finite outer gradient (NaN/Inf pseudo-gradient) in federation group(s)"
                f" {list(self.groups)}{where}, sync {num_syncs + 1} (after {num_syncs} successful sync(s)). The anchor"
                " was left untouched"
            )
        else:
            head = (
                f"Non-finite weights (NaN/Inf) in federation group(s) {list(self.groups)}{where}, at a {sync} (after"
                f" {num_syncs} outer step(s)). No group's weights were changed"
            )
        if policy == "skip_group":
            hint = (
                ". Under `on_nonfinite='skip_group'` a broken group needs a healthy group to take weights from, and"
                " these had none at this sync."
            )
        else:
            hint = ", or pass `on_nonfinite='skip_group'` to average over the healthy groups only."
        super().__init__(
            f"{head} and no checkpoint is written from this state: resume from the last checkpoint (e.g. with a lower"
            f" learning rate){hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.groups, self.num_syncs, self.step, self.sync, self.policy)


def healthy_mix(matrix: Tensor, broken: Sequence[int]) -> tuple[Tensor, list[int]]:
    """A mixing matrix without the ``broken`` groups' weights, each row renormalized over the healthy groups.

    ``W'_ij = W_ij / sum_k W_ik`` over healthy ``j`` and ``k``, and 0 for a broken ``j``: a healthy group takes the
    same mix of the healthy groups it took from before, a broken one the mix of its healthy partners. The columns
    then no longer sum to 1, so such a mix does not keep the groups' mean. A healthy row with no healthy weight left
    (only a matrix with a zero diagonal has one) keeps its own weights.

    Returns:
        The matrix, and the broken groups whose row gives no weight to a healthy group (they cannot be restarted).
    """
    kept = matrix.clone()
    kept[:, list(broken)] = 0.0
    mass = kept.sum(dim=1)
    stranded = [i for i in broken if mass[i] <= 0]
    for i in range(matrix.shape[0]):
        if mass[i] <= 0 and i not in broken:
            kept[i, i], mass[i] = 1.0, 1.0
    return kept / mass.clamp_min(1e-300)[:, None], stranded
