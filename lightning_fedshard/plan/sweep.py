"""Every federated configuration of a cluster that fits in memory, ranked by predicted throughput or time to target."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from lightning_fedshard.plan.hetero import heterogeneous, lockstep_tokens_per_second
from lightning_fedshard.plan.predict import Prediction, predict
from lightning_fedshard.plan.quality import tokens_to_target
from lightning_fedshard.plan.specs import ClusterSpec, ModelSpec, TrainSetup

#: What :func:`sweep` varies, unless told otherwise.
SYNC_EVERY = (8, 32, 128)
FRAGMENTS = (1, 4)
REDUCE_DTYPES = ("float32", "bfloat16", "int8", "int4", "sparse")
SYNC_DELAYS = (0, 1)
EAGER_UPDATES = (False, True)


def uses_given_layout(setup: TrainSetup) -> bool:
    """Whether ``setup``'s layout rests on a ``num_groups`` or ``shard_size`` that was given, not on a default."""
    return (setup.federated and setup.federation.num_groups is not None) or (
        setup.hybrid and setup.federation.shard_size is not None
    )


def does_not_fit(cluster: ClusterSpec, setup: TrainSetup, error: ValueError) -> ValueError:
    """The error for a given layout that cannot cut the cluster's ranks: the strategy's message, with the cluster."""
    return ValueError(
        f"{setup.strategy} on {cluster.name} ({cluster.num_nodes} x {cluster.devices_per_node} ="
        f" {cluster.world_size} ranks): {error}"
    )


def compare(model: ModelSpec, cluster: ClusterSpec, base: TrainSetup) -> list[Prediction]:
    """The four strategies with ``base``'s other settings (the baselines ignore the federation options).

    A strategy whose default layout does not fit the cluster (e.g. FL+HSDP's default two groups on one node) is
    left out.

    Raises:
        ValueError: If a strategy cannot use the given ``num_groups`` or ``shard_size`` on the cluster.
    """
    predictions = []
    for strategy in ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"):
        setup = replace(base, strategy=strategy)  # type: ignore[arg-type]
        if not setup.federated:
            setup = replace(setup, federation=replace(setup.federation, num_groups=None))
        try:
            predictions.append(predict(model, cluster, setup))
        except ValueError as error:
            if uses_given_layout(setup):
                raise does_not_fit(cluster, setup, error) from None
    return predictions


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _group_counts(cluster: ClusterSpec, base: TrainSetup) -> list[int]:
    """``base``'s own ``num_groups`` if given, else every count of two or more groups of whole nodes."""
    if base.federation.num_groups is not None:
        return [base.federation.num_groups]
    return [groups for groups in _divisors(cluster.num_nodes) if groups >= 2]


def _layouts(cluster: ClusterSpec, group_size: int, shard_size: int | None) -> list[tuple[str, int | None]]:
    """FL+FSDP and FL+HSDP on groups of ``group_size`` ranks: the given shard size, or every one that fits."""
    if shard_size is not None:  # FL+FSDP when the shard is the whole group, FL+HSDP otherwise
        return [("fl_fsdp", None)] if shard_size == group_size else [("fl_hsdp", shard_size)]
    d = cluster.devices_per_node
    shards = [s for s in _divisors(group_size) if s < group_size and (s <= d or s % d == 0)]
    return [("fl_fsdp", None), *(("fl_hsdp", s) for s in shards)]


