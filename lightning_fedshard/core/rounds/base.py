"""What every kind of sync round shares: the protocol the federation drives, and what a round declares it runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Protocol

from torch import Tensor
from typing_extensions import override

from lightning_fedshard.core.options.refusal import Refusal
from lightning_fedshard.core.step.outer import OuterStep
from lightning_fedshard.core.step.participation import Participation
from lightning_fedshard.core.step.pending import PendingSync
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.step.transaction import SyncKind
from lightning_fedshard.core.transport.comm import Communicator
from lightning_fedshard.core.wire.codecs import Codec

__all__ = ["Host", "OnePendingRound", "Options", "Refusal", "Round", "combined", "drop"]


class Options(Protocol):
    """The federation options a round reads (a :class:`~lightning_fedshard.core.config.FederationConfig`)."""

    @property
    def num_groups(self) -> int | None: ...  # noqa: D102

    @property
    def sync_every(self) -> int: ...  # noqa: D102

    @property
    def fragments(self) -> int: ...  # noqa: D102

    @property
    def sync_delay(self) -> int: ...  # noqa: D102

    @property
    def merge_alpha(self) -> float: ...  # noqa: D102

    @property
    def outer_topology(self) -> Any: ...  # noqa: D102

    @property
    def eager_rule(self) -> str | None: ...  # noqa: D102

    @property
    def outer_period(self) -> int: ...  # noqa: D102

    @property
    def codec(self) -> Codec: ...  # noqa: D102


class Host(Protocol):
    """What a round drives: the federation's outer step, collectives and schedule (a ``Federation``)."""

    communicator: Communicator
    participation: Participation | None
    groups_may_join: bool
    last_synced_step: int
    landed_at: list[int]
    consensus_distance: float | None

    @property
    def config(self) -> Options: ...  # noqa: D102

    @property
    def outer(self) -> OuterStep: ...  # noqa: D102

    def written(self) -> None: ...  # noqa: D102


class Round:
    """One kind of sync: when it is due, what lands then, what ends training, and what the consensus is.

    The federation holds the schedule's steps and exactly one round, chosen when it is built; it calls
    :meth:`after_step` once per optimizer step, :meth:`finish` at the end of training and :meth:`load_consensus` for
    validation and checkpoints. A round declares in :attr:`refuses` the options (the switches of
    :mod:`~lightning_fedshard.core.rounds.options`) it does not run; every other option is one it runs.

    Args:
        federation: The federation this round syncs (its outer step, communicator, config and schedule).
    """

    #: Options this kind of round does not run, and why.
    refuses: ClassVar[dict[str, Refusal]] = {}

    def __init__(self, federation: Host) -> None:
        self.federation = federation

    @property
    def config(self) -> Options:
        """The federation's options."""
        return self.federation.config

    @property
    def outer(self) -> OuterStep:
        """The federation's outer step."""
        return self.federation.outer

    def is_due(self, step: int) -> bool:
        """Whether a sync lands after optimizer step ``step``."""
        raise NotImplementedError

    def after_step(self, step: int) -> SyncStats | None:
        """Everything the round does after optimizer step ``step`` (not handled before); collective."""
        raise NotImplementedError

    def take_part(self, kind: SyncKind, step: int) -> SyncStats | None:
        """Take part in the peers' sync ``kind`` at ``step``, adding nothing (a group that just healed)."""
        raise NotImplementedError(f"{type(self).__name__} does not take joining groups yet.")

    def finish(self, step: int) -> list[SyncStats]:
        """End of training after optimizer step ``step``: every group ends on the consensus; collective."""
        raise NotImplementedError

    def load_consensus(self) -> None:
        """Write the consensus into the shards (the caller saved them and restores them); collective.

        Default: the anchor, which every group restarted from at the last outer step.
        """
        self.outer.copy_anchor_to_shards()

    def in_flight(self) -> list[PendingSync]:
        """Every sum started and not landed, in the order every rank started them."""
        return []

    def await_in_flight(self) -> None:
        """Wait for every sum in flight, in the order every rank started them; they stay in flight (landed later)."""
        for pending in self.in_flight():
            pending.result()

    def forget_in_flight(self) -> None:
        """Await every sum in flight and drop it; collective (every rank started them)."""
        self.await_in_flight()

    def site_state(self) -> list[Tensor]:
        """What this group keeps per group that a site sync averages along with the weights (e.g. eager offsets)."""
        return []

    def restart_from_anchor(self) -> None:
        """Every group's shards were just set to the anchor (a heal): forget what the round kept per group."""

    def state_dict(self) -> dict[str, Any]:
        """What the round holds between steps that a resume needs (sums in flight)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the federation's outer step is started)."""

    def group_state_dict(self) -> dict[str, Any]:
        """What the round holds that differs between groups."""
        return {}

    def load_group_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`group_state_dict`."""

    def state_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds for the round, by name (added to the federation's)."""
        return {}


class OnePendingRound(Round):
    """A round with at most one sync in flight at a time (``_pending``), started on every rank in the same order."""

    def __init__(self, federation: Host) -> None:
        super().__init__(federation)
        self._pending: PendingSync | None = None

    @override
    def in_flight(self) -> list[PendingSync]:
        """The sync in flight, if any."""
        return [self._pending] if self._pending is not None else []

    @override
    def forget_in_flight(self) -> None:
        """Await the sync in flight and drop it; collective."""
        drop(self._pending)
        self._pending = None


def combined(stats: list[SyncStats], num_fragments: int) -> SyncStats | None:
    """One record for several syncs after one step: the last one's norms, everyone's bytes and seconds."""
    if not stats:
        return None
    return replace(
        stats[-1],
        bytes_sent=sum(s.bytes_sent for s in stats),
        seconds=sum(s.seconds for s in stats),
        exposed_seconds=sum(s.exposed_seconds for s in stats),
        num_fragments=num_fragments,
    )


def drop(pending: PendingSync | None) -> None:
    """Let a sum every rank started finish everywhere, then forget it."""
    if pending is not None:
        pending.result()
