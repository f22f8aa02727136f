"""The constructors the Trainer and Fabric strategies share: the federation arguments, validated once.

Lightning keeps two strategy hierarchies (``lightning.pytorch`` and ``lightning.fabric``) and two ways to shard:
``FSDPStrategy`` (FSDP1) and ``ModelParallelStrategy`` (FSDP2). :class:`FederatedArguments` takes the federation
arguments and builds the :class:`~lightning_fedshard.runtime.FederatedRuntime`; :class:`FSDP1Arguments` and
:class:`FSDP2Arguments` take the arguments of one sharding backend; whatever remains goes to the Lightning strategy
behind them. jsonargparse (LightningCLI) follows the ``**kwargs`` down that chain.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# Private: Lightning's FSDP wrapping steps, reused so that wrapping on CPU does exactly what Lightning does elsewhere.
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_fedshard.core.backends.fsdp import FSDP1, fsdp_device_id
from lightning_fedshard.core.backends.fsdp2 import (
    FSDP2,
    apply_activation_checkpointing,
    check_group_mesh,
    is_fully_sharded,
    mixed_precision_policy,
    shard_model,
)
from lightning_fedshard.core.backends.sharding import ShardingBackend, StateDictType
from lightning_fedshard.core.config import (
    FederationConfig,
    OuterOptimizerSpec,
    federation_args_doc,
    outer_learning_rate_warning,
)
from lightning_fedshard.core.listeners import SyncListener, UtilizationClock
from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.options.outer_topology import OuterTopologySpec
from lightning_fedshard.core.options.pace import Pace
from lightning_fedshard.core.wire.codecs import Codec
from lightning_fedshard.plan.check import PlanCheck
from lightning_fedshard.runtime import FederatedRuntime

#: How a strategy's ``state_dict_type`` may be set.
STATE_DICT_TYPES = ("full", "sharded")

#: The ``Args:`` entries of the FSDP1 arguments the federated strategies handle themselves (shared by both adapters).
FSDP1_ARGS_DOC = """\
        auto_wrap_policy: As for Lightning's ``FSDPStrategy``; layer classes may also be given by import path, e.g.
            ``["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]``.
        activation_checkpointing_policy: As for Lightning's ``FSDPStrategy``; layer classes may also be given by
            import path.
        sharding_strategy: Leave unset: FL+FSDP uses ``"FULL_SHARD"`` and FL+HSDP ``"HYBRID_SHARD"`` inside a group,
            and any other value raises ``ValueError``.
        state_dict_type: ``"full"`` or ``"sharded"`` checkpoints; both resume exactly (see docs/checkpoints.md).
        **kwargs: Passed on to Lightning's ``FSDPStrategy`` and torch FSDP, except ``device_mesh`` and
            ``process_group``, which the federation builds itself."""

#: The ``Args:`` entries of the FSDP2 arguments (shared by both adapters).
FSDP2_ARGS_DOC = """\
        fsdp_modules: Module classes (or import paths, like ``auto_wrap_policy``) that each get a ``fully_shard``
            unit of their own, e.g. the decoder layers; the model's top modules always get one. Ignored when
            the model was sharded already (``configure_model`` applied ``fully_shard`` on ``self.device_mesh``).
        auto_wrap_policy: The same as ``fsdp_modules``, so that a config written for the FSDP1 strategies switches
            backend by its class name alone.
        activation_checkpointing_policy: Module classes (or import paths) to recompute in the backward pass.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy``, or a dict of its fields with dtype names, e.g.
            ``{"param_dtype": "bfloat16", "reduce_dtype": "float32"}``; ``None``: full precision.
        reshard_after_forward: FSDP2's option for the ``fsdp_modules`` units (``False`` keeps their gathered
            parameters from forward to backward: faster, more memory).
        state_dict_type: ``"full"`` or ``"sharded"`` checkpoints; both resume exactly (see docs/checkpoints.md).
        **kwargs: Passed on to Lightning's ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``);
            its mesh sizes and ``save_distributed_checkpoint`` are set by the federation and refused here."""


#: The ``Args:`` entry of ``plan`` (shared by every federated strategy).
_PLAN_DOC = """\
        plan: Check the planner against this run (off by default): a cluster preset of ``fedshard plan`` (e.g.
            ``"leonardo-512"``) or a dict with ``"cluster"`` and cluster fields to change (e.g.
            ``{"cluster": "leonardo-512", "inter_bandwidth": 12.5e9}``). At the end of training the predicted and
            measured step, outer-sum and waiting times are logged (``fedshard/plan/*``); see docs/plan.md."""


def _from_runtime(name: str, doc: str) -> Any:
    """A read-only property that reads ``self.runtime.<name>``."""
    return property(lambda self: getattr(self.runtime, name), doc=doc)


def document_federation_args(backend_args_doc: str) -> Callable[[type], type]:
    """Class decorator: complete a strategy's docstring with the one description of its arguments."""

    def document(cls: type) -> type:
        args = federation_args_doc() + "\n" + _PLAN_DOC + "\n" + backend_args_doc
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + args + "\n"
        return cls

    return document


class FederatedArguments:
    """Constructor of a federated strategy, placed before the Lightning strategy that shards the model.

    Subclasses set :attr:`hybrid`, :attr:`strategy_name` and :attr:`backend`; everything federated then lives in
    :attr:`runtime`. The arguments of the sharding backend are taken by :class:`FSDP1Arguments` or
    :class:`FSDP2Arguments`, the rest is passed on to the Lightning strategy.
    """

    #: HYBRID_SHARD inside a group (FL+HSDP) instead of FULL_SHARD (FL+FSDP).
    hybrid: ClassVar[bool] = False
    #: The registered name, e.g. ``"fl_fsdp"``.
    strategy_name: str = ""
    #: One line describing the strategy in Lightning's registries.
    description: str = ""
    #: How the model is sharded inside a group.
    backend: ClassVar[ShardingBackend] = FSDP1
    # Provided by Lightning's strategy classes.
    num_nodes: int
    num_processes: int
    root_device: torch.device
    _state_dict_type: StateDictType

    def __init__(
        self,
        num_groups: int | None = None,
        shard_size: int | None = None,
        sync_every: int = 8,
        outer_optimizer: OuterOptimizerSpec = "fedavg",
        anchor_device: str = "cpu",
        on_nonfinite: str = "raise",
        fragments: int = 1,
        reduce_dtype: str | torch.dtype | Codec | None = None,
        quant_block_size: int = 128,
        error_feedback: bool | None = None,
        sync_delay: int = 0,
        merge_alpha: float = 0.0,
        eager_updates: bool | str = False,
        outer_topology: OuterTopologySpec = "all",
        elastic: Elastic | None = None,
        pace: Pace | None = None,
        plan: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.hybrid and shard_size is not None:
            raise ValueError(
                f"`shard_size={shard_size}` is only for FL+HSDP; FL+FSDP shards over the whole group."
                f" Use `strategy='{self.strategy_name.replace('fsdp', 'hsdp')}'` to replicate inside a group."
            )
        # Every FederationConfig field is an argument of this constructor, with the same default (a test checks it).
        arguments = locals()
        config = FederationConfig(**{f.name: arguments[f.name] for f in dataclasses.fields(FederationConfig)})
        listeners: list[SyncListener] = [UtilizationClock()]
        self._plan_check: PlanCheck | None = None
        if plan is not None:
            self._plan_check = PlanCheck(plan, log=rank_zero_info)  # a bad preset or field fails here
            listeners.append(self._plan_check)
        self.runtime = FederatedRuntime(config, self.hybrid, self.strategy_name, self.backend, listeners=listeners)
        check_keywords(type(self), kwargs)
        _silence_lightning_internals()
        lr_warning = outer_learning_rate_warning(outer_optimizer)
        if lr_warning is not None:
            rank_zero_warn(lr_warning)
        super().__init__(**kwargs)
        state_dict_type = getattr(self, "_state_dict_type", None)  # private in Lightning, which does not validate it
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"`state_dict_type={state_dict_type!r}` is not supported; choose 'full' or 'sharded'.")

    federation_config = _from_runtime("config", "The validated federation options.")
    topology = _from_runtime(
        "topology", "Groups, replicas and shards of this job (known once devices and nodes are set)."
    )
    mesh = _from_runtime("mesh", "The federation device mesh; exists after the processes have initialized.")
    federation = _from_runtime("federation", "This rank's federation (outer step and schedule), after initialization.")
    fragment_parameter_names = _from_runtime(
        "fragment_parameter_names", "The model's parameter names in each streaming fragment, once it is set up."
    )

    @property
    def plan_report(self) -> dict[str, float] | None:
        """Predicted and measured step and sync times at the end of training (with ``plan=...``)."""
        return self._plan_check.report if self._plan_check is not None else None

    @property
    def plan_check(self) -> PlanCheck | None:
        """The check of the run's pace against the planner's prediction (``plan=...``), if asked for."""
        return self._plan_check

    # -- Lightning hooks of the strategy behind this class (no @override: this class has no such base) --------------

    def _configure_launcher(self) -> None:
        # Private hook, but the only one that runs in the launching process once nodes and devices are known: a
        # topology that does not fit fails here, before any rank starts.
        super()._configure_launcher()  # type: ignore[misc]
        self.runtime.validate(self.num_nodes, self.num_processes)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if dist.get_rank() != 0:
            # A deprecation is about code, the same on every rank: rank 0 shows it once for the whole job.
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category)
        self.runtime.setup(self.num_nodes, self.num_processes, self.root_device)
        self._use_federation_mesh()

    def _use_federation_mesh(self) -> None:
        """Point the sharding backend at this rank's group, once the federation mesh exists."""
        raise NotImplementedError

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's local parameter shards of the federated model."""
        return self.runtime.model.local_shards()

    def _data_split(self, num_replicas: int, rank: int) -> dict[str, Any]:
        """The training sampler's split: every rank its own part; an elastic group's ranks take their group's part.

        An elastic job holds one group: its data is part ``group`` of ``num_groups`` (planned groups), so a group that
        replaces a failed one trains on the data the failed one would have.
        """
        elastic = self.runtime.config.elastic
        if elastic is None:
            return {"num_replicas": num_replicas, "rank": rank}
        group = self.runtime.group_index
        return {"num_replicas": self.runtime.num_groups * num_replicas, "rank": group * num_replicas + rank}


# jsonargparse (LightningCLI's --help) reads each argument's description from the class that takes it.
FederatedArguments.__doc__ = (
    f"{(FederatedArguments.__doc__ or '').rstrip()}\n\n    Args:\n{federation_args_doc()}\n{_PLAN_DOC}\n"
)


class FSDP1Arguments(FederatedArguments):
    """The FSDP1 arguments in front of one of Lightning's ``FSDPStrategy`` classes (``FullyShardedDataParallel``)."""

    # Provided by Lightning's FSDPStrategy classes.
    sharding_strategy: Any
    cpu_offload: Any
    mixed_precision_config: Any
    _activation_checkpointing_kwargs: dict[str, Any]  # private in Lightning; needed to wrap on CPU as it does

    def __init__(
        self,
        auto_wrap_policy: Any | None = None,
        activation_checkpointing_policy: Any | None = None,
        sharding_strategy: Any | None = None,
        **kwargs: Any,
    ) -> None:
        _check_fsdp_arguments(self.hybrid, sharding_strategy, kwargs)
        # Lightning's FSDPStrategy refuses HYBRID_SHARD this early (no process group exists yet): the in-group
        # sharding is set once the mesh is built.
        super().__init__(
            auto_wrap_policy=resolve_module_classes(auto_wrap_policy, "auto_wrap_policy"),
            activation_checkpointing_policy=resolve_module_classes(
                activation_checkpointing_policy, "activation_checkpointing_policy"
            ),
            sharding_strategy="FULL_SHARD",
            **kwargs,
        )
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = ShardingStrategy["HYBRID_SHARD" if self.hybrid else "FULL_SHARD"]

    def _use_federation_mesh(self) -> None:
        from torch.distributed.fsdp import ShardingStrategy

        self._fsdp_options["process_group"] = self.runtime.fsdp_process_group
        self.sharding_strategy = ShardingStrategy[self.runtime.fsdp_sharding]

    @property
    def _fsdp_options(self) -> dict[str, Any]:
        """The dict of FSDP arguments that the Lightning strategy behind this class passes to every FSDP unit."""
        raise NotImplementedError

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own data (an elastic group's ranks read their group's part)."""
        return self._data_split(self.num_nodes * self.num_processes, self.global_rank)  # type: ignore[attr-defined]

    def _federated_wrap(self, module: Module, lightning_wrap: Callable[[Module], Module]) -> Module:
        """Shard ``module`` inside this rank's group (on CPU with the ``device_id`` FSDP needs) and start all equal."""
        return self.runtime.model.wrap(module, lambda m: self._wrap_with_fsdp(m, lightning_wrap))

    def _wrap_with_fsdp(self, module: Module, lightning_wrap: Callable[[Module], Module]) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        already_wrapped = any(isinstance(m, FullyShardedDataParallel) for m in module.modules())
        if self.root_device.type != "cpu" or already_wrapped:
            return lightning_wrap(module)
        # Lightning passes `device_id=None` on CPU, which FSDP refuses; otherwise this is Lightning's own wrapping.
        wrapped = FullyShardedDataParallel(module=module, **self._fsdp_wrap_kwargs())
        _move_torchmetrics_to_device(wrapped, self.root_device)
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped

    def _fsdp_wrap_kwargs(self) -> dict[str, Any]:
        """Arguments of every FSDP unit: Lightning's own, with the ``device_id`` FSDP needs on CPU."""
        return {
            "cpu_offload": self.cpu_offload,
            "mixed_precision": self.mixed_precision_config,
            "sharding_strategy": self.sharding_strategy,
            "device_id": fsdp_device_id(self.root_device),
            **self._fsdp_options,
        }

    def _enable_wrap(self) -> AbstractContextManager:
        """FSDP's ``enable_wrap`` context for manual wrapping inside ``configure_model``."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._fsdp_wrap_kwargs())


#: ModelParallelStrategy arguments that the federation decides, with their defaults (which LightningCLI passes on).
_MODEL_PARALLEL_FIXED = {
    "data_parallel_size": "auto",
    "tensor_parallel_size": "auto",
    "save_distributed_checkpoint": True,
}


class FSDP2Arguments(FederatedArguments):
    """The FSDP2 arguments in front of one of Lightning's ``ModelParallelStrategy`` classes (``fully_shard``).

    The strategy's ``device_mesh`` is this rank's group: ``mesh["shard"]`` for FL+FSDP, ``mesh["replicate",
    "shard"]`` for FL+HSDP, so a ``configure_model`` written for Lightning's ``ModelParallelStrategy`` shards with
    ``fully_shard(layer, mesh=self.device_mesh)``.
    """

    backend = FSDP2
    _device_mesh: Any  # Lightning's ModelParallelStrategy reads its mesh from this attribute

    def __init__(
        self,
        fsdp_modules: Any | None = None,
        auto_wrap_policy: Any | None = None,
        activation_checkpointing_policy: Any | None = None,
        mixed_precision: Any | None = None,
        reshard_after_forward: bool = True,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        for key, default in (*_MODEL_PARALLEL_FIXED.items(), ("device_mesh", None), ("process_group", None)):
            if kwargs.get(key, default) == default:
                kwargs.pop(key, None)
            else:
                raise ValueError(
                    f"`{key}={kwargs[key]!r}` cannot be set on `{self.strategy_name}`: the federation builds the mesh"
                    " from `num_groups` and `shard_size`, and `state_dict_type` chooses the checkpoint."
                )
        if fsdp_modules is not None and auto_wrap_policy is not None:
            raise ValueError(
                f"`fsdp_modules={fsdp_modules!r}` and `auto_wrap_policy={auto_wrap_policy!r}` name the same thing; give"
                " one of them."
            )
        policy = fsdp_modules if fsdp_modules is not None else auto_wrap_policy
        self._fsdp_modules = resolve_module_classes(policy, "fsdp_modules")
        self._checkpointed_modules = resolve_module_classes(
            activation_checkpointing_policy, "activation_checkpointing_policy"
        )
        self._mp_policy = mixed_precision_policy(mixed_precision)
        self._reshard_after_forward = reshard_after_forward
        self._state_dict_type = state_dict_type  # type: ignore[assignment]  # validated by FederatedArguments
        super().__init__(**kwargs)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own data: groups, replicas and the shards of one replica are all data parallel."""
        return self._data_split(self.num_nodes * self.num_processes, self.global_rank)  # type: ignore[attr-defined]

    def _use_federation_mesh(self) -> None:
        self._device_mesh = self.runtime.group_mesh
        module = getattr(self, "lightning_module", None)  # the Trainer's; `configure_model` reads `self.device_mesh`
        if module is not None:
            # Private, and set by Lightning's own ModelParallelStrategy in the same way: `LightningModule.device_mesh`
            # is a read-only property over this attribute, and the mesh exists only now, after the process groups.
            module._device_mesh = self._device_mesh

    def _shard(self, module: Module, roots: Sequence[Module]) -> None:
        """Apply activation checkpointing and ``fully_shard`` unless ``configure_model`` sharded the model already.

        Raises:
            ValueError: If the model was sharded on another mesh than this rank's group, or left parameters unsharded.
        """
        if is_fully_sharded(module):
            check_group_mesh(module, self.runtime.group_mesh)
            return
        if self._checkpointed_modules:
            apply_activation_checkpointing(module, self._checkpointed_modules)
        shard_model(roots, self.runtime.group_mesh, self._fsdp_modules, self._mp_policy, self._reshard_after_forward)


def _silence_lightning_internals() -> None:
    """Drop a deprecation warning that Lightning's own code triggers on every run and rank, with no user action to take.

    Lightning 2.6 checks ``isinstance(treespec, LeafSpec)`` for every data loader, which torch deprecates; the filter
    names that message and Lightning's module only.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def _named_parameters(function: Callable[..., Any]) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}


def _lightning_base(cls: type) -> type:
    """The Lightning strategy class that a federated strategy passes its remaining keyword arguments to."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("lightning."))


def accepted_keywords(cls: type) -> set[str]:
    """The keyword arguments that the Lightning strategy behind ``cls`` (and, for FSDP1, torch's FSDP) accepts."""
    base = _lightning_base(cls)
    init = vars(base)["__init__"]
    accepted = _named_parameters(init)
    if any(p.kind == p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
        # Lightning's FSDPStrategy passes the rest on to every `FullyShardedDataParallel` unit.
        from torch.distributed.fsdp import FullyShardedDataParallel

        accepted |= _named_parameters(FullyShardedDataParallel.__init__) - {"module"}
    return accepted


def did_you_mean(name: str, valid: Iterable[str], prefix: str = "", n: int = 3) -> str:
    """`` (did you mean `a`, `b`?)`` naming the valid names closest to a misspelled ``name``; empty if none is close.

    Args:
        name: The name as the user wrote it.
        valid: The accepted names.
        prefix: Written before each suggestion (e.g. ``"--"`` for command-line options given without it).
        n: The most names suggested, closest first.
    """
    close = difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(f'`{prefix}{c}`' for c in close)}?)" if close else ""


def check_keywords(cls: type, kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments that neither the federation nor the strategy behind ``cls`` accepts.

    Without this check a misspelled federation argument (``sync_evry=2``) would travel on to torch's FSDP and fail
    only after launch, on every rank.

    Raises:
        ValueError: Naming each unknown keyword and the closest valid names.
    """
    accepted = accepted_keywords(cls)
    unknown = [key for key in kwargs if key not in accepted]
    if not unknown:
        return
    base = _lightning_base(cls)
    ours = cls.__mro__[: cls.__mro__.index(base)]
    own = set().union(*(_named_parameters(vars(c)["__init__"]) for c in ours if "__init__" in vars(c)))
    valid = sorted(own | accepted)
    hints = [f"`{key}={kwargs[key]!r}`{did_you_mean(key, valid)}" for key in unknown]
    raise ValueError(
        f"`{cls.__name__}` got unknown argument(s) {'; '.join(hints)}. It takes the federation arguments and those"
        f" of Lightning's `{base.__name__}`; valid names: {', '.join(valid)}."
    )


def _check_fsdp_arguments(hybrid: bool, sharding_strategy: Any, kwargs: dict[str, Any]) -> None:
    """Refuse FSDP1 arguments that contradict the federation, naming the value.

    Raises:
        ValueError: For ``device_mesh`` or ``process_group`` (the federation builds its own), or a
            ``sharding_strategy`` other than the strategy's own.
    """
    for key in ("device_mesh", "process_group"):
        if kwargs.get(key) is not None:
            raise ValueError(
                f"`{key}={kwargs[key]!r}` cannot be combined with a federated strategy: it builds its own"
                " mesh from `num_groups` and `shard_size`."
            )
    kwargs.pop("device_mesh", None)
    kwargs.pop("process_group", None)
    own = "HYBRID_SHARD" if hybrid else "FULL_SHARD"
    name = getattr(sharding_strategy, "name", sharding_strategy)
    if sharding_strategy is not None and name != own:
        raise ValueError(
            f"`sharding_strategy={sharding_strategy!r}` is not supported here; this strategy uses {own!r}."
        )


def resolve_module_classes(policy: Any, name: str) -> Any:
    """Accept layer classes by import path (``"transformers....LlamaDecoderLayer"`` or a list), as YAML gives them.

    Anything else (a set of classes, a callable policy, ``None``) is returned unchanged.

    Raises:
        ValueError: If a path does not name a ``torch.nn.Module`` subclass.
    """
    if isinstance(policy, str):
        policy = [policy]
    if not isinstance(policy, (list, tuple, set)) or not all(isinstance(p, str) for p in policy):
        return policy
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
