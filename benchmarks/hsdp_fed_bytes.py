"""FL+HSDP's cross-group bytes per sync, measured on the links: each shard sent across the groups once, or R times.

Run as root from the repository root::

    sudo PYTHONPATH=. python -m benchmarks.hsdp_fed_bytes

An emulated cluster of 4 nodes x 2 ranks runs FL+HSDP with one group per node and ``shard_size=1``: each group holds
``R = 2`` replicas of one shard, on the same node, so everything a group says inside itself stays on the node and its
link carries the cross-group traffic only. Every rank takes one outer step of the same pseudo-gradient (a fixed random
vector per group, the same on both replicas) twice, on the same communicator, and the node counters are read around
each:

- ``split``: the package's pattern, each replica sums its ``1 / R`` of the shard over the groups and the replicas
  gather the summed parts inside the group;
- ``copies``: each replica sums the whole shard over the groups (what FL+HSDP did before the split: the communicator
  is given no replicate group, so each replica acts as if it were alone).

The bytes on the links drop by ``R``. In float32 the two anchors agree to float32 rounding (the largest difference
is recorded in units of float32's epsilon times the mean magnitude of the summed terms): gloo's ring all-reduce adds
each element's terms in an order set by where the element falls among the ring's segments, and half a shard falls
differently from a whole one; with two groups (two terms) they agree bit for bit. Three
repeats per reduce dtype, interleaved; the results go to ``benchmarks/results/hsdp_fed_bytes.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "hsdp_fed_bytes.json"
NUM_NODES, DEVICES, NUMEL = 4, 2, 1 << 21
DTYPES = ("float32", "int4")
PATTERNS = ("split", "copies")


def worker(out: Path, repeats: int) -> None:
    """One rank: build the mesh, then take the outer steps of every (repeat, dtype, pattern) in order."""
    import torch
    import torch.distributed as dist

    from lightning_fedshard.core.config import FederationConfig
    from lightning_fedshard.core.step.outer import OuterStep
    from lightning_fedshard.core.transport.mesh import build_federation_mesh
    from lightning_fedshard.core.transport.topology import FederationTopology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    mesh = build_federation_mesh(FederationTopology(NUM_NODES * DEVICES, NUM_NODES, 1), "cpu")
    split = mesh.communicator()
    copies = type(split)(split.num_groups, split.fed_group, split.shard_group, None, split.stats_group)
    assert split.num_replicas == DEVICES and copies.num_replicas == 1
    group = split.group_index
    every = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(g)) for g in range(NUM_NODES)]
    pseudo_gradient = every[group]
    # The rounding scale of a sum of G terms: float32's epsilon times the mean of the terms' magnitudes.
    scale = torch.finfo(torch.float32).eps * torch.stack(every).abs().mean(0)
    del every

    rows = []
    for repeat in range(repeats):
        order = PATTERNS if repeat % 2 == 0 else PATTERNS[::-1]
        for dtype in DTYPES:
            anchors = {}
            for pattern in order:
                config = FederationConfig(reduce_dtype=dtype)
                shard = torch.zeros(NUMEL)
                outer = OuterStep(
                    [shard],
                    functools.partial(torch.optim.SGD, lr=1.0),
                    split if pattern == "split" else copies,
                    reducer=config.reducer,
                )
                shard.sub_(pseudo_gradient)  # anchor 0 - shard = the group's pseudo-gradient
                before, start = read_link_counter(local), time.perf_counter()
                stats = outer.step(step=1)
                seconds, after = time.perf_counter() - start, read_link_counter(local)
                anchors[pattern] = outer.anchor[0].detach().clone()
                rows.append(
                    {
                        "repeat": repeat,
                        "reduce_dtype": dtype,
                        "pattern": pattern,
                        "rank": rank,
                        "node_link_bytes": after - before if local == 0 else None,
                        "sync_bytes": stats.bytes_sent,
                        "seconds": seconds,
                    }
                )
            same = torch.equal(anchors["split"], anchors["copies"])
            difference = (anchors["split"] - anchors["copies"]).abs()
            rows.append(
                {
                    "repeat": repeat,
                    "reduce_dtype": dtype,
                    "rank": rank,
                    "same_anchor": same,
                    "max_abs_difference": float(difference.max()),
                    "max_ulps": float((difference / scale).max()),
                }
            )
    (out / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def read_link_counter(local_rank: int) -> int:
    """This node's link counter, read between two world barriers by its local rank 0 (0 on the other ranks)."""
    import torch.distributed as dist

    from benchmarks.harness.recorder import LINK_COUNTER

    dist.barrier()
    value = int(Path(LINK_COUNTER).read_text()) if local_rank == 0 else 0
    dist.barrier()
    return value


