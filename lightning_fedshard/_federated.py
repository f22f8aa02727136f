"""What the Trainer and Fabric strategies share: options, topology, mesh, FSDP wrapping on CPU, shards.

Lightning keeps two FSDP strategy hierarchies (``lightning.pytorch`` and ``lightning.fabric``); this mixin sits in
front of either and holds everything federated, so the adapters only route Lightning's hooks to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard.checkpoint import FederationCheckpointer
from lightning_fedshard.core.config import FederationConfig, OuterOptimizerSpec
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.fsdp import free_unsharded_params, fsdp_device_id, local_shards
from lightning_fedshard.core.mesh import FederationMesh, build_federation_mesh
from lightning_fedshard.core.outer import SyncStats
from lightning_fedshard.core.topology import FederationTopology

log = logging.getLogger(__name__)


class FederatedStrategyMixin:
    """Federation state and helpers for a subclass of one of Lightning's ``FSDPStrategy`` classes."""

    #: HYBRID_SHARD inside a group (FL+HSDP) instead of FULL_SHARD (FL+FSDP).
    hybrid: ClassVar[bool] = False
    strategy_name: str

    # Provided by Lightning's FSDPStrategy classes.
    num_nodes: int
    num_processes: int
    root_device: torch.device
    global_rank: int
    sharding_strategy: Any
    cpu_offload: Any
    mixed_precision_config: Any
    _activation_checkpointing_kwargs: dict[str, Any]

    def _init_federation(
        self,
        num_groups: int | None,
        shard_size: int | None,
        sync_every: int,
        outer_optimizer: OuterOptimizerSpec,
        reduce_dtype: str | torch.dtype,
        anchor_device: str,
        on_nonfinite: str,
        sharding_strategy: object,
        fsdp_kwargs: dict[str, Any],
    ) -> None:
        """Validate the federation options (call first in ``__init__``, before any heavy work)."""
        for key in ("device_mesh", "process_group"):
            if fsdp_kwargs.get(key) is not None:
                raise ValueError(
                    f"`{key}={fsdp_kwargs[key]!r}` cannot be combined with a federated strategy: it builds its own"
                    " mesh from `num_groups` and `shard_size`."
                )
        if not self.hybrid and shard_size is not None:
            raise ValueError(
                f"`shard_size={shard_size}` is only for FL+HSDP; FL+FSDP shards over the whole group."
                " Use `strategy='fl_hsdp'` to replicate inside a group."
            )
        name = getattr(sharding_strategy, "name", sharding_strategy)
        if sharding_strategy is not None and name != self._sharding_name:
            raise ValueError(
                f"`sharding_strategy={sharding_strategy!r}` is not supported here; this strategy uses"
                f" {self._sharding_name!r}."
            )
        self.federation_config = FederationConfig(
            num_groups=num_groups,
            shard_size=shard_size,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            reduce_dtype=reduce_dtype,
            anchor_device=anchor_device,
            on_nonfinite=on_nonfinite,
        )
        self._topology: FederationTopology | None = None
        self._mesh: FederationMesh | None = None
        self._federation: Federation | None = None
        self._wrapped: Module | None = None

    @staticmethod
    def _resolve_module_classes(policy: Any, name: str = "auto_wrap_policy") -> Any:
        """Accept layer classes by import path (``"transformers....LlamaDecoderLayer"`` or a list), as YAML gives them.

        Anything else (a set of classes, a callable policy, ``None``) is returned unchanged.

        Raises:
            ValueError: If a path does not name a ``torch.nn.Module`` subclass.
        """
        if isinstance(policy, str):
            policy = [policy]
        if not isinstance(policy, (list, tuple, set)) or not all(isinstance(p, str) for p in policy):
            return policy
        import importlib

        classes = set()
        for path in policy:
            module_name, _, attr = path.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, ValueError) as err:
                raise ValueError(f"`{name}` entry {path!r} cannot be imported: {err}") from err
            if not (isinstance(cls, type) and issubclass(cls, Module)):
                raise ValueError(f"`{name}` entry {path!r} is not a torch.nn.Module subclass.")
            classes.add(cls)
        return classes

    @property
    def _sharding_name(self) -> str:
        return "HYBRID_SHARD" if self.hybrid else "FULL_SHARD"

    def _use_federated_sharding(self) -> None:
        """Set the in-group sharding strategy (after the base ``__init__``, which refuses HYBRID_SHARD so early)."""
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = ShardingStrategy[self._sharding_name]

    # -- topology and mesh ------------------------------------------------------------------------------------

    @property
    def topology(self) -> FederationTopology:
        """Groups, replicas and shards of this job (known once devices and nodes are set)."""
        if self._topology is None:
            self._topology = self.federation_config.topology(self.num_nodes, self.num_processes, self.hybrid)
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

    def _validate_topology(self) -> None:
        """Check the topology in the launching process, and warn if there is nothing to federate."""
        self._topology = None
        topology = self.topology
        if topology.num_groups == 1:
            kind = "HSDP" if self.hybrid else "FSDP"
            rank_zero_warn(
                f"`{self.strategy_name}` with a single federation group ({topology}) is {kind} over all ranks:"
                " there is nothing to federate (with `outer_optimizer='fedavg'` it is exactly plain"
                f" {kind}; other outer optimizers still step the single group's weights every `sync_every` steps)."
                " Set `num_groups` > 1 to get federated training."
            )
        if topology.group_size % self.num_processes and self.num_processes % topology.group_size:
            rank_zero_warn(
                f"Federation groups of {topology.group_size} ranks do not line up with nodes of"
                f" {self.num_processes} devices: some groups span parts of two nodes, so their per-step traffic"
                " crosses the slow links the federation is meant to avoid."
            )
        if self.hybrid and topology.shard_size > self.num_processes:
            rank_zero_warn(
                f"`shard_size={topology.shard_size}` is larger than a node ({self.num_processes} devices):"
                " the per-step FSDP collectives of every replica cross nodes."
            )

    def _setup_federation(self, fsdp_kwargs: dict[str, Any]) -> None:
        """Build the mesh and the federation after the default process group exists (collective)."""
        self._topology = None
        self._mesh = build_federation_mesh(self.topology, self.root_device.type)
        self._federation = Federation(self.federation_config, self._mesh.communicator())
        fsdp_kwargs["process_group"] = self._mesh.fsdp_process_group(self.hybrid)
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = ShardingStrategy[self._mesh.fsdp_sharding(self.hybrid)]
        log.info(f"{type(self).__name__}: rank {self.global_rank} at {self._mesh.coords} of {self.topology}")

    # -- wrapping ---------------------------------------------------------------------------------------------

    def _wrap(self, module: Module, fsdp_kwargs: dict[str, Any], lightning_wrap: Callable[[Module], Module]) -> Module:
        """Wrap with FSDP (on CPU with the device FSDP needs) and make all groups and replicas start equal."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        already_wrapped = any(isinstance(m, FullyShardedDataParallel) for m in module.modules())
        if self.root_device.type == "cpu" and not already_wrapped:
            # Lightning passes `device_id=None` on CPU, which FSDP refuses.
            module = FullyShardedDataParallel(
                module=module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=fsdp_device_id(self.root_device),
                **fsdp_kwargs,
            )
            _move_torchmetrics_to_device(module, self.root_device)
            _setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
        else:
            module = lightning_wrap(module)
        self._synchronize_initial_weights(module)
        self._wrapped = module
        return module

    def _wrap_context_kwargs(self, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Arguments for FSDP's ``enable_wrap`` (manual wrapping inside ``configure_model``)."""
        return {
            "cpu_offload": self.cpu_offload,
            "mixed_precision": self.mixed_precision_config,
            "sharding_strategy": self.sharding_strategy,
            "device_id": fsdp_device_id(self.root_device),
            **fsdp_kwargs,
        }

    @torch.no_grad()
    def _synchronize_initial_weights(self, module: Module) -> None:
        """All groups and replicas start from the same weights, whatever each process initialized."""
        self.mesh.broadcast_shards(local_shards(module))
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    # -- shards -----------------------------------------------------------------------------------------------

    def local_shards(self) -> list[Tensor]:
        """This rank's flat parameter shards of the wrapped model."""
        if self._wrapped is None:
            raise RuntimeError("The model has not been wrapped by the federated strategy yet.")
        return local_shards(self._wrapped)

    def free_unsharded_params(self) -> None:
        """Make the next forward gather the (just rewritten) shards instead of reusing gathered weights."""
        if self._wrapped is not None:
            free_unsharded_params(self._wrapped)

    @property
    def checkpointer(self) -> FederationCheckpointer:
        """Saves and loads this rank's federation state with the model (see :mod:`lightning_fedshard.checkpoint`)."""
        if self._wrapped is None:
            raise RuntimeError("The model has not been wrapped by the federated strategy yet.")
        return FederationCheckpointer(
            self.mesh.topology,
            self.hybrid,
            self.global_rank,
            self.federation,
            self._wrapped,
            self.free_unsharded_params,
        )

    def restart_skipped_groups(self, stats: SyncStats, optimizers: Iterable[Optimizer], step: int) -> None:
        """After ``on_nonfinite="skip_group"`` left groups out of a sync: say so, and clear their inner optimizer state.

        The outer step already reset their weights to the new anchor; their inner optimizer state most likely holds
        the same NaN/Inf, so every rank of a skipped group starts it afresh (all of them, to keep the group
        consistent).
        """
        if not stats.skipped_groups:
            return
        rank_zero_warn(
            f"Skipped federation group(s) {list(stats.skipped_groups)} with a non-finite outer gradient at optimizer"
            f" step {step} (sync {stats.num_syncs}): the outer step averaged the healthy groups only, and the skipped"
            " groups restart from the new anchor with a fresh inner optimizer state."
        )
        if self.federation.communicator.group_index in stats.skipped_groups:
            for optimizer in optimizers:
                optimizer.state.clear()

    def start_federation(self, step: int) -> None:
        """Anchor the federation on the current weights at optimizer step ``step``."""
        self.federation.start(self.local_shards(), step, on_write=self.free_unsharded_params)
