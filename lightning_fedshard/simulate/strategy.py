"""One federation group of a simulation: a Lightning strategy on one device whose collectives meet other threads.

Each group of a simulated federation is a Lightning ``Trainer`` running in a thread of its own with a
:class:`SimulatedStrategy`. To Lightning the strategy is rank ``g`` of a world of ``num_groups`` ranks: the data
loaders get a ``DistributedSampler`` for the group's part, validation metrics logged with ``sync_dist=True`` are
averaged over the groups (a training step's metrics stay each group's own, as on a cluster), only group 0 draws the
progress bar and writes logs. The federation itself is the strategies' own
(:class:`~lightning_fedshard.runtime.FederatedRuntime` with its :class:`~lightning_fedshard.OuterSync` callback) over
an in-process communicator.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_fedshard.checkpoint import upgrades
from lightning_fedshard.checkpoint.atomic import save_file
from lightning_fedshard.core.transport.inprocess import GROUP_THREAD_PREFIX, Baton, InProcessGroups
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.elastic.heal import cloned
from lightning_fedshard.runtime import FederatedRuntime
from lightning_fedshard.trainer.callback import OuterSync
from lightning_fedshard.trainer.strategy import (
    place_outer_sync_first,
    refuse_pace_with_manual_optimization,
    skipped_step_loss,
)

#: Version of the simulator's checkpoint files.
CHECKPOINT_VERSION = 2
#: The key of a checkpoint of the consensus under which the simulation (every group's own state) is stored.
SIMULATION_KEY = "fedshard_simulation"


class InProcessMesh:
    """What the runtime needs of a federation mesh, for one group of :class:`InProcessGroups` (one rank per group)."""

    def __init__(self, groups: InProcessGroups, group: int) -> None:
        self._groups = groups
        self.rank = group
        self.coords = (group, 0, 0)
        self.topology = FederationTopology(groups.num_groups, 1, 1)

    def communicator(self) -> Any:
        """The group's in-process communicator."""
        return self._groups.communicator(self.rank)

    @torch.no_grad()
    def broadcast_shards(self, shards: list[Tensor]) -> None:
        """Every group takes group 0's values."""
        for shard in shards:
            shard.copy_(self._groups.host.exchange(self.rank, shard.detach().clone(), lambda posted: posted[0]))

    broadcast_buffers = broadcast_shards


