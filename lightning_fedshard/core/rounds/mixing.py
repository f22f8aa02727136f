"""A mixing round: every ``sync_every`` steps each group takes a doubly-stochastic mix of the groups' weights.

Row ``i`` of the round's matrix ``W`` (``Gossip``, ``Sampled``, ``Mixing``) says what group ``i`` takes:
``theta_i' = sum_j W_ij theta_j``, with no outer step (the outer optimizer does not move). With ``fragments = P`` the
fragments mix in turn, one every ``sync_every / P`` steps, each with the matrix of its ``sync_every``-step round. The
end of training is the federation's plain outer step in float32: every group restarts from the exact mean.

In float32 without a delay a mix writes ``sum_j W_ij theta_j``, and a round whose matrix is uniform is the
federation's plain outer step. Otherwise every round, a uniform one included, is a *message* mix:

- each group sends its message ``m_i``: its weights in float32, or with a lossy ``reduce_dtype`` the encoding of
  ``theta_i - anchor`` (what it moved since the anchor, which every group shares); ``m^_i`` is what its partners
  decode;
- at the landing each group adds ``sum_j W_ij m^_j - m^_i`` to its weights. With ``sync_delay = d`` the messages are
  taken ``d`` steps before the landing and travel meanwhile, so the ``d`` steps a group trained since are kept; the
  mix also keeps what an encoding dropped (``theta_i - anchor - m^_i``) in each group's own weights, so the groups'
  mean never changes (the columns of ``W`` sum to 1);
- a uniform round also moves the anchor to the mean of the messages (every group receives all of them and adds them
  in group order, so the anchors stay identical).

With a per-group pace each column ``j`` of a round's matrix weighs by the steps group ``j`` trained in the fragment's
last ``sync_every`` steps, every row renormalized (:func:`weigh_columns`): a group takes more of the partners that
trained more, and the mix no longer keeps the groups' plain mean. A uniform round is the federation's outer step,
weighed by the pace's merge.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fedshard.core.options.outer_topology import Mixing
from lightning_fedshard.core.rounds.averaging import (
    FLOAT32_SUM,
    apply_weights,
    flat_weights,
    load_mean_over_groups,
    weights_sync_stats,
    write_weights,
)
from lightning_fedshard.core.rounds.base import Host, OnePendingRound, Refusal, drop
from lightning_fedshard.core.rounds.plain import PlainRound
from lightning_fedshard.core.step.fragments import landing_fragment, starting_fragment
from lightning_fedshard.core.step.nonfinite import NonFiniteOuterGradientError, healthy_mix
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import MIX, SyncKind, SyncTransaction
from lightning_fedshard.core.wire.codecs import ChunkCodec, Codec, FloatCodec

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lightning_fedshard.core.step.outer import OuterStep
    from lightning_fedshard.core.step.participation import Participation

_NO_SHARED_ANCHOR = "a mix moves no shared anchor, so there is no common pseudo-gradient for it"


class MixingRound(OnePendingRound):
    """Mixes of the groups' weights, and the plain outer step at the end (see the module).

    Args:
        federation: The federation this round syncs.
        topology: The mixing schedule.
        inner: The plain round that takes the federation's outer step.
    """

    refuses = {
        "merge_alpha": Refusal(f"{_NO_SHARED_ANCHOR} to merge towards", impossible=True),
        "eager_updates": Refusal(f"{_NO_SHARED_ANCHOR} to share in advance", impossible=True),
        "outer_momentum": Refusal(f"{_NO_SHARED_ANCHOR} to keep momentum on", impossible=True),
    }

    def __init__(self, federation: Host, topology: Mixing, inner: PlainRound) -> None:
        super().__init__(federation)
        self.topology = topology
        self.inner = inner

    @override
    def is_due(self, step: int) -> bool:
        due = landing_fragment(step, self.config.sync_every, self.config.fragments) is not None
        return due and step > self.federation.last_synced_step

    def weights(self, landing: int) -> Callable[[Sequence[int]], Tensor]:
        """The matrix, by the groups taking part, of the round the landing after step ``landing`` is in.

        That round is ``(landing - 1) // sync_every``: with ``P`` fragments the ``P`` landings of one
        ``sync_every``-step period mix with that round's matrix. Its rows and columns are the positions of the groups
        in ring order. In an elastic federation a gossip or a sample is drawn among the live groups; a fixed matrix
        names the planned groups, so its gone groups' columns are left out and every row renormalized
        (:func:`live_rows`).
        """
        round = (landing - 1) // self.config.sync_every
        if type(self.topology) is not Mixing:
            return lambda groups: self.topology.weights(round, len(groups))
        planned = self.config.num_groups
        return lambda groups: live_rows(self.topology.weights(round, planned or len(groups)), groups)

    @override
    def after_step(self, step: int) -> SyncStats | None:
        """Mix the fragment due after ``step``, then take the messages of the one due ``sync_delay`` steps later."""
        stats = self._land(step) if self.is_due(step) else None
        config = self.config
        starting = starting_fragment(step, config.sync_every, config.fragments, config.sync_delay)
        if starting is not None:
            self._pending = self._begin(starting, step, background=True)
        return stats

    def _begin(self, fragment: int, step: int, background: bool) -> PendingSync:
        landing = step + (self.config.sync_delay if background else 0)
        rule = self.federation.participation
        weights, codec = self.weights(landing), self.config.codec
        return begin_mix(self.outer, weights, fragment, step, codec, background, rule, self._since(step))

    def _since(self, step: int) -> int:
        """The step after which a fragment's message taken after ``step`` was trained: its previous message's."""
        return max(0, step - self.config.sync_every)

    def _land(self, step: int, pending: PendingSync | None = None) -> SyncStats:
        config = self.config
        fragment = landing_fragment(step, config.sync_every, config.fragments)
        assert fragment is not None
        pending, self._pending = pending or self._pending, None
        if pending is None or pending.fragment != fragment:  # no overlap (sync_delay=0), or resumed without one
            drop(pending)
            if config.codec.exact and not self.federation.groups_may_join:
                return self._mix_weights(step, fragment)
            pending = self._begin(fragment, step, background=False)
        stats = land_mix(self.outer, pending, self.weights(step), step, config.codec)
        self.federation.written()
        return replace(stats, fragment=fragment, num_fragments=config.fragments)

    def _mix_weights(self, step: int, fragment: int) -> SyncStats:
        """The float32 mix of the weights themselves, or the plain outer step for a uniform matrix (one job)."""
        fragments = self.config.fragments
        matrix = self.weights(step)(self.federation.communicator.participants())
        if _uniform(matrix):
            return replace(self.inner.sync(step, fragment), num_fragments=fragments)
        part = None if fragments == 1 else fragment
        stats = mix(self.outer, matrix, step, part, self.federation.participation, self._since(step))
        self.federation.written()
        return replace(stats, fragment=fragment, num_fragments=fragments)

    @override
    def take_part(self, kind: SyncKind, step: int) -> SyncStats | None:
        """Take part in the peers' mix (its messages start, or land with ``sync_delay=0``), or in their outer step.

        A group that healed adds nothing to a mix and takes its row's mix of the others, renormalized over them.
        """
        if kind.name != MIX:
            return self.inner.take_part(kind, step)
        mixed = kind.fragment
        assert mixed is not None
        if self.config.sync_delay:
            self._pending = self._begin(mixed, step, background=True)
            return None
        return self._land(step, self._begin(mixed, step, background=False))

    @override
    def restart_from_anchor(self) -> None:
        self._pending = None

    @override
    def finish(self, step: int) -> list[SyncStats]:
        """A mix in flight is dropped (it would not change the mean); every fragment takes the plain outer step."""
        self.forget_in_flight()
        return self.inner.finish(step)

    @override
    def load_consensus(self) -> None:
        """The exact mean over all groups of their current weights, which a doubly-stochastic mix does not change.

        In an elastic federation each group's own weights: a mean over the live groups would need a quorum of its own.
        """
        if self.federation.groups_may_join:
            return
        self.await_in_flight()  # the mean travels on the fed ring, where the mix in flight runs
        load_mean_over_groups(self.federation)

    @override
    def group_state_dict(self) -> dict[str, Any]:
        """The mix in flight: what this group received and sent differs between groups."""
        return {"mix": self._pending.state_dict() if self._pending is not None else None}

    @override
    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("mix")
        device = self.outer.shards[0].device
        self._pending = None if saved is None else PendingSync.from_state_dict(saved, device, self.outer)


def _uniform(matrix: Tensor) -> bool:
    return torch.allclose(matrix, torch.full_like(matrix, 1.0 / matrix.shape[0]), rtol=0.0, atol=1e-12)


def wire_form(codec: Codec, values: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``values`` (flat float32) as the codec writes them on the wire, and how a receiver decodes them to float32."""
    numel = values.numel()
    if isinstance(codec, FloatCodec):
        return values.to(codec.torch_dtype), lambda wire: wire.to(torch.float32)
    assert isinstance(codec, ChunkCodec), f"no wire form for {codec!r}"
    padded = codec.padded_length(numel, 1)
    buffer = torch.zeros(padded, dtype=torch.float32, device=values.device)
    buffer[:numel] = values
    return codec.encode_pieces(buffer, 1), lambda wire: codec.decode_pieces(wire, padded).reshape(-1)[:numel]


