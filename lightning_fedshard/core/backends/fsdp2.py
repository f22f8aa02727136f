"""The FSDP2 backend: ``fully_shard`` on a federation group's mesh, and local shards as ``DTensor.to_local()`` views.

FSDP2 keeps every parameter as a ``DTensor`` sharded on dim 0 over the group's ``"shard"`` axis (and replicated over
its ``"replicate"`` axis with FL+HSDP). ``DTensor.to_local()`` is a view of this rank's rows, so the outer step writes
the parameters in place through it (under ``torch.no_grad()``: an in-place write to the view while autograd records
raises). The federation mesh's groups line the shards up: the rank at one in-group position holds the same rows of
every parameter in every group. Only public torch APIs are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard.core.backends.sharding import StateDictType

#: Prefixes that wrappers (activation checkpointing, ``torch.compile``) insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def is_fully_sharded(module: Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def sharded_parameters(module: Module) -> list[tuple[str, DTensor]]:
    """``module``'s parameters with their names, all of them ``DTensor`` shards.

    Parameters that a forward without backward left gathered (see :func:`free_unsharded`) are resharded first.

    Raises:
        ValueError: If a parameter is not sharded (a module outside every ``fully_shard`` call): its gradient would
            never be reduced within the group, nor its value merged across groups.
    """
    free_unsharded(module)
    named = list(module.named_parameters())
    plain = [name for name, p in named if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"Parameter(s) {plain[:3]}{' ...' if len(plain) > 3 else ''} of {type(module).__name__} are not sharded"
            " by FSDP2: apply `fully_shard` to a module that holds them (or leave sharding to the strategy)."
        )
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameters to federate.")
    return [(name, p) for name, p in named if isinstance(p, DTensor)]


def local_shards(module: Module) -> list[Tensor]:
    """This rank's rows of every parameter (``DTensor.to_local()``, detached), in ``named_parameters`` order.

    The tensors share storage with the parameters, so writing them in place (under ``torch.no_grad()``) updates what
    the optimizer and the next all-gather see. A rank may hold zero rows of a small parameter. Gathered parameters
    are dropped first (see :func:`sharded_parameters`).
    """
    with torch.no_grad():
        return [p.to_local().detach() for _, p in sharded_parameters(module)]


def free_unsharded(module: Module) -> None:
    """Reshard every FSDP2 module (public ``FSDPModule.reshard``), dropping gathered parameters.

    FSDP2 keeps the root's parameters gathered after a forward without backward (evaluation, e.g. Lightning's
    sanity check): until they are resharded, the module's parameters are plain gathered tensors instead of the
    ``DTensor`` shards, and a forward after the shards were rewritten would reuse them.
    """
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def unit_parameter_names(module: Module) -> list[list[str]]:
    """One entry per parameter (FSDP2 shards each parameter on its own), with wrapper prefixes removed."""
    return [[_clean_name(name)] for name, _ in sharded_parameters(module)]


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def mixed_precision_policy(spec: MixedPrecisionPolicy | dict[str, Any] | None) -> MixedPrecisionPolicy:
    """A ``MixedPrecisionPolicy`` from itself, ``None`` (full precision) or a dict with dtype names as YAML gives them.

    Raises:
        ValueError: For an unknown key or dtype name, naming it.
    """
    if isinstance(spec, MixedPrecisionPolicy):
        return spec
    if spec is None:
        return MixedPrecisionPolicy()
    fields = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
    unknown = set(spec) - fields
    if unknown:
        raise ValueError(f"`mixed_precision` keys {sorted(unknown)} are unknown; use {sorted(fields)}.")
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "cast_forward_inputs" or value is None or isinstance(value, torch.dtype):
            kwargs[key] = value
            continue
        dtype = getattr(torch, str(value).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"`mixed_precision.{key}={value!r}` is not a torch dtype name (e.g. 'bfloat16').")
        kwargs[key] = dtype
    return MixedPrecisionPolicy(**kwargs)


def shard_model(
    roots: Sequence[Module],
    mesh: DeviceMesh,
    policy: Callable[[Module], bool] | set[type[Module]] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Apply ``fully_shard`` bottom-up: to every module the policy selects, then to each root.

    Args:
        roots: The modules whose forward runs the model (for a LightningModule: its children that hold parameters).
        mesh: The group's mesh slice: ``mesh["shard"]`` (FL+FSDP) or ``mesh["replicate", "shard"]`` (FL+HSDP).
        policy: Module classes (or a predicate) that each get a ``fully_shard`` unit of their own, e.g. the decoder
            layers; ``None``: one unit per root.
        mp_policy: FSDP2's mixed precision; ``None``: full precision.
        reshard_after_forward: FSDP2's option of the same name for the policy's modules (the roots keep gathered
            parameters for the backward, as FSDP2 does by default).
    """
    select = _selector(policy)
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for root in roots:
        units = [m for m in root.modules() if m is not root and select(m) and not isinstance(m, FSDPModule)]
        for unit in reversed(units):  # children before their parents
            fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
        if not isinstance(root, FSDPModule):
            fully_shard(root, **options)


