"""FL+FSDP and FL+HSDP strategies for Lightning Fabric, on FSDP1 (``fl_fsdp``) and FSDP2 (``fl_fsdp2``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

# Private names: Lightning types its own strategy hooks with them and exports no public alias.
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy, _StrategyRegistry
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard._arguments import (
    FSDP1_ARGS_DOC,
    FSDP2_ARGS_DOC,
    FederatedArguments,
    FSDP1Arguments,
    FSDP2Arguments,
    document_federation_args,
)
from lightning_fedshard.checkpoint.format import FABRIC_KEY, fabric_model_key
from lightning_fedshard.core.options.elastic import FederationEnded
from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.export import read_whole_checkpoint


class _FabricHooks(FederatedArguments):
    """Fabric's hooks routed to the runtime, whatever shards the model (no @override: no such base here).

    The outer step runs inside every ``sync_every``-th ``optimizer.step()``. After the training loop, call
    :meth:`finish` once so that every group holds the consensus (it syncs if the loop stopped between two syncs).
    Evaluate between syncs inside :meth:`consensus_weights` to see the consensus instead of the group's weights.
    Only one optimizer is supported: every ``optimizer.step()`` counts as one step.
    """

    # Provided by Lightning's strategy classes.
    broadcast: Any

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # Every optimizer.step() counts as one step of the sync schedule, so a second optimizer would double it.
        if self.runtime.model.optimizers and self.runtime.model.optimizers[0] is not optimizer:
            raise RuntimeError(
                f"`{type(self).__name__}` supports one optimizer; use parameter groups instead of a second optimizer."
            )
        self.runtime.model.set_optimizers([optimizer])
        return super().setup_optimizer(optimizer)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.runtime.config.elastic is not None and not self.runtime.joined:
            raise RuntimeError(
                f"An elastic `{type(self).__name__}` steps only after the group joined the federation: call"
                " `fabric.strategy.join(...)` after setting up the model and optimizer (and loading a checkpoint), and"
                " start the loop at the step it returns."
            )
        if not self.runtime.trains():
            self._refuse_gradients_of_a_skipped_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        self.runtime.after_optimizer_step()
        return output

    def _refuse_gradients_of_a_skipped_step(self, optimizer: Optimizable) -> None:
        """A per-group pace: this group skips the next step, so no gradient may reach ``optimizer.step()``.

        A loop that does not ask :meth:`trains` would train every step and be merged as if it trained only the steps
        of its pace: neither the paced result nor the barrier's. The ranks of the group agree (one tiny sum inside
        the group, on skipped steps only), so all of them raise together.

        Raises:
            RuntimeError: If a gradient of this group is not zero.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        found = any(p.grad is not None and bool(p.grad.ne(0).any()) for p in params)
        flag = torch.tensor([float(found)], device=self.root_device)  # type: ignore[attr-defined]
        self.runtime.federation.communicator.sum_in_group(flag)
        if flag.item() > 0:
            step, group = self.runtime.step + 1, self.runtime.federation.communicator.group_index
            raise RuntimeError(
                f"Group {group} skips optimizer step {step} (a per-group pace, `pace={self.runtime.config.pace!r}`),"
                " but `optimizer.step()` found gradients: the loop ran a backward pass on a step its group skips, and"
                " the group would be merged as if it trained only the steps of its pace. Ask"
                " `fabric.strategy.trains()` before the forward and backward of every step, and call `optimizer.step()`"
                " either way (see docs/pace.md)."
            )

    def join(self, state: dict[str, Any] | None = None, after_step: dict[str, Any] | None = None) -> int:
        """Elastic: enter the federation; returns the optimizer step to continue from (collective over the groups).

        Call it once, after ``fabric.setup`` of the model and optimizer (and ``fabric.load`` when resuming), before the
        loop. A group that joins a running federation takes a peer's weights, anchor, outer state, step and optimizer
        settings (learning rate, ...), and the state of every object in ``state`` and ``after_step`` (anything with
        ``state_dict`` / ``load_state_dict``, e.g. a torchdata ``StatefulDataLoader``); its inner optimizer state
        starts fresh. Give the same keys in every group.

        A peer hands its state over inside its ``optimizer.step()``, where the sync runs: objects that the loop steps
        *after* ``optimizer.step()`` (a learning-rate scheduler) go into ``after_step``, and are stepped once after
        loading, as the peers step them. In a federation that is not elastic this only returns :attr:`num_steps`.

        Args:
            state: Objects to take from a peer as they are.
            after_step: Objects to take from a peer and then ``step()`` once.
        """
        if self.runtime.config.elastic is None:
            return self.runtime.step
        if self.runtime.standing_by and not self.stand_by():
            raise FederationEnded("The federation ended while this standby waited: it has no group to train.")
        objects, stepped = dict(state or {}), dict(after_step or {})
        if set(objects) & set(stepped):
            raise ValueError(f"`state` and `after_step` both name {sorted(set(objects) & set(stepped))}.")
        everything = {**objects, **stepped}
        self.runtime.set_host_state(
            lambda: {k: v.state_dict() for k, v in everything.items()},
            lambda saved: _load_objects(everything, saved, stepped),
        )
        self.runtime.start(self.runtime.step)
        if self.runtime.standing_by:
            raise FederationEnded("The federation ended as this standby took a place in it: it has no group to train.")
        return self.runtime.step

    def stand_by(self) -> bool:
        """Elastic standby (``Elastic(standby=True)``): wait for a group of the federation to be gone, take its place.

        Call it after setting up the model and optimizer and before setting up the data loaders, which take the
        group's part of the data (``join`` calls it too, if it was not called). Collective inside this job.

        Returns:
            ``True`` once this job holds a group's index; ``False`` if the federation ended while it waited (there is
            nothing to train). ``True`` at once for a job that is not a standby.
        """
        return self.runtime.stand_by()

    def teardown(self) -> None:
        self.runtime.close()  # elastic: this group leaves the federation
        super().teardown()  # type: ignore[misc]

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken so far (restored by :meth:`load_checkpoint`)."""
        return self.runtime.step

    def trains(self) -> bool:
        """Whether this group trains the next optimizer step; ``False`` only with a per-group pace (``Pace``).

        A group slower than the fastest skips the last steps of each round so that it reaches the sync with the
        others. A loop skips the forward and backward of such a step and still calls ``optimizer.step()`` (it finds no
        gradient, and counts the step)::

            for batch in loader:
                if fabric.strategy.trains():
                    fabric.backward(model(batch))
                optimizer.step()
                optimizer.zero_grad()
        """
        return self.runtime.trains()

    @property
    def last_sync_stats(self) -> SyncStats | None:
        """Statistics of the most recent sync, or ``None`` before the first one."""
        return self.runtime.last_sync_stats

    def finish(self) -> SyncStats | None:
        """End of training: sync once more if the loop stopped between two syncs (collective).

        Afterwards every group holds the consensus. Returns the statistics of that sync, or ``None`` if the last
        optimizer step already ended with one.
        """
        return self.runtime.finish()

    def consensus_weights(self) -> AbstractContextManager[None]:
        """Evaluate on the consensus of the last sync; the group's own weights come back on exit."""
        return self.runtime.consensus_weights()

    # -- checkpoints: the consensus as the model, every group's own state beside it (lightning_fedshard/checkpoint/) ---

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` (the federated model, its optimizer, anything else) for an exact resume; collective.

        The file keeps the keys of ``state``, as Lightning's FSDP strategy writes them: the model's key holds the
        consensus as a plain state dict (in the DCP files of a sharded checkpoint); in a full checkpoint each
        optimizer's key holds group 0's optimizer state over the whole model, keyed by parameter name. Each group's
        own weights and inner optimizer state, the anchor and the outer optimizer state go under ``"fedshard"``, the
        step count under ``"fedshard_fabric"`` (see docs/checkpoints.md).
        """
        if storage_options is not None or filter is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` supports neither `storage_options` nor `filter`.")
        module_key, optimizer_keys = self._federated_keys(state)
        checkpoint = {
            k: v.state_dict() if isinstance(v, Stateful) else v
            for k, v in state.items()
            if k != module_key and k not in optimizer_keys
        }
        runtime = self.runtime
        checkpoint[module_key] = runtime.checkpointer.consensus_state_dict(self._state_dict_type)
        if self._state_dict_type == "full":
            for key in optimizer_keys:
                checkpoint[key] = runtime.backend.full_optimizer_state_dict(runtime.model.module, state[key])  # type: ignore[arg-type]
        checkpoint[FABRIC_KEY] = {"num_steps": runtime.step, "model_key": module_key}
        optimizer_states = [state[k].state_dict() for k in optimizer_keys]
        runtime.checkpointer.save(
            checkpoint, self.broadcast(path), self._state_dict_type, optimizer_states, fabric_model_key(module_key)
        )

    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote into the objects of ``state`` (in place); returns the rest.

        With the model and its optimizer in ``state`` the run continues exactly where it was saved (with the same
        topology; otherwise every group starts from the consensus, see docs/checkpoints.md). With the model alone,
        every group gets the consensus and the federation starts afresh from it. A module alone (``fabric.load_raw``)
        loads a plain state dict file into every group, e.g. pretrained weights. Without ``state`` the whole
        checkpoint is returned. Collective.
        """
        path = self.broadcast(path)
        if isinstance(state, Module):
            self._load_raw_module(path, state, strict, weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                f"`{type(self).__name__}` cannot load an optimizer alone: its state is each group's own. Save and load"
                " it together with the model, e.g. `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
            )
        if not state:
            return read_whole_checkpoint(path, weights_only)
        module_key, optimizer_keys = self._federated_keys(state)
        optimizers: list[Optimizer] = [state[k] for k in optimizer_keys]  # type: ignore[misc]
        runtime = self.runtime
        metadata = runtime.checkpointer.load(
            path, optimizers=optimizers or None, strict=strict, weights_only=weights_only
        )
        fabric = metadata.pop(FABRIC_KEY, {})
        if optimizers:
            runtime.step = int(fabric.get("num_steps", runtime.step))
        else:  # weights only: every group holds the consensus now
            self._restart_federation()
        for key, obj in state.items():
            if key == module_key or key in optimizer_keys:
                metadata.pop(key, None)  # restored above (an optimizer from its group's entry)
            elif key in metadata:
                if isinstance(obj, Stateful):
                    obj.load_state_dict(metadata.pop(key))
                else:
                    state[key] = metadata.pop(key)
        return metadata

    def _load_raw_module(self, path: _PATH, module: Module, strict: bool, weights_only: bool | None) -> None:
        """Load a plain ``torch.save(model.state_dict())`` file into ``module`` (the federated one: in every group)."""
        state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        if module is not self.runtime.model.module:
            module.load_state_dict(state_dict, strict=strict)
            return
        self.runtime.backend.load_state_dict(module, state_dict, "full", strict=strict)
        self._restart_federation()

    def _restart_federation(self) -> None:
        """Anchor the federation afresh on the weights every group holds now (loaded from outside the federation)."""
        if self.runtime.federation.started:
            self.runtime.checkpointer.start_afresh(self.runtime.step)

    def _federated_keys(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        """The key of the federated model in ``state`` and the keys of the optimizers."""
        modules = [k for k, v in state.items() if v is self.runtime.model.module]
        if len(modules) != 1:
            raise ValueError(
                f"The checkpoint `state` must hold the model set up by `{type(self).__name__}` exactly once"
                f" (found it under {modules})."
            )
        return modules[0], [k for k, v in state.items() if isinstance(v, Optimizer)]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register the strategy under its name with Fabric's registry."""
        if dist.is_available() and cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description)