def _reference(outer: OuterStep, indices: Sequence[int], codec: Codec, device: torch.device) -> Tensor | None:
    """What messages are taken against: the anchor with a lossy codec, nothing (the weights themselves) in float32."""
    return None if codec.exact else flat_weights([outer.anchor[i] for i in indices]).to(device)


@torch.no_grad()
def begin_mix(
    outer: OuterStep,
    weights: Callable[[Sequence[int]], Tensor],
    fragment: int,
    step: int,
    codec: Codec,
    background: bool,
    participation: Participation | None = None,
    since: int = 0,
) -> PendingSync:
    """Take this group's message of ``fragment`` now and start mixing the messages (see the module); collective.

    ``weights`` gives the round's matrix for the number of groups that take part (asked here, once). Broken groups
    (NaN/Inf weights) and, in an elastic federation, groups that joined at this sync are found here, before anything
    travels: they send nothing, and every row is renormalized over the others (:func:`healthy_mix`). A
    ``participation`` rule that weighs the groups (a pace: by the steps each trained after ``since``) weighs the
    columns, every row renormalized (:func:`weigh_columns`). The pending mix's result holds two rows:
    ``sum_j W_ij m^_j`` and this group's own ``m^_i`` (zero for an absent group).

    Raises:
        NonFiniteOuterGradientError: As for :func:`mix`; nothing was changed then.
    """
    start = time.perf_counter()
    communicator = outer.communicator
    transaction = SyncTransaction(outer, SyncKind.mix(fragment), step, participation)
    groups = transaction.open()
    indices = outer.fragments[fragment]
    flat = flat_weights([outer.shards[i] for i in indices])
    transaction.exchange(bool(torch.isfinite(flat).all()), flat.device)
    broken, left_out = transaction.broken, (*transaction.joined, *transaction.idle)
    matrix = weigh_columns(_present(outer, weights(groups), groups, broken, left_out, step), transaction, since)
    me = groups.index(communicator.group_index)
    reference = _reference(outer, indices, codec, flat.device)
    if not transaction.adds:
        flat.zero_()
    elif reference is not None:
        flat.sub_(reference)
    wire, decode = wire_form(codec, flat)
    own = decode(wire)

    def run() -> Tensor:
        return torch.stack([communicator.mix_over_groups(wire, matrix, decode), own])

    receivers = len(groups) - 1 if getattr(communicator, "mixes_by_all_gather", False) else _partners(matrix, me)
    sent = receivers * wire.numel() * wire.element_size()
    pending = PendingSync(transaction=transaction, own_sq=0.0, bytes_sent=sent, clock=start)
    if background:
        pending._future = outer.in_background(run)
    else:
        pending._part = run()
    pending.exposed = time.perf_counter() - start
    return pending


