"""One job's place in an elastic federation: its communicator on torchft, joining, healing and standing by.

The runtime (:class:`~lightning_fedshard.runtime.FederatedRuntime`) owns the model, the optimizers and the count of
optimizer steps; with ``elastic=Elastic(...)`` it holds an :class:`ElasticHost` for everything that only an elastic
job does: wait as a standby for a place, join the federation at a sync (healing from a peer: weights, outer state,
schedule, the strategy's loops and the optimizers' settings), hand its own state to a peer that heals, and stop a
group that fell behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_fedshard.core.backends.sharding import ShardingBackend
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.lazy import required
from lightning_fedshard.core.options.elastic import FederationEnded, FederationError
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.mesh import FederationMesh
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.elastic.communicator import ElasticCommunicator
from lightning_fedshard.elastic.membership import ElasticMembership
from lightning_fedshard.elastic.quorum import MembershipChange
from lightning_fedshard.elastic.torchft_api import torchft_version
from lightning_fedshard.federated_model import FederatedModel

#: Lightning's warning when a fit resumes mid-epoch with a data loader that is not resumable. A group that heals takes
#: a peer's loop position on purpose, not a checkpoint's: for a heal (only) the warning is dropped.
_MID_EPOCH_RESUME = "You're resuming from a checkpoint that ended before the epoch ended"

__all__ = ["ElasticHost"]


class Runtime(Protocol):
    """What the host needs of the runtime it serves."""

    config: FederationConfig
    name: str
    step: int
    backend: ShardingBackend

    @property
    def num_groups(self) -> int: ...  # noqa: D102

    @property
    def topology(self) -> FederationTopology: ...  # noqa: D102

    @property
    def mesh(self) -> FederationMesh: ...  # noqa: D102

    @property
    def model(self) -> FederatedModel: ...  # noqa: D102

    def start_federation(self, step: int) -> None: ...  # noqa: D102


class ElasticHost:
    """An elastic job's membership of its federation, as its runtime needs it (see the module).

    Args:
        runtime: The runtime this job trains with.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.membership: ElasticMembership | None = None
        self.joined = False
        self._joining = False
        self.standby_ended = False  # a standby whose federation ended before it trained
        self._fell_behind: FederationError | None = None
        self._resume_filter: Any = None  # the warnings filter of a heal, until the first step after it
        self._host_state: Callable[[], Any] | None = None
        self._load_host_state: Callable[[Any], None] | None = None

    @property
    def options(self) -> Any:
        """The elastic options."""
        return self.runtime.config.elastic

    def communicator(self) -> ElasticCommunicator:
        """This rank's communicator on torchft, around the job's own mesh (the in-group collectives)."""
        runtime, elastic = self.runtime, self.options
        group = None if elastic.standby else elastic.group_index(runtime.num_groups)
        sites = runtime.config.site_blocks(runtime.num_groups)
        communicator = ElasticCommunicator(
            elastic, group, runtime.mesh.communicator(), self._description, sites, num_groups=runtime.num_groups
        )
        communicator.on_membership = self._log_membership
        return communicator

    def attach(self, federation: Federation) -> None:
        """Serve ``federation`` (new, or rebuilt for another model): joins and heals go through its communicator."""
        self.membership = None
        self.joined = False
        communicator = federation.communicator
        if isinstance(communicator, ElasticCommunicator):
            self.membership = ElasticMembership(federation, communicator)
            self.membership.host_state = self._host_state_of_peer
            self.membership.load_host_state = self._load_host_state_of_peer

    @property
    def group_index(self) -> int:
        """This job's group (a standby's once it took a place; 0 if its federation ended).

        Raises:
            RuntimeError: For a standby that has not waited for a place yet (its data part is not known).
        """
        if not self.options.standby:
            return int(self.options.group_index(self.runtime.num_groups))
        group = self.membership.communicator.place if self.membership is not None else None
        if group is None and not self.standby_ended:
            raise RuntimeError(
                "An elastic standby has no group yet, so no part of the data: the Trainer waits for a place before"
                " it sets up the data; with Fabric call `fabric.strategy.stand_by()` before setting up data loaders."
            )
        return 0 if group is None else group

    @property
    def standing_by(self) -> bool:
        """Whether this job is a standby that holds no place (it waits, or its federation ended)."""
        return self.options.standby and (self.membership is None or self.membership.communicator.place is None)

    def stand_by(self) -> bool:
        """A standby's wait until a group of the running federation is gone, then take its place; collective.

        Returns:
            Whether this job took a place (it then joins as that group); ``False`` if the federation ended first.
            Always ``True`` for a job that is not a standby.
        """
        elastic, name = self.options, self.runtime.name
        if not elastic.standby:
            return True
        membership = required(self.membership, "A standby waits only once its federation exists.")
        group = membership.communicator.stand_by(self.runtime.num_groups)
        if group is None:
            self.standby_ended = True
            rank_zero_info(
                f"{name}: standby of federation {elastic.federation!r}: the federation ended while this job"
                " waited; it trained nothing."
            )
            return False
        rank_zero_info(f"{name}: standby of federation {elastic.federation!r}: taking the place of group {group}.")
        return True

    def set_host_state(self, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """What the strategy adds to the state a joining group receives, and how a joining group applies it.

        E.g. the Trainer's loops and learning-rate schedules. ``state`` runs on torchft's thread while this rank waits
        in a sync.
        """
        self._host_state, self._load_host_state = state, load

    def join(self, step: int) -> tuple[int, SyncStats | None]:
        """Enter the federation at optimizer step ``step`` (collective with the other groups' ranks).

        Returns:
            The step training continues from (the peers' if this group healed: its weights, anchor, outer state,
            schedule and the strategy's loops are then theirs, else ``step``) and the statistics of the sync this
            group took part in, if any.
        """
        runtime = self.runtime
        runtime.start_federation(step)
        self._joining = True
        try:
            membership = required(self.membership, "Only an elastic federation is joined.")
            step, stats = membership.join(step)
        except FederationEnded:
            self.standby_ended = True
            rank_zero_info(
                f"{runtime.name}: the federation ended as this standby took a place in it; it trains nothing."
            )
            return runtime.step, None
        finally:
            self._joining = False
        self.joined = True
        return step, stats

    def raise_if_fell_behind(self) -> None:
        """After a sync: end this group if a peer's state showed that it fell behind.

        Raises:
            FederationError: If this group fell behind the federation (it was stopped or cut off for a while).
        """
        if self._fell_behind is not None:
            raise self._fell_behind

    def close(self) -> None:
        """Leave the federation (this group's manager stops; the others go on without it)."""
        if self.membership is not None:
            self.membership.communicator.close()
        self.joined = False
        self.restore_mid_epoch_resume()

    def restore_mid_epoch_resume(self) -> None:
        """Lightning's mid-epoch resume warning again, once the first optimizer step after a heal ran."""
        if self._resume_filter is not None:
            filters: list[Any] = warnings.filters  # type: ignore[assignment]  # typeshed: a Sequence; it is a list
            if self._resume_filter in filters:
                filters.remove(self._resume_filter)
            self._resume_filter = None

    def _host_state_of_peer(self) -> dict[str, Any]:
        runtime = self.runtime
        return {
            "step": runtime.step,
            "host": self._host_state() if self._host_state is not None else None,
            "hyperparameters": [_hyperparameters(optimizer) for optimizer in runtime.model.optimizers],
        }

    def _load_host_state_of_peer(self, step: int, state: dict[str, Any] | None) -> None:
        """A peer's loops and schedules: taken when joining; a group already training must be at the peer's step."""
        runtime = self.runtime
        if self._joining:
            if step != runtime.step and state is not None:
                # The inner optimizer's state is this group's own and starts fresh, but its settings (learning rate,
                # betas, ...) follow the schedules: a scheduler writes them only at its next step, and until then they
                # must be the federation's, not the initial ones. Then the strategy's own state (which may step them).
                for optimizer, groups in zip(runtime.model.optimizers, state.get("hyperparameters", [])):
                    for group, saved in zip(optimizer.param_groups, groups):
                        group.update(saved)
                if self._load_host_state is not None and state.get("host") is not None:
                    self._silence_mid_epoch_resume()
                    self._load_host_state(state["host"])
            runtime.step = step
            return
        if step != runtime.step:
            # Raised once this sync is over, so that the others' sync is not lost: this group takes part in it and
            # adds nothing.
            index = self.membership.communicator.group_index if self.membership is not None else "?"
            self._fell_behind = FederationError(
                f"Elastic group {index} fell behind the federation (it is at optimizer step {runtime.step}, the others"
                f" at {step}; it was stopped or cut off for a while). It ends here: restart it, and it joins again at"
                " the federation's step."
            )

    def _log_membership(self, change: MembershipChange) -> None:
        """One line per group that joined, healed or left, on this group's rank 0."""
        for line in change.lines(self.runtime.step):
            rank_zero_info(line)

    def _silence_mid_epoch_resume(self) -> None:
        """Drop Lightning's mid-epoch resume warning until the first optimizer step (a heal would trigger it)."""
        if self._resume_filter is None:
            warnings.filterwarnings("ignore", message=_MID_EPOCH_RESUME)
            self._resume_filter = warnings.filters[0]

    def _description(self) -> dict[str, Any]:
        """What must be equal in every group at this rank's in-group position (the elastic admission check)."""
        runtime = self.runtime
        shards = runtime.model.local_shards()
        layout = hashlib.sha1(repr([(tuple(s.shape), str(s.dtype)) for s in shards]).encode()).hexdigest()[:12]
        dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in shards})
        topology = runtime.topology
        return {
            "strategy": f"{runtime.name} ({runtime.backend.name})",
            "group shape": f"{topology.num_replicas} replica(s) x {topology.shard_size} shard(s)",
            "model": f"{sum(s.numel() for s in shards):,} values per rank in {len(shards)} shard(s) of"
            f" {'/'.join(dtypes)}",
            "shard layout": layout,
            "num_groups": runtime.num_groups,
            "sync options": dataclasses.replace(runtime.config, elastic=None, num_groups=None).describe(),
            "torchft": torchft_version(),  # every job of a federation must run the same release
        }


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (learning rate, betas, ...), without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
