"""Meta-device initialization that FSDP can run one unit at a time.

A model built under ``torch.device("meta")`` holds shapes only. When FSDP1 (torch's ``FullyShardedDataParallel``)
wraps such a model and is given no ``param_init_fn``, it materializes each unit on its own: it walks the unit's
modules breadth-first, and on every module that directly holds parameters or buffers it calls
``module.to_empty(device=..., recurse=False)`` and then ``module.reset_parameters()``. It then flattens and shards
the unit before the next one is materialized, so a rank never holds more than one unit's full parameters plus the
shards of the units before it. Lightning relies on the same contract (``Trainer.init_module(empty_init=True)``,
``Fabric.init_module(empty_init=True)``) and passes no ``param_init_fn`` of its own.

The contract needs a correct ``reset_parameters()`` on every such module, which many models lack (normalization
layers, rotary embeddings with a non-persistent ``inv_freq`` buffer that ``to_empty`` leaves as garbage) or define
with an initialization the model does not use (``nn.Linear``'s own Kaiming init, where transformers draws from
``normal(0, initializer_range)``). :func:`install_reset_parameters` gives every module that holds tensors a
``reset_parameters`` that runs one initialization function (for a transformers model: its own ``_init_weights``),
under a random seed derived from ``(seed, qualified module name)``. Consequences:

- Initialization needs no strategy change and works for any model, in the Trainer, the CLI and Fabric.
- The weights depend on ``seed`` and the module names only: not on the rank, the global RNG state, the order in
  which units are materialized or the wrap policy. Every rank materializes the same values; a single process that
  calls :func:`materialize` gets them too (on the same device type: CPU and CUDA generators differ).
- They are *not* the values of an eager (non-meta) build with the same seed, which draws every tensor from one RNG
  stream in construction order; they follow the same distributions.
- ``to_empty`` turns tied (shared) parameters into separate tensors. The installed ``reset_parameters`` re-ties
  them: the first module of a tie to be materialized initializes the tensor, the others adopt it. Tied modules
  must sit in the same FSDP unit (as FSDP1 requires anyway).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.nn import Module

#: Initializes the parameters and buffers a module holds directly (not those of its children), in place.
InitFn = Callable[[Module], None]


def module_seed(seed: int, name: str) -> int:
    """The random seed of module ``name``: a stable 63-bit hash of ``(seed, name)`` (same in every process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def holds_tensors(module: Module) -> bool:
    """Whether ``module`` directly holds a parameter or a buffer (those are the modules FSDP calls)."""
    return next(itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)), None) is not None


class ModuleReset:
    """A module's ``reset_parameters``: re-tie shared parameters, then run the init function under a seeded RNG.

    A plain object rather than a closure, so that a model holding it can still be pickled and deep-copied.

    Args:
        module: The module whose tensors are initialized.
        name: Qualified name of ``module`` in the model (decides its random seed).
        init: The initialization function.
        seed: Model-wide seed.
        ties: For each tied parameter name of ``module``, the ``(module, name)`` pairs that share it.
    """

    def __init__(
        self, module: Module, name: str, init: InitFn, seed: int, ties: dict[str, list[tuple[Module, str]]]
    ) -> None:
        self.module, self.name, self.init, self.seed, self.ties = module, name, init, seed, ties

    @torch.no_grad()
    def __call__(self) -> None:
        """Initialize the module's own tensors (they must already be materialized, e.g. by ``to_empty``)."""
        adopted = self._adopt_tied()
        own = [name for name, _ in self.module.named_parameters(recurse=False)]
        if adopted and adopted.issuperset(own) and next(self.module.buffers(recurse=False), None) is None:
            return  # every tensor is a peer's, already initialized
        # A shared tensor keeps the values its first owner gave it, whatever this module's init does to it.
        saved = {name: self.module.get_parameter(name).detach().clone() for name in adopted}
        with _seeded_rng(module_seed(self.seed, self.name), self._device()):
            self.init(self.module)
        for name, value in saved.items():
            self.module.get_parameter(name).copy_(value)

    def _adopt_tied(self) -> set[str]:
        """Point each tied parameter at a peer's tensor if a peer was materialized first; return those names."""
        adopted = set()
        for name, peers in self.ties.items():
            for peer, peer_name in peers:
                # Private `_parameters`: re-tying needs the Parameter object itself, and `register_parameter` (the
                # public way) refuses a name that exists, while `setattr` would go through `__setattr__` hooks that
                # wrappers such as FSDP install; reading and writing the dict is what `nn.Module` itself does.
                shared = peer._parameters.get(peer_name)
                if shared is not None and not shared.is_meta:
                    self.module._parameters[name] = shared
                    adopted.add(name)
                    break
        return adopted

    def _device(self) -> torch.device:
        tensor = next(itertools.chain(self.module.parameters(recurse=False), self.module.buffers(recurse=False)))
        return tensor.device


