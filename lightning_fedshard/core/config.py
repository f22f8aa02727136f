"""The user-facing federation options, validated as they are built, shared by the Trainer and Fabric strategies.

Every check (:mod:`~lightning_fedshard.core.validation`) runs in the constructor, before any process is
launched, so that a typo fails in seconds.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning_fedshard.core.options.checks import check_positive_int
from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.options.outer_topology import (
    Hierarchical,
    Mixing,
    OuterTopologySpec,
    Sampled,
    resolve_outer_topology,
)
from lightning_fedshard.core.options.pace import Pace
from lightning_fedshard.core.rounds.options import check_compatible
from lightning_fedshard.core.step.outer import OuterOptimizerFactory, build_outer_optimizer
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.core.validation import (
    check_choices,
    check_codec_options,
    check_elastic,
    check_error_feedback,
    check_outer_topology,
    check_pace,
    check_streaming,
)
from lightning_fedshard.core.wire.codecs import (
    DEFAULT_BLOCK_SIZE,
    ChunkCodec,
    Codec,
    SparseLoCo,
    resolve_codec,
)
from lightning_fedshard.core.wire.reducers import Reducer, make_reducer

#: Named outer optimizers. "fedavg" (the default) replaces every group by the groups' mean, which is what the paper's
#: published runs do and what won our benchmarks at sync_every=8 (docs/benchmarks.md); "nesterov" is DiLoCo's outer
#: step (the default of PyTorch's fault-tolerance library and of OpenDiLoCo), tuned there for hundreds of inner steps
#: between syncs.
OUTER_OPTIMIZERS: dict[str, OuterOptimizerFactory] = {
    "nesterov": functools.partial(SGD, lr=0.7, momentum=0.9, nesterov=True),
    "fedavg": functools.partial(SGD, lr=1.0),
}

OuterOptimizerSpec = str | Callable[[Iterable[Tensor]], Optimizer]

#: What ``reduce_dtype=None`` (the default) runs: int4 with error feedback, and float32 with a mixing outer topology,
#: whose plain outer steps (a uniform round, the end of training) carry the pseudo-gradient of the whole run.
DEFAULT_REDUCE_DTYPE = "int4"
MIXING_REDUCE_DTYPE = "float32"


@dataclass(frozen=True)
class FederationConfig:
    """The federation options of an FL+FSDP / FL+HSDP strategy, validated.

    This docstring is the one description of these options: the Trainer and Fabric strategies show it as their own
    (see :func:`federation_args_doc`), and so do LightningCLI's ``--help`` and the docs.

    Args:
        num_groups: Number of federation groups ``G``. Default: one group per node (``num_nodes``). The world size
            must be divisible by it.
        shard_size: FL+HSDP only: ranks that shard one replica (``S``). Default: the devices of one node. The group
            size must be divisible by it. FL+FSDP shards over the whole group and refuses this argument.
        sync_every: Optimizer steps between two outer steps (the paper's ``H``; default 8).
        outer_optimizer: ``"fedavg"`` (default; ``SGD(lr=1.0)``: plain averaging, as in the paper's runs and best
            in our benchmarks at ``sync_every=8``, see docs/benchmarks.md), ``"nesterov"``
            (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's outer step, tuned for hundreds of inner steps) or
            a callable that builds a ``torch.optim.Optimizer`` from an iterable of tensors.
        reduce_dtype: Data type of the pseudo-gradient on the wire: ``"int4"`` (the default) or ``"int8"``: block-wise
            absmax quantization, summed in float32 by an all-to-all and an all-gather of quantized chunks (works on
            gloo and NCCL; about 0.13x and 0.26x the bytes of float32, scales included); or ``"float32"``,
            ``"bfloat16"``, ``"float16"`` (or the matching ``torch.dtype``), summed by an all-reduce. int4 with error
            feedback is the default: its perplexity measured level with float32 (+0.6% mean over 3 paired seeds at
            64 steps, -4% over 2 at 120) at 1/8 of the bytes, which took FL+FSDP from 0.76 to 0.95 compute utilization
            at 50 Mbit/s (see docs/benchmarks.md). ``"float32"`` reproduces plain averaging exactly. A codec object
            carries its own parameters: ``lightning_fedshard.BlockQuantizer(bits=4, block_size=64)`` or
            ``lightning_fedshard.FloatCodec("bfloat16")`` (in YAML a ``class_path`` with ``init_args``).
            ``"sparse"`` is ``lightning_fedshard.SparseTopK()``: the largest 1/64 of each chunk of 4096 values with
            2-bit values (about 0.0073x the bytes of float32), summed like int4; see docs/configuration.md.
            Default ``None``: ``"int4"``, and ``"float32"`` with a mixing ``outer_topology`` (``Gossip``, ``Sampled``,
            ``Mixing``). Under a mixing a lossy dtype encodes each group's mix message (its weights less the anchor),
            keeps what the encoding dropped in the group's own weights, and the end of training averages in float32
            (see docs/topologies.md).
        quant_block_size: Values per quantization block (one float32 scale each) for ``"int8"`` / ``"int4"`` given by
            name (default 128, measured as the smallest block that keeps int4 under 0.14x float32).
        error_feedback: With ``"int8"`` / ``"int4"`` / ``"sparse"``, carry what each rank's encoding dropped into its
            next sync, so that rounding errors (and unsent entries) are delayed instead of lost (kept in
            checkpoints). Default ``None``: on with a compressed ``reduce_dtype``, off with a float one. ``True`` is
            rejected with a float ``reduce_dtype``, which has no residual.
        anchor_device: Where the anchor (float32) and the outer optimizer state live: ``"cpu"`` (default; host
            memory, the accelerator pays nothing) or ``"device"`` (next to the model's shards).
        on_nonfinite: What a sync does when a group's pseudo-gradient holds NaN/Inf. ``"raise"`` (default): stop
            with an error naming the groups, the step and the sync, leaving the anchor and the last checkpoint
            untouched. ``"skip_group"``: average over the healthy groups only and restart the broken ones (weights
            from the new anchor, fresh inner optimizer state), with a warning.
        fragments: Streaming fragments ``P`` (default 1: the whole model syncs at once). The model's FSDP units, in
            module order, are cut into ``P`` contiguous fragments balanced by size, each with its own outer
            optimizer; one fragment lands every ``sync_every / P`` optimizer steps, in turn, so every fragment still
            syncs every ``sync_every`` steps but one sync moves about ``1 / P`` of the model (with a hierarchical
            topology: its largest period instead of ``sync_every``). That period must be divisible by it, and the model
            needs at least ``P`` FSDP units (the DiLoCo of PyTorch's fault-tolerance library takes a list of model
            fragments instead).
        sync_delay: Optimizer steps that a fragment's sum over the groups may overlap with training (default 0):
            the pseudo-gradient is taken after step ``s - sync_delay``, summed in the background, and applied after
            step ``s``. ``0 <= sync_delay < sync_every / fragments``. That library's ``fragment_sync_delay``.
        merge_alpha: After a fragment lands, each group's weights of it become
            ``anchor + merge_alpha * (local - anchor)`` (default 0.0: restart from the new anchor); in ``[0, 1]``.
            That library's ``fragment_update_alpha``.
        eager_updates: Overlap each fragment's sum over the groups with the whole next round (default ``False``):
            at a sync every group lands the mean that was summed during the round that just ended, starts summing its
            new pseudo-gradient ``d_g``, and restarts from ``anchor - lr * d_g / G``, its own share of that mean
            applied at once (``True`` or ``"share"``: the eager updates of arXiv 2502.12996; ``lr`` the outer
            learning rate), or from ``anchor - lr * d_g`` (``"local"``: its own pseudo-gradient stands in for the
            whole mean until the mean lands). The anchor and the outer optimizer stay identical in every group;
            nothing a group trains is thrown away. See docs/configuration.md, "Eager updates".
        elastic: Run each federation group as a job of its own, joined to the others through a lighthouse:
            groups may fail, be replaced and join while the others train (``lightning_fedshard.Elastic(lighthouse=...,
            group=...)``; needs ``pip install lightning-fedshard[elastic]``; see docs/elastic.md). ``num_groups`` is
            then the number of groups the federation is planned for (the data is split into that many parts), and the
            job itself holds one group. Default ``None``: every group runs in this job.
        outer_topology: Which groups average at a sync: ``"all"`` (default: every group with every group) or
            ``lightning_fedshard.Hierarchical(levels={8: 2, 32: 4})``: blocks of consecutive groups (sites) average
            their weights at the smaller periods, the whole federation takes the outer step at the largest (see
            docs/configuration.md, "Outer topology"). Hierarchical levels below the federation are summed in float32;
            the federation's own round (fragments, ``sync_delay``, ``merge_alpha``) runs at the largest period. Or a
            mixing (``Gossip(peers=1)``, ``Sampled(groups_per_round=k)``, ``Mixing(matrix)``): every ``sync_every``
            steps each group takes a doubly-stochastic mix of the groups' weights (plain means:
            ``outer_optimizer="fedavg"``; with ``sync_delay`` the mix travels while training goes on, and a lossy
            ``reduce_dtype`` compresses it).
            ``Sampled(groups_per_round=k, outer_step=True)`` instead takes the outer step on the sampled groups' mean.
        pace: Groups of different speeds: ``lightning_fedshard.Pace()`` lets each group train the share of a round
            its measured speed allows (the fastest trains every step, a slower one skips the last steps of the
            round) and weighs the merge by the steps each trained; ``Pace(speeds=(1, 1, 1, 0.5))`` gives the relative
            speeds instead. Default ``None``: every group trains every step and waits for the slowest at a sync. See
            docs/pace.md.

            Which of these options compose is declared by each sync mode and listed in
            docs/configuration.md, "Which options compose"; a pair that does not is refused in the constructor.

    Raises:
        ValueError: For a non-positive ``num_groups``, ``shard_size`` or ``sync_every``, an unknown outer optimizer
            name, an outer optimizer factory that does not return an optimizer, an unknown reduce dtype, anchor device
            or ``on_nonfinite`` policy, the outer period not divisible by ``fragments``, ``sync_delay`` outside ``[0,
            period / fragments)``, ``merge_alpha`` outside ``[0, 1]``, ``quant_block_size < 1``, a
            ``quant_block_size`` with a codec that does not use it (``"sparse"``, a codec object),
            ``error_feedback=False`` with a sparse codec (``"sparse"``, ``SparseLoCo``) that drops values,
            ``error_feedback=True`` with a float ``reduce_dtype``, error feedback with a mixing, or two
            options that do not compose (see above).
    """

    num_groups: int | None = None
    shard_size: int | None = None
    sync_every: int = 8
    outer_optimizer: OuterOptimizerSpec = "fedavg"
    reduce_dtype: str | torch.dtype | Codec | None = None
    anchor_device: str = "cpu"
    on_nonfinite: str = "raise"
    fragments: int = 1
    sync_delay: int = 0
    merge_alpha: float = 0.0
    quant_block_size: int = DEFAULT_BLOCK_SIZE
    error_feedback: bool | None = None
    eager_updates: bool | str = False
    outer_topology: OuterTopologySpec = "all"
    elastic: Elastic | None = None
    pace: Pace | None = None

    def __post_init__(self) -> None:
        for name in ("num_groups", "shard_size"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        check_positive_int("sync_every", self.sync_every)
        _check_learning_rate_given(self.outer_optimizer)
        # Build the outer optimizer once on a probe tensor, so a broken factory fails before any rank starts.
        build_outer_optimizer(self.outer_optimizer_factory, [torch.zeros(1, requires_grad=True)])
        check_error_feedback(self.error_feedback)
        check_positive_int("quant_block_size", self.quant_block_size)
        check_outer_topology(self)
        # Builds a reducer once: an unknown dtype, or error feedback with a float dtype, fail here.
        self.reducer()
        check_codec_options(self)
        check_choices(self.anchor_device, self.on_nonfinite)
        check_streaming(self)
        check_elastic(self)
        check_pace(self)
        check_compatible(self)

    def topology(self, num_nodes: int, devices_per_node: int, hybrid: bool) -> FederationTopology:
        """The job's topology once the number of nodes and devices per node are known.

        Args:
            num_nodes: Nodes in the job.
            devices_per_node: Ranks per node.
            hybrid: FL+HSDP (shard over ``shard_size``, default a node) instead of FL+FSDP (shard over the group).

        Raises:
            ValueError: If the world size is not divisible by the number of groups, or a group by the shard size.
        """
        world_size = num_nodes * devices_per_node
        if self.elastic is not None:  # the job is one group of the federation
            shard_size = (self.shard_size or devices_per_node) if hybrid else world_size
            if world_size % shard_size:
                raise ValueError(
                    f"The elastic group's {world_size} rank(s) are not divisible by `shard_size={shard_size}`"
                    f"{' (the devices of one node, the default)' if self.shard_size is None else ''}."
                )
            return FederationTopology(world_size=world_size, num_groups=1, shard_size=shard_size)
        num_groups = self.num_groups or num_nodes
        if world_size % num_groups:
            raise ValueError(
                f"The world size ({world_size} = {num_nodes} node(s) x {devices_per_node} device(s)) must be"
                f" divisible by `num_groups={num_groups}`."
            )
        group_size = world_size // num_groups
        if (topology := resolve_outer_topology(self.outer_topology)) is not None:
            topology.check_groups(num_groups)
        shard_size = (self.shard_size or devices_per_node) if hybrid else group_size
        if group_size % shard_size and self.shard_size is None:
            raise ValueError(
                f"The group size ({group_size} = world size {world_size} / `num_groups={num_groups}`) is not divisible"
                f" by the default `shard_size={shard_size}` (the devices of one node). Pass a `shard_size` that"
                f" divides {group_size}, or fewer `num_groups`."
            )
        return FederationTopology(world_size=world_size, num_groups=num_groups, shard_size=shard_size)

    def describe(self) -> str:
        """The sync options in one line, e.g. for the log at the start of training."""
        outer = self.outer_optimizer if isinstance(self.outer_optimizer, str) else repr(self.outer_optimizer)
        codec = self.codec
        dtype = (
            codec.describe(feedback=self.error_feedback is not False)
            if isinstance(codec, SparseLoCo)
            else codec.describe()
        )
        if self.mixing is not None and not self.codec.exact:
            dtype += " mix messages, what they drop kept in the weights"
        elif self.compressed:
            dtype += f" {'with' if self.error_feedback is not False else 'without'} error feedback"
        parts = [f"outer step every {self.sync_every} optimizer steps ({outer})", f"outer traffic {dtype}"]
        if self.fragments > 1:
            parts.append(f"{self.fragments} streaming fragments")
        if self.sync_delay:
            parts.append(f"sum overlapped with {self.sync_delay} step(s)")
        if self.eager_rule is not None:
            parts.append(f"eager updates ({self.eager_rule}: each sum overlapped with a whole round)")
        if (topology := resolve_outer_topology(self.outer_topology)) is not None:
            parts.append(topology.describe())
        if self.merge_alpha:
            parts.append(f"merge_alpha={self.merge_alpha}")
        if self.pace is not None:
            parts.append(self.pace.describe())
        if self.elastic is not None:
            parts.append(
                f"elastic (federation {self.elastic.federation!r}, at least {self.elastic.min_groups} group(s))"
            )
        parts.append(f"anchor on the {'CPU' if self.anchor_device == 'cpu' else 'device'}")
        return ", ".join(parts)

    @property
    def hierarchical(self) -> Hierarchical | None:
        """The hierarchical outer topology, if that is the one."""
        topology = resolve_outer_topology(self.outer_topology)
        return topology if isinstance(topology, Hierarchical) else None

    @property
    def outer_period(self) -> int:
        """Steps between two outer steps of a fragment: ``sync_every``, or a hierarchical topology's largest period."""
        hierarchical = self.hierarchical
        return max(hierarchical.levels) if hierarchical is not None else self.sync_every

    @property
    def mixing(self) -> Mixing | None:
        """The mixing outer topology (``Mixing``, ``Gossip``, ``Sampled``), if that is the one.

        ``Sampled(..., outer_step=True)`` is none: its sample takes the federation's outer step on a shared anchor.
        """
        topology = resolve_outer_topology(self.outer_topology)
        if isinstance(topology, Sampled) and topology.outer_step:
            return None
        return topology if isinstance(topology, Mixing) else None

    def site_blocks(self, num_groups: int) -> dict[int, tuple[tuple[int, ...], ...]]:
        """By block size below the whole federation, the outer topology's blocks of groups (empty for ``"all"``)."""
        hierarchical = self.hierarchical
        return hierarchical.site_blocks(num_groups) if hierarchical is not None else {}

    @property
    def eager_rule(self) -> str | None:
        """``None`` without eager updates, else what stands in for the mean in flight: ``"share"`` or ``"local"``."""
        if self.eager_updates is False:
            return None
        return "share" if self.eager_updates is True else str(self.eager_updates)

    @property
    def outer_optimizer_factory(self) -> OuterOptimizerFactory:
        """A callable that builds the outer optimizer from a list of anchor tensors."""
        return resolve_outer_optimizer(self.outer_optimizer)

    @property
    def codec(self) -> Codec:
        """How the pseudo-gradient travels (see :mod:`~lightning_fedshard.core.wire.codecs`)."""
        return resolve_codec(self.effective_reduce_dtype, self.quant_block_size)

    @property
    def effective_reduce_dtype(self) -> str | torch.dtype | Codec:
        """The ``reduce_dtype`` that runs: the one given, else ``"int4"`` (``"float32"`` with a :attr:`mixing`)."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return MIXING_REDUCE_DTYPE if self.mixing is not None else DEFAULT_REDUCE_DTYPE

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        """The dtype of the pseudo-gradient buffer: ``reduce_dtype`` for floats, float32 before quantization."""
        return self.reducer().input_dtype

    @property
    def compressed(self) -> bool:
        """Whether the outer traffic is compressed (``"int8"`` / ``"int4"`` / ``"sparse"``, or such a codec object)."""
        return isinstance(self.codec, (ChunkCodec, SparseLoCo))

    def reducer(self) -> Reducer:
        """A new reducer for one fragment (see :mod:`~lightning_fedshard.core.wire.reducers`).

        Its error-feedback residuals wait with the anchor: in host memory with ``anchor_device="cpu"``.
        """
        residual_device = "cpu" if self.anchor_device == "cpu" else None
        if self.mixing is not None:  # the mixes carry the codec; the end of training averages exactly
            return make_reducer(MIXING_REDUCE_DTYPE, None, None, residual_device)
        block_size = None if isinstance(self.reduce_dtype, Codec) else self.quant_block_size
        return make_reducer(self.effective_reduce_dtype, block_size, self.error_feedback, residual_device)


def args_doc(options: type) -> str:
    """The ``Args:`` entries of a class's docstring, indented as they stand in it.

    Wherever the fields of a class of options are arguments too, its docstring stays their one description.
    """
    lines = (options.__doc__ or "").split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == "Args:") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def federation_args_doc() -> str:
    """The ``Args:`` entries of :class:`FederationConfig`'s docstring, indented for a class docstring.

    The strategies append them to their own docstrings, so every place that documents the federation arguments
    (Python's ``help``, LightningCLI's ``--help``) shows this one description.
    """
    return args_doc(FederationConfig)


def resolve_outer_optimizer(spec: OuterOptimizerSpec) -> OuterOptimizerFactory:
    """Turn an outer optimizer name or factory into a factory.

    Raises:
        ValueError: For an unknown name or something that is neither a name nor callable.
    """
    if isinstance(spec, str):
        if spec not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"Unknown `outer_optimizer={spec!r}`; choose one of {sorted(OUTER_OPTIMIZERS)} or pass a callable."
            )
        return OUTER_OPTIMIZERS[spec]
    if not callable(spec):
        raise ValueError(f"`outer_optimizer` must be a name or a callable returning an optimizer, got {spec!r}.")
    return spec


def _optimizer_class(spec: OuterOptimizerSpec) -> tuple[type[Optimizer] | None, dict[str, Any], bool]:
    """The optimizer class behind an outer optimizer spec, the keywords bound to it, and whether it was given by class.

    Recognizes a class, a ``functools.partial`` of one, and the partial jsonargparse (LightningCLI) builds from a
    ``class_path`` (the class among its positional arguments, every ``init_arg`` bound, defaults included).
    """
    if isinstance(spec, type) and issubclass(spec, Optimizer):
        return spec, {}, False
    if not isinstance(spec, functools.partial):
        return None, {}, False
    if isinstance(spec.func, type) and issubclass(spec.func, Optimizer):
        return spec.func, dict(spec.keywords), False
    classes = [a for a in spec.args if isinstance(a, type) and issubclass(a, Optimizer)]
    return (classes[0], dict(spec.keywords), True) if classes else (None, {}, False)


def _default_lr(cls: type[Optimizer]) -> Any:
    parameter = inspect.signature(cls).parameters.get("lr")
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _check_learning_rate_given(spec: OuterOptimizerSpec) -> None:
    """Refuse an optimizer class, or a ``functools.partial`` of one, that leaves the outer learning rate at its default.

    torch's defaults are inner-step learning rates (``SGD``: 0.001): as an outer step that barely moves the anchor
    towards the groups' mean, which is never what was meant.

    Raises:
        ValueError: Naming the optimizer and how to give the learning rate.
    """
    cls, keywords, _ = _optimizer_class(spec)
    if cls is None or "lr" in keywords:
        return
    default = _default_lr(cls)
    raise ValueError(
        f"`outer_optimizer={spec!r}` leaves the outer learning rate at torch's default (lr={default}), which barely"
        f" moves the anchor. Give it, e.g. `functools.partial(torch.optim.{cls.__name__}, lr=1.0)` (lr=1.0 with SGD is"
        " plain averaging), or use 'fedavg' / 'nesterov'."
    )


def outer_learning_rate_warning(spec: OuterOptimizerSpec) -> str | None:
    """A warning for an outer optimizer from a LightningCLI ``class_path`` whose ``lr`` is torch's default.

    jsonargparse binds every default, so a ``class_path`` without ``init_args.lr`` cannot be told from one that gives
    torch's default on purpose: this is a warning, where a Python class without ``lr`` is an error.
    """
    cls, keywords, from_cli = _optimizer_class(spec)
    if cls is None or not from_cli or keywords.get("lr") != _default_lr(cls):
        return None
    return (
        f"The outer optimizer `{cls.__name__}` runs at lr={keywords['lr']}, torch's default, which barely moves the"
        " anchor towards the groups' mean. Set its `init_args.lr` (1.0 with SGD is plain averaging) unless this is"
        " what you mean."
    )
