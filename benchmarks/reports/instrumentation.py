"""Link bytes a benchmark run sends besides the training's collectives: the recorder's barriers, Lightning's broadcast.

The link counters of the training window (:func:`benchmarks.metrics.link_bytes_per_step`) see, besides the
strategy's collectives (the planner's byte model), two kinds of small messages, each framed as every gloo message
over TCP (:func:`lightning_fedshard.plan.framing.framed_bytes`):

- **the recorder's barriers** (``benchmarks/harness/recorder.py``), world barriers around each counter reading:
  inside the training window the second barrier of its opening and the barrier of its closing, the first barrier of
  the validation and of the end-of-fit windows (their other barriers are inside those windows, which are left out),
  and three per sync window (two to open it, one to close it); plus Lightning's barrier before the first
  validation's dataloader (``_EvaluationLoop.setup_data``). gloo's dissemination barrier sends one empty message per
  rank and round, ``⌈log2 W⌉`` rounds.
- **Lightning's SIGTERM check**: every training step, the Trainer broadcasts one int64
  (``_TrainingEpochLoop._broadcast_sigterm_tensor``), gloo's binomial tree of ``n − 1`` messages over ``n`` ranks.
  Lightning sends it from rank 0 over the world; the federated strategies send it inside each group (over its
  replicas, then its shards), as the run records (``sigterm_groups``; runs recorded before that have none: the world).

Only the messages between ranks of different nodes reach a link.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_fedshard.plan.framing import barrier_edges, broadcast_edges, framed_bytes

#: World barriers of a run inside its training window, sync windows aside (see the module docstring).
RUN_BARRIERS = 5
#: World barriers of one sync window (two open it, one closes it), all inside the training window.
SYNC_WINDOW_BARRIERS = 3
#: Bytes of Lightning's per-step SIGTERM flag (an int64 tensor).
SIGTERM_FLAG_BYTES = 8


def cross_node(edges: list[tuple[int, int]], devices_per_node: int) -> int:
    """How many of the ``(sender, receiver)`` messages leave a node."""
    return sum(a // devices_per_node != b // devices_per_node for a, b in edges)


def barrier_bytes(world_size: int, devices_per_node: int, mtu: int) -> float:
    """Link bytes of one world barrier: its cross-node empty messages, framed."""
    return framed_bytes(0, cross_node(barrier_edges(range(world_size)), devices_per_node), mtu)


def sigterm_broadcast_bytes(
    world_size: int, devices_per_node: int, mtu: int, groups: Sequence[Sequence[int]] | None = None
) -> float:
    """Link bytes of one step's SIGTERM broadcasts: their cross-node messages, framed.

    Args:
        world_size: Ranks.
        devices_per_node: Ranks per node.
        mtu: The links' MTU.
        groups: The process groups the flag is broadcast over, each from its first rank; default: the world.
    """
    groups = groups if groups is not None else [range(world_size)]
    messages = sum(cross_node(broadcast_edges(list(group)), devices_per_node) for group in groups)
    return framed_bytes(messages * SIGTERM_FLAG_BYTES, messages, mtu)


def harness_bytes(
    world_size: int,
    devices_per_node: int,
    steps: int,
    sync_windows: int,
    mtu: int,
    sigterm_groups: Sequence[Sequence[int]] | None = None,
) -> float:
    """Link bytes of a run's training window that are not the training's: barriers and SIGTERM broadcasts.

    Args:
        world_size: Ranks.
        devices_per_node: Ranks per node (rank ``r`` on node ``r // devices_per_node``).
        steps: Training steps (one broadcast each).
        sync_windows: Sync windows the recorder opened during training (one per landing of a sync).
        mtu: The links' MTU.
        sigterm_groups: The process groups of the SIGTERM flag (the run's ``sigterm_groups``); default: the world.
    """
    if world_size < 2:
        return 0.0
    barriers = RUN_BARRIERS + SYNC_WINDOW_BARRIERS * sync_windows
    flag = sigterm_broadcast_bytes(world_size, devices_per_node, mtu, sigterm_groups)
    return barriers * barrier_bytes(world_size, devices_per_node, mtu) + steps * flag
