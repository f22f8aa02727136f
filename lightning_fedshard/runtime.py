"""The federated runtime: everything federated about one strategy, shared by the Trainer and Fabric adapters.

Lightning keeps two FSDP strategy hierarchies (``lightning.pytorch`` and ``lightning.fabric``). Each adapter owns one
:class:`FederatedRuntime` and only routes Lightning's hooks to it; the runtime owns the topology, the mesh, the
:class:`~lightning_fedshard.core.federation.Federation`, the wrapped module and its optimizers (a
:class:`~lightning_fedshard.federated_model.FederatedModel`), the count of optimizer steps, the restart of skipped
groups and the checkpointer. A sync reaches the core the same way from both adapters:
one call of :meth:`FederatedRuntime.after_optimizer_step` after every real optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_fedshard.checkpoint import FederationCheckpointer
from lightning_fedshard.core.backends.fsdp import FSDP1
from lightning_fedshard.core.backends.sharding import ShardingBackend
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.lazy import required
from lightning_fedshard.core.listeners import Listeners, SyncListener, UtilizationClock
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.core.transport.comm import Communicator
from lightning_fedshard.core.transport.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.elastic import ElasticMembership
from lightning_fedshard.elastic.host import ElasticHost
from lightning_fedshard.federated_model import FederatedModel

log = logging.getLogger(__name__)


class FederatedRuntime:
    """One rank's federation as a strategy sees it: set up once, then told about every optimizer step.

    Life cycle (every call after :meth:`setup` is collective: all ranks make it at the same point):

    1. :meth:`validate` in the launching process, once nodes and devices are known;
    2. :meth:`setup` after the default process group exists (builds the mesh and process groups);
    3. wrap the model and set its optimizers (:attr:`model`: all groups and replicas then start from the same weights);
    4. :meth:`start` when training starts, :meth:`after_optimizer_step` after every real optimizer step,
       :meth:`finish` when training ends.

    Args:
        config: The validated federation options.
        hybrid: FL+HSDP (HYBRID_SHARD inside a group) instead of FL+FSDP (FULL_SHARD).
        name: The strategy's registered name, for messages.
        backend: How the model is sharded: FSDP1 (default) or FSDP2 (see
            :mod:`lightning_fedshard.core.backends.sharding`).
        communicator: Builds the collectives of this rank's syncs once the mesh exists (see
            :mod:`lightning_fedshard.core.transport.comm`); default: the mesh's process groups.
        listeners: Told of the start and end of training and of every sync that lands, in order (see
            :mod:`lightning_fedshard.core.listeners`); default: the compute-utilization clock.
        mesh: Builds this rank's federation mesh from the topology, the device type and the site blocks; default:
            process groups of the default world (:func:`~lightning_fedshard.core.transport.mesh.build_federation_mesh`).
        shape: How :meth:`describe` names the groups (default: the topology's groups x replicas x shards), e.g. a
            simulation's groups on one device.
    """

    def __init__(
        self,
        config: FederationConfig,
        hybrid: bool,
        name: str,
        backend: ShardingBackend = FSDP1,
        communicator: Callable[[FederationMesh], Communicator] | None = None,
        listeners: Sequence[SyncListener] | None = None,
        mesh: Callable[..., FederationMesh] | None = None,
        shape: str | None = None,
    ) -> None:
        self.config = config
        self.shape = shape
        self.hybrid = hybrid
        self.name = name
        self.backend = backend
        self.step = 0
        self.last_sync_stats: SyncStats | None = None
        self.devices_per_node = 1
        self.listeners = Listeners(listeners if listeners is not None else [UtilizationClock()])
        self._make_communicator = communicator or _mesh_communicator
        self._build_mesh = mesh
        self._topology: FederationTopology | None = None
        self._mesh: FederationMesh | None = None
        self._federation: Federation | None = None
        #: The federated model and its inner optimizers.
        self.model = FederatedModel(backend, name, lambda: self.mesh)
        #: Elastic: this job's place in its federation (joins, heals, standby); ``None`` in one job.
        self.elastic: ElasticHost | None = ElasticHost(self) if config.elastic is not None else None

    # -- topology and mesh ------------------------------------------------------------------------------------

    def resolve_topology(self, num_nodes: int, devices_per_node: int) -> FederationTopology:
        """Fix the job's topology once nodes and devices are known.

        Raises:
            ValueError: If the ranks cannot be cut into the configured groups and shards.
        """
        self._topology = self.config.topology(num_nodes, devices_per_node, self.hybrid)
        return self._topology

    @property
    def topology(self) -> FederationTopology:
        """Groups, replicas and shards of this job; known once :meth:`resolve_topology` ran."""
        return required(self._topology, "The federation topology is known only once nodes and devices are set.")

    def describe(self) -> str:
        """This job's federation in one line: the groups x replicas x shards and the sync options."""
        elastic = self.config.elastic
        if elastic is not None:
            group = self.group_index
            shape = f"{self.topology.num_replicas} replica(s) x {self.topology.shard_size} shard(s)"
            return f"{self.name}: {elastic.describe(group, self.num_groups)}, {shape} here; {self.config.describe()}"
        one_group = " (one group: nothing to federate)" if self.syncs_are_identity else ""
        return f"{self.name}: {self.shape or self.topology}{one_group}; {self.config.describe()}"

    @property
    def num_groups(self) -> int:
        """The groups of the federation: of this job, or (elastic) those the federation is planned for."""
        if self.config.elastic is not None:
            assert self.config.num_groups is not None  # checked by FederationConfig
            return self.config.num_groups
        return self.topology.num_groups

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """Check the topology in the launching process and warn about layouts that defeat the federation."""
        topology = self.resolve_topology(num_nodes, devices_per_node)
        if self.config.elastic is not None:
            if not self.config.elastic.standby:
                self.config.elastic.group_index(self.num_groups)  # a missing or bad index fails before any rank starts
            self.config.elastic.lighthouse_address()
            return
        for message in topology.layout_warnings(devices_per_node, self.hybrid, self.name):
            rank_zero_warn(message)

    def setup(self, num_nodes: int, devices_per_node: int, device: torch.device) -> None:
        """Build the federation mesh and the federation; collective, after the default process group exists.

        Lightning sets its strategy up again for every entry point (``fit``, ``validate``, ``test``, ``predict``) of
        one Trainer: a mesh built for the same topology is kept, and so is the federation with its anchor, outer
        optimizer state and schedule, so that a second ``fit`` continues where the first one stopped.
        """
        topology = self.resolve_topology(num_nodes, devices_per_node)
        if self._mesh is not None and self._mesh.topology == topology:
            return
        self.devices_per_node = devices_per_node
        build = self._build_mesh or build_federation_mesh
        self._mesh = build(topology, device.type, self.config.site_blocks(topology.num_groups))
        self._federation = self._new_federation()
        log.info(f"{self.name}: rank {self._mesh.rank} at {self._mesh.coords} of {self.shape or topology}")

    def _new_federation(self) -> Federation:
        """A federation over this rank's communicator: the mesh's, or (elastic) torchft's around the job's mesh."""
        host = self.elastic
        if host is None or self._make_communicator is not _mesh_communicator:
            communicator = self._make_communicator(self.mesh)
        else:
            communicator = host.communicator()
        federation = Federation(self.config, communicator)
        if host is not None:
            host.attach(federation)
        return federation

    @property
    def group_index(self) -> int:
        """Elastic: this job's group (see :attr:`ElasticHost.group_index`); 0 in one job."""
        return 0 if self.elastic is None else self.elastic.group_index

    @property
    def standing_by(self) -> bool:
        """Elastic: whether this job is a standby that holds no place (it waits, or its federation ended)."""
        return self.elastic is not None and self.elastic.standing_by

    def stand_by(self) -> bool:
        """Elastic standby: wait for a place in the running federation (see :meth:`ElasticHost.stand_by`)."""
        return self.elastic is None or self.elastic.stand_by()

    @property
    def membership(self) -> ElasticMembership | None:
        """Elastic: how this group joins and heals, and the groups of the last sync; ``None`` in one job."""
        return self.elastic.membership if self.elastic is not None else None

    @property
    def mesh(self) -> FederationMesh:
        """The federation device mesh; exists after the processes have initialized."""
        return required(self._mesh, "Accessing the federation mesh before processes have initialized is not allowed.")

    @property
    def federation(self) -> Federation:
        """This rank's federation (outer step and schedule); exists after the processes have initialized."""
        return required(self._federation, "Accessing the federation before processes have initialized is not allowed.")

    @property
    def fsdp_process_group(self) -> ProcessGroup | tuple[ProcessGroup, ProcessGroup]:
        """What FSDP's ``process_group`` must be inside this rank's federation group."""
        return self.mesh.fsdp_process_group(self.hybrid)

    @property
    def group_mesh(self) -> DeviceMesh:
        """This rank's federation group as the device mesh FSDP2's ``fully_shard`` takes."""
        return self.mesh.group_mesh(self.hybrid)

    @property
    def fsdp_sharding(self) -> str:
        """The FSDP ``ShardingStrategy`` name that goes with :attr:`fsdp_process_group`."""
        return self.mesh.fsdp_sharding(self.hybrid)

    # -- model and optimizers ---------------------------------------------------------------------------------

    def release_model(self) -> None:
        """Forget the federated model and start a new federation on the same mesh, for another model to be set up.

        Collective on the next :meth:`wrap`. A sum still in flight is awaited first (every rank started it).
        """
        if self._federation is not None:
            self._federation.finish_pending()
            self.close()
            self._federation = self._new_federation()
        self.model.release()
        self.step = 0

    # -- the sync schedule ------------------------------------------------------------------------------------

    @property
    def syncs_are_identity(self) -> bool:
        """One group averaging with itself: every outer step would give its weights back, so none runs.

        This is what makes a one-group ``"fedavg"`` run exactly plain FSDP / HSDP, with no copy and no rounding.
        """
        if self.config.elastic is not None:
            return False  # other groups (other jobs) may join at any time
        return self.topology.num_groups == 1 and self.config.outer_optimizer == "fedavg"

    def is_due(self, step: int) -> bool:
        """Whether :meth:`after_optimizer_step` with ``step`` would run an outer step."""
        return not self.syncs_are_identity and self.federation.is_due(step)

    def start(self, step: int) -> SyncStats | None:
        """Anchor the federation on the current weights at optimizer step ``step``; collective.

        If a checkpoint restored a federation whose sync of step ``step`` had not run yet (it was saved between the
        optimizer step and the sync), that sync runs now, as it did in the uninterrupted run.
        """
        if self.standing_by:
            return None  # a standby whose federation ended before it took a place: it trains nothing
        joined = None
        if self.elastic is not None and not self.elastic.joined:
            joined = self.join(step)
            step = self.step
        self.step = step
        self.listeners.on_start(step)
        federation = self.federation
        self.start_federation(step)
        rank_zero_info(self.describe())
        if federation.config.fragments > 1:
            summary = self.model.fragment_summary(federation.outer.fragments)
            rank_zero_info(f"{self.name}: streaming fragments (in module order): {summary}")
        if joined is not None or self.syncs_are_identity:
            return joined
        return self._synced(federation.maybe_sync(step))

    def start_federation(self, step: int) -> None:
        """Anchor the federation on the model's local shards at optimizer step ``step`` (kept if started already)."""
        self.federation.start(
            self.model.local_shards(),
            step,
            on_write=self.model.free_unsharded_params,
            unit_sizes=self.model.unit_sizes(),
        )

    # -- elastic ----------------------------------------------------------------------------------------------

    def set_host_state(self, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Elastic: what the strategy adds to the state a joining group receives (see :class:`ElasticHost`)."""
        if self.elastic is not None:
            self.elastic.set_host_state(state, load)

    def join(self, step: int) -> SyncStats | None:
        """Elastic: enter the federation at optimizer step ``step`` (collective with the other groups' ranks).

        After it :attr:`step` is the step training continues from: the peers' if this group healed (its weights,
        anchor, outer state, schedule and the strategy's loops are then theirs), else ``step``.

        Returns:
            The statistics of the sync this group took part in, if any.
        """
        host = required(self.elastic, "Only an elastic federation is joined.")
        self.step, stats = host.join(step)
        return None if stats is None else self._synced(stats)

    @property
    def joined(self) -> bool:
        """Elastic: whether this group has joined the federation (always ``False`` in one job)."""
        return self.elastic is not None and self.elastic.joined

    def close(self) -> None:
        """Elastic: leave the federation (this group's manager stops; the others go on without it)."""
        if self.elastic is not None:
            self.elastic.close()

    def trains(self, step: int | None = None) -> bool:
        """Whether this group trains optimizer step ``step`` (default: the next one).

        Always, except with a per-group pace (``pace=Pace(...)``): a group slower than the fastest skips the last
        steps of each round (no forward, backward or inner update), so that it reaches the sync with the others.
        """
        if self.config.pace is None or self._federation is None or not self._federation.started:
            return True
        return self._federation.trains(self.step + 1 if step is None else step)

    def after_optimizer_step(self, step: int | None = None) -> SyncStats | None:
        """Tell the federation that a real optimizer step completed; runs the outer step when one is due.

        This is the one entry point of a sync during training, for the Trainer and Fabric alike. Calls that repeat
        an already counted step (e.g. once per micro-batch under gradient accumulation) do nothing.

        Args:
            step: Optimizer steps completed so far, when the caller counts them (the Trainer's ``global_step``);
                ``None`` counts one more step.

        Returns:
            The statistics of the sync that ran, or ``None``.

        Raises:
            NonFiniteOuterGradientError: See :class:`~lightning_fedshard.core.step.outer.OuterStep`.
        """
        step = self.step + 1 if step is None else step
        if step <= self.step:
            return None
        self.step = step
        if self.elastic is not None:
            self.elastic.restore_mid_epoch_resume()
        return None if self.syncs_are_identity else self._synced(self.federation.maybe_sync(step))

    def finish(self) -> SyncStats | None:
        """End of training: sync once more if it stopped between two syncs, so every group holds the consensus."""
        if self.syncs_are_identity:
            return None
        self.listeners.on_stop(self.step)  # the end-of-training sync is not part of the training pace
        stats = self._synced(self.federation.finish(self.step))
        self.listeners.on_finish(self)
        if self.config.elastic is not None:
            self.close()
        return stats

    def _synced(self, stats: SyncStats | None) -> SyncStats | None:
        if self.elastic is not None:
            self.elastic.raise_if_fell_behind()
        if stats is None:
            return None
        stats = self.last_sync_stats = self.listeners.on_sync(stats)
        self._restart_skipped_groups(stats)
        if stats.lost:
            after = "every group keeps its training, which the next sync carries" if stats.extra.get("carried") else ""
            after = after or "every group went back to the last consensus"
            rank_zero_warn(
                f"The sync of fragment {stats.fragment} at optimizer step {self.step} was not committed: {after}"
                f" ({stats.syncs_lost} sync(s) lost so far)."
            )
        return stats

    @property
    def fragment_parameter_names(self) -> list[list[str]]:
        """The model's parameter names in each streaming fragment, in order (known once the federation started)."""
        return self.model.fragment_parameter_names(self.federation.outer.fragments)

    def _restart_skipped_groups(self, stats: SyncStats) -> None:
        """After ``on_nonfinite="skip_group"`` left groups out of a sync: say so, and clear their inner optimizer state.

        The sync already reset their weights (an outer step: to the new anchor; a site sync or a mix: to what it gave
        them, the mean of their healthy partners); their inner optimizer state most likely holds the same NaN/Inf,
        so every rank of a skipped group starts it afresh (all of them, to keep the group consistent).
        """
        message = stats.skipped_message(self.step)
        if message is None:
            return
        rank_zero_warn(message)
        if self.federation.communicator.group_index in stats.skipped_groups:
            self.model.restart_optimizers()

    def consensus_weights(self) -> AbstractContextManager[None]:
        """Within the block the model holds the consensus of the last sync; its own weights come back on exit."""
        return nullcontext() if self._federation is None else self._federation.consensus_weights()

    # -- checkpoints ------------------------------------------------------------------------------------------

    @property
    def checkpointer(self) -> FederationCheckpointer:
        """Saves and loads this rank's federation state with the model (see :mod:`lightning_fedshard.checkpoint`)."""
        return FederationCheckpointer(
            self.mesh.topology,
            self.hybrid,
            self.mesh.rank,
            self.federation,
            self.model.module,
            self.model.free_unsharded_params,
            self.backend,
        )


def _mesh_communicator(mesh: FederationMesh) -> Communicator:
    """The default communicator: the process groups of one job's mesh."""
    return mesh.communicator()
