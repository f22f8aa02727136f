"""A mixing round: every ``sync_every`` steps each group takes a doubly-stochastic mix of the groups' weights.

Row ``i`` of the round's matrix ``W`` (``Gossip``, ``Sampled``, ``Mixing``) says what group ``i`` takes:
``theta_i' = sum_j W_ij theta_j``, in float32, with no outer step (the anchor and the outer optimizer do not move). A
round whose matrix is uniform is the federation's plain outer step, and so is the end of training: both average the
pseudo-gradient of everything trained since the last one. With ``fragments = P`` the fragments mix in turn, one every
``sync_every / P`` steps, each with the matrix of its ``sync_every``-step round.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fedshard.core.fragments import landing_fragment
from lightning_fedshard.core.nonfinite import NonFiniteOuterGradientError, healthy_mix
from lightning_fedshard.core.outer_topology import Mixing
from lightning_fedshard.core.rounds.averaging import (
    FLOAT32_SUM,
    apply_weights,
    flat_weights,
    load_mean_over_groups,
    weights_sync_stats,
)
from lightning_fedshard.core.rounds.base import Host, Refusal, Round
from lightning_fedshard.core.rounds.plain import PlainRound
from lightning_fedshard.core.stats import SyncStats

if TYPE_CHECKING:
    from lightning_fedshard.core.outer import OuterStep

_NO_SHARED_ANCHOR = "a mix moves no shared anchor, so there is no common pseudo-gradient for it"


class MixingRound(Round):
    """Mixes of the groups' weights, and the plain outer step for a uniform round (see the module).

    Args:
        federation: The federation this round syncs.
        topology: The mixing schedule.
        inner: The plain round that takes the federation's outer step.
    """

    refuses = {
        "sync_delay": Refusal("a mix takes the weights themselves, not a snapshot's pseudo-gradient"),
        "merge_alpha": Refusal(f"{_NO_SHARED_ANCHOR} to merge towards", impossible=True),
        "eager_updates": Refusal(f"{_NO_SHARED_ANCHOR} to share in advance", impossible=True),
        "outer_momentum": Refusal(f"{_NO_SHARED_ANCHOR} to keep momentum on", impossible=True),
        "lossy_dtype": Refusal("a uniform round and the end of training average the whole run's pseudo-gradient"),
        "error_feedback_weights": Refusal("a mix runs in float32, which drops nothing to keep", impossible=True),
    }

    def __init__(self, federation: Host, topology: Mixing, inner: PlainRound) -> None:
        super().__init__(federation)
        self.topology = topology
        self.inner = inner

    @override
    def is_due(self, step: int) -> bool:
        due = landing_fragment(step, self.config.sync_every, self.config.fragments) is not None
        return due and step > self.federation.last_synced_step

    @override
    def after_step(self, step: int) -> SyncStats | None:
        """Mix the fragment due after ``step`` (the whole model with one fragment) with its round's matrix.

        The landing after step ``s`` belongs to round ``(s - 1) // sync_every``: with ``P`` fragments the ``P`` landings
        of one ``sync_every``-step period mix their fragments with that round's matrix.
        """
        if not self.is_due(step):
            return None
        fragments = self.config.fragments
        fragment = landing_fragment(step, self.config.sync_every, fragments)
        assert fragment is not None
        groups = len(self.federation.communicator.participants())
        matrix = self.topology.weights((step - 1) // self.config.sync_every, groups)
        if torch.allclose(matrix, torch.full_like(matrix, 1.0 / groups), rtol=0.0, atol=1e-12):
            return replace(self.inner.sync(step, fragment), num_fragments=fragments)
        stats = mix(self.outer, matrix, step=step, fragment=None if fragments == 1 else fragment)
        self.federation.written()
        return replace(stats, fragment=fragment, num_fragments=fragments)

    @override
    def finish(self, step: int) -> list[SyncStats]:
        return self.inner.finish(step)

    @override
    def load_consensus(self) -> None:
        """The exact mean over all groups of their current weights, which a doubly-stochastic mix does not change."""
        load_mean_over_groups(self.federation)


@torch.no_grad()
def mix(outer: OuterStep, matrix: Tensor, step: int | None = None, fragment: int | None = None) -> SyncStats:
    """Replace every shard by ``sum_j W_ij theta_j`` (this group ``i``, float32); collective over the fed ring.

    With ``fragment``, only that fragment's shards.

    Broken groups (NaN/Inf weights) are found before anything is written, as for a site sync. With
    ``on_nonfinite="skip_group"`` they send nothing, and every row's weights are renormalized over the healthy groups:
    ``W'_ij = W_ij / sum_k W_ik`` over healthy ``j`` and ``k`` (see :func:`healthy_mix`).

    Raises:
        NonFiniteOuterGradientError: If a group's weights hold NaN/Inf and ``on_nonfinite="raise"``, or a broken
            group's row gives no weight to a healthy group. No group's weights were changed then.
    """
    start = time.perf_counter()
    communicator = outer.communicator
    groups = communicator.participants()  # asked once per sync
    indices = range(len(outer.shards)) if fragment is None else outer.fragments[fragment]
    flat = flat_weights([outer.shards[i] for i in indices])
    broken = outer.nonfinite_groups(flat, groups, step, "mix")
    if broken:
        matrix, stranded = healthy_mix(matrix, broken)
        if stranded:
            raise NonFiniteOuterGradientError(stranded, outer.num_syncs, step, "mix", outer.on_nonfinite)
        if communicator.group_index in broken:
            flat.zero_()  # its column is zero: nobody takes from it, and its own NaN must not meet a 0 weight
    communicator.mix_over_groups(flat, matrix)
    norm, drift = apply_weights(outer, flat, broken, len(groups), indices)
    seconds = time.perf_counter() - start
    i = communicator.group_index
    partners = sum(1 for j in range(matrix.shape[0]) if j != i and matrix[j, i] > 0)
    sent = partners * FLOAT32_SUM.encoded_bytes(flat.numel(), len(groups))  # the whole vector to each partner
    return weights_sync_stats(
        outer, norm, drift, sent, seconds, broken, kind="mix", extra={"mixing_partners": partners}
    )