@torch.no_grad()
def land_mix(
    outer: OuterStep, pending: PendingSync, weights: Callable[[Sequence[int]], Tensor], step: int, codec: Codec
) -> SyncStats:
    """Add ``sum_j W_ij m^_j - m^_i`` to this group's weights of the fragment (see the module); collective.

    An absent group (broken, joined at this sync, or left out by a participation rule) takes
    ``reference + sum_j W_ij m^_j``, the mix of the others, or keeps its weights if its row has no one else. A uniform
    matrix also moves the anchor to ``reference + sum_j m^_j / G``. Nothing is written unless the communicator commits
    the sync (an elastic vote).
    """
    start = time.perf_counter()
    mixed, own = pending.result().unbind(0)
    communicator = outer.communicator
    groups, absent = pending.participants, (*pending.broken, *pending.joined, *pending.idle)
    matrix = weights(groups)
    uniform = _uniform(matrix)
    matrix = _present(outer, matrix, groups, pending.broken, (*pending.joined, *pending.idle), step)
    me = groups.index(communicator.group_index)
    indices = outer.fragments[pending.fragment]
    current = flat_weights([outer.shards[i] for i in indices])
    reference = _reference(outer, indices, codec, current.device)
    if communicator.group_index not in absent:
        new = current.add_(mixed).sub_(own)
    elif matrix[me].sum() > 0:
        new = mixed.clone() if reference is None else reference + mixed
    else:  # a group that joined with no one else in its row keeps the anchor it healed
        new = current
    norm, drift = apply_weights(outer, new, absent, len(groups), indices, write=False)
    committed = pending.transaction.commit()
    if committed:
        write_weights([outer.shards[i] for i in indices], new)
        if uniform:
            write_weights([outer.anchor[i] for i in indices], mixed if reference is None else reference + mixed)
    seconds = time.perf_counter() - pending.clock
    extra = {"mixing_partners": _partners(matrix, me)}
    stats = weights_sync_stats(outer, norm, drift, pending.bytes_sent, seconds, pending.broken, kind="mix", extra=extra)
    return replace(
        stats,
        exposed_seconds=pending.exposed + time.perf_counter() - start,
        joined_groups=pending.joined,
        lost=not committed,
        syncs_lost=outer.syncs_lost,
    )


