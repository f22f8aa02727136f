"""The one model a federated strategy holds: sharded once, every group and replica starting equal, and its optimizers.

A federation averages one model: :class:`FederatedModel` wraps it with the strategy's sharding (FSDP over this rank's
group), broadcasts its first weights so that every process starts from the same, and reads its local shards, units and
parameter names for the federation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard.core.backends.sharding import ShardingBackend
from lightning_fedshard.core.lazy import required
from lightning_fedshard.core.quiet import torch_choices_silenced
from lightning_fedshard.core.transport.mesh import FederationMesh

__all__ = ["FederatedModel"]


class FederatedModel:
    """The federated model of one rank and its inner optimizers.

    Args:
        backend: How the model is sharded (see :mod:`lightning_fedshard.core.backends.sharding`).
        name: The strategy's registered name, for messages.
        mesh: This rank's federation mesh, once it exists: the first weights are broadcast over it.
    """

    def __init__(self, backend: ShardingBackend, name: str, mesh: Callable[[], FederationMesh]) -> None:
        self.backend = backend
        self.name = name
        self._mesh = mesh
        self._module: Module | None = None
        self._optimizers: list[Optimizer] = []

    def wrap(self, module: Module, wrap: Callable[[Module], Module]) -> Module:
        """Shard ``module`` with ``wrap`` and make every group and replica start from its weights.

        The model wrapped already is returned as it is.

        Raises:
            RuntimeError: If another model was wrapped already: the federation holds one model.
        """
        if self._module is not None:
            if self.holds(module):
                return self._module
            raise RuntimeError(
                f"`{self.name}` federates one model, and one was set up already. Put all trainable modules into one"
                " `nn.Module` before setting it up."
            )
        with torch_choices_silenced():
            wrapped = wrap(module)
        self.backend.check(wrapped)
        self._synchronize_initial_weights(wrapped)
        self._module = wrapped
        return wrapped

    @torch.no_grad()
    def _synchronize_initial_weights(self, module: Module) -> None:
        """All groups and replicas start from the same weights and buffers, whatever each process initialized."""
        mesh = self._mesh()
        mesh.broadcast_shards(self.backend.local_shards(module))
        buffers = list(module.buffers())
        if buffers:
            mesh.broadcast_buffers(buffers)

    def holds(self, module: Module) -> bool:
        """Whether ``module`` is the federated model, or the module inside its FSDP wrapper."""
        return self._module is not None and any(m is module for m in self._module.modules())

    @property
    def wrapped(self) -> bool:
        """Whether a model was wrapped (and not released since)."""
        return self._module is not None

    def release(self) -> None:
        """Forget the model and its optimizers, for another model to be wrapped."""
        self._module = None
        self._optimizers = []

    @property
    def module(self) -> Module:
        """The wrapped model."""
        return required(self._module, "The model has not been set up by the federated strategy yet.")

    def local_shards(self) -> list[Tensor]:
        """This rank's local parameter shards of the wrapped model (written in place by the outer step)."""
        return self.backend.local_shards(self.module)

    def unit_sizes(self) -> list[int]:
        """The sizes of the wrapped model's sharded units, in module order."""
        return self.backend.unit_sizes(self.module)

    def free_unsharded_params(self) -> None:
        """Make the next forward gather the (just rewritten) shards instead of reusing gathered weights."""
        if self._module is not None:
            self.backend.free_unsharded(self._module)

    def set_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """The inner optimizers of the model."""
        self._optimizers = list(optimizers)

    @property
    def optimizers(self) -> list[Optimizer]:
        """The inner optimizers given to :meth:`set_optimizers`."""
        return list(self._optimizers)

    def restart_optimizers(self) -> None:
        """Clear the inner optimizers' state (a group that a sync skipped starts it afresh)."""
        for optimizer in self._optimizers:
            optimizer.state.clear()

    def fragment_parameter_names(self, fragments: Sequence[Sequence[int]]) -> list[list[str]]:
        """The parameter names in each streaming fragment (given as the units it holds), in order."""
        names = self.backend.unit_parameter_names(self.module)
        return [[n for unit in fragment for n in names[unit]] for fragment in fragments]

    def fragment_summary(self, fragments: Sequence[Sequence[int]]) -> str:
        """The streaming fragments in one line: each one's units, local values and first parameter."""
        shards = self.local_shards()
        sizes = [sum(shards[u].numel() for u in fragment) for fragment in fragments]
        return "; ".join(
            f"{f}: units {units[0]}-{units[-1]}, {size:,} local values, {len(names)} parameter(s) from {names[0]!r}"
            for f, (units, size, names) in enumerate(zip(fragments, sizes, self.fragment_parameter_names(fragments)))
        )
