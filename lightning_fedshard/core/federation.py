"""One rank's view of a running federation: when to sync, the outer step, and the consensus weights.

The Trainer callback and the Fabric strategy both drive this class, so the schedule (every ``sync_every`` real
optimizer steps, once more at the end) lives in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_fedshard.core.comm import Communicator, sum_over_model
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.elastic import ElasticCommunicator, FederationError, cloned
from lightning_fedshard.core.fragments import cut_fragments, landing_fragment, starting_fragment
from lightning_fedshard.core.lazy import required
from lightning_fedshard.core.outer import OuterStep, PendingSync, SyncStats


class Federation:
    """Schedules outer steps over the local shards of one rank.

    Args:
        config: Validated federation options (``sync_every``, outer optimizer, dtype, anchor device).
        communicator: Collectives over the federation groups.
    """

    def __init__(self, config: FederationConfig, communicator: Communicator) -> None:
        self.config = config
        self.communicator = communicator
        self._outer: OuterStep | None = None
        self._on_write: Callable[[], None] = _nothing
        self._pending: PendingSync | None = None
        self._eager: dict[int, PendingSync] = {}  # eager updates: each fragment's sum in flight until its next sync
        #: The groups' distance from their mean at the last consensus of a topology whose groups differ
        #: (hierarchical, mixing; ``None`` before one, and with ``"all"``).
        self.consensus_distance: float | None = None
        self.last_synced_step = 0
        self.last_step = 0
        self.landed_at: list[int] = [0] * config.fragments
        #: The groups of the last sync, in ring order (elastic: new members reset the error-feedback residuals).
        self.members: tuple[int, ...] = ()
        #: Elastic: what the host (the strategy) adds to the state a joining group receives, and how it applies it.
        self.host_state: Callable[[], Any] | None = None
        self.load_host_state: Callable[[int, Any], None] | None = None
        #: Elastic: the sync the peers were in when this group last healed (``(fragment, step)``), if any.
        self.peer_sync: tuple[int, int] | None = None
        self._joining_at: int | None = None
        if isinstance(communicator, ElasticCommunicator):
            communicator.set_heal(self._heal_state, self._apply_heal)
            communicator.on_new_members = self._on_new_members

    @property
    def elastic(self) -> ElasticCommunicator | None:
        """The elastic communicator, when the groups are jobs of their own."""
        return self.communicator if isinstance(self.communicator, ElasticCommunicator) else None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` attached the model's shards."""
        return self._outer is not None

    @property
    def outer(self) -> OuterStep:
        """The outer step; raises before :meth:`start`."""
        return required(self._outer, "The federation has not started: call `start(shards, step)` first.")

    @property
    def pending(self) -> PendingSync | None:
        """The fragment sync in flight (started, not landed yet) that started first, if any."""
        in_flight = self._in_flight()
        return in_flight[0] if in_flight else None

    def start(
        self,
        shards: Sequence[Tensor],
        step: int,
        on_write: Callable[[], None] | None = None,
        unit_sizes: Sequence[int] | None = None,
    ) -> None:
        """Take the current shards as the anchor (all groups must hold the same weights) at optimizer step ``step``.

        Calling it again with shards of the same layout (the same model's) keeps everything (anchor, outer optimizer
        state, schedule), e.g. after :meth:`load_state_dict` restored them from a checkpoint; only the tensors written
        by later syncs and ``on_write`` are replaced. The shards (FSDP
        units, in module order) are cut into ``config.fragments`` fragments (see :func:`cut_fragments`).

        Args:
            shards: This rank's local shards, updated in place by training.
            step: The optimizer step training starts from.
            on_write: Called after the shards were overwritten in place, e.g. to drop caches of gathered weights.
            unit_sizes: What the fragments are balanced by, one size per shard; default: the shards' numels. Give the
                whole parameters' sizes when local shards are uneven (FSDP2), so that every in-group position cuts
                the model at the same parameters.

        Raises:
            ValueError: If the model has fewer FSDP units than ``config.fragments``.
        """
        self._on_write = on_write or _nothing
        if self._outer is not None and _same_layout(self._outer.shards, shards):
            # The same parameters: FSDP2 hands out new `to_local()` views, and loading a state dict may move its
            # shards to new memory, so the outer step writes to the tensors given last.
            self._outer.shards = list(shards)
            return
        anchor_device = "cpu" if self.config.anchor_device == "cpu" else None
        self._outer = OuterStep(
            shards,
            self.config.outer_optimizer_factory,
            self.communicator,
            anchor_device=anchor_device,
            on_nonfinite=self.config.on_nonfinite,
            fragments=cut_fragments(unit_sizes or [s.numel() for s in shards], self.config.fragments),
            reducer=self.config.reducer,
            eager_rule=self.config.eager_rule or "share",
            feedback_in_weights=self.config.feedback_in_weights,
        )
        self.last_synced_step = self.last_step = step
        self.landed_at = [step] * self.config.fragments

    def is_due(self, step: int) -> bool:
        """Whether a fragment lands after optimizer step ``step`` (a multiple of ``sync_every / fragments``).

        ``step`` counts real optimizer steps, so gradient accumulation and repeated hook calls for the same step
        never trigger twice.
        """
        if (hierarchical := self.config.hierarchical) is not None:
            return hierarchical.block_size(step) is not None and step > self.last_step
        due = landing_fragment(step, self.config.sync_every, self.config.fragments) is not None
        return due and step > self.last_synced_step

    def maybe_sync(self, step: int) -> SyncStats | None:
        """Everything the schedule asks for after optimizer step ``step``; collective.

        Lands the fragment that is due (waits for its sum, outer step, merge) and, with ``sync_delay > 0``, takes the
        pseudo-gradient of the fragment that lands ``sync_delay`` steps later and starts its sum in the background.
        A step already handled is ignored.

        Returns:
            The statistics of the sync that landed, or ``None``.

        Raises:
            NonFiniteOuterGradientError: See :class:`~lightning_fedshard.core.outer.OuterStep`.
        """
        if step <= self.last_step:
            return None
        if self.config.hierarchical is not None:
            stats = self._hierarchical_sync(step) if self.is_due(step) else None
            self.last_step = step
            return stats
        if self.config.mixing is not None:
            stats = self._mixing_sync(step) if self.is_due(step) else None
            self.last_step = step
            return stats
        if self.config.eager_rule is not None:
            stats = self._eager_sync(step) if self.is_due(step) else None
            self.last_step = step
            return stats
        stats = self._land(step) if self.is_due(step) else None
        starting = starting_fragment(step, self.config.sync_every, self.config.fragments, self.config.sync_delay)
        if starting is not None:
            self._pending = self.outer.begin(starting, step, background=True)
        self.last_step = step
        return self._elastic_stats(stats)

    def join(self, step: int) -> tuple[int, SyncStats | None]:
        """Elastic: enter the federation at optimizer step ``step``; collective with the groups of the quorum.

        Takes the next quorum as a joining group. If a peer was ahead, this group heals (its anchor, outer state,
        schedule and the host's state become the peer's, its shards the anchor) and then does what the peers do at
        that point: the sync they are in, to which it adds nothing. If every group is joining (a new federation, or
        all of one restarting from checkpoints) the quorum is only a change of members: nothing is summed and every
        group keeps its weights. A join that is not committed is tried again at the next quorum.

        Returns:
            The optimizer step training continues from (the peers' when this group healed) and the statistics of the
            sync this group took part in, if any.

        Raises:
            FederationError: If ``max_failures`` joins in a row were not committed, or as :meth:`ElasticCommunicator.
                quorum` raises.
        """
        elastic = self.elastic
        assert elastic is not None, "only an elastic federation is joined"
        for _ in range(elastic.options.max_failures):
            self._joining_at, self.peer_sync = step, None
            try:
                elastic.quorum(joining=True)
            finally:
                self._joining_at = None
            if self.peer_sync is None:  # every group is joining: only the members change
                stats: SyncStats | None = self.outer.complete(self.outer.begin(0, step, background=False), step=step)
            else:
                fragment, step = self.peer_sync
                if self.config.sync_delay == 0:
                    stats = self._land(step)
                else:
                    self._pending, stats = self.outer.begin(fragment, step, background=True), None
                self.last_step = step
            if stats is None or not stats.lost:
                return step, self._elastic_stats(stats)
        raise FederationError(
            f"Elastic group {elastic.group_index} could not join the federation: {elastic.options.max_failures}"
            " attempts in a row were not committed."
        )

    def _heal_state(self) -> dict[str, Any]:
        """What a joining or lagging peer receives from this rank (torchft's thread; this rank waits in a quorum)."""
        outer = self.outer
        syncing = outer.syncing
        step = syncing[1] if syncing is not None else self._joining_at
        state = {
            "outer": outer.state_dict(),
            "schedule": {
                "last_synced_step": self.last_synced_step,
                "last_step": self.last_step,
                "landed_at": list(self.landed_at),
            },  # fmt: skip
            "sync": syncing,
            "step": step,
            "host": self.host_state() if self.host_state is not None else None,
        }
        return cloned(state)

    @torch.no_grad()
    def _apply_heal(self, state: dict[str, Any]) -> None:
        """Take a peer's state (training thread, inside a quorum): every shard becomes the healed anchor."""
        outer = self.outer
        outer.load_state_dict(state["outer"])
        schedule = state["schedule"]
        self.last_synced_step, self.last_step = int(schedule["last_synced_step"]), int(schedule["last_step"])
        self.landed_at = [int(s) for s in schedule["landed_at"]]
        outer.copy_anchor_to_shards()
        outer.offsets = [None] * len(outer.fragments)
        self._reset_residuals()
        self._on_write()
        sync = state["sync"]
        self.peer_sync = None if sync is None else (int(sync[0]), int(sync[1]))
        if self.load_host_state is not None:
            self.load_host_state(int(state["step"]), state["host"])

    def _on_new_members(self, members: tuple[int, ...]) -> None:
        """The groups of a sync changed: residuals laid out over the old ring cannot be carried on."""
        if self.members and members != self.members:
            self._reset_residuals()
        self.members = members

    def _reset_residuals(self) -> None:
        if self._outer is not None:
            for reducer in self._outer.reducers:
                feedback = getattr(reducer, "feedback", None)
                if feedback is not None:
                    feedback.reset()

    def _elastic_stats(self, stats: SyncStats | None) -> SyncStats | None:
        """Add the groups of the sync and the time spent healing (elastic only)."""
        elastic = self.elastic
        if stats is None or elastic is None:
            return stats
        return replace(stats, groups=len(self.members), heal_seconds=elastic.last_heal_seconds)

    def _hierarchical_sync(self, step: int) -> SyncStats:
        """A block of consecutive groups averages its weights, or the whole federation takes the outer step."""
        hierarchical = self.config.hierarchical
        assert hierarchical is not None
        size = hierarchical.block_size(step)
        assert size is not None
        groups = len(self.communicator.participants())
        if size < groups:
            stats = self.outer.average_in_site(size, hierarchical.blocks(size, groups), step=step)
            self._on_write()
            return stats
        return self.sync(step)

    def _mixing_sync(self, step: int) -> SyncStats:
        """Every group takes the round's mix of the groups' weights; the uniform mix is the plain outer step."""
        mixing = self.config.mixing
        assert mixing is not None
        groups = len(self.communicator.participants())
        matrix = mixing.weights(step // self.config.sync_every - 1, groups)
        if torch.allclose(matrix, torch.full_like(matrix, 1.0 / groups), rtol=0.0, atol=1e-12):
            return self.sync(step)
        stats = self.outer.mix(matrix, step=step)
        self._on_write()
        return stats

    def _eager_sync(self, step: int) -> SyncStats | None:
        fragment = landing_fragment(step, self.config.sync_every, self.config.fragments)
        assert fragment is not None
        stats, started = self.outer.eager_step(fragment, self._take_eager(fragment), step)
        assert started is not None  # only the end of training lands everything
        self._eager[fragment] = started
        self._on_write()
        self.last_synced_step = self.landed_at[fragment] = step
        return None if stats is None else replace(stats, num_fragments=self.config.fragments)

    def _take_eager(self, fragment: int) -> PendingSync | None:
        """The fragment's eager sum in flight, no longer held here (``None`` if it has none)."""
        return self._eager.pop(fragment) if fragment in self._eager else None

    def _finish_eager(self, step: int) -> list[SyncStats]:
        """Every fragment lands its sum in flight; those that trained since it started also sync what they did.

        The final sums run in this thread over the ring the background sums use, so every sum in flight is awaited
        first.
        """
        for in_flight in self._in_flight():
            in_flight.result()
        synced = []
        for fragment in range(self.config.fragments):
            pending = self._take_eager(fragment)
            if self.landed_at[fragment] == step:
                stats = self.outer.settle(fragment, pending, step)
            else:
                stats, _ = self.outer.eager_step(fragment, pending, step, final=True)
                self.landed_at[fragment] = step
            if stats is not None:
                synced.append(stats)
        self._on_write()
        self.last_synced_step = step
        return synced

    def _land(self, step: int) -> SyncStats:
        fragment = landing_fragment(step, self.config.sync_every, self.config.fragments)
        assert fragment is not None
        pending, self._pending = self._pending, None
        if pending is None or pending.fragment != fragment:  # no overlap (sync_delay=0), or resumed without one
            self._drop(pending)
            pending = self.outer.begin(fragment, step, background=False)
        stats = self.outer.complete(pending, step=step, merge_alpha=self.config.merge_alpha)
        self._on_write()
        self.last_synced_step = self.landed_at[fragment] = step
        since_snapshot = step - pending.started_at if pending.started_at is not None else 0
        discarded = (1.0 - self.config.merge_alpha) * since_snapshot / self.config.sync_every
        return replace(stats, num_fragments=self.config.fragments, discarded_fraction=discarded)

    def finish(self, step: int) -> SyncStats | None:
        """End of training after optimizer step ``step``: every group ends with the consensus; collective.

        A sum still in flight is dropped (awaited, then discarded). Every fragment that did not land at ``step`` takes
        one synchronous outer step on its current pseudo-gradient; a fragment that landed at ``step`` with
        ``merge_alpha > 0`` gets the new anchor copied in, so that all groups agree. With eager updates no sum is
        dropped: every fragment first lands the sum it has in flight, then syncs what it trained since (if anything).
        With ``error_feedback="weights"`` the groups, which differ by what they have not sent, then take the exact
        mean of their weights (one float32 all-reduce), which also becomes the anchor.

        Returns:
            The statistics of the last of these syncs, or ``None`` if none was needed.
        """
        if not self.started:
            return None
        if self.config.eager_rule is not None:
            synced = self._finish_eager(step)
            self.last_step = max(self.last_step, step)
            return _combined(synced, self.config.fragments)
        self.finish_pending()
        synced = []
        for fragment in range(self.config.fragments):
            if self.landed_at[fragment] == step:
                if self.config.merge_alpha > 0:
                    self.outer.copy_anchor_to_shards(fragment)
                    self._on_write()
                continue
            synced.append(self.sync(step, fragment))
        if self.config.feedback_in_weights and len(self.communicator.participants()) > 1:
            synced.insert(0, self.outer.agree_on_mean())  # counted in the bytes; the norms are the last sync's
            self._on_write()
        self.last_step = max(self.last_step, step)
        return _combined(synced, self.config.fragments)

    def sync(self, step: int, fragment: int = 0) -> SyncStats:
        """Run one fragment's outer step now, synchronously (the new anchor replaces the shards); collective.

        Raises:
            NonFiniteOuterGradientError: See :class:`~lightning_fedshard.core.outer.OuterStep`.
        """
        stats = self.outer.step(step=step, fragment=fragment)
        self._on_write()
        self.last_synced_step = self.landed_at[fragment] = step
        return stats

    def finish_pending(self) -> None:
        """Await the fragment sums in flight, if any, and forget them; collective (every rank started them)."""
        self._drop(self._pending)
        self._pending = None
        for fragment in sorted(self._eager):
            self._drop(self._eager.pop(fragment))

    def _in_flight(self) -> list[PendingSync]:
        """Every sum started and not landed, in the order they were started on every rank."""
        eager = sorted(self._eager.values(), key=lambda p: (p.started_at or 0, p.fragment))
        return ([self._pending] if self._pending is not None else []) + eager

    @staticmethod
    def _drop(pending: PendingSync | None) -> None:
        if pending is not None:
            pending.result()  # every rank started this collective: let it finish everywhere, then forget it

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Temporarily load the consensus (the anchor) into the shards, e.g. for validation between syncs.

        With eager updates the consensus includes the sums in flight: it waits for them and shows the anchor each
        fragment will have once its sum has landed (the anchor itself and the outer state are not changed).

        With a hierarchical or mixing outer topology, or with ``error_feedback="weights"``, the consensus is the exact
        mean over all groups of their current weights (a float32 all-reduce over the fed ring), which a site sync, a
        doubly-stochastic mix or a landing that leaves each group its own residual does not change.

        With a single group there is nothing to agree on: its current weights are the consensus and stay in place
        (so a one-group run validates and saves what plain FSDP would).
        """
        if self._outer is None or (self.elastic is None and len(self.communicator.participants()) == 1):
            yield
            return
        saved = [s.detach().clone() for s in self._outer.shards]
        if self.config.hierarchical is not None or self.config.mixing is not None or self.config.feedback_in_weights:
            self._load_mean_over_groups()
        else:
            self._outer.copy_anchor_to_shards()
            self._project_sums_in_flight()
        self._on_write()
        try:
            yield
        finally:
            with torch.no_grad():
                for shard, local in zip(self._outer.shards, saved):
                    shard.copy_(local)
            self._on_write()

    @torch.no_grad()
    def _load_mean_over_groups(self) -> None:
        """The consensus of groups that differ: the exact mean over all groups of their current weights.

        Also measures :attr:`consensus_distance`: the root mean square over groups of a group's L2 distance from it.
        """
        outer = self.outer
        squared = torch.zeros(1, dtype=torch.float64)
        for shard, mean in zip(outer.shards, outer.mean_over_groups()):
            mean = mean.view_as(shard).to(shard.device)
            squared += float(torch.linalg.vector_norm(shard.float() - mean) ** 2)
            shard.copy_(mean)
        sum_over_model(self.communicator, squared)
        self.consensus_distance = math.sqrt(float(squared) / len(self.communicator.participants()))

    @torch.no_grad()
    def _project_sums_in_flight(self) -> None:
        """With eager updates, write each fragment's anchor as it will be once its sum in flight has landed.

        A fragment's sum lands a round after it started, so the anchor alone lags the groups by a round; the consensus
        that validation sees includes every round trained so far. Waits for the sums (collective, in start order).
        """
        for pending in self._in_flight():
            pending.result()
        outer = self.outer
        for fragment in sorted(self._eager):
            indices = outer.fragments[fragment]
            for i, anchor in zip(indices, outer.projected_anchor(self._eager[fragment])):
                outer.shards[i].copy_(anchor)

    def state_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds for the federation: anchor, outer optimizer state, error-feedback residuals.

        All zero before :meth:`start`.
        """
        if self._outer is None:
            return {"anchor": 0, "outer_optimizer": 0, "residuals": 0}
        return self._outer.state_nbytes()

    def state_dict(self) -> dict[str, Any]:
        """This rank's federation state: outer step, schedule and the fragment sync in flight (its sum completed)."""
        return {
            "outer": self.outer.state_dict() if self._outer else None,
            "last_synced_step": self.last_synced_step,
            "last_step": self.last_step,
            "landed_at": list(self.landed_at),
            "pending": self._pending.state_dict() if self._pending is not None else None,
            "eager": {f: self._eager[f].state_dict() for f in sorted(self._eager)},
            "members": list(self.members),
            "membership": self.elastic.state_dict() if self.elastic is not None else None,
        }

    def group_state_dict(self) -> dict[str, Any]:
        """This rank's state that differs between groups (error-feedback residuals); see :class:`OuterStep`.

        Sums in flight update the residuals from the background thread, so they are completed first.
        """
        for pending in self._in_flight():
            pending.result()
        return self.outer.group_state_dict() if self._outer else {}

    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`group_state_dict`."""
        if self._outer is not None:
            self._outer.load_group_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the federation must already be started on the same shards layout."""
        if state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
        self.last_synced_step = int(state["last_synced_step"])
        # Written by versions without fragments: the last handled step was the last sync (a sync still due then
        # runs when training starts), and every fragment (the only one) landed then.
        self.last_step = int(state.get("last_step", self.last_synced_step))
        self.landed_at = [int(s) for s in state.get("landed_at", [self.last_synced_step] * self.config.fragments)]
        self.members = tuple(int(g) for g in state.get("members", ()))
        if self.elastic is not None and state.get("membership") is not None:
            self.elastic.load_state_dict(state["membership"])
        self._eager = {
            int(f): PendingSync.from_state_dict(saved, self.outer.shards[0].device)
            for f, saved in state.get("eager", {}).items()
        }
        pending = state.get("pending")
        self._pending = None
        if pending is not None:
            self._pending = PendingSync.from_state_dict(pending, self.outer.shards[0].device)
            if not self._pending.participants:  # saved before syncs recorded their participants: every group
                self._pending.participants = self.communicator.participants()


def _combined(stats: list[SyncStats], num_fragments: int) -> SyncStats | None:
    """One record for the final syncs of several fragments: the last one's norms, everyone's bytes and seconds."""
    if not stats:
        return None
    return replace(
        stats[-1],
        bytes_sent=sum(s.bytes_sent for s in stats),
        seconds=sum(s.seconds for s in stats),
        exposed_seconds=sum(s.exposed_seconds for s in stats),
        num_fragments=num_fragments,
    )


def _nothing() -> None:
    pass


def _same_layout(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """As many tensors, pairwise of the same shape, dtype and device (the local shards of the same model)."""

    def key(t: Tensor) -> tuple:
        return t.shape, t.dtype, t.device

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))