def live_rows(matrix: Tensor, groups: Sequence[int]) -> Tensor:
    """The rows and columns of the live ``groups`` (planned indices, in ring order) of a matrix over the planned groups.

    The gone groups' columns are left out and every row renormalized over the live groups (:func:`healthy_mix`): each
    live group takes the same mix of the live groups it took from before; one whose partners are all gone keeps its
    weights. With every planned group alive, the matrix as it is.
    """
    gone = [g for g in range(matrix.shape[0]) if g not in groups]
    if gone:
        matrix, _ = healthy_mix(matrix, gone)
    index = torch.tensor(list(groups), dtype=torch.long)
    return matrix.index_select(0, index).index_select(1, index)


def weigh_columns(matrix: Tensor, transaction: SyncTransaction, since: int) -> Tensor:
    """``matrix`` with column ``j`` weighed by group ``j``'s factor in the sync's merge, each row renormalized.

    ``W'_ij = W_ij c_j / sum_k W_ik c_k``: a group takes the same partners' weights, each counted by what it trained
    (with a pace: the steps after ``since``). A row whose partners all weigh 0 stays as it was, and so does the
    whole matrix when no rule weighs the groups.
    """
    factors = transaction.column_weights(since)
    if factors is None:
        return matrix
    weighted = matrix * torch.tensor(factors, dtype=matrix.dtype, device=matrix.device)[None, :]
    mass = weighted.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, weighted / mass.clamp_min(1e-300), matrix)


def _partners(matrix: Tensor, me: int) -> int:
    """The groups that take from group (position) ``me`` under ``matrix``: whom it sends its message to."""
    return sum(1 for j in range(matrix.shape[0]) if j != me and matrix[j, me] > 0)