class SimulatedStrategy(ParallelStrategy):
    """Group ``group`` of a simulated federation of ``groups.num_groups`` groups, each a whole model on ``device``.

    Built by :class:`~lightning_fedshard.simulate.Simulator`, one per group; not meant to be given to a ``Trainer``
    by hand.

    Args:
        runtime: The group's federated runtime (its federation options).
        groups: Where the groups' collectives meet.
        group: This group's index.
        device: The device every group trains on.
        baton: Lets one group's thread run at a time (checkpoints keep each group's random generators).
        settings: What the simulation's checkpoints must match to be resumed (e.g. the federation options).
    """

    strategy_name = "fl_simulated"
    #: Lightning injects a ``DistributedSampler`` only for strategies it deems distributed.
    is_distributed = True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after the model is set up: a checkpoint's federation state needs the model's parameters."""
        return True

    def __init__(
        self,
        runtime: FederatedRuntime,
        groups: InProcessGroups,
        group: int,
        device: torch.device,
        baton: Baton,
        settings: dict[str, Any],
    ) -> None:
        super().__init__(parallel_devices=[device])
        self.runtime = runtime
        self.groups = groups
        self.group = group
        self.device = device
        self.baton = baton
        self.settings = settings
        self._outer_sync: OuterSync | None = None

    # -- where this group is --------------------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        return self.device

    @property
    @override
    def global_rank(self) -> int:
        return self.group

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return self.group

    @property
    @override
    def world_size(self) -> int:
        return self.groups.num_groups

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.groups.num_groups, "rank": self.group}

    # -- set-up ---------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        reset_seed()  # as Lightning's distributed strategies do, in this group's generators (it holds the baton)
        self.runtime.setup(num_nodes=self.groups.num_groups, devices_per_node=1, device=self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        self._outer_sync = place_outer_sync_first(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_pace_with_manual_optimization(trainer.lightning_module, self.runtime.config.pace)
        assert self.model is not None
        self.model_to_device()
        self.model = self.runtime.model.wrap(self.model, lambda module: module)
        super().setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if not self.runtime.trains(module.trainer.global_step + 1):
            return skipped_step_loss(module)
        return super().training_step(*args, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives over the groups' threads ------------------------------------------------------------------------

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every group's ``obj``, in group order (collective).

        Raises:
            RuntimeError: When called outside the simulation's group threads (one group's ``Trainer`` used alone after
                the simulation), where it would wait forever for the other groups.
        """
        if self.groups.num_groups > 1 and not threading.current_thread().name.startswith(GROUP_THREAD_PREFIX):
            raise RuntimeError(
                f"Group {self.group}'s Trainer met the other groups (a barrier, a broadcast or a metric reduced over"
                " the groups) outside the simulation: the groups of a simulation run together, and alone it would wait"
                " for them forever. Call `result.validate(...)`, `result.test(...)` or `result.run('predict', ...)`"
                " of the `SimulationResult`, which run every group at once."
            )
        return self.groups.host.exchange(self.group, obj, lambda posted: posted)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.gather_objects(None)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.gather_objects(obj)[src]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Sum or average a tensor over the groups (in group order: every group gets the same bits).

        A metric reduced inside an epoch's training batches stays in its group, as on the cluster (groups do not meet
        between syncs): a group is one rank here, so it is the group's own value. An epoch's metrics are reduced over
        the groups once its batches are done, as on the cluster.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        boundary = self._outer_sync.epoch_boundary if self._outer_sync is not None else None
        if trainer is not None and trainer.training and boundary is not None and boundary.inside:
            return tensor
        op = str(reduce_op).lower().removeprefix("reduceop.") if reduce_op is not None else "mean"
        posted = self.gather_objects(tensor.detach().clone())
        stacked = torch.stack([t.to(tensor.device) for t in posted])
        if op in ("sum",):
            return stacked.sum(0)
        if op in ("mean", "avg"):
            return stacked.sum(0) / len(posted)
        if op == "max":
            return stacked.max(0).values
        if op == "min":
            return stacked.min(0).values
        raise ValueError(
            f"`reduce_op={reduce_op!r}` is not supported by the simulator; use 'sum', 'mean', 'max', 'min'."
        )

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return torch.stack([t.to(tensor.device) for t in self.gather_objects(tensor.detach().clone())])

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        decisions = self.gather_objects(bool(decision))
        return all_(decisions) if all else any(decisions)

    # -- checkpoints: one file holding every group ----------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every group hands its state to group 0, which writes one file atomically (never half-written).

        The file is a Lightning checkpoint of the consensus (``state_dict``, the loops, the hyper-parameters: what
        ``LightningModule.load_from_checkpoint``, a plain ``Trainer`` and ``export_consensus`` read) holding every
        group's own checkpoint beside it, which resuming the simulation reads.
        """
        federation = self.runtime.federation
        module = self.lightning_module
        assert module is not None
        with self.runtime.consensus_weights():  # collective with a mixing topology: every group takes part
            consensus = {k: v.detach().clone() for k, v in module.state_dict().items()}
        mine = {
            **checkpoint,
            "fedshard_simulated": {
                "federation": cloned(federation.state_dict()) if federation.started else None,
                "group": cloned(federation.group_state_dict()) if federation.started else None,
                "rng": self.baton.current_state(),
            },
        }
        states = self.gather_objects(mine)
        if self.group == 0:
            Path(filepath).parent.mkdir(parents=True, exist_ok=True)
            simulation = {"version": CHECKPOINT_VERSION, "settings": self.settings, "groups": states}
            # The consensus, as a checkpoint of the federation's model: each group's inner optimizer state is its own.
            plain = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            save_file(
                {**plain, "state_dict": consensus, "optimizer_states": [], SIMULATION_KEY: simulation}, Path(filepath)
            )
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """This group's part of a simulation checkpoint; its federation, residuals and random generators resume."""
        saved = read_checkpoint(Path(checkpoint_path), self.settings, self.groups.num_groups)
        mine = saved["groups"][self.group]
        own = mine.pop("fedshard_simulated")
        if own["federation"] is not None:
            self._restore_federation(own)
        self.baton.restore_state(own["rng"])
        return mine

    def _restore_federation(self, own: dict[str, Any]) -> None:
        federation = self.runtime.federation
        step = int(own["federation"]["last_synced_step"])
        unit_sizes = self.runtime.backend.unit_sizes(self.runtime.model.module)
        federation.start(self.runtime.model.local_shards(), step, unit_sizes=unit_sizes)
        groups = self.groups.num_groups
        federation.load_state_dict(upgrades.federation_state(own["federation"], federation.config.fragments, groups))
        federation.load_group_state_dict(upgrades.group_state(own["group"], groups))

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.group == 0:
            super().remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        self.runtime.close()
        super().teardown()


def all_(values: list[bool]) -> bool:
    """``all`` (the name is shadowed by Lightning's argument)."""
    return all(values)


def read_checkpoint(path: Path, settings: dict[str, Any], num_groups: int) -> dict[str, Any]:
    """Every group's own part of a simulation checkpoint, checked against this simulation's settings first.

    Raises:
        ValueError: If the file is not a simulation checkpoint, or was written with other settings.
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    # Version 1 held the simulation alone; version 2 holds it inside a checkpoint of the consensus.
    saved = checkpoint.get(SIMULATION_KEY, checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict) or "groups" not in saved or "settings" not in saved:
        raise ValueError(f"{str(path)!r} is not a checkpoint of `fedshard simulate` (it holds no groups).")
    differences = {
        key: (saved["settings"].get(key), value)
        for key, value in settings.items()
        if saved["settings"].get(key) != value
    }
    if differences or len(saved["groups"]) != num_groups:
        shown = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differences.items())
        raise ValueError(f"Checkpoint {str(path)!r} was written by a simulation with other settings ({shown}).")
    return saved
