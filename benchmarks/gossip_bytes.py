"""Gossip's bytes per sync, measured on the links, against the ring all-reduce of the default topology.

Run as root from the repository root::

    sudo PYTHONPATH=. python -m benchmarks.gossip_bytes

An emulated cluster of 4 nodes x 2 ranks holds FL+FSDP's layout: 4 groups (one per node), each sharding a vector of
``NUMEL`` values over its 2 ranks, so every fed ring crosses the links. Each rank syncs its shard twice, on the same
communicator, and the node counters are read around each: ``ring`` is the default topology's outer step (a float32
ring all-reduce over the 4 groups, with its NaN/Inf flags and statistics), ``gossip`` is one round of
``Gossip(peers=1)`` (the shard sent to one partner and received from it). A ring all-reduce sends ``2 (G - 1) / G``
of the shard per rank and gossip one shard: 0.67x at ``G = 4``. Three repeats, interleaved; the results go to
``benchmarks/results/gossip_bytes.json``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.hsdp_fed_bytes import DEVICES, NUM_NODES, NUMEL, command, link_spread, read_link_counter

RESULTS = Path(__file__).resolve().parent / "results" / "gossip_bytes.json"
PATTERNS = ("ring", "gossip")


def worker(out: Path, repeats: int) -> None:
    """One rank: the mesh of 4 groups x 2 shards, then every (repeat, pattern) sync in order."""
    import torch
    import torch.distributed as dist

    from lightning_fedshard import Gossip
    from lightning_fedshard.core.config import FederationConfig
    from lightning_fedshard.core.rounds.mixing import mix
    from lightning_fedshard.core.step.outer import OuterStep
    from lightning_fedshard.core.transport.mesh import build_federation_mesh
    from lightning_fedshard.core.transport.topology import FederationTopology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    comm = build_federation_mesh(FederationTopology(NUM_NODES * DEVICES, NUM_NODES, DEVICES), "cpu").communicator()
    shard = torch.randn(NUMEL // DEVICES, generator=torch.Generator().manual_seed(rank))
    matrix = Gossip(peers=1).weights(0, NUM_NODES)

    rows = []
    for repeat in range(repeats):
        for pattern in PATTERNS if repeat % 2 == 0 else PATTERNS[::-1]:
            weights = shard.clone()
            outer = OuterStep(
                [weights], functools.partial(torch.optim.SGD, lr=1.0), comm,
                reducer=FederationConfig(reduce_dtype="float32").reducer,
            )  # fmt: skip
            weights.add_(1.0)
            before = read_link_counter(local)
            stats = outer.step(step=1) if pattern == "ring" else mix(outer, matrix)
            after = read_link_counter(local)
            rows.append({"repeat": repeat, "pattern": pattern, "rank": rank, "sync_bytes": stats.bytes_sent,
                         "node_link_bytes": after - before if local == 0 else None})  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per pattern: link bytes of one sync summed over the nodes (median over repeats), and gossip / ring."""
    summary: dict[str, Any] = {pattern: link_spread(record["rows"], pattern=pattern) for pattern in PATTERNS}
    summary["ratio"] = summary["gossip"]["link_bytes"] / summary["ring"]["link_bytes"]
    return summary


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (``--worker`` is how the driver starts the ranks)."""
    description = "Gossip's bytes per sync against the ring's, on the links."
    command(argv, description, "benchmarks.gossip_bytes", RESULTS, worker, summarize)


if __name__ == "__main__":
    main()
