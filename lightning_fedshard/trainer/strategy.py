"""FL+FSDP and FL+HSDP strategies for the Lightning ``Trainer``, on FSDP1 (``fl_fsdp``) and FSDP2 (``fl_fsdp2``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# Private names: Lightning types its own strategy hooks with them and exports no public alias.
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard._arguments import (
    FSDP1_ARGS_DOC,
    FSDP2_ARGS_DOC,
    FederatedArguments,
    FSDP1Arguments,
    FSDP2Arguments,
    document_federation_args,
)
from lightning_fedshard.checkpoint import is_peer_failure, peer_failure_message, unsafe_to_save
from lightning_fedshard.core.backends.fsdp2 import parameter_roots
from lightning_fedshard.trainer.callback import OuterSync
from lightning_fedshard.trainer.meetings import (
    decide_at_syncs,
    keep_sigterm_in_group,
    meetings_between_syncs,
    restore_callbacks,
)

log = logging.getLogger(__name__)


class _TrainerHooks(FederatedArguments):
    """The Trainer's hooks routed to the runtime, whatever shards the model (no @override: no such base here)."""

    #: Callbacks whose per-batch decision waits for the ends of rounds while fitting (see `trainer/meetings.py`).
    _deferred_callbacks: list[Callback] = []
    #: The Trainer's `OuterSync`, which knows whether the loop is inside an epoch's training batches.
    _outer_sync: OuterSync | None = None

    # Provided by Lightning's strategy classes.
    lightning_module: Any
    optimizers: list[Optimizer]
    global_rank: int
    world_size: int
    root_device: torch.device
    broadcast: Any

    def __repr__(self) -> str:
        # Fabric quotes this when it is handed a Trainer strategy ("You selected an invalid strategy name: ...").
        name = type(self).__name__
        return (
            f"<lightning_fedshard.{name} for the Trainer; under Fabric use lightning_fedshard.fabric.{name} or"
            f" strategy={self.strategy_name!r}>"
        )

    def _begin_setup(self, trainer: Trainer) -> None:
        """Before Lightning's ``setup`` of one entry point (``fit``, ``validate``, ``test``, ``predict``).

        The model federated by an earlier entry point of this Trainer stays federated (sharded once, its anchor and
        outer state kept); a different LightningModule gets a new federation.
        """
        self._outer_sync = place_outer_sync_first(trainer)
        if not self.runtime.model.holds(self.lightning_module):
            self.runtime.release_model()
        if self.runtime.config.elastic is not None:
            self.runtime.set_host_state(lambda: _loop_state(trainer), lambda state: _load_loop_state(trainer, state))
        keep_sigterm_in_group(trainer, lambda: self.runtime.fsdp_process_group)
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_pace_with_manual_optimization(self.lightning_module, self.runtime.config.pace)
            self._meet_only_at_syncs(trainer)

    def _meet_only_at_syncs(self, trainer: Trainer) -> None:
        """Keep Lightning's per-batch decisions off the steps between syncs; warn of settings that meet there."""
        restore_callbacks(self._deferred_callbacks)
        if self.runtime.topology.num_groups == 1:
            self._deferred_callbacks = []
            return  # one group in this world (one group, or an elastic group's own job): nothing to keep apart
        period = self.runtime.config.outer_period
        self._deferred_callbacks = decide_at_syncs(trainer, period)
        for message in meetings_between_syncs(trainer, period):
            rank_zero_warn(message)

    def _end_setup(self, trainer: Trainer) -> None:
        """After Lightning's ``setup``: an elastic standby waits for a place, before ``fit`` splits the data by group.

        The model, optimizers and data module are ready by then; if the federation ends first, ``fit`` stops without
        training.
        """
        if trainer.state.fn == TrainerFn.FITTING and not self.runtime.stand_by():
            trainer.should_stop = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``, unless this group skips the step (a per-group pace, see ``Pace``)."""
        module = self.lightning_module
        if not self.runtime.trains(module.trainer.global_step + 1):
            return skipped_step_loss(module)
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce; inside an epoch's training batches, over the group's own ranks: a metric of the group.

        ``self.log(..., sync_dist=True)`` in ``training_step`` reduces at every step; over every group it would make
        all of them wait for the slowest at every step (and with a per-group pace for one that skips the step). The
        value logged by global rank 0 is therefore group 0's. An epoch's metrics (``on_epoch=True``) are reduced once
        its batches are done, where every group meets: over the world, as under DDP. Validation and testing evaluate
        the consensus on a validation set split over every rank, and reduce over every group as usual.
        """
        if group is None and self._inside_training_batches():
            process_groups = self.runtime.fsdp_process_group
            for process_group in process_groups if isinstance(process_groups, tuple) else (process_groups,):
                tensor = super().reduce(tensor, group=process_group, reduce_op=reduce_op)  # type: ignore[misc]
            return tensor
        return super().reduce(tensor, group, reduce_op)  # type: ignore[misc]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's vote (``all`` or any), over every rank of every group wherever it is taken, as under DDP.

        ``ModelCheckpoint`` and ``EarlyStopping`` vote where every group meets anyway (a checkpoint, the end of an
        epoch or of validation), and every rank must reach the same decision: a save or a stop that one group takes
        and another does not is a collective that some ranks never enter.
        """
        votes = torch.tensor(int(decision), device=self.root_device)
        votes = super().reduce(votes, reduce_op=dist.ReduceOp.SUM)  # type: ignore[misc]  # over the world
        return bool(votes == self.world_size) if all else bool(votes)

    def _inside_training_batches(self) -> bool:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        boundary = self._outer_sync.epoch_boundary if self._outer_sync is not None else None
        return trainer is not None and trainer.training and boundary is not None and boundary.inside

    def process_dataloader(self, dataloader: object) -> object:
        """Elastic: the group joins the federation when ``fit`` asks for its training data.

        This is the last moment before the loop commits to a position, and the first after a checkpoint was restored:
        a group that heals takes a peer's loops (its step, epoch and batch position, and the data loader's position if
        the loader is resumable) and learning-rate schedules here, as if it resumed from the peer's checkpoint.
        """
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if (
            self.runtime.config.elastic is not None
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.training
            and not self.runtime.joined
            and not self.runtime.standing_by
        ):
            self.runtime.model.set_optimizers(trainer.optimizers)
            self.runtime.join(trainer.global_step)
            if self.runtime.standing_by:  # a standby whose federation ended as it took a place
                trainer.should_stop = True
        return dataloader

    def teardown(self) -> None:
        restore_callbacks(self._deferred_callbacks)
        self._deferred_callbacks = []
        self.runtime.close()  # elastic: this group leaves (a later `fit` joins again)
        super().teardown()  # type: ignore[misc]

    # -- checkpoints: the consensus as the model, every group's own state beside it (lightning_fedshard/checkpoint/) ---

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict holding the consensus (the anchor of the last sync), in Lightning's key layout."""
        if unsafe_to_save(sys.exc_info()[1]) is not None:
            return {}  # `save_checkpoint` will skip this save; gathering now could only fail or store broken weights
        return self.runtime.checkpointer.consensus_state_dict(self._state_dict_type)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """This rank's own inner optimizer state; :meth:`save_checkpoint` files it under the rank's group."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return optimizer.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        # `sys.exc_info()` is set while Lightning runs `on_exception` hooks such as `OnExceptionCheckpoint`.
        reason = unsafe_to_save(sys.exc_info()[1])
        if reason is not None:
            rank_zero_warn(f"Not saving checkpoint {str(filepath)!r}: {reason}")
            return
        optimizer_states = checkpoint.pop("optimizer_states", [])
        # Each group's inner optimizer state is saved in the federation's entries. A plain strategy (e.g. "ddp")
        # that resumes this checkpoint restores the consensus, the loops and the schedulers, and starts its
        # optimizer afresh, where a missing key would fail with an unrelated message (docs/checkpoints.md).
        checkpoint["optimizer_states"] = []
        self.runtime.checkpointer.save(checkpoint, self.broadcast(filepath), self._state_dict_type, optimizer_states)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self.runtime.checkpointer.load(
            self.broadcast(checkpoint_path),
            optimizers=self.optimizers if fitting else None,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    def barrier(self, name: str | None = None) -> None:
        if is_peer_failure(sys.exc_info()[1]):
            return  # handling a failed collective (e.g. the barrier after `OnExceptionCheckpoint`): it would fail too
        super().barrier(name)  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        if is_peer_failure(exception):
            message = peer_failure_message(exception, self.global_rank)
            log.error(message)
            if hasattr(exception, "add_note"):  # Python >= 3.11: shown under the traceback
                exception.add_note(message)


class GroupNormFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP1 precision, with gradient clipping by norm: the norm of the group's whole model.

    Lightning's own ``FSDPPrecision`` refuses ``gradient_clip_algorithm="norm"`` because it holds no reference to the
    root FSDP module, whose ``clip_grad_norm_`` is the correct clip of a sharded model; the federation strategies
    give it theirs. The norm is computed over the group's shards (FSDP's process group), never across groups.

    Args:
        plugin: The precision plugin Lightning chose (its precision and gradient scaler are kept).
        root: Returns the root FSDP module of the group's model.
    """

    def __init__(self, plugin: FSDPPrecision, root: Callable[[], Module]) -> None:
        super().__init__(plugin.precision, plugin.scaler)  # type: ignore[arg-type]
        self._root = root

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        root = self._root()
        if not isinstance(root, FullyShardedDataParallel):
            raise TypeError(f"Clipping by norm needs the root FSDP module; the model is a {type(root).__name__}.")
        root.clip_grad_norm_(clip_val)