@contextmanager
def _seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the global RNG (CPU and ``device``) for the block and restore its previous state afterwards."""
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def _ties(root: Module) -> dict[Module, dict[str, list[tuple[Module, str]]]]:
    """For every module, its parameters that other modules share, with the sharing ``(module, name)`` pairs."""
    owners: dict[int, list[tuple[Module, str]]] = collections.defaultdict(list)
    for module in root.modules():
        for name, param in module.named_parameters(recurse=False):
            owners[id(param)].append((module, name))
    ties: dict[Module, dict[str, list[tuple[Module, str]]]] = collections.defaultdict(dict)
    for pairs in owners.values():
        if len(pairs) < 2:
            continue
        for module, name in pairs:
            ties[module][name] = [pair for pair in pairs if pair != (module, name)]
    return ties


def install_reset_parameters(root: Module, seed: int, init: InitFn | None = None) -> None:
    """Give every module of ``root`` that holds tensors a seeded ``reset_parameters`` (see the module docstring).

    Call it once on the model, on the meta device or not; it touches no tensor. Then either let FSDP1 wrap the meta
    model with ``param_init_fn=None`` (the default, and what Lightning's FSDP strategies pass), or call
    :func:`materialize`.

    Args:
        root: The model.
        seed: Model-wide seed; module ``name`` initializes under :func:`module_seed` ``(seed, name)``.
        init: Initializes the tensors a module holds directly; it must cover every parameter and buffer it is given.
            For a transformers ``PreTrainedModel`` pass its ``_init_weights``. Default: each module's own
            ``reset_parameters`` (as its class defines it).

    Raises:
        ValueError: If ``init`` is None and a module that holds tensors has no ``reset_parameters`` of its own.
    """
    ties = _ties(root)
    for name, module in root.named_modules():
        if not holds_tensors(module):
            continue
        module_init = init if init is not None else _own_reset(module, name)
        # An instance attribute: it shadows the class' method and travels with the module.
        module.reset_parameters = ModuleReset(module, name, module_init, seed, ties.get(module, {}))


def _own_reset(module: Module, name: str) -> InitFn:
    method = getattr(type(module), "reset_parameters", None)
    if method is None:
        raise ValueError(
            f"Module `{name or '<root>'}` ({type(module).__name__}) holds tensors but has no `reset_parameters()`:"
            " pass an `init` function that covers it."
        )
    return _ClassReset(method)


class _ClassReset:
    """Calls the ``reset_parameters`` a module's class defines (picklable, unlike a lambda)."""

    def __init__(self, method: Callable[[Module], None]) -> None:
        self.method = method

    def __call__(self, module: Module) -> None:
        self.method(module)


@torch.no_grad()
def materialize(root: Module, device: torch.device | str) -> None:
    """Materialize a meta model in place, module by module, the way FSDP1 materializes one unit.

    For models used without FSDP (one device, DDP, loading a checkpoint): breadth-first, every module that holds
    tensors gets ``to_empty(device, recurse=False)`` and ``reset_parameters()``. With the hooks of
    :func:`install_reset_parameters` the result equals what FSDP materializes, on any number of ranks.
    """
    queue = collections.deque([root])
    while queue:
        module = queue.popleft()
        queue.extend(module.children())
        if holds_tensors(module) and _has_own_meta(module):
            module.to_empty(device=device, recurse=False)
            reset: Callable[[], None] = getattr(module, "reset_parameters")  # as FSDP calls it
            reset()


def _has_own_meta(module: Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)))


def materialized_bytes(root: Module) -> tuple[int, int]:
    """Bytes held by ``root``'s tensors: ``(in FSDP flat parameters, elsewhere)``, each storage counted once.

    The first number is what FSDP1 keeps of the units wrapped so far (this rank's shards; ``use_orig_params`` views
    share their storage); the second is every other tensor that is not on the meta device, e.g. the unit being
    materialized. Meant for tests and benchmarks: it sees what the model references, not temporaries.
    """
    from lightning_fedshard.core.backends.fsdp import flat_params

    flat: dict[int, int] = {}
    for flat_param in flat_params(root):
        storage = flat_param.untyped_storage()
        flat[storage.data_ptr()] = storage.nbytes()
    other: dict[int, int] = {}
    for tensor in itertools.chain(root.parameters(), root.buffers()):
        storage = tensor.untyped_storage()
        if not tensor.is_meta and storage.data_ptr() not in flat:
            other[storage.data_ptr()] = storage.nbytes()
    return sum(flat.values()), sum(other.values())