def _selector(policy: Callable[[Module], bool] | set[type[Module]] | None) -> Callable[[Module], bool]:
    if policy is None:
        return lambda module: False
    if isinstance(policy, (set, list, tuple, frozenset)):
        classes = tuple(policy)
        return lambda module: isinstance(module, classes)
    return policy


def check_group_mesh(module: Module, mesh: DeviceMesh) -> None:
    """Check that every parameter is sharded on ``mesh`` (a model sharded by the user's own ``configure_model``).

    Raises:
        ValueError: If a parameter is not a ``DTensor`` or lives on another mesh, naming it and its mesh.
    """
    for name, param in sharded_parameters(module):
        if param.device_mesh != mesh:
            raise ValueError(
                f"Parameter {name!r} is sharded on {param.device_mesh}, not on this rank's federation group"
                f" {mesh}: apply `fully_shard(..., mesh=self.device_mesh)` in `configure_model`."
            )


def apply_activation_checkpointing(module: Module, classes: Any) -> None:
    """Recompute the forward of the modules of ``classes`` in the backward pass (before ``fully_shard``)."""
    # torch's activation-checkpointing wrapper, as Lightning's FSDPStrategy uses it; it lives in a private module.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply_checkpointing,
    )

    select = _selector(classes)
    apply_checkpointing(module, check_fn=select)


def parameter_roots(module: Module) -> list[Module]:
    """The children of ``module`` that hold parameters, as the roots to shard when ``module`` itself never runs.

    Raises:
        ValueError: If ``module`` holds parameters directly (they would belong to no unit whose forward runs).
    """
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameter(s) {own} directly; put them into a submodule so that FSDP2 can"
            " shard them with the module whose forward uses them."
        )
    return [child for child in module.children() if any(True for _ in child.parameters())]


@torch.no_grad()
def restore_dtensor_state(optimizer: Optimizer) -> None:
    """Turn optimizer state loaded as local shards back into ``DTensor`` like the parameters (FSDP2).

    An optimizer stores per-parameter state as ``DTensor`` when its parameters are ``DTensor`` (FSDP2);
    checkpoints keep local shards, which would otherwise meet ``DTensor``
    parameters in the next step and fail.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor) or param not in optimizer.state:
                continue
            local_shape = param.to_local().shape
            state = optimizer.state[param]
            for key, value in state.items():
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == local_shape:
                    state[key] = DTensor.from_local(
                        value.to(param.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )


class FSDP2Backend:
    """The sharding backend of FSDP2: one ``DTensor`` shard per parameter (see :mod:`.sharding`)."""

    name = "fsdp2"

    def local_shards(self, module: Module) -> list[Tensor]:
        """See :func:`local_shards`."""
        return local_shards(module)

    def check(self, module: Module) -> None:
        """Nothing to check: FSDP2's ``DTensor`` shards are read through public torch APIs only."""

    def unit_sizes(self, module: Module) -> list[int]:
        """The whole parameters' numels (the local rows of a parameter differ between in-group positions)."""
        return [p.numel() for _, p in sharded_parameters(module)]

    def free_unsharded(self, module: Module) -> None:
        """See :func:`free_unsharded`."""
        free_unsharded(module)

    def unit_parameter_names(self, module: Module) -> list[list[str]]:
        """See :func:`unit_parameter_names`."""
        return unit_parameter_names(module)

    def state_dict(self, module: Module, state_dict_type: StateDictType) -> dict[str, Any]:
        """The state dict of torch's ``get_model_state_dict``: full on rank 0 (on the CPU), or ``DTensor`` shards."""
        options = StateDictOptions(full_state_dict=state_dict_type == "full", cpu_offload=True)
        free_unsharded(module)  # after an evaluation forward the root's parameters are gathered plain tensors
        state_dict = get_model_state_dict(module, options=options)
        if any(p.device.type == "cpu" for p in module.parameters()):
            # On the CPU "offloading" may hand back the parameters' own storage (e.g. unsharded ones); a state dict
            # taken of the consensus must not change when the group's own weights are written back.
            state_dict = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state_dict.items()}
        return state_dict

    def load_state_dict(
        self, module: Module, state_dict: dict[str, Any], state_dict_type: StateDictType, strict: bool = True
    ) -> None:
        """Load with torch's ``set_model_state_dict``; a full state dict is given on every rank."""
        options = StateDictOptions(full_state_dict=state_dict_type == "full", strict=strict)
        free_unsharded(module)
        set_model_state_dict(module, state_dict, options=options)

    def full_optimizer_state_dict(self, module: Module, optimizer: Optimizer) -> dict[str, Any]:
        """Torch's ``get_optimizer_state_dict`` over the whole model, on global rank 0 (on the CPU)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(module, optimizer, options=options)


#: The FSDP2 backend (stateless).
FSDP2 = FSDP2Backend()