class _FederatedFSDPStrategy(_TrainerHooks, FSDP1Arguments, FSDPStrategy):
    """What :class:`FLFSDPStrategy` and :class:`FLHSDPStrategy` share: Lightning's FSDP1 strategy, federated."""

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> FSDPPrecision:
        plugin = FSDPStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]
        if not isinstance(plugin, GroupNormFSDPPrecision):
            plugin = self._precision_plugin = GroupNormFSDPPrecision(plugin, lambda: self.runtime.model.module)
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        FSDPStrategy.precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]

    @property
    def _fsdp_options(self) -> dict[str, Any]:
        return self.kwargs

    @override
    def _setup_model(self, model: Module) -> Module:
        # Private hook: Lightning's only place where the model is wrapped by FSDP (and the CPU device_id is needed).
        return self._federated_wrap(model, super()._setup_model)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with self._enable_wrap():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        self._begin_setup(trainer)
        super().setup(trainer)
        self._end_setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if not dist.is_available():
            return
        _register(cls, strategy_registry)
        # Lightning refuses FSDP on CPU for the names in FSDPStrategy's own `_registered_strategies` (a private list
        # with no public accessor); each concrete class keeps a list of its own so that CPU runs are allowed.
        if cls.strategy_name not in cls._registered_strategies:
            cls._registered_strategies.append(cls.strategy_name)