def candidates(
    cluster: ClusterSpec,
    base: TrainSetup,
    sync_every: Sequence[int] = SYNC_EVERY,
    fragments: Sequence[int] = FRAGMENTS,
    reduce_dtypes: Sequence[str] = REDUCE_DTYPES,
    sync_delays: Sequence[int] = SYNC_DELAYS,
    eager_updates: Sequence[bool] = EAGER_UPDATES,
) -> Iterator[TrainSetup]:
    """FL+FSDP and FL+HSDP setups: groups of whole nodes, shards that divide a node or a group, and every option.

    A ``num_groups`` or ``shard_size`` given in ``base`` is kept instead of varied. Eager updates are tried without a
    ``sync_delay`` only (they exclude each other).
    """
    for groups in _group_counts(cluster, base):
        for strategy, shard in _layouts(cluster, max(cluster.world_size // groups, 1), base.federation.shard_size):
            for h in sync_every:
                for f in fragments:
                    for dtype in reduce_dtypes:
                        for delay in sync_delays:
                            for eager in eager_updates:
                                if h % f or (delay and delay >= h // f) or (eager and delay):
                                    continue
                                federation = replace(
                                    base.federation,
                                    num_groups=groups,
                                    shard_size=shard,
                                    sync_every=h,
                                    fragments=f,
                                    reduce_dtype=dtype,
                                    error_feedback=None,  # on for the compressed codecs, as the strategies default to
                                    sync_delay=delay,
                                    merge_alpha=0.0 if eager else base.federation.merge_alpha,
                                    eager_updates=eager,
                                )
                                yield replace(base, strategy=strategy, federation=federation)  # type: ignore[arg-type]


def sweep(
    model: ModelSpec,
    cluster: ClusterSpec,
    base: TrainSetup,
    top: int = 10,
    rank: str = "tokens_per_s",
    node_speeds: Sequence[float] | None = None,
    **grid: Sequence,
) -> list[Prediction]:
    """The ``top`` federated setups among those that fit in device memory, best first.

    ``rank="tokens_per_s"``: by predicted tokens/s; setups within 0.5% of each other's throughput by the bytes they
    send between nodes, fewest first. A larger ``sync_every`` or a coarser ``reduce_dtype`` may cost perplexity per
    token, which this ignores. ``rank="time_to_target"``: the setups whose sync options have a measured
    tokens-to-target factor (:mod:`~lightning_fedshard.plan.quality`) by ``factor / tokens per second``, then the
    others by tokens/s; plain FSDP over the whole cluster (:func:`fsdp_reference`) is ranked with them, and shown
    below the ``top`` rows where it ranks lower, so that the table says whether a federation reaches FSDP's quality
    sooner than FSDP does. With ``node_speeds`` (each node's speed relative to the cluster's device) the tokens/s are
    the barrier's with those speeds (:func:`~lightning_fedshard.plan.hetero.heterogeneous`): a slow node slows a
    compute-bound setup more than one bound by its links.

    Raises:
        ValueError: If the given ``num_groups`` or ``shard_size`` of ``base`` cannot cut the cluster's ranks, or for
            an unknown ``rank``.
    """
    if rank not in RANKS:
        raise ValueError(f"`rank={rank!r}` must be one of {list(RANKS)}.")
    predictions, laid_out = [], False
    refused: tuple[TrainSetup, ValueError] | None = None
    for setup in candidates(cluster, base, **grid):
        try:
            prediction = predict(model, cluster, setup)
        except ValueError as error:
            refused = refused or (setup, error)
            continue
        laid_out = True
        if prediction.fits:
            predictions.append(prediction)
    given = base.federation.num_groups is not None or base.federation.shard_size is not None
    if given and refused is not None and not laid_out:  # no setup can use the given layout
        raise does_not_fit(cluster, *refused)
    if not predictions:
        return []
    # Within 0.5% of each other, setups are equally fast: prefer the one that sends fewer bytes between nodes.
    speed = {id(p): throughput(p, node_speeds) for p in predictions}
    best = max(speed.values())
    predictions.sort(key=lambda p: (-math.floor(speed[id(p)] / best * 200), p.link_bytes_per_step))
    if rank != "time_to_target":
        return predictions[:top]
    reference = fsdp_reference(model, cluster, base)
    if reference is not None:
        predictions.append(reference)
    predictions.sort(key=lambda p: _time_to_target_order(p, node_speeds))  # stable: the unmeasured keep order
    shown = predictions[:top]
    return shown if reference is None or reference in shown else [*shown, reference]


def fsdp_reference(model: ModelSpec, cluster: ClusterSpec, base: TrainSetup) -> Prediction | None:
    """Plain FSDP over the whole cluster with ``base``'s training settings, or ``None`` where it does not fit."""
    setup = replace(base, strategy="fsdp", federation=replace(base.federation, num_groups=None, shard_size=None))
    try:
        prediction = predict(model, cluster, setup)
    except ValueError:
        return None
    return prediction if prediction.fits else None


#: What a sweep may rank by.
RANKS = ("tokens_per_s", "time_to_target")


def throughput(prediction: Prediction, node_speeds: Sequence[float] | None = None) -> float:
    """Predicted tokens/s; with ``node_speeds``, the barrier's with nodes of those speeds (FSDP: the slowest's)."""
    if node_speeds is None:
        return prediction.tokens_per_second
    if not prediction.setup.federated:
        return lockstep_tokens_per_second(prediction, node_speeds)
    paced = heterogeneous(prediction, node_speeds)
    return prediction.tokens_per_second if paced is None else paced.barrier


def relative_time_to_target(prediction: Prediction, node_speeds: Sequence[float] | None = None) -> float | None:
    """Measured tokens-to-target factor over predicted tokens/s (seconds per target token), or ``None``."""
    measured = tokens_to_target(prediction.setup)
    return None if measured is None else measured.factor / throughput(prediction, node_speeds)


def _time_to_target_order(prediction: Prediction, node_speeds: Sequence[float] | None) -> tuple[int, float]:
    time = relative_time_to_target(prediction, node_speeds)
    return (1, 0.0) if time is None else (0, time)
