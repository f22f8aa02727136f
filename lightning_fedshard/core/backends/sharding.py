"""What the federation needs from a sharding backend: torch FSDP1 (:mod:`.fsdp`) or FSDP2 (:mod:`.fsdp2`).

The outer step, the schedule and the checkpoint files only ever see a list of local shards (tensors written in place)
and a state dict; a :class:`ShardingBackend` supplies both for one kind of sharded model. Everything above it (the
runtime, the checkpointer, the Lightning adapters) is written once for both backends.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

#: How a model state dict is laid out: the whole model on one rank, or each rank's part for DCP.
StateDictType = Literal["full", "sharded"]


class ShardingBackend(Protocol):
    """Reads and writes the local shards and the state dict of a model sharded by one FSDP implementation."""

    #: Short name for messages and checkpoint layouts, e.g. ``"fsdp1"``.
    name: str

    def local_shards(self, module: Module) -> list[Tensor]:
        """This rank's local parameter shards, in a fixed order; writing them in place updates the model.

        Every rank at the same in-group position gets tensors of the same sizes, in the same order, in every group.
        """
        ...

    def check(self, module: Module) -> None:
        """Check, once after ``module`` was wrapped, that the installed torch offers what this backend reads.

        Raises:
            RuntimeError: Naming what is missing.
        """
        ...

    def unit_sizes(self, module: Module) -> list[int]:
        """The size of each entry of :meth:`local_shards` that streaming fragments are balanced by.

        Equal at every in-group position, so that all positions cut the model at the same places.
        """
        ...

    def free_unsharded(self, module: Module) -> None:
        """Drop gathered (unsharded) parameters, so that the next forward gathers the shards written in place."""
        ...

    def unit_parameter_names(self, module: Module) -> list[list[str]]:
        """The model's parameter names behind each entry of :meth:`local_shards`, in the same order."""
        ...

    def state_dict(self, module: Module, state_dict_type: StateDictType) -> dict[str, Any]:
        """The model's state dict under its plain parameter names (collective).

        ``"full"``: the whole state dict on global rank 0 and an empty one elsewhere. ``"sharded"``: each rank's part,
        ready for ``torch.distributed.checkpoint``.
        """
        ...

    def load_state_dict(
        self, module: Module, state_dict: dict[str, Any], state_dict_type: StateDictType, strict: bool = True
    ) -> None:
        """Load a state dict of :meth:`state_dict`'s kind; a ``"full"`` one must be given on every rank (collective)."""
        ...

    def full_optimizer_state_dict(self, module: Module, optimizer: Optimizer) -> dict[str, Any]:
        """The state of ``optimizer`` over the whole model, keyed by parameter names, as Lightning's FSDP saves it.

        Collective within the module's group: each group gathers its own; global rank 0 gets group 0's (other ranks
        may get an empty dict).
        """
        ...


class UnshardedBackend:
    """:class:`ShardingBackend` of a model that one rank holds whole (a group of one rank, e.g. in the simulator).

    The local shards are the parameters themselves, one per parameter in ``named_parameters`` order: the layout FSDP2
    gives a group of one rank, so fragments are cut at the same parameters.
    """

    name = "unsharded"

    def local_shards(self, module: Module) -> list[Tensor]:
        """Every parameter (detached, sharing its memory), in ``named_parameters`` order."""
        return [p.detach() for _, p in _named_parameters(module)]

    def check(self, module: Module) -> None:
        """Nothing to check: plain parameters."""

    def unit_sizes(self, module: Module) -> list[int]:
        """The parameters' numels."""
        return [p.numel() for _, p in _named_parameters(module)]

    def free_unsharded(self, module: Module) -> None:
        """Nothing is gathered."""

    def unit_parameter_names(self, module: Module) -> list[list[str]]:
        """One entry per parameter."""
        return [[name] for name, _ in _named_parameters(module)]

    def state_dict(self, module: Module, state_dict_type: StateDictType) -> dict[str, Any]:
        """The module's own state dict (the whole model: the same for both kinds)."""
        return module.state_dict()

    def load_state_dict(
        self, module: Module, state_dict: dict[str, Any], state_dict_type: StateDictType, strict: bool = True
    ) -> None:
        """Load the module's own state dict."""
        module.load_state_dict(state_dict, strict=strict)

    def full_optimizer_state_dict(self, module: Module, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's own state dict (it holds the whole model)."""
        return optimizer.state_dict()


def _named_parameters(module: Module) -> list[tuple[str, Tensor]]:
    named: list[tuple[str, Tensor]] = list(module.named_parameters())
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameters to federate.")
    return named


#: The backend of whole models (stateless).
UNSHARDED = UnshardedBackend()
