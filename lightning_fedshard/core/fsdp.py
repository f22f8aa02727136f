"""Helpers that find the local shards of a model wrapped by FSDP (torch's ``FullyShardedDataParallel``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn import Module


def local_shards(module: Module) -> list[Tensor]:
    """This rank's flat parameter shards of every FSDP unit in ``module``, in a fixed order.

    Each FSDP unit keeps its parameters in one flat tensor; outside forward and backward it holds only this rank's
    (padded) slice, and ``use_orig_params`` parameters are views into it. Writing to these tensors in place
    therefore updates the parameters the optimizer sees. Every rank at the same in-group position gets tensors
    of the same sizes, in the same order, in every federation group.

    Raises:
        ValueError: If ``module`` holds no FSDP unit.
    """
    # Private: FSDP1 has no public access to its flat parameters (FSDP2's `DTensor.to_local()` is the public way).
    handles = [unit._handle for unit in FullyShardedDataParallel.fsdp_modules(module)]
    shards: list[Tensor] = [handle.flat_param for handle in handles if handle is not None]
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
        # Before FSDP's lazy initialization (the first forward) no unsharded storage exists, so nothing is stale.
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
