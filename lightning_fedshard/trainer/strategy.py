"""FL+FSDP and FL+HSDP strategies for the Lightning ``Trainer``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard._compat import cpu_safe_full_state_dict
from lightning_fedshard.checkpoint import FederationCheckpointer, is_peer_failure, peer_failure_message, unsafe_to_save
from lightning_fedshard.core.config import FederationConfig, OuterOptimizerSpec
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.fsdp import free_unsharded_params, fsdp_device_id, local_shards
from lightning_fedshard.core.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.topology import FederationTopology

if TYPE_CHECKING:
    from lightning.pytorch.strategies.fsdp import _POLICY
    from torch.distributed.fsdp.fully_sharded_data_parallel import CPUOffload, MixedPrecision

log = logging.getLogger(__name__)


class _FederatedFSDPStrategy(FSDPStrategy):
    """Shared machinery of :class:`FLFSDPStrategy` and :class:`FLHSDPStrategy`; see their docstrings."""

    #: HYBRID_SHARD inside a group (FL+HSDP) or FULL_SHARD (FL+FSDP).
    hybrid: ClassVar[bool] = False
    # Lightning refuses FSDP on CPU for names in FSDPStrategy's own list; each subclass keeps its own.
    _registered_strategies: ClassVar[list[str]] = []

    def __init__(
        self,
        num_groups: int | None = None,
        shard_size: int | None = None,
        sync_every: int = 8,
        outer_optimizer: OuterOptimizerSpec = "nesterov",
        reduce_dtype: str = "float32",
        anchor_device: Literal["cpu", "device"] = "cpu",
        on_nonfinite: Literal["raise", "skip_group"] = "raise",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: _POLICY | None = None,
        activation_checkpointing_policy: _POLICY | None = None,
        sharding_strategy: str | None = None,
        state_dict_type: Literal["full", "sharded"] = "full",
        **kwargs: Any,
    ) -> None:
        _reject_own_mesh(kwargs)
        self.federation_config = FederationConfig(
            num_groups=num_groups,
            shard_size=shard_size,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            reduce_dtype=reduce_dtype,
            anchor_device=anchor_device,
            on_nonfinite=on_nonfinite,
        )
        if not self.hybrid and shard_size is not None:
            raise ValueError(
                f"`shard_size={shard_size}` is only for FL+HSDP; FL+FSDP shards over the whole group."
                " Use `strategy='fl_hsdp'` to replicate inside a group."
            )
        expected = "HYBRID_SHARD" if self.hybrid else "FULL_SHARD"
        _check_sharding_strategy(sharding_strategy, expected)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing_policy=activation_checkpointing_policy,
            # HYBRID_SHARD is refused here until a process group exists; it is set after the super call.
            sharding_strategy="FULL_SHARD",
            state_dict_type=state_dict_type,
            **kwargs,
        )
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = ShardingStrategy[expected]
        self._topology: FederationTopology | None = None
        self._mesh: FederationMesh | None = None
        self._federation: Federation | None = None

    # -- topology ---------------------------------------------------------------------------------------------

    @property
    def topology(self) -> FederationTopology:
        """Groups, replicas and shards of this job (known once the Trainer has set devices and nodes)."""
        if self._topology is None:
            self._topology = self._resolve_topology()
        return self._topology

    @property
    def mesh(self) -> FederationMesh:
        """The federation device mesh; exists after the processes have initialized."""
        if self._mesh is None:
            raise RuntimeError("Accessing the federation mesh before processes have initialized is not allowed.")
        return self._mesh

    @property
    def federation(self) -> Federation:
        """This rank's federation runtime (outer step and schedule)."""
        if self._federation is None:
            raise RuntimeError("Accessing the federation before processes have initialized is not allowed.")
        return self._federation

    def _resolve_topology(self) -> FederationTopology:
        config = self.federation_config
        world_size = self.num_nodes * self.num_processes
        num_groups = config.num_groups or self.num_nodes
        if world_size % num_groups:
            raise ValueError(
                f"The world size ({world_size} = {self.num_nodes} node(s) x {self.num_processes} device(s)) must be"
                f" divisible by `num_groups={num_groups}`."
            )
        group_size = world_size // num_groups
        shard_size = (config.shard_size or self.num_processes) if self.hybrid else group_size
        return FederationTopology(world_size=world_size, num_groups=num_groups, shard_size=shard_size)

    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process once devices and nodes are known: validate before any rank starts.
        super()._configure_launcher()
        self._topology = self._resolve_topology()
        if self._topology.num_groups == 1:
            kind = "HSDP" if self.hybrid else "FSDP"
            rank_zero_warn(
                f"`{self.strategy_name}` with a single federation group ({self._topology}) is plain {kind}:"
                " there is nothing to federate. Set `num_groups` > 1 to get federated training."
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._topology = self._resolve_topology()
        self._mesh = build_federation_mesh(self._topology, self.root_device.type)
        self._federation = Federation(self.federation_config, self._mesh.communicator())
        self.kwargs["process_group"] = self._mesh.fsdp_process_group(self.hybrid)
        log.info(f"{type(self).__name__}: rank {self.global_rank} at {self._mesh.coords} of {self._topology}")

    # -- wrapping ---------------------------------------------------------------------------------------------

    @override
    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        already_wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self.root_device.type == "cpu" and not already_wrapped:
            # Lightning passes `device_id=None` on CPU, which FSDP refuses; wrap here with the CPU device.
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=fsdp_device_id(self.root_device),
                **self.kwargs,
            )
            _move_torchmetrics_to_device(model, self.root_device)
            _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        else:
            model = super()._setup_model(model)
        self._synchronize_initial_weights(model)
        return model

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=fsdp_device_id(self.root_device),
            **self.kwargs,
        ):
            yield

    @torch.no_grad()
    def _synchronize_initial_weights(self, model: Module) -> None:
        """All groups and replicas start from the same weights, whatever each process initialized."""
        self.mesh.broadcast_shards(local_shards(model))
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)

    # -- the outer step, driven by the OuterSync callback -----------------------------------------------------

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's flat parameter shards of the wrapped model."""
        assert self.model is not None
        return local_shards(self.model)

    def free_unsharded_params(self) -> None:
        """Make the next forward gather the (just rewritten) shards instead of reusing gathered weights."""
        assert self.model is not None
        free_unsharded_params(self.model)

    # -- checkpoints: the consensus as the model, every group's own state beside it (see checkpoint.py) ----------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict holding the consensus (the anchor of the last sync), in Lightning's key layout."""
        if unsafe_to_save(sys.exc_info()[1]) is not None:
            return {}  # `save_checkpoint` will skip this save; gathering now could only fail or store broken weights
        with self._consensus(), cpu_safe_full_state_dict(self.root_device):
            return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """This rank's own inner optimizer state; :meth:`save_checkpoint` files it under the rank's group."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        # `sys.exc_info()` is set while Lightning runs `on_exception` hooks such as `OnExceptionCheckpoint`.
        reason = unsafe_to_save(sys.exc_info()[1])
        if reason is not None:
            rank_zero_warn(f"Not saving checkpoint {str(filepath)!r}: {reason}")
            return
        optimizer_states = checkpoint.pop("optimizer_states", [])
        self.checkpointer.save(checkpoint, self.broadcast(filepath), self._state_dict_type, optimizer_states)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self.checkpointer.load(
            self.broadcast(checkpoint_path),
            optimizers=self.optimizers if fitting else None,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    @override
    def barrier(self, name: str | None = None) -> None:
        if is_peer_failure(sys.exc_info()[1]):
            return  # handling a failed collective (e.g. the barrier after `OnExceptionCheckpoint`): it would fail too
        super().barrier(name)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if is_peer_failure(exception):
            message = peer_failure_message(exception, self.global_rank)
            log.error(message)
            if hasattr(exception, "add_note"):  # Python >= 3.11: shown under the traceback
                exception.add_note(message)

    @property
    def checkpointer(self) -> FederationCheckpointer:
        """Saves and loads this rank's federation state with the model (see :mod:`lightning_fedshard.checkpoint`)."""
        assert self.model is not None
        return FederationCheckpointer(
            self.mesh.topology, self.hybrid, self.global_rank, self.federation, self.model, self.free_unsharded_params
        )

    def _consensus(self) -> AbstractContextManager[None]:
        return self._federation.consensus_weights() if self._federation is not None else nullcontext()

    @override
    def setup(self, trainer: Trainer) -> None:
        _attach_outer_sync(trainer)
        super().setup(trainer)

    @classmethod
    def _register(cls, strategy_registry: _StrategyRegistry, name: str, description: str) -> None:
        if not dist.is_available():
            return
        if name not in strategy_registry:
            strategy_registry.register(name, cls, description=description)
        if name not in cls._registered_strategies:
            cls._registered_strategies.append(name)


