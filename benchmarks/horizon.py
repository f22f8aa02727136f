"""Perplexity over a longer horizon: does a sync option's cost shrink when a run has more syncs?

Run as root from the repository root (it builds the 4 x 2 cluster of the sweeps)::

    sudo PYTHONPATH=. python -m benchmarks.horizon --work /tmp/fedshard-horizon

The race scores every option after 64 steps, 8 syncs at ``sync_every=8``. Options whose cost is paid per round
(eager updates: the other groups' progress arrives a round late) or whose benefit needs many rounds (the sparse codec:
what one sync does not send waits in the error-feedback residuals) may look different after more syncs. This runs
them for ``HORIZON_STEPS`` steps (32 syncs) at the race's learning rate for FL+FSDP, unthrottled, each seed of
``HORIZON_SEEDS``; the results go to ``benchmarks/results/horizon.json`` and a run already there is not run again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness.cluster import EmulatedCluster
from benchmarks.harness.machine import machine
from benchmarks.harness.sweep import RESULTS, prepare_data, require_namespaces
from benchmarks.presets import RACE, race_job
from benchmarks.race import Race, best_lr, open_results

HORIZON_STEPS = 256
HORIZON_SEEDS = (0, 1)
HORIZON_OPTIONS = (
    "fl_fsdp",
    "fl_fsdp-int4ef",
    "fl_fsdp-int4ef-eager-local",
    "fl_fsdp-sparse",
    "fl_fsdp-sparse-eager-local",
)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-horizon"), help="scratch folder")
    parser.add_argument("--results", type=Path, default=RESULTS / "horizon.json")
    parser.add_argument("--race", type=Path, default=RESULTS / "race.json", help="where the tuned rate comes from")
    args = parser.parse_args(argv)
    require_namespaces()
    args.work.mkdir(parents=True, exist_ok=True)
    lr = best_lr(open_results(args.race).runs, "fl_fsdp", 64)
    results = open_results(args.results)
    results.data["machine"] = machine("benchmarks.horizon")
    prepare_data(race_job(args.work, "fl_fsdp", HORIZON_STEPS, lr, 0).config, args.work)
    with EmulatedCluster(RACE.num_nodes) as cluster:
        cluster.set_bandwidth(None)
        horizon = Race(args.work, results, cluster)
        for seed in HORIZON_SEEDS:
            for option in HORIZON_OPTIONS:
                horizon.run("horizon", option, HORIZON_STEPS, lr, seed)
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
