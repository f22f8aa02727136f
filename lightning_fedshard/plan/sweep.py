"""Every federated configuration of a cluster that fits in memory, ranked by predicted throughput."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from lightning_fedshard.plan.predict import Prediction, predict
from lightning_fedshard.plan.specs import ClusterSpec, ModelSpec, TrainSetup

#: What :func:`sweep` varies, unless told otherwise.
SYNC_EVERY = (8, 32, 128)
FRAGMENTS = (1, 4)
REDUCE_DTYPES = ("float32", "bfloat16", "int8", "int4")
SYNC_DELAYS = (0, 1)


def compare(model: ModelSpec, cluster: ClusterSpec, base: TrainSetup) -> list[Prediction]:
    """The four strategies with ``base``'s other settings (the baselines ignore the federation options).

    A strategy whose layout does not fit the cluster (e.g. FL+HSDP's default two groups on one node) is left out.
    """
    predictions = []
    for strategy in ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"):
        setup = replace(base, strategy=strategy)  # type: ignore[arg-type]
        if not setup.federated:
            setup = replace(setup, num_groups=None)
        try:
            predictions.append(predict(model, cluster, setup))
        except ValueError:
            continue
    return predictions


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    cluster: ClusterSpec,
    base: TrainSetup,
    sync_every: Sequence[int] = SYNC_EVERY,
    fragments: Sequence[int] = FRAGMENTS,
    reduce_dtypes: Sequence[str] = REDUCE_DTYPES,
    sync_delays: Sequence[int] = SYNC_DELAYS,
) -> Iterator[TrainSetup]:
    """FL+FSDP and FL+HSDP setups: groups of whole nodes, shards that divide a node or a group, and every option."""
    d = cluster.devices_per_node
    for groups in _divisors(cluster.num_nodes):
        if groups < 2:
            continue
        group_size = cluster.world_size // groups
        layouts: list[tuple[str, int | None]] = [("fl_fsdp", None)]
        layouts += [("fl_hsdp", s) for s in _divisors(group_size) if s < group_size and (s <= d or s % d == 0)]
        for strategy, shard in layouts:
            for h in sync_every:
                for f in fragments:
                    for dtype in reduce_dtypes:
                        for delay in sync_delays:
                            if h % f or (delay and delay >= h // f):
                                continue
                            yield replace(
                                base,
                                strategy=strategy,  # type: ignore[arg-type]
                                num_groups=groups,
                                shard_size=shard,
                                sync_every=h,
                                fragments=f,
                                reduce_dtype=dtype,
                                error_feedback=dtype in ("int8", "int4"),
                                sync_delay=delay,
                            )


def sweep(
    model: ModelSpec, cluster: ClusterSpec, base: TrainSetup, top: int = 10, **grid: Sequence
) -> list[Prediction]:
    """The ``top`` federated setups by predicted tokens/s among those that fit in device memory.

    Setups within 0.5% of each other's throughput are ranked by the bytes they send between nodes, fewest first.

    Throughput only: a larger ``sync_every`` or a coarser ``reduce_dtype`` may cost perplexity per token, which this
    model does not predict (see docs/benchmarks.md for measured costs).
    """
    predictions = []
    for setup in candidates(cluster, base, **grid):
        try:
            prediction = predict(model, cluster, setup)
        except ValueError:
            continue
        if prediction.fits:
            predictions.append(prediction)
    if not predictions:
        return []
    # Within 0.5% of each other, setups are equally fast: prefer the one that sends fewer bytes between nodes.
    best = max(p.tokens_per_second for p in predictions)
    predictions.sort(key=lambda p: (-math.floor(p.tokens_per_second / best * 200), p.link_bytes_per_step))
    return predictions[:top]
