"""The sweep command: build an emulated cluster, run a preset's jobs, keep their results, tear the cluster down.

Run as root from the repository root (``benchmarks.presets`` defines the presets; ``--help`` lists them)::

    sudo PYTHONPATH=. python -m benchmarks.run --preset throughput

Every run writes ``<work>/<name>/`` (rank 0's ``run.json``, every node's log, Lightning's CSV metrics); the driver
adds the runs to ``benchmarks/results/<preset>.json`` (earlier invocations' runs stay), rewritten after every run,
failed ones included. The
cluster is removed at the end, also after a failure or Ctrl-C. The command exits with an error naming the runs that
failed; ``python -m benchmarks.report`` turns the results into the docs' tables.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from benchmarks import metrics
from benchmarks.harness.cluster import EmulatedCluster
from benchmarks.harness.config import Job
from benchmarks.harness.launch import RunFailed
from benchmarks.harness.sweep import RESULTS, ResultsFile, prepare_data, require_namespaces, run_job
from benchmarks.presets import PRESETS, Preset


def summary_line(run: dict[str, Any]) -> str:
    """One line about a finished run: pace, link bytes, final perplexity, wall time."""
    ppl = metrics.final_ppl(run) if run["vals"] else math.nan
    return (
        f"{metrics.tokens_per_second(run):,.0f} tok/s, {metrics.link_bytes_per_step(run) / 1e6:.2f} link MB/step,"
        f" val_ppl {ppl:.1f}, wall {run['driver']['wall_seconds']:.0f} s"
    )


def run_preset(preset: Preset, jobs: list[Job], results: ResultsFile, prefix: str | None) -> list[str]:
    """Run ``jobs`` on a new cluster of ``preset``'s shape; return the names of the runs that failed."""
    failed = []
    names = {} if prefix is None else {"prefix": prefix}
    cluster = EmulatedCluster(preset.num_nodes, sites=preset.sites, latency=preset.latency, **names)
    with cluster:
        for index, job in enumerate(jobs):
            print(f"[{index + 1}/{len(jobs)}] {job.name}", flush=True)
            try:
                run = run_job(cluster, job, index, preset.timeout, results, preset.between_sites_mbit)
            except RunFailed as error:
                print(f"  FAILED: {error}", flush=True)
                failed.append(job.name)
                continue
            print(f"  {summary_line(run)}", flush=True)
    return failed


def _presets_help() -> str:
    return "\n".join(f"  {p.name:<11} ~{p.minutes:g} min: {p.summary}" for p in PRESETS.values())


def main(argv: list[str] | None = None) -> None:
    """Command line entry point.

    Raises:
        SystemExit: If a run failed (after every other run ran), or the cluster cannot be emulated here.
    """
    parser = argparse.ArgumentParser(
        description="Emulated-cluster benchmark of FSDP, HSDP, FL+FSDP and FL+HSDP (as root).",
        epilog=f"presets (2 CPU cores):\n{_presets_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-bench"), help="scratch: data, logs, CSVs")
    parser.add_argument("--results", type=Path, help="results JSON (default: benchmarks/results/<preset>.json)")
    parser.add_argument("--only", nargs="*", help="run only these job names")
    parser.add_argument("--prefix", help="name prefix of the namespaces (default: fsb<pid>)")
    parser.add_argument("--repeats", type=int, help="repeats of the preset's configurations (default: the preset's)")
    args = parser.parse_args(argv)
    require_namespaces()
    preset = PRESETS[args.preset]
    jobs = [job for job in preset.jobs(args.work, args.repeats) if not args.only or job.name in args.only]
    if not jobs:
        raise SystemExit(f"No job of preset {preset.name!r} is named {args.only}.")
    path = args.results or RESULTS / f"{preset.name}.json"
    results = ResultsFile.open(path, preset.name, "benchmarks.run")  # earlier runs stay; this invocation adds to them
    args.work.mkdir(parents=True, exist_ok=True)
    prepare_data(jobs[0].config, args.work)
    failed = run_preset(preset, jobs, results, args.prefix)
    print(f"results: {path}")
    if failed:
        raise SystemExit(f"{len(failed)} of {len(jobs)} runs failed ({', '.join(failed)}); see 'failed' in {path}.")


if __name__ == "__main__":
    main()