class FLFSDPStrategy(_FederatedFSDPStrategy):
    """FL+FSDP: FSDP (FULL_SHARD) inside federation groups, periodic outer steps between them.

    The ranks are cut into ``num_groups`` groups of consecutive ranks. Each group trains its own copy of the model
    with FSDP over its ranks; there is no traffic between groups except every ``sync_every`` optimizer steps,
    when the groups merge their weights with an outer optimizer step computed on local shards. The batch behind
    one optimizer step is bounded by the group, not by the cluster. An :class:`~lightning_fedshard.OuterSync`
    callback is attached automatically.

    Args:
        num_groups: Number of federation groups. Default: one group per node (``num_nodes``).
        shard_size: Not used by FL+FSDP (it shards over the whole group); passing it raises ``ValueError``.
        sync_every: Optimizer steps between two outer steps (the paper's ``H``; default 8).
        outer_optimizer: ``"nesterov"`` (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo), ``"fedavg"``
            (``SGD(lr=1.0)``: plain averaging, as in the paper's runs) or a callable that builds a
            ``torch.optim.Optimizer`` from an iterable of tensors.
        reduce_dtype: Data type of the outer all-reduce: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        anchor_device: Where the anchor and outer optimizer state live: ``"cpu"`` (default) or ``"device"``.
        on_nonfinite: ``"raise"`` (default): a NaN/Inf pseudo-gradient stops training with an error naming the
            groups, the step and the sync, leaving the anchor and the last checkpoint untouched. ``"skip_group"``:
            average over the healthy groups only and restart the broken ones (weights from the new anchor, fresh
            inner optimizer state), with a warning.
        accelerator: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        parallel_devices: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        cluster_environment: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        checkpoint_io: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        precision_plugin: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        process_group_backend: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        timeout: Timeout of collective operations: if a rank dies, the others stop with an error within it.
        cpu_offload: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        mixed_precision: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        auto_wrap_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        activation_checkpointing_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"FULL_SHARD"`` (the default) for FL+FSDP.
        state_dict_type: ``"full"`` (default) or ``"sharded"`` checkpoints; both resume exactly (see
            docs/checkpoints.md).
        **kwargs: Passed on to :class:`~lightning.pytorch.strategies.FSDPStrategy` and torch FSDP, except
            ``device_mesh`` and ``process_group``, which the federation builds itself.
    """

    strategy_name = "fl_fsdp"
    hybrid = False
    _registered_strategies: ClassVar[list[str]] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "fl_fsdp", "FL+FSDP: FSDP inside federation groups, outer steps between")


