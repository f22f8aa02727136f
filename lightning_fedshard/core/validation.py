"""The checks :class:`~lightning_fedshard.core.config.FederationConfig` runs on its options when it is built.

Each check refuses one kind of mistake with a ``ValueError`` that quotes the values given: an option on its own (an
unknown ``error_feedback``, ``sync_delay`` out of range) or options that contradict each other (a block size the codec
does not use, error feedback with a mixing).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from lightning_fedshard.core.options.checks import check_positive_int
from lightning_fedshard.core.options.elastic import Elastic
from lightning_fedshard.core.options.outer_topology import Hierarchical, resolve_outer_topology
from lightning_fedshard.core.options.pace import Pace
from lightning_fedshard.core.step.nonfinite import NONFINITE_POLICIES
from lightning_fedshard.core.wire.codecs import (
    DEFAULT_BLOCK_SIZE,
    QUANTIZED_REDUCE_DTYPES,
    ChunkCodec,
    Codec,
    SparseLoCo,
    SparseTopK,
)

#: What stands in for the mean in flight with eager updates: this group's share of it (the paper's), or its own
#: pseudo-gradient for the whole of it.
EAGER_RULES: tuple[str, ...] = ("share", "local")

#: The error-feedback setting that kept what a group's encoding dropped in its weights; removed, named in the error.
REMOVED_FEEDBACK_IN_WEIGHTS = "weights"


#: A :class:`~lightning_fedshard.core.config.FederationConfig` (which imports this module, so it is not
#: imported here).
Config = Any


def check_error_feedback(error_feedback: object) -> None:
    """Refuse an ``error_feedback`` that is none of ``True``, ``False`` and ``None``; say so for the removed one."""
    if error_feedback is None or isinstance(error_feedback, bool):
        return
    if error_feedback == REMOVED_FEEDBACK_IN_WEIGHTS:
        raise ValueError(
            "`error_feedback='weights'` was removed: over longer runs it trained worse than the error-feedback buffer"
            " (with the sparse codec, +39% perplexity over float32 after 256 steps against the buffer's +29%), and it"
            " composed with fewer options. Leave `error_feedback` unset (the buffer, on with int8, int4 and sparse)."
        )
    raise ValueError(f"`error_feedback` must be True, False or None (automatic), got {error_feedback!r}.")


def check_choices(anchor_device: str, on_nonfinite: str) -> None:
    """Refuse an unknown ``anchor_device`` or ``on_nonfinite`` policy."""
    if anchor_device not in ("cpu", "device"):
        raise ValueError(f"`anchor_device` must be 'cpu' or 'device', got {anchor_device!r}.")
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"`on_nonfinite` must be one of {list(NONFINITE_POLICIES)}, got {on_nonfinite!r}.")


def check_outer_topology(config: Config) -> None:
    """Refuse an outer topology that does not resolve, and an error-feedback setting under a mixing.

    A mixing keeps what its mixes drop in each group's own weights, always: no setting of ``error_feedback`` applies.
    """
    topology = resolve_outer_topology(config.outer_topology)
    if config.mixing is None or config.error_feedback is None:
        return
    if config.codec.exact and config.error_feedback is not False:
        raise ValueError(
            f"`outer_topology={topology!r}` runs in float32, which drops nothing for"
            f" `error_feedback={config.error_feedback!r}` to keep. Leave `error_feedback` unset."
        )
    if not config.codec.exact:
        raise ValueError(
            f"`outer_topology={topology!r}` with `reduce_dtype={config.effective_reduce_dtype!r}` keeps what a mix's"
            f" encoding dropped in each group's own weights, always; `error_feedback={config.error_feedback!r}`"
            " cannot change that. Leave `error_feedback` unset."
        )


def check_codec_options(config: Config) -> None:
    """Refuse what the codec would silently ignore: a block size it does not use, or sparse without feedback."""
    codec = config.codec
    named = isinstance(config.effective_reduce_dtype, str) and config.effective_reduce_dtype in QUANTIZED_REDUCE_DTYPES
    if config.quant_block_size != DEFAULT_BLOCK_SIZE and isinstance(config.reduce_dtype, Codec):
        raise ValueError(
            f"`quant_block_size={config.quant_block_size}` is for the named 'int8' / 'int4'; the codec"
            f" {config.reduce_dtype!r} carries its own parameters."
        )
    if config.quant_block_size != DEFAULT_BLOCK_SIZE and isinstance(codec, ChunkCodec) and not named:
        raise ValueError(
            f"`quant_block_size={config.quant_block_size}` is for 'int8' / 'int4' given by name;"
            f" `reduce_dtype={config.reduce_dtype!r}` is `{codec!r}`, which carries its own parameters: give"
            f" `lightning_fedshard.{type(codec).__name__}({_size_argument(codec)}=...)` (in YAML a `class_path`"
            " with `init_args`)."
        )
    sent = _sent_per_chunk(codec)
    if config.error_feedback is False and sent is not None and sent[0] < sent[1]:
        kept, chunk = sent
        raise ValueError(
            f"`reduce_dtype={config.reduce_dtype!r}` with `error_feedback=False` sends {kept} of every"
            f" {chunk} values and drops the others for good: {Fraction(chunk - kept, chunk)} of every update would"
            " be lost. Leave `error_feedback` unset (on with a sparse codec), set it to True, or use 'int8' /"
            " 'int4' (which send every value)."
        )


def check_pace(config: Config) -> None:
    """Refuse a ``pace`` that is no ``Pace``, does not fit the groups and period, or is measured in an elastic run."""
    if config.pace is None:
        return
    if not isinstance(config.pace, Pace):
        raise ValueError(f"`pace` must be a `lightning_fedshard.Pace` or None, got {config.pace!r}.")
    if isinstance(config.num_groups, int):
        config.pace.check(config.num_groups, config.sync_every)
    if config.elastic is not None and config.pace.measured:
        raise ValueError(
            "A measured `Pace()` is agreed by every group of one job at every round's end; the groups of an"
            " elastic federation change between syncs. Give the planned groups' speeds,"
            " `Pace(speeds=(...))`, one per group of `num_groups`."
        )


def check_elastic(config: Config) -> None:
    """Refuse an elastic federation without ``num_groups``, waiting for more groups or sites than it is planned for."""
    if config.elastic is None:
        return
    if not isinstance(config.elastic, Elastic):
        raise ValueError(f"`elastic` must be a `lightning_fedshard.Elastic` or None, got {config.elastic!r}.")
    if config.num_groups is None:
        raise ValueError(
            "An elastic federation needs `num_groups`: the number of groups it is planned for (the data is split"
            " into that many parts, and each group's index is in [0, num_groups))."
        )
    for name in ("min_groups", "start_groups"):
        value = getattr(config.elastic, name)
        if value is not None and isinstance(config.num_groups, int) and value > config.num_groups:
            raise ValueError(
                f"`Elastic({name}={value})` is larger than `num_groups={config.num_groups}`: the federation is"
                f" planned for {config.num_groups} group(s), so it would wait for groups that never come (and fail"
                f" after `quorum_timeout={config.elastic.quorum_timeout:g}` s). Set `{name}` <= `num_groups`."
            )
    if isinstance(config.num_groups, int):
        config.elastic.check_group(config.num_groups)  # when the options are built, not seconds into the job
    if config.hierarchical is not None and isinstance(config.num_groups, int):
        config.hierarchical.check_groups(config.num_groups)  # the sites hold planned groups, whichever are running


def check_streaming(config: Config) -> None:
    """Refuse ``fragments``, ``sync_delay``, ``merge_alpha`` or ``eager_updates`` that do not fit the outer period."""
    check_positive_int("fragments", config.fragments)
    topology = resolve_outer_topology(config.outer_topology)
    if isinstance(topology, Hierarchical):
        topology.check_sync_every(config.sync_every)
    period = config.outer_period
    if config.hierarchical is None:
        given, name = f"`sync_every={period}`", "sync_every"
    else:  # the federation's round runs at the largest period
        given, name = f"The largest period of `outer_topology={config.hierarchical!r}` ({period} steps)", "period"
    if period % config.fragments:
        raise ValueError(
            f"{given} must be divisible by `fragments={config.fragments}`: one fragment lands every"
            f" `{name} / fragments` optimizer steps."
        )
    interval = period // config.fragments
    delay = config.sync_delay
    if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay < interval:
        raise ValueError(
            f"`sync_delay` must be an integer in [0, {name} / fragments) = [0, {interval}), got {delay!r}."
        )
    alpha = config.merge_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"`merge_alpha` must be a number in [0, 1], got {alpha!r}.")
    if not (isinstance(config.eager_updates, bool) or config.eager_updates in EAGER_RULES):
        raise ValueError(
            f"`eager_updates` must be False, True, or one of {list(EAGER_RULES)}, got {config.eager_updates!r}."
        )


def _sent_per_chunk(codec: Codec) -> tuple[int, int] | None:
    """``(values sent, values)`` of each chunk of a sparse codec (``SparseTopK``, ``SparseLoCo``), else ``None``."""
    if isinstance(codec, SparseTopK):
        return codec.kept, codec.chunk_size
    if isinstance(codec, SparseLoCo):
        return codec.top_k, codec.chunk_size
    return None


def _size_argument(codec: ChunkCodec) -> str:
    """The argument that sets a chunk codec's block: ``chunk_size`` for the sparse codec, else ``block_size``."""
    return "chunk_size" if isinstance(codec, SparseTopK) else "block_size"
