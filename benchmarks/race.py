"""The race to perplexity: learning rates tuned per strategy and budget, schedules sized to each budget, 3 seeds.

Run as root from the repository root (it builds the 4 x 2 cluster of the sweeps)::

    sudo PYTHONPATH=. python -m benchmarks.race --work /tmp/fedshard-race

Perplexity per optimizer step does not depend on the link (the link only decides how long a step takes), so every
run here trains on an unthrottled cluster, and :mod:`benchmarks.reports.race` places the results on each link's time
axis with the median paces that the sweeps measured on that link (syncs included).

What runs, in this order (each stage reads the results of the previous ones; the plan is in
:mod:`benchmarks.presets`):

1. ``tune``: each curve at each of its step budgets (``RACE_BUDGETS``), with three learning rates a factor 2 apart,
   seed 0. The schedule (warm-up + cosine, ``LlamaLM``) spans the run's own ``max_steps``, so every run ends
   annealed; it is scored by the validation of its final (consensus) model.
2. ``extend``: where the best learning rate of a budget is at the edge of those tried, the next one outward (x2 or
   /2), ``RACE_MAX_EXTENSIONS`` time(s); a budget whose best is still at an edge is marked so in the report.
3. ``seeds``: seeds 1 and 2 at each budget's best learning rate. A seed sets the data order and the initial weights.
4. ``hsdp_check``: HSDP at the largest budget with FSDP's learning rate. HSDP and FSDP compute the same update from
   the same global batch, so HSDP's curve is FSDP's (this run checks it) and the report charges it HSDP's pace.
5. ``options``: FL+FSDP's sync options at its largest budget and best learning rate, three seeds: what each option
   costs in perplexity, beside what it saves in time.

The results go to ``benchmarks/results/race.json``, rewritten after every run; a run already there is not run again,
so an interrupted race continues where it stopped.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import metrics, records
from benchmarks.harness.cluster import EmulatedCluster
from benchmarks.harness.launch import RunFailed
from benchmarks.harness.machine import machine
from benchmarks.harness.sweep import RESULTS, ResultsFile, prepare_data, require_namespaces, run_job
from benchmarks.presets import (
    RACE,
    RACE_BUDGETS,
    RACE_LEARNING_RATES,
    RACE_LONGER_BUDGET_RATES,
    RACE_MAX_EXTENSIONS,
    RACE_OPTIONS,
    RACE_SEEDS,
    race_job,
)

STAGES = ("tune", "extend", "seeds", "hsdp_check", "options")


def tried(runs: list[dict[str, Any]], configuration: str, steps: int) -> dict[float, float]:
    """Seed-0 learning rates tried for ``configuration`` at ``steps`` and their final perplexity."""
    return {
        run["config"]["lr"]: metrics.final_ppl(run)
        for run in runs
        if metrics.identity(run).configuration == configuration
        and run["config"]["max_steps"] == steps
        and run["config"]["seed"] == 0
    }


def best_lr(runs: list[dict[str, Any]], configuration: str, steps: int) -> float:
    """The seed-0 learning rate with the lowest final perplexity.

    Raises:
        ValueError: If no tuning run of that budget finished.
    """
    scores = tried(runs, configuration, steps)
    if not scores:
        raise ValueError(f"no tuning run of {configuration} at {steps} steps")
    return min(scores, key=scores.__getitem__)


def next_lr(scores: dict[float, float]) -> float | None:
    """The learning rate to try next when the best one is at an edge of ``scores`` (else None)."""
    rates = sorted(scores)
    best = min(rates, key=scores.__getitem__)
    if best == rates[0]:
        return rates[0] / 2
    if best == rates[-1]:
        return rates[-1] * 2
    return None


def budgets() -> Iterator[tuple[str, int]]:
    """Every (curve, budget), shortest budgets first, so an interrupted race has every curve's short end."""
    for steps in sorted({s for ladder in RACE_BUDGETS.values() for s in ladder}):
        for curve, ladder in RACE_BUDGETS.items():
            if steps in ladder:
                yield curve, steps