class _FederatedFabricStrategy(_FabricHooks, FSDP1Arguments, FSDPStrategy):
    """What the Fabric :class:`FLFSDPStrategy` and :class:`FLHSDPStrategy` share: Fabric's FSDP1 strategy, federated."""

    @property
    def _fsdp_options(self) -> dict[str, Any]:
        return self._fsdp_kwargs  # private: Fabric's FSDPStrategy keeps the FSDP arguments only here

    @override
    def setup_module(self, module: Module) -> Module:
        module = self._federated_wrap(module, super().setup_module)
        if self.runtime.config.elastic is None:  # an elastic group starts when it joins (`join`)
            self.runtime.start(self.runtime.step)
        return module

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._enable_wrap()


class _FederatedFabricFSDP2Strategy(_FabricHooks, FSDP2Arguments, ModelParallelStrategy):
    """What the Fabric :class:`FLFSDP2Strategy` and :class:`FLHSDP2Strategy` share: Fabric's FSDP2 strategy, federated.

    ``parallelize_fn(module, device_mesh)``, if given, runs first with this rank's group as the mesh (as for Fabric's
    ``ModelParallelStrategy``); whatever it leaves unsharded is sharded by the ``fsdp_modules`` policy, with the
    module itself as the root unit.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[Module, Any], Module] | None = None,
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ) -> None:
        self._user_parallelize = parallelize_fn
        super().__init__(parallelize_fn=self._parallelize, state_dict_type=state_dict_type, **kwargs)

    def _parallelize(self, module: Module, device_mesh: Any) -> Module:
        if self._user_parallelize is not None:
            module = self._user_parallelize(module, device_mesh)
        self._shard(module, [module])
        return module

    @override
    def setup_module(self, module: Module) -> Module:
        module = self.runtime.model.wrap(module, self._shard_and_materialize)
        if self.runtime.config.elastic is None:  # an elastic group starts when it joins (`join`)
            self.runtime.start(self.runtime.step)
        return module

    def _shard_and_materialize(self, module: Module) -> Module:
        module = super().setup_module(module)  # ModelParallelStrategy: parallelize, then materialize meta tensors
        return module.to(self.root_device)


def _load_objects(objects: dict[str, Any], saved: dict[str, Any], stepped: dict[str, Any]) -> None:
    """Load a peer's states into the objects given to ``join`` (the same keys in every group); step ``stepped``."""
    if set(saved) != set(objects):
        raise ValueError(f"This group joins with the objects {sorted(objects)}, the federation's are {sorted(saved)}.")
    for key, obj in objects.items():
        obj.load_state_dict(saved[key])
    for obj in stepped.values():
        obj.step()


