"""FL+FSDP and FL+HSDP strategies for Lightning Fabric."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import FSDPStrategy, _StrategyRegistry
from lightning.fabric.utilities.types import Optimizable
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard._federated import FederatedStrategyMixin
from lightning_fedshard.core.config import OuterOptimizerSpec
from lightning_fedshard.core.outer import SyncStats

if TYPE_CHECKING:
    from lightning.fabric.strategies.fsdp import _POLICY
    from torch.distributed.fsdp.fully_sharded_data_parallel import CPUOffload, MixedPrecision


class _FederatedFabricStrategy(FederatedStrategyMixin, FSDPStrategy):
    """Shared machinery of the Fabric :class:`FLFSDPStrategy` and :class:`FLHSDPStrategy`.

    The outer step runs inside every ``sync_every``-th ``optimizer.step()``. After the training loop, call
    :meth:`finish` once so that every group holds the consensus (it syncs if the loop stopped between two syncs).
    Evaluate between syncs inside :meth:`consensus_weights` to see the consensus instead of the group's weights.
    Only one optimizer is supported: every ``optimizer.step()`` counts as one step.
    """

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
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: _POLICY | str | list[str] | None = None,
        activation_checkpointing_policy: _POLICY | str | list[str] | None = None,
        sharding_strategy: str | None = None,
        state_dict_type: Literal["full", "sharded"] = "sharded",
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
            precision=precision,
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
        self.num_steps = 0
        self.last_sync_stats: SyncStats | None = None
        self._optimizer: Optimizer | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._validate_topology()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_federation(self._fsdp_kwargs)

    @override
    def setup_module(self, module: Module) -> Module:
        if self._wrapped is not None:
            raise RuntimeError(
                f"`{type(self).__name__}` federates one model: `setup_module` was already called. Put all trainable"
                " modules into one `nn.Module` before setting it up."
            )
        module = self._wrap(module, self._fsdp_kwargs, super().setup_module)
        self.start_federation(self.num_steps)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # Every optimizer.step() counts as one step of the sync schedule, so a second optimizer would double it.
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise RuntimeError(
                f"`{type(self).__name__}` supports one optimizer; use parameter groups instead of a second optimizer."
            )
        self._optimizer = optimizer
        return super().setup_optimizer(optimizer)

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._wrap_context_kwargs(self._fsdp_kwargs))

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.num_steps += 1
        stats = self.federation.maybe_sync(self.num_steps)
        if stats is not None:
            self.last_sync_stats = stats
        return output

    def finish(self) -> SyncStats | None:
        """End of training: sync once more if the loop stopped between two syncs (collective).

        Afterwards every group holds the consensus. Returns the statistics of that sync, or ``None`` if the last
        optimizer step already ended with one.
        """
        stats = self.federation.finish(self.num_steps)
        if stats is not None:
            self.last_sync_stats = stats
        return stats

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Evaluate on the consensus of the last sync; the group's own weights come back on exit."""
        with self.federation.consensus_weights():
            yield

    @classmethod
    def _register(cls, strategy_registry: _StrategyRegistry, name: str, description: str) -> None:
        if dist.is_available() and name not in strategy_registry:
            strategy_registry.register(name, cls, description=description)


class FLFSDPStrategy(_FederatedFabricStrategy):
    """FL+FSDP for Fabric: FSDP (FULL_SHARD) inside federation groups, an outer step every ``sync_every`` steps.

    Same federation arguments as :class:`lightning_fedshard.FLFSDPStrategy` (the Trainer strategy); the others are
    those of :class:`lightning.fabric.strategies.FSDPStrategy`. See :class:`_FederatedFabricStrategy` for the
    loop contract (:meth:`finish` after the loop).

    Args:
        num_groups: Number of federation groups. Default: one group per node.
        shard_size: Not used by FL+FSDP; passing it raises ``ValueError``.
        sync_every: Optimizer steps between two outer steps (default 8).
        outer_optimizer: ``"fedavg"`` (default), ``"nesterov"`` or a callable building an optimizer from tensors.
        reduce_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"`` for the outer all-reduce.
        anchor_device: ``"cpu"`` (default) or ``"device"``: where the anchor and outer state live.
        on_nonfinite: ``"raise"`` (default) or ``"skip_group"``: what a NaN/Inf pseudo-gradient does.
        accelerator: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        parallel_devices: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        cluster_environment: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        precision: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        process_group_backend: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        timeout: Timeout of collective operations.
        cpu_offload: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        mixed_precision: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        auto_wrap_policy: See :class:`lightning.fabric.strategies.FSDPStrategy`; layer classes may also be given
            by import path.
        activation_checkpointing_policy: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"FULL_SHARD"`` (the default).
        state_dict_type: ``"sharded"`` (default) or ``"full"`` checkpoints.
        **kwargs: Passed on to torch FSDP, except ``device_mesh`` and ``process_group``.
    """

    strategy_name = "fl_fsdp"
    hybrid = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "fl_fsdp", "FL+FSDP: FSDP inside federation groups, outer steps between")


class FLHSDPStrategy(_FederatedFabricStrategy):
    """FL+HSDP for Fabric: HSDP (HYBRID_SHARD) inside federation groups, an outer step every ``sync_every`` steps.

    Same federation arguments as :class:`lightning_fedshard.FLHSDPStrategy` (the Trainer strategy); the others are
    those of :class:`lightning.fabric.strategies.FSDPStrategy`. See :class:`_FederatedFabricStrategy` for the
    loop contract (:meth:`finish` after the loop).

    Args:
        num_groups: Number of federation groups. Default: one group per node.
        shard_size: Ranks that shard one replica. Default: the devices of one node.
        sync_every: Optimizer steps between two outer steps (default 8).
        outer_optimizer: ``"fedavg"`` (default), ``"nesterov"`` or a callable building an optimizer from tensors.
        reduce_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"`` for the outer all-reduce.
        anchor_device: ``"cpu"`` (default) or ``"device"``: where the anchor and outer state live.
        on_nonfinite: ``"raise"`` (default) or ``"skip_group"``: what a NaN/Inf pseudo-gradient does.
        accelerator: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        parallel_devices: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        cluster_environment: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        precision: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        process_group_backend: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        timeout: Timeout of collective operations.
        cpu_offload: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        mixed_precision: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        auto_wrap_policy: See :class:`lightning.fabric.strategies.FSDPStrategy`; layer classes may also be given
            by import path.
        activation_checkpointing_policy: See :class:`lightning.fabric.strategies.FSDPStrategy`.
        sharding_strategy: Must be ``"HYBRID_SHARD"`` (the default).
        state_dict_type: ``"sharded"`` (default) or ``"full"`` checkpoints.
        **kwargs: Passed on to torch FSDP, except ``device_mesh`` and ``process_group``.
    """

    strategy_name = "fl_hsdp"
    hybrid = True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "fl_hsdp", "FL+HSDP: HSDP inside federation groups, outer steps between")
