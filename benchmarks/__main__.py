"""One entry point for every study: ``python -m benchmarks <study> [its arguments]``.

    PYTHONPATH=. python -m benchmarks --help            # the studies, with their time and what each decides
    PYTHONPATH=. python -m benchmarks recipes --help    # one study's own arguments

Each study is a module of this package with its own command line; this one only finds it. The studies that build an
emulated cluster (``run``, ``race``, ``elastic``, the byte counts, ``torchft_kill``) need root for its network
namespaces.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Study:
    """One study: its module, how long it takes on 2 cores, and what it decides."""

    module: str
    time: str
    decides: str


STUDIES = {
    "run": Study(
        "benchmarks.run",
        "3 min to 90 min by preset",
        "speed, link bytes and utilization on the emulated cluster (--preset throughput, sync_grid, defaults,"
        " torchft, hetero, latency, walltime, quick, smoke)",
    ),
    "race": Study("benchmarks.race", "~80 min", "perplexity against wall time, tuned learning rates, 3 seeds"),
    "elastic": Study("benchmarks.elastic", "~70 min", "goodput, stalls and restarts of an elastic federation"),
    "torchft_kill": Study("benchmarks.torchft_kill", "~15 min", "a group killed: torchft's DiLoCo against ours"),
    "hsdp_fed_bytes": Study("benchmarks.hsdp_fed_bytes", "~5 min", "FL+HSDP's cross-group bytes: each shard once"),
    "gossip_bytes": Study("benchmarks.gossip_bytes", "~5 min", "gossip's bytes per sync against the ring all-reduce"),
    "recipes": Study(
        "benchmarks.recipes",
        "~8 min a run, 2 at a time",
        "sync recipes at 150 outer rounds on the simulator: tokens to target, the outer step by H and M",
    ),
    "paper": Study(
        "benchmarks.paper",
        "3 to 30 min a run, 2 at a time",
        "the seed paper's experiment as it ran it (64 steps, one learning rate), 3 seeds",
    ),
    "pairs": Study("benchmarks.pairs", "~6 min a run", "pairs of options: does the pair train as well as each alone"),
    "horizon": Study("benchmarks.horizon", "~40 min", "whether a sync option's cost shrinks with more syncs"),
    "sim_exact": Study("benchmarks.sim_exact", "~2 min", "the simulator against the Trainer strategy, every mode"),
    "init_memory": Study("benchmarks.init_memory", "~5 min", "peak host memory setting a Llama up, eager or meta"),
    "report": Study("benchmarks.report", "seconds", "every table, plot and target (--write-docs rewrites the pages)"),
}


def usage() -> str:
    """The studies, one a line, as ``--help`` prints them."""
    width = max(map(len, STUDIES))
    lines = [f"  {name:<{width}}  {s.time:<30}  {s.decides}" for name, s in STUDIES.items()]
    return "usage: python -m benchmarks <study> [its arguments]\n\nstudies:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run a study's own command line with the rest of the arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    study = STUDIES.get(argv[0])
    if study is None:
        sys.exit(f"python -m benchmarks: unknown study {argv[0]!r}; the studies are {', '.join(STUDIES)}.")
    module = importlib.import_module(study.module)
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    module.main()


if __name__ == "__main__":
    main()
