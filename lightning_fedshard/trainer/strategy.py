"""FL+FSDP and FL+HSDP strategies for the Lightning ``Trainer``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
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
from lightning_fedshard._federated import FederatedStrategyMixin
from lightning_fedshard.checkpoint import is_peer_failure, peer_failure_message, unsafe_to_save
from lightning_fedshard.core.config import OuterOptimizerSpec

if TYPE_CHECKING:
    from lightning.pytorch.strategies.fsdp import _POLICY
    from torch.distributed.fsdp.fully_sharded_data_parallel import CPUOffload, MixedPrecision

log = logging.getLogger(__name__)


class _FederatedFSDPStrategy(FederatedStrategyMixin, FSDPStrategy):
    """Shared machinery of :class:`FLFSDPStrategy` and :class:`FLHSDPStrategy`; see their docstrings."""

    # Lightning refuses FSDP on CPU for names in FSDPStrategy's own list; each subclass keeps its own.
    _registered_strategies: list[str] = []

    def __init__(
        self,
        num_groups: int | None = None,
        shard_size: int | None = None,
        sync_every: int = 8,
        outer_optimizer: OuterOptimizerSpec = "fedavg",
        reduce_dtype: str | torch.dtype = "float32",
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
        auto_wrap_policy: _POLICY | str | list[str] | None = None,
        activation_checkpointing_policy: _POLICY | str | list[str] | None = None,
        sharding_strategy: str | None = None,
        state_dict_type: Literal["full", "sharded"] = "full",
        **kwargs: Any,
    ) -> None:
        self._init_federation(
            num_groups, shard_size, sync_every, outer_optimizer, reduce_dtype, anchor_device, on_nonfinite,
            sharding_strategy, kwargs,
        )  # fmt: skip
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
            auto_wrap_policy=self._resolve_module_classes(auto_wrap_policy),
            activation_checkpointing_policy=self._resolve_module_classes(
                activation_checkpointing_policy, "activation_checkpointing_policy"
            ),
            sharding_strategy="FULL_SHARD",
            state_dict_type=state_dict_type,
            **kwargs,
        )
        self._use_federated_sharding()

    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process once devices and nodes are known: validate before any rank starts.
        super()._configure_launcher()
        self._validate_topology()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_federation(self.kwargs)

    @override
    def _setup_model(self, model: Module) -> Module:
        return self._wrap(model, self.kwargs, super()._setup_model)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._wrap_context_kwargs(self.kwargs)):
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        _attach_outer_sync(trainer)
        super().setup(trainer)

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

    def _consensus(self) -> AbstractContextManager[None]:
        return self._federation.consensus_weights() if self._federation is not None else nullcontext()

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
        outer_optimizer: ``"fedavg"`` (default; ``SGD(lr=1.0)``: plain averaging, as in the paper's runs and best
            in our benchmarks at ``sync_every=8``, see docs/benchmarks.md), ``"nesterov"``
            (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's outer step, tuned for hundreds of inner steps) or
            a callable that builds a ``torch.optim.Optimizer`` from an iterable of tensors.
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
        auto_wrap_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`; layer classes may also be given
            by import path, e.g. ``["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]``.
        activation_checkpointing_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"FULL_SHARD"`` (the default) for FL+FSDP.
        state_dict_type: ``"full"`` (default) or ``"sharded"`` checkpoints; both resume exactly (see
            docs/checkpoints.md).
        **kwargs: Passed on to :class:`~lightning.pytorch.strategies.FSDPStrategy` and torch FSDP, except
            ``device_mesh`` and ``process_group``, which the federation builds itself.
    """

    strategy_name = "fl_fsdp"
    hybrid = False
    _registered_strategies: list[str] = []

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
        outer_optimizer: ``"fedavg"`` (default; ``SGD(lr=1.0)``: plain averaging, as in the paper's runs and best
            in our benchmarks at ``sync_every=8``, see docs/benchmarks.md), ``"nesterov"``
            (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's outer step, tuned for hundreds of inner steps) or
            a callable that builds a ``torch.optim.Optimizer`` from an iterable of tensors.
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
        auto_wrap_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`; layer classes may also be given
            by import path, e.g. ``["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]``.
        activation_checkpointing_policy: See :class:`~lightning.pytorch.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"HYBRID_SHARD"`` (the default) for FL+HSDP.
        state_dict_type: ``"full"`` (default) or ``"sharded"`` checkpoints; both resume exactly (see
            docs/checkpoints.md).
        **kwargs: Passed on to :class:`~lightning.pytorch.strategies.FSDPStrategy` and torch FSDP, except
            ``device_mesh`` and ``process_group``, which the federation builds itself.
    """

    strategy_name = "fl_hsdp"
    hybrid = True
    _registered_strategies: list[str] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "fl_hsdp", "FL+HSDP: HSDP inside federation groups, outer steps between")


def _attach_outer_sync(trainer: Trainer) -> None:
    from lightning.pytorch.callbacks import Checkpoint

    from lightning_fedshard.trainer.callback import OuterSync

    callbacks: list = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    if not any(isinstance(cb, OuterSync) for cb in callbacks):
        # Before the checkpoint callbacks: a checkpoint of a sync step then holds the synced state, and a failed
        # (non-finite) sync stops training before a checkpoint of the broken weights is written.
        first_checkpoint = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
        callbacks.insert(first_checkpoint, OuterSync())


def federated_strategy(trainer: Trainer) -> _FederatedFSDPStrategy:
    """The trainer's federated strategy, or a clear error if it uses another strategy."""
    strategy = trainer.strategy
    if not isinstance(strategy, _FederatedFSDPStrategy):
        raise TypeError(
            f"`OuterSync` needs the 'fl_fsdp' or 'fl_hsdp' strategy, but the trainer uses {type(strategy).__name__}."
        )
    return strategy


__all__ = ["FLFSDPStrategy", "FLHSDPStrategy", "federated_strategy"]