@document_federation_args(FSDP1_ARGS_DOC)
class FLFSDPStrategy(_FederatedFabricStrategy):
    """FL+FSDP for Fabric: FSDP (FULL_SHARD) inside federation groups, an outer step every ``sync_every`` steps.

    The Fabric twin of :class:`lightning_fedshard.FLFSDPStrategy`. The outer step runs inside every
    ``sync_every``-th ``optimizer.step()``; call :meth:`finish` after the loop. Every argument of Fabric's
    ``FSDPStrategy`` not listed below is accepted too (``state_dict_type`` defaults to ``"sharded"`` there).
    """

    strategy_name = "fl_fsdp"
    description = "FL+FSDP: FSDP inside federation groups, outer steps between"
    hybrid = False


@document_federation_args(FSDP1_ARGS_DOC)
class FLHSDPStrategy(_FederatedFabricStrategy):
    """FL+HSDP for Fabric: HSDP (HYBRID_SHARD) inside federation groups, an outer step every ``sync_every`` steps.

    The Fabric twin of :class:`lightning_fedshard.FLHSDPStrategy`: inside a group the model is sharded over
    ``shard_size`` ranks and replicated across the group's nodes. As with :class:`FLFSDPStrategy`, the outer step
    runs inside ``optimizer.step()`` and :meth:`finish` closes the last round; Fabric's other ``FSDPStrategy``
    arguments are accepted too.
    """

    strategy_name = "fl_hsdp"
    description = "FL+HSDP: HSDP inside federation groups, outer steps between"
    hybrid = True