def link_spread(rows: list[dict[str, Any]], **match: Any) -> dict[str, float]:
    """Link bytes of one sync summed over the nodes, per repeat, of the rows matching ``match``: median, min, max."""
    chosen = [r for r in rows if all(r.get(key) == value for key, value in match.items())]
    repeats = sorted({r["repeat"] for r in chosen})
    totals = [sum(r["node_link_bytes"] or 0 for r in chosen if r["repeat"] == k) for k in repeats]
    return {"link_bytes": statistics.median(totals), "min": min(totals), "max": max(totals)}


def command(argv: list[str] | None, description: str, module: str, results: Path, worker: Any, summary: Any) -> None:
    """A bytes benchmark's command line: ``--worker`` starts one rank, otherwise drive the cluster and summarize."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--worker":
        worker(Path(args[1]), int(args[2]))
        return
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", type=Path, default=Path("/tmp") / module.replace(".", "-"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=results)
    options = parser.parse_args(args)
    record = drive(options.work, options.repeats, module=module)
    record["summary"] = summary(record)
    options.results.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))


def drive(work: Path, repeats: int, module: str = "benchmarks.hsdp_fed_bytes") -> dict[str, Any]:
    """Build the cluster, start every rank of ``module``'s worker in its node and collect their rows."""
    from benchmarks.harness.cluster import NODE_IFACE, EmulatedCluster
    from benchmarks.harness.machine import machine

    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.json"):
        old.unlink()
    repo = Path(__file__).resolve().parents[1]
    with EmulatedCluster(NUM_NODES) as cluster:
        procs = []
        for node in range(NUM_NODES):
            for local in range(DEVICES):
                env = {
                    "MASTER_ADDR": cluster.address(0),
                    "MASTER_PORT": "29633",
                    "WORLD_SIZE": str(NUM_NODES * DEVICES),
                    "RANK": str(node * DEVICES + local),
                    "LOCAL_RANK": str(local),
                    "GLOO_SOCKET_IFNAME": NODE_IFACE,
                    "PYTHONPATH": str(repo),
                    "OMP_NUM_THREADS": "1",
                }
                argv = [sys.executable, "-m", module, "--worker", str(work), str(repeats)]
                procs.append(subprocess.Popen(cluster.command(node, argv, env), cwd=repo))
        codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    rows = [row for path in sorted(work.glob("rank*.json")) for row in json.loads(path.read_text())]
    about = {"machine": machine(module), "numel": NUMEL}
    return {**about, "num_nodes": NUM_NODES, "devices": DEVICES, "rows": rows}


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per dtype and pattern: link bytes of one sync summed over the nodes (median over repeats) and their ratio."""
    rows = [r for r in record["rows"] if "pattern" in r]
    summary: dict[str, Any] = {}
    for dtype in DTYPES:
        per: dict[str, Any] = {}
        for pattern in PATTERNS:
            sync_bytes = {r["sync_bytes"] for r in rows if (r["reduce_dtype"], r["pattern"]) == (dtype, pattern)}
            per[pattern] = link_spread(rows, reduce_dtype=dtype, pattern=pattern)
            per[pattern]["sync_bytes_per_rank"] = sorted(sync_bytes)
        checks = [r for r in record["rows"] if "same_anchor" in r and r["reduce_dtype"] == dtype]
        per["reduction"] = per["copies"]["link_bytes"] / per["split"]["link_bytes"]
        per["same_anchor_every_rank"] = all(r["same_anchor"] for r in checks)
        per["max_ulps"] = max((r.get("max_ulps", 0.0) for r in checks), default=0.0)
        summary[dtype] = per
    return summary


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (``--worker`` is how the driver starts the ranks)."""
    description = "FL+HSDP cross-group bytes per sync, split vs copies."
    command(argv, description, "benchmarks.hsdp_fed_bytes", RESULTS, worker, summarize)


if __name__ == "__main__":
    main()
