"""Workarounds for Lightning/torch behaviour on CPU, shared by the Trainer and Fabric adapters."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager

import torch
from torch.nn import Module

# Lightning builds full state dicts with `offload_to_cpu=True` in these modules; see `cpu_safe_full_state_dict`.
_MODULES_WITH_FULL_STATE_DICT_CONTEXT = (
    "lightning.fabric.strategies.fsdp",
    "lightning.fabric.strategies.model_parallel",
    "lightning.pytorch.strategies.fsdp",
)


@contextmanager
def cpu_safe_full_state_dict(device: torch.device) -> Iterator[None]:
    """Within the block, make Lightning's FSDP full-state-dict context work for models on the CPU.

    torch's FSDP segfaults when asked to offload a full state dict to the CPU while the model already lives there
    (pytorch issue 188989), and Lightning always asks for it. On CPU this swaps Lightning's helper for one that
    does not offload; on accelerators it changes nothing.
    """
    if device.type != "cpu":
        yield
        return
    import importlib

    modules = [importlib.import_module(name) for name in _MODULES_WITH_FULL_STATE_DICT_CONTEXT]
    name = "_get_full_state_dict_context"
    originals = [getattr(m, name) for m in modules]
    for m in modules:
        setattr(m, name, _full_state_dict_context_without_offload)
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            setattr(m, name, original)


def _full_state_dict_context_without_offload(
    module: Module, world_size: int, rank0_only: bool = True
) -> Generator[None, None, None]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    return FSDP.state_dict_type(  # type: ignore[return-value]
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )
