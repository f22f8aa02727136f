"""An elastic federation on one machine: groups as separate jobs that are killed, hung and replaced while they train.

    OMP_NUM_THREADS=1 .venv/bin/python examples/elastic_shakespeare.py --groups 3 --ranks-per-group 1 --max-steps 96 \\
        --faults kill:1@20,restart:1@30,stop:2@50 --report outputs/elastic/report.json

Starts a torchft lighthouse in this process and one Lightning job per federation group (FL+FSDP on the example
Llama and Shakespeare, each group with its own part of the data), injects the faults - ``kill:G@S`` (SIGKILL),
``stop:G@S`` (SIGSTOP: a hung group) and ``restart:G@S`` (a new job for group G, which joins and heals), once the
furthest running group has done S optimizer steps - and writes a JSON report: per group its steps, syncs committed
and lost, heals and exit codes; per fault how long the surviving groups stalled; every live group's final consensus
checksum; the committed tokens per second. With ``--standbys N``, N standby jobs start with the groups: each waits
without training and takes the place of a group that is gone (its index and data) at the next sync, and every
``restart:G@S`` starts a new standby instead of a job for group G. It prints a summary and ends every process it
started. Needs the ``elastic`` extra (``pip install lightning-fedshard[elastic]``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from lightning_fedshard.examples.elastic import DemoConfig, ElasticDemo, parse_faults, summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3, help="federation groups, one job each")
    parser.add_argument("--ranks-per-group", type=int, default=1, help="ranks (CPU processes) of each group job")
    parser.add_argument("--max-steps", type=int, default=96, help="optimizer steps of every group")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--faults", default="", help="kill, stop, restart: e.g. kill:1@20,restart:1@30,stop:2@50")
    parser.add_argument(
        "--standbys", type=int, default=0,
        help="standby jobs started with the groups; each takes a gone group's place, and `restart` starts a new one",
    )  # fmt: skip
    parser.add_argument("--report", type=Path, default=Path("outputs/elastic/report.json"))
    parser.add_argument("--reduce-dtype", default="int4")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds a collective between groups may take")
    parser.add_argument(
        "--peer-check", type=float, default=1.0,
        help="seconds between readings of the lighthouse while a sum waits (0: wait for --timeout on a hung group)",
    )  # fmt: skip
    parser.add_argument("--heartbeat", type=float, default=2.0, help="seconds before the lighthouse drops a group")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (to slow a demo down)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = DemoConfig(
        groups=args.groups,
        ranks_per_group=args.ranks_per_group,
        max_steps=args.max_steps,
        sync_every=args.sync_every,
        faults=parse_faults(args.faults, args.groups),
        standbys=args.standbys,
        reduce_dtype=args.reduce_dtype,
        timeout=args.timeout,
        peer_check=args.peer_check,
        heartbeat=args.heartbeat,
        step_sleep=args.step_sleep,
    )
    # The federation's secret, if any, from this command's environment (the stranger faults need one).
    report = ElasticDemo(config, args.report.parent / "jobs", secret=os.environ.get("FEDSHARD_SECRET")).run()
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2))
    print(summary(report))
    print(f"report: {args.report}")


if __name__ == "__main__":
    main()
