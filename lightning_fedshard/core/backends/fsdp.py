"""The FSDP1 backend: local shards and state dicts of a model wrapped by torch's ``FullyShardedDataParallel``.

FSDP1 offers no public access to its flat parameters, which the outer step writes in place, nor a public way to free
the parameters it gathered for a forward pass. This module is the only place in the package that reads FSDP1's
private parts (:data:`FSDP1_INTERNALS`); :func:`check_internals` checks them once, when a model is wrapped, against
the installed torch. FSDP2 (:mod:`.fsdp2`) needs none: ``DTensor.to_local()`` is public.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp import StateDictType as FSDPStateDictType
from torch.distributed.fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
)
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard.core.backends.sharding import StateDictType

#: The torch releases on which the whole suite ran with the FSDP1 internals read here.
FSDP1_TESTED_TORCH = ("2.13", "2.14")
#: The private parts of FSDP1 this module reads: FSDP units' ``_handle``, its ``flat_param`` (the local shard), the
#: handle's methods that free gathered parameters, and the lazily created ``_full_param_padded`` (gathered storage).
FSDP1_INTERNALS = (
    "FullyShardedDataParallel._handle",
    "FlatParamHandle.flat_param",
    "FlatParamHandle.uses_sharded_strategy",
    "FlatParamHandle.needs_unshard",
    "FlatParamHandle.reshard",
    "FlatParamHandle.post_reshard",
    "FlatParameter._full_param_padded",
)


def check_internals(module: Module) -> None:
    """Check, once the model is wrapped, that the installed torch's FSDP1 has every part in :data:`FSDP1_INTERNALS`.

    A torch release that renamed one would otherwise fail deep inside a sync, or (``_full_param_padded``) silently
    evaluate stale weights after a sync.

    Raises:
        RuntimeError: Naming the first missing part, the installed torch and the releases tested.
    """
    units = FullyShardedDataParallel.fsdp_modules(module)
    # A unit whose parameters all went to inner units holds no handle (`_handle` is None): read one that holds some.
    unit = next((u for u in units if getattr(u, "_handle", None) is not None), units[0] if units else None)
    for part in FSDP1_INTERNALS:
        if unit is not None and not _has_internal(part, unit):
            raise RuntimeError(
                f"lightning_fedshard reads FSDP1's private `{part}`, which torch {torch.__version__} does not have"
                f" (tested with torch {', '.join(FSDP1_TESTED_TORCH)}). Use the FSDP2 strategies ('fl_fsdp2',"
                " 'fl_hsdp2'), which read only public torch APIs, or a tested torch release."
            )


def _has_internal(part: str, unit: Module) -> bool:
    owner, name = part.split(".")
    if owner == "FullyShardedDataParallel":
        return hasattr(unit, name)
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return False
    if owner == "FlatParamHandle":
        return hasattr(type(handle), name) or hasattr(handle, name)
    # Created lazily by the handle's `init_flat_param_attributes` (at the first forward): present if it sets it.
    init = getattr(type(handle), "init_flat_param_attributes", None)
    return init is not None and name in inspect.unwrap(init).__code__.co_names  # under torch's `no_grad` decorator


def flat_params(module: Module) -> list[Tensor]:
    """The flat parameter of every FSDP unit in ``module`` that holds parameters, in a fixed order (maybe none)."""
    handles = [unit._handle for unit in FullyShardedDataParallel.fsdp_modules(module)]
    return [handle.flat_param for handle in handles if handle is not None]


def local_shards(module: Module) -> list[Tensor]:
    """This rank's flat parameter shards of every FSDP unit in ``module``, in a fixed order.

    Each FSDP unit keeps its parameters in one flat tensor; outside forward and backward it holds only this rank's
    (padded) slice, and ``use_orig_params`` parameters are views into it. Writing to these tensors in place
    therefore updates the parameters the optimizer sees. Every rank at the same in-group position gets tensors
    of the same sizes, in the same order, in every federation group.

    Raises:
        ValueError: If ``module`` holds no FSDP unit.
    """
    shards = flat_params(module)
    if not shards:
        raise ValueError(f"{type(module).__name__} contains no FSDP-wrapped parameters.")
    return shards


def fsdp_device_id(device: torch.device) -> int | torch.device | None:
    """The ``device_id`` argument FSDP needs: torch refuses CPU modules unless given the CPU device itself."""
    return device if device.type == "cpu" else device.index


@torch.no_grad()
def free_unsharded_params(module: Module) -> None:
    """Drop the gathered (unsharded) parameters FSDP may still hold, so the next forward gathers the shards anew.

    FSDP does not free the root unit's gathered parameters after a forward pass (it expects a backward to follow),
    and skips the all-gather on the next forward if they are still allocated. After validation (forward only)
    those stale copies would shadow shards that were written in place, e.g. by the outer step.
    """
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        handle = unit._handle  # private: FSDP1 has no public way to free its gathered parameters outside a backward
        # Before FSDP's lazy initialization (the first forward) no unsharded storage exists, so nothing is stale. The
        # private `_full_param_padded` is that storage: FSDP1 creates it lazily and offers no public way to ask
        # whether it exists, and resharding before it does raises inside FSDP.
        if handle is None or not hasattr(handle.flat_param, "_full_param_padded"):
            continue
        if handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(free_unsharded_flat_param=True)
            handle.post_reshard()


#: Prefixes that FSDP1 and activation checkpointing insert into parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def unit_parameter_names(module: Module) -> list[list[str]]:
    """The parameter names of ``module`` held by each FSDP unit, in the order of :func:`local_shards`.

    A parameter belongs to the innermost unit that contains it. Names are those of the unwrapped module (FSDP's and
    activation checkpointing's prefixes removed). With ``use_orig_params=False`` FSDP only exposes its flat
    parameters, so their names are returned instead.
    """
    units = [u for u in FullyShardedDataParallel.fsdp_modules(module) if u._handle is not None]  # as local_shards
    prefixes = {id(m): name for name, m in module.named_modules()}
    unit_prefixes = [prefixes[id(u)] for u in units]
    names: list[list[str]] = [[] for _ in units]
    for name, _ in module.named_parameters():
        owners = [i for i, p in enumerate(unit_prefixes) if p == "" or name.startswith(p + ".")]
        if owners:
            names[max(owners, key=lambda i: len(unit_prefixes[i]))].append(_clean_name(name))
    return names


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def fsdp_state_dict_type(
    module: Module, state_dict_type: StateDictType, rank0_only: bool = True
) -> AbstractContextManager[Any]:
    """FSDP's state-dict context with the settings Lightning's ``FSDPStrategy`` uses, safe for models on the CPU.

    ``"sharded"``: the sharded state dict, offloaded to the CPU. ``"full"``: the full state dict, on global rank 0 only
    unless ``rank0_only=False``, offloaded to the CPU on accelerators; on the CPU offloading would segfault
    (pytorch/pytorch#188989), so it is not asked for. A root module that FSDP does not wrap needs no context.
    """
    if not isinstance(module, FullyShardedDataParallel):
        return nullcontext()
    if state_dict_type == "sharded":
        return FullyShardedDataParallel.state_dict_type(
            module,
            FSDPStateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=True),
            ShardedOptimStateDictConfig(offload_to_cpu=True),
        )
    offload = local_shards(module)[0].device.type != "cpu"
    return FullyShardedDataParallel.state_dict_type(
        module,
        FSDPStateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
    )


class FSDP1Backend:
    """:class:`~lightning_fedshard.core.backends.sharding.ShardingBackend` of FSDP1: one flat shard per FSDP unit."""

    name = "fsdp1"

    def local_shards(self, module: Module) -> list[Tensor]:
        """See :func:`local_shards`."""
        return local_shards(module)

    def check(self, module: Module) -> None:
        """See :func:`check_internals`."""
        check_internals(module)

    def unit_sizes(self, module: Module) -> list[int]:
        """The flat shards' numels: FSDP1 pads every unit's shards to equal sizes."""
        return [s.numel() for s in local_shards(module)]

    def free_unsharded(self, module: Module) -> None:
        """See :func:`free_unsharded_params`."""
        free_unsharded_params(module)

    def unit_parameter_names(self, module: Module) -> list[list[str]]:
        """See :func:`unit_parameter_names`."""
        return unit_parameter_names(module)

    def state_dict(self, module: Module, state_dict_type: StateDictType) -> dict[str, Any]:
        """FSDP's full (rank 0 only) or sharded state dict."""
        with fsdp_state_dict_type(module, state_dict_type):
            return module.state_dict()

    def load_state_dict(
        self, module: Module, state_dict: dict[str, Any], state_dict_type: StateDictType, strict: bool = True
    ) -> None:
        """Load a full state dict given on every rank, or a sharded one of :meth:`state_dict`'s layout."""
        with fsdp_state_dict_type(module, state_dict_type, rank0_only=False):
            module.load_state_dict(state_dict, strict=strict)

    def full_optimizer_state_dict(self, module: Module, optimizer: Optimizer) -> dict[str, Any]:
        """FSDP's full optimizer state dict (``FullyShardedDataParallel.optim_state_dict``), on the group's rank 0."""
        with fsdp_state_dict_type(module, "full"):
            return FullyShardedDataParallel.optim_state_dict(module, optimizer)


#: The FSDP1 backend (stateless).
FSDP1 = FSDP1Backend()
