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
        handle = unit._handle
        if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(free_unsharded_flat_param=True)
            handle.post_reshard()