@document_federation_args(FSDP2_ARGS_DOC)
class FLFSDP2Strategy(_FederatedFabricFSDP2Strategy):
    """FL+FSDP for Fabric on FSDP2 (``fully_shard``): the Fabric twin of :class:`lightning_fedshard.FLFSDP2Strategy`.

    Used like the Fabric :class:`FLFSDPStrategy` (the outer step inside ``optimizer.step()``, :meth:`finish` after the
    loop); ``parallelize_fn`` and ``process_group_backend``/``timeout`` of Fabric's ``ModelParallelStrategy`` are
    accepted too (``state_dict_type`` defaults to ``"sharded"``).
    """

    strategy_name = "fl_fsdp2"
    description = "FL+FSDP on FSDP2 (fully_shard): FSDP inside federation groups, outer steps between"
    hybrid = False


@document_federation_args(FSDP2_ARGS_DOC)
class FLHSDP2Strategy(_FederatedFabricFSDP2Strategy):
    """FL+HSDP for Fabric on FSDP2 (``fully_shard`` on each group's ``("replicate", "shard")`` mesh).

    The Fabric twin of :class:`lightning_fedshard.FLHSDP2Strategy`, used like :class:`FLFSDP2Strategy`.
    """

    strategy_name = "fl_hsdp2"
    description = "FL+HSDP on FSDP2 (fully_shard): HSDP inside federation groups, outer steps between"
    hybrid = True
