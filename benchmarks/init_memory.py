"""Peak host memory per rank while the Trainer sets up a Llama model under FL+FSDP on CPU ranks, eager vs meta init.

Each rank is a fresh process (started here with the variables a cluster launcher sets). It builds ``LlamaLM`` in
float32, eagerly in ``__init__`` (``meta_init=False``) or on the meta device (``meta_init=True``), and runs
``Trainer.fit`` up to ``on_train_start``: FSDP wrapping (one unit per decoder layer), the initial broadcast, the
optimizer. There it stops, before any training step, and records its peak resident set size (``ru_maxrss``, which
includes the interpreter, torch, Lightning and transformers) next to the RSS measured right after those imports.

    python benchmarks/init_memory.py --shape 1.1b --modes meta --out benchmarks/results/init_memory_1.1b.json
    python benchmarks/init_memory.py --shape 0.5b --modes eager meta --out benchmarks/results/init_memory_0.5b.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: Llama shapes, untied embeddings. "1.1b" is TinyLlama-1.1B's; "0.5b" the largest whose eager run fits here.
SHAPES: dict[str, dict[str, Any]] = {
    "1.1b": {
        "hidden_size": 2048,
        "num_layers": 22,
        "num_heads": 32,
        "num_kv_heads": 4,
        "intermediate_size": 5632,
        "vocab_size": 32000,
    },
    "0.5b": {
        "hidden_size": 1536,
        "num_layers": 16,
        "num_heads": 12,
        "num_kv_heads": 4,
        "intermediate_size": 4096,
        "vocab_size": 32000,
    },
    "tiny": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    },
}
SEQ_LEN = 16
GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- one rank -------------------------------------------------------------------------------------------------------


def run_rank(shape: str, mode: str, num_groups: int, out: Path) -> None:
    """One rank: import, measure the baseline, set the model up through the Trainer, measure the peak."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_fedshard
    from lightning_fedshard.core.backends.fsdp import local_shards
    from lightning_fedshard.examples import LlamaLM

    baseline = rss_bytes()
    start = time.perf_counter()
    model = LlamaLM(**SHAPES[shape], max_seq_len=SEQ_LEN, tie_word_embeddings=False, meta_init=mode == "meta")
    after_init = peak_rss_bytes()
    report: dict[str, Any] = {}

    class Measure(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # The model is wrapped and broadcast; the federation has not copied its anchor yet.
            assert trainer.strategy.model is not None
            shards = local_shards(trainer.strategy.model)
            report["shard_bytes"] = sum(s.numel() * s.element_size() for s in shards)
            report["peak_rss_wrapped_bytes"] = peak_rss_bytes()
            report["rss_wrapped_bytes"] = rss_bytes()
            report["wrap_seconds"] = time.perf_counter() - start

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            report["peak_rss_bytes"] = peak_rss_bytes()
            report["rss_after_setup_bytes"] = rss_bytes()
            report["setup_seconds"] = time.perf_counter() - start
            trainer.should_stop = True  # measured: stop before the first step

    tokens = torch.zeros(8, SEQ_LEN, dtype=torch.long)
    samples: list[dict[str, Any]] = [{"input_ids": row, "labels": row} for row in tokens]
    data: DataLoader[dict[str, Any]] = DataLoader(samples, batch_size=1)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=lightning_fedshard.FLFSDPStrategy(num_groups=num_groups, auto_wrap_policy=LlamaLM.wrap_policy()),
        precision="32-true",
        max_steps=1,
        callbacks=[Measure()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    report.update(baseline_rss_bytes=baseline, peak_rss_after_init_bytes=after_init, rank=int(os.environ["RANK"]))
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))


# -- driver ---------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(shape: str, mode: str, ranks: int, num_groups: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    """Start ``ranks`` rank processes of this script and return what each one measured."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(ranks),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        }
        argv = [sys.executable, __file__, "--rank-worker", "--shape", shape, "--modes", mode]
        argv += ["--num-groups", str(num_groups), "--out", str(out)]
        log = open(out / f"rank{rank}.log", "wb")
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    failed = [rank for rank, (proc, _) in enumerate(procs) if proc.returncode != 0]
    if failed:
        tail = (out / f"rank{failed[0]}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{mode}: ranks {failed} failed:\n{tail}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def model_sizes(shape: str) -> dict[str, int]:
    """Parameter count and bytes (float32) of the whole model and of its largest FSDP unit, from a meta build."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_fedshard.examples import LlamaLM

    model = LlamaLM(**SHAPES[shape], max_seq_len=SEQ_LEN, tie_word_embeddings=False, meta_init=True)
    with torch.device("meta"):  # shapes only, nothing allocated
        network = LlamaForCausalLM(model.config)
    layer = sum(p.numel() for p in network.model.layers[0].parameters())
    total = model.num_parameters()
    root = total - layer * len(network.model.layers)
    return {"num_parameters": total, "model_bytes": 4 * total, "largest_unit_bytes": 4 * max(layer, root)}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The maximum over ranks of each measurement, in GiB (the per-rank raw numbers are kept under ``ranks``)."""

    def gib(key: str, minus_baseline: bool = False) -> float:
        return round(max(r[key] - (r["baseline_rss_bytes"] if minus_baseline else 0) for r in ranks) / GIB, 3)

    return {
        "baseline_rss_gib": gib("baseline_rss_bytes"),
        "peak_rss_until_wrapped_gib": gib("peak_rss_wrapped_bytes"),
        "peak_rss_until_wrapped_minus_baseline_gib": gib("peak_rss_wrapped_bytes", minus_baseline=True),
        "peak_rss_until_train_start_gib": gib("peak_rss_bytes"),
        "rss_at_train_start_gib": gib("rss_after_setup_bytes"),
        "shard_gib": gib("shard_bytes"),
        "max_setup_seconds": round(max(r["setup_seconds"] for r in ranks), 1),
        "ranks": ranks,
    }


def main() -> None:
    """Command line entry point (also each rank's, with ``--rank-worker``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    parser.add_argument("--modes", nargs="+", choices=["eager", "meta"], default=["eager", "meta"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--num-groups", type=int, default=1, help="1 = every rank shards the model (S = ranks)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "init_memory.json")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        run_rank(args.shape, args.modes[0], args.num_groups, args.out)
        return
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/init_memory.py", *sys.argv[1:]]),
        "shape": {"name": args.shape, **SHAPES[args.shape], "tie_word_embeddings": False, "dtype": "float32"},
        **model_sizes(args.shape),
        "ranks": args.ranks,
        "num_groups": args.num_groups,
        "shard_size": args.ranks // args.num_groups,
        "machine": {
            "cpus": os.cpu_count(),
            "ram_gib": round(_total_ram() / GIB, 1),
            "python": platform.python_version(),
        },
        # glibc's allocator settings change how much freed memory stays resident (e.g. MALLOC_MMAP_THRESHOLD_).
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "modes": {},
    }
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"init_memory_{mode}_") as work:  # rank logs and reports
            ranks = launch(args.shape, mode, args.ranks, args.num_groups, Path(work), args.timeout)
        result["modes"][mode] = summarize(ranks)
        print(mode, {k: v for k, v in result["modes"][mode].items() if k != "ranks"}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


if __name__ == "__main__":
    main()
