"""FL+FSDP and FL+HSDP strategies for Lightning Fabric."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import FSDPStrategy, _StrategyRegistry
from lightning.fabric.utilities.types import _PATH, Optimizable, _Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard._compat import cpu_safe_full_state_dict
from lightning_fedshard._federated import FederatedStrategyMixin
from lightning_fedshard.core.config import OuterOptimizerSpec
from lightning_fedshard.core.outer import SyncStats

#: Key of the Fabric strategy's own counters in a checkpoint.
_FABRIC_KEY = "fedshard_fabric"

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
            self.restart_skipped_groups(stats, [self._optimizer] if self._optimizer else [], self.num_steps)
        return output

    def finish(self) -> SyncStats | None:
        """End of training: sync once more if the loop stopped between two syncs (collective).

        Afterwards every group holds the consensus. Returns the statistics of that sync, or ``None`` if the last
        optimizer step already ended with one.
        """
        stats = self.federation.finish(self.num_steps)
        if stats is not None:
            self.last_sync_stats = stats
            self.restart_skipped_groups(stats, [self._optimizer] if self._optimizer else [], self.num_steps)
        return stats

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Evaluate on the consensus of the last sync; the group's own weights come back on exit."""
        with self.federation.consensus_weights():
            yield

    # -- checkpoints: the consensus as the model's state, every group's own state beside it (checkpoint.py) ----

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` (the federated model, its optimizer, anything else) for an exact resume; collective.

        The saved model weights are the consensus; each group's own weights and inner optimizer state, the anchor
        and the outer optimizer state are stored beside them (see docs/checkpoints.md).
        """
        if storage_options is not None or filter is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` supports neither `storage_options` nor `filter`.")
        module_key, optimizer_keys = self._federated_keys(state)
        checkpoint = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in state.items()
                      if k != module_key and k not in optimizer_keys}  # fmt: skip
        checkpoint["state_dict"] = self._consensus_state_dict()
        checkpoint[_FABRIC_KEY] = {"num_steps": self.num_steps}
        optimizer_states = [state[k].state_dict() for k in optimizer_keys]
        self.checkpointer.save(checkpoint, self.broadcast(path), self._state_dict_type, optimizer_states)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote into the objects of ``state`` (in place); returns the rest.

        The model must have been set up by this strategy. With the same topology the run continues bit-identically;
        otherwise every group starts from the consensus (see docs/checkpoints.md).
        """
        if not isinstance(state, dict):
            raise TypeError("Pass the same `state` dict to `fabric.load` that was given to `fabric.save`.")
        module_key, optimizer_keys = self._federated_keys(state)
        optimizers = [state[k] for k in optimizer_keys]
        metadata = self.checkpointer.load(self.broadcast(path), optimizers=optimizers, strict=strict,
                                          weights_only=weights_only)  # fmt: skip
        self.num_steps = int(metadata.pop(_FABRIC_KEY, {}).get("num_steps", self.num_steps))
        for key, obj in state.items():
            if key == module_key or key in optimizer_keys or key not in metadata:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(metadata.pop(key))
            else:
                state[key] = metadata.pop(key)
        return metadata

    def _federated_keys(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        """The key of the federated model in ``state`` and the keys of the optimizers."""
        modules = [k for k, v in state.items() if v is self._wrapped]
        if len(modules) != 1:
            raise ValueError(
                f"The checkpoint `state` must hold the model set up by `{type(self).__name__}` exactly once"
                f" (found it under {modules})."
            )
        return modules[0], [k for k, v in state.items() if isinstance(v, Optimizer)]

    def _consensus_state_dict(self) -> dict[str, Any]:
        # Lightning's helpers are looked up at call time, so that `cpu_safe_full_state_dict` can swap them on CPU.
        from lightning.fabric.strategies import fsdp as fabric_fsdp

        module = self._wrapped
        assert module is not None
        with self.federation.consensus_weights(), cpu_safe_full_state_dict(self.root_device):
            if self._state_dict_type == "sharded":
                context = fabric_fsdp._get_sharded_state_dict_context(module)
            else:
                context = fabric_fsdp._get_full_state_dict_context(module, world_size=self.world_size)
            with context:  # type: ignore[attr-defined]  # a context manager at runtime
                return module.state_dict()

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