class FLHSDPStrategy(_FederatedFSDPStrategy):
    """FL+HSDP: HSDP (HYBRID_SHARD) inside federation groups, periodic outer steps between them.

    Like :class:`FLFSDPStrategy`, but inside a group the model is sharded over ``shard_size`` ranks (normally the
    devices of one node) and replicated across the group's ``group_size / shard_size`` replicas, so per-step
    traffic crosses nodes only inside a group. The device mesh has shape ``(num_groups, replicas, shard_size)``
    with axes ``("fed", "replicate", "shard")``.

    Args:
        num_groups: Number of federation groups. Default: one group per node (``num_nodes``).
        shard_size: Ranks that shard one replica. Default: the devices of one node.
        sync_every: Optimizer steps between two outer steps (the paper's ``H``; default 8).
        outer_optimizer: ``"nesterov"`` (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo), ``"fedavg"``
            (``SGD(lr=1.0)``: plain averaging, as in the paper's runs) or a callable that builds a
            ``torch.optim.Optimizer`` from an iterable of tensors.
        reduce_dtype: Data type of the outer all-reduce: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        anchor_device: Where the anchor and outer optimizer state live: ``"cpu"`` (default) or ``"device"``.
        on_nonfinite: ``"raise"`` (default): a NaN/Inf pseudo-gradient stops training with an error naming the
            groups, the step and the sync, leaving the anchor and the last checkpoint untouched. ``"skip_group"``:
            average over the healthy groups only and restart the broken ones (weights from the new anchor, fresh
            inner optimizer state), with a warning.
        accelerator: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        parallel_devices: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        cluster_environment: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        checkpoint_io: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        precision_plugin: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        process_group_backend: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        timeout: Timeout of collective operations: if a rank dies, the others stop with an error within it.
        cpu_offload: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        mixed_precision: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        auto_wrap_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        activation_checkpointing_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"HYBRID_SHARD"`` (the default) for FL+HSDP.
        state_dict_type: ``"full"`` (default) or ``"sharded"`` checkpoints; both resume exactly (see
            docs/checkpoints.md).
        **kwargs: Passed on to :class:`~lightning.pytorch.strategies.FSDPStrategy` and torch FSDP, except
            ``device_mesh`` and ``process_group``, which the federation builds itself.
    """

    strategy_name = "fl_hsdp"
    hybrid = True
    _registered_strategies: ClassVar[list[str]] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "fl_hsdp", "FL+HSDP: HSDP inside federation groups, outer steps between")