class _FederatedFSDP2Strategy(_TrainerHooks, FSDP2Arguments, ModelParallelStrategy):
    """What :class:`FLFSDP2Strategy` and :class:`FLHSDP2Strategy` share: Lightning's FSDP2 strategy, federated.

    Unlike Lightning's ``ModelParallelStrategy`` it needs no ``configure_model``: a model that is not sharded yet is
    sharded here, one ``fully_shard`` unit per ``fsdp_modules`` module and per child of the LightningModule that
    holds parameters (the LightningModule's own forward is never called by the Trainer).
    """

    @override
    def setup(self, trainer: Trainer) -> None:
        # Replaces ModelParallelStrategy.setup, which insists on an overridden `configure_model`; the steps are its own.
        from lightning.fabric.utilities.optimizer import _optimizers_to_device  # private: Lightning's own helper

        self._begin_setup(trainer)
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        _refuse_fsdp1(self.model)
        self.model = self.runtime.model.wrap(self.model, self._shard_and_materialize)
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._end_setup(trainer)

    def _shard_and_materialize(self, model: Module) -> Module:
        # Private: Lightning's meta-device materialization (`to_empty` + `reset_parameters`), as ModelParallel uses it.
        from lightning.fabric.utilities.init import _materialize_distributed_module

        self._shard(model, parameter_roots(model))
        _materialize_distributed_module(model, self.root_device)
        model = self.precision_plugin.convert_module(model)
        return model.to(self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if dist.is_available():
            _register(cls, strategy_registry)


def _register(cls: type[FederatedArguments], strategy_registry: _StrategyRegistry) -> None:
    if cls.strategy_name not in strategy_registry:
        strategy_registry.register(cls.strategy_name, cls, description=cls.description)


def _refuse_fsdp1(model: Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "The model holds FSDP1 `FullyShardedDataParallel` modules; the FSDP2 strategies ('fl_fsdp2', 'fl_hsdp2')"
            " shard with `fully_shard`. Use 'fl_fsdp' / 'fl_hsdp' for FSDP1 models."
        )


@document_federation_args(FSDP1_ARGS_DOC)
class FLFSDPStrategy(_FederatedFSDPStrategy):
    """FL+FSDP: FSDP (FULL_SHARD) inside federation groups, periodic outer steps between them.

    The ranks are cut into ``num_groups`` groups of consecutive ranks. Each group trains its own copy of the model
    with FSDP over its ranks; there is no traffic between groups except every ``sync_every`` optimizer steps,
    when the groups merge their weights with an outer optimizer step computed on local shards. The batch behind
    one optimizer step is bounded by the group, not by the cluster. The :class:`~lightning_fedshard.OuterSync`
    callback is placed first in the Trainer's callbacks automatically, so every other callback sees synced weights.
    Every argument of Lightning's ``FSDPStrategy`` not listed below is accepted too.
    """

    strategy_name = "fl_fsdp"
    description = "FL+FSDP: FSDP inside federation groups, outer steps between"
    hybrid = False
    _registered_strategies: list[str] = []


@document_federation_args(FSDP1_ARGS_DOC)
class FLHSDPStrategy(_FederatedFSDPStrategy):
    """FL+HSDP: HSDP (HYBRID_SHARD) inside federation groups, periodic outer steps between them.

    Like :class:`FLFSDPStrategy`, but inside a group the model is sharded over ``shard_size`` ranks (normally the
    devices of one node) and replicated across the group's ``group_size / shard_size`` replicas, so per-step
    traffic crosses nodes only inside a group. The device mesh has shape ``(num_groups, replicas, shard_size)``
    with axes ``("fed", "replicate", "shard")``. Every argument of Lightning's ``FSDPStrategy`` not listed below is
    accepted too.
    """

    strategy_name = "fl_hsdp"
    description = "FL+HSDP: HSDP inside federation groups, outer steps between"
    hybrid = True
    _registered_strategies: list[str] = []


@document_federation_args(FSDP2_ARGS_DOC)
class FLFSDP2Strategy(_FederatedFSDP2Strategy):
    """FL+FSDP on FSDP2: ``fully_shard`` inside federation groups, periodic outer steps between them.

    The algorithm, the federation arguments and the checkpoints of :class:`FLFSDPStrategy`, built on Lightning's
    ``ModelParallelStrategy`` and torch's ``fully_shard`` instead of ``FullyShardedDataParallel``. Parameters are
    ``DTensor`` shards on the group's ``"shard"`` axis; the outer step runs on their local shards. A
    ``configure_model`` may shard the model itself with ``fully_shard(module, mesh=self.device_mesh)``.
    """

    strategy_name = "fl_fsdp2"
    description = "FL+FSDP on FSDP2 (fully_shard): FSDP inside federation groups, outer steps between"
    hybrid = False


@document_federation_args(FSDP2_ARGS_DOC)
class FLHSDP2Strategy(_FederatedFSDP2Strategy):
    """FL+HSDP on FSDP2: HSDP (``fully_shard`` on a 2-D mesh) inside federation groups, outer steps between them.

    Like :class:`FLHSDPStrategy`, on FSDP2: parameters are ``(Replicate(), Shard(0))`` ``DTensor`` shards on the
    group's ``("replicate", "shard")`` mesh, which is also the strategy's ``device_mesh``.
    """

    strategy_name = "fl_hsdp2"
    description = "FL+HSDP on FSDP2 (fully_shard): HSDP inside federation groups, outer steps between"
    hybrid = True


def _loop_state(trainer: Trainer) -> dict[str, Any]:
    """What a joining group takes from this one: the fit loop's position and the learning-rate schedules."""
    return {
        "fit_loop": trainer.fit_loop.state_dict(),
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }


def _load_loop_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue from a peer's loop position, as a resume from a checkpoint it saved after its last step would."""
    trainer.fit_loop.load_state_dict(state["fit_loop"])
    schedulers = trainer.lr_scheduler_configs
    if len(schedulers) != len(state["lr_schedulers"]):
        raise ValueError(
            f"This group has {len(schedulers)} learning-rate scheduler(s), the federation's"
            f" {len(state['lr_schedulers'])}."
        )
    for config, saved in zip(schedulers, state["lr_schedulers"]):
        config.scheduler.load_state_dict(saved)


def refuse_pace_with_manual_optimization(module: LightningModule, pace: Any) -> None:
    """Refuse a per-group pace for a module that steps its optimizers itself, before anything trains.

    A pace skips a slow group's steps by not running ``training_step``; under manual optimization that is where the
    optimizers step, so a skipped step would never be counted and the group would skip the same step forever.

    Raises:
        ValueError: If ``pace`` is set and ``module.automatic_optimization`` is off.
    """
    if pace is not None and not module.automatic_optimization:
        raise ValueError(
            f"`pace={pace!r}` skips a slow group's steps by not running `training_step`, but"
            f" `{type(module).__name__}` uses manual optimization (`automatic_optimization = False`): its"
            " `training_step` steps the optimizers, so a skipped step would never be counted and the group would skip"
            " it forever. Use automatic optimization with a pace, or leave `pace=None`."
        )


def skipped_step_loss(module: LightningModule) -> Tensor:
    """What a skipped step returns: a zero loss tied to no parameter.

    No forward runs; the backward and the inner optimizer's update find no gradient. Every rank of the group skips
    alike, so its collectives stay in step.
    """
    return torch.zeros((), device=module.device, requires_grad=True)


def place_outer_sync_first(trainer: Trainer) -> OuterSync:
    """Put the trainer's :class:`OuterSync` (a new one if the user gave none) first in its callback list; return it.

    Callbacks run in list order, so at a sync step every other callback (checkpoints included) sees the synced
    weights in ``on_train_batch_end``, and when ``fit`` stops mid-round every other ``on_train_end`` sees the
    consensus, whatever order the user listed them in.
    """
    callbacks: list = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    given = [cb for cb in callbacks if isinstance(cb, OuterSync)]
    if len(given) > 1:
        raise ValueError(f"The Trainer got {len(given)} `OuterSync` callbacks; give at most one.")
    for callback in given:
        callbacks.remove(callback)
    outer_sync = given[0] if given else OuterSync()
    callbacks.insert(0, outer_sync)
    return outer_sync


__all__ = [
    "FLFSDP2Strategy",
    "FLFSDPStrategy",
    "FLHSDP2Strategy",
    "FLHSDPStrategy",
    "place_outer_sync_first",
    "refuse_pace_with_manual_optimization",
]