def _present(
    outer: OuterStep,
    matrix: Tensor,
    groups: Sequence[int],
    broken: Sequence[int],
    left_out: Sequence[int],
    step: int | None,
) -> Tensor:
    """``matrix`` (by position among ``groups``) without the columns of the groups that add nothing.

    Those are the broken ones and those ``left_out``: joined at this sync, or left out by a participation rule
    (:func:`healthy_mix`).

    Raises:
        NonFiniteOuterGradientError: For a broken group left with no healthy partner.
    """
    if not broken and not left_out:
        return matrix
    matrix, stranded = healthy_mix(matrix, [groups.index(g) for g in (*broken, *left_out)])
    stranded_broken = [groups[p] for p in stranded if groups[p] in broken]
    if stranded_broken:
        raise NonFiniteOuterGradientError(stranded_broken, outer.num_syncs, step, "mix", outer.on_nonfinite)
    return matrix


def _without_broken(outer: OuterStep, matrix: Tensor, broken: Sequence[int], step: int | None) -> Tensor:
    """:func:`healthy_mix` of ``matrix``, raising for a broken group left with no healthy partner."""
    if not broken:
        return matrix
    matrix, stranded = healthy_mix(matrix, broken)
    if stranded:
        raise NonFiniteOuterGradientError(stranded, outer.num_syncs, step, "mix", outer.on_nonfinite)
    return matrix


@torch.no_grad()
def mix(
    outer: OuterStep,
    matrix: Tensor,
    step: int | None = None,
    fragment: int | None = None,
    participation: Participation | None = None,
    since: int = 0,
) -> SyncStats:
    """Replace every shard by ``sum_j W_ij theta_j`` (this group ``i``, float32); collective over the fed ring.

    With ``fragment``, only that fragment's shards. A ``participation`` rule that weighs the groups weighs the columns
    (:func:`weigh_columns`).

    Broken groups (NaN/Inf weights) are found before anything is written, as for a site sync. With
    ``on_nonfinite="skip_group"`` they send nothing, and every row's weights are renormalized over the healthy groups:
    ``W'_ij = W_ij / sum_k W_ik`` over healthy ``j`` and ``k`` (see :func:`healthy_mix`).

    Raises:
        NonFiniteOuterGradientError: If a group's weights hold NaN/Inf and ``on_nonfinite="raise"``, or a broken
            group's row gives no weight to a healthy group. No group's weights were changed then.
    """
    start = time.perf_counter()
    communicator = outer.communicator
    transaction = SyncTransaction(outer, SyncKind(MIX, fragment), step, participation)
    groups = transaction.open()
    indices = range(len(outer.shards)) if fragment is None else outer.fragments[fragment]
    flat = flat_weights([outer.shards[i] for i in indices])
    transaction.exchange(bool(torch.isfinite(flat).all()), flat.device, joined=False)
    broken = transaction.broken
    matrix = weigh_columns(_without_broken(outer, matrix, broken, step), transaction, since)
    if communicator.group_index in broken:
        flat.zero_()  # its column is zero: nobody takes from it, and its own NaN must not meet a 0 weight
    flat = communicator.mix_over_groups(flat, matrix)
    norm, drift = apply_weights(outer, flat, broken, len(groups), indices, write=False)
    committed = transaction.commit()  # after every collective of the mix; nothing is written unless it commits
    if committed:
        write_weights([outer.shards[i] for i in indices], flat)
    seconds = time.perf_counter() - start
    i = communicator.group_index
    partners = sum(1 for j in range(matrix.shape[0]) if j != i and matrix[j, i] > 0)
    sent = partners * FLOAT32_SUM.encoded_bytes(flat.numel(), len(groups))  # the whole vector to each partner
    stats = weights_sync_stats(
        outer, norm, drift, sent, seconds, broken, kind="mix", extra={"mixing_partners": partners}
    )
    return replace(stats, lost=not committed, syncs_lost=outer.syncs_lost)