def _reject_own_mesh(kwargs: dict[str, Any]) -> None:
    for key in ("device_mesh", "process_group"):
        if kwargs.get(key) is not None:
            raise ValueError(
                f"`{key}={kwargs[key]!r}` cannot be combined with a federated strategy: it builds its own mesh"
                " from `num_groups` and `shard_size`."
            )


def _check_sharding_strategy(value: object, expected: str) -> None:
    if value is None:
        return
    name = getattr(value, "name", value)
    if name != expected:
        raise ValueError(f"`sharding_strategy={value!r}` is not supported here; this strategy uses {expected!r}.")


def _attach_outer_sync(trainer: Trainer) -> None:
    from lightning.pytorch.callbacks import Checkpoint

    from lightning_fedshard.trainer.callback import OuterSync

    if not any(isinstance(cb, OuterSync) for cb in trainer.callbacks):
        # Before the checkpoint callbacks: a checkpoint of a sync step then holds the synced state, and a failed
        # (non-finite) sync stops training before a checkpoint of the broken weights is written.
        first_checkpoint = next(
            (i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks)
        )
        trainer.callbacks.insert(first_checkpoint, OuterSync())


def federated_strategy(trainer: Trainer) -> _FederatedFSDPStrategy:
    """The trainer's federated strategy, or a clear error if it uses another strategy."""
    strategy = trainer.strategy
    if not isinstance(strategy, _FederatedFSDPStrategy):
        raise TypeError(
            f"`OuterSync` needs the 'fl_fsdp' or 'fl_hsdp' strategy, but the trainer uses {type(strategy).__name__}."
        )
    return strategy


__all__ = ["FLFSDPStrategy", "FLHSDPStrategy", "federated_strategy"]