class Race:
    """Runs the stages on one cluster and keeps the results on disk after every run.

    Args:
        work: Scratch folder (data, logs).
        results: The race's results file (a run already in it is not run again).
        cluster: The emulated cluster, unthrottled.
    """

    def __init__(self, work: Path, results: ResultsFile, cluster: EmulatedCluster) -> None:
        self.work = work
        self.results = results
        self.cluster = cluster
        self._launches = 0

    @property
    def runs(self) -> list[dict[str, Any]]:
        """The finished runs."""
        return self.results.runs

    def run(self, stage: str, configuration: str, steps: int, lr: float, seed: int) -> None:
        """One run, unless the results already have it."""
        job = race_job(self.work, configuration, steps, lr, seed)
        if self.results.has(job.name):
            return
        self._launches += 1
        print(f"[{stage} {len(self.runs) + 1}] {job.name}", flush=True)
        try:
            run = run_job(self.cluster, job, self._launches, RACE.timeout, self.results)
        except RunFailed as error:
            print(f"  FAILED: {error}", flush=True)
            return
        run.pop("steps", None)  # per-step clocks: not needed to score a run, and most of the file's size
        run["stage"] = stage
        self.results.write()
        print(f"  val_ppl {metrics.final_ppl(run):.1f}, wall {run['driver']['wall_seconds']:.0f} s", flush=True)

    def tune(self) -> None:
        """Stage 1: three learning rates at every budget, seed 0."""
        for curve, steps in budgets():
            for lr in RACE_LEARNING_RATES.get(steps, RACE_LONGER_BUDGET_RATES):
                self.run("tune", curve, steps, lr, seed=0)

    def extend(self) -> None:
        """Stage 2: one more learning rate outward where the best is at an edge."""
        for curve, steps in budgets():
            for _ in range(RACE_MAX_EXTENSIONS):
                lr = next_lr(tried(self.runs, curve, steps))
                if lr is None:
                    break
                self.run("extend", curve, steps, lr, seed=0)

    def seeds(self) -> None:
        """Stage 3: the other seeds at every budget's best learning rate."""
        for curve, steps in budgets():
            lr = best_lr(self.runs, curve, steps)
            for seed in RACE_SEEDS[1:]:
                self.run("seeds", curve, steps, lr, seed)

    def hsdp_check(self) -> None:
        """Stage 4: HSDP at FSDP's largest budget and learning rate."""
        steps = max(RACE_BUDGETS["fsdp"])
        self.run("hsdp_check", "hsdp", steps, best_lr(self.runs, "fsdp", steps), seed=0)

    def options(self) -> None:
        """Stage 5: FL+FSDP's sync options at its largest budget and learning rate, every seed."""
        steps = max(RACE_BUDGETS["fl_fsdp"])
        lr = best_lr(self.runs, "fl_fsdp", steps)
        for seed in RACE_SEEDS:
            for option in RACE_OPTIONS:
                self.run("options", option, steps, lr, seed)


def open_results(path: Path) -> ResultsFile:
    """The race's results so far (older records brought to the current form), or a new file."""
    if not path.exists():
        return ResultsFile.new(path, RACE.name, "benchmarks.race")
    results = ResultsFile(path, records.load(path, runs="all"))  # resuming: every run on record stays
    results.data["machine"] = machine("benchmarks.race")
    return results


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description="Race to perplexity: tuned learning rates, 3 seeds (unthrottled).")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-race"), help="scratch folder")
    parser.add_argument("--results", type=Path, default=RESULTS / "race.json")
    parser.add_argument("--stages", nargs="*", choices=STAGES, default=list(STAGES), help="stages to run, in order")
    args = parser.parse_args(argv)
    require_namespaces()
    args.work.mkdir(parents=True, exist_ok=True)
    results = open_results(args.results)
    prepare_data(race_job(args.work, "fsdp", 8, 3e-3, 0).config, args.work)
    with EmulatedCluster(RACE.num_nodes) as cluster:
        cluster.set_bandwidth(None)
        race = Race(args.work, results, cluster)
        for stage in args.stages:
            getattr(race, stage)()
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
