"""Issue 9's race to perplexity: tuned learning rates, schedules sized to each step budget, three seeds.

Run as root from the repository root (it builds the same emulated 4 x 2 cluster as the throughput preset)::

    PYTHONPATH=. python -m benchmarks.race --work /tmp/fedshard-race

Perplexity per optimizer step does not depend on the link (the link only decides how long a step takes), so every
run here trains on an unthrottled cluster, and :mod:`benchmarks.race_report` places the results on each link's
time axis with the median step times that the ``throughput`` preset measured on that link (syncs included).

What runs, in this order (each stage reads the results of the previous ones):

1. ``tune``: each curve (:data:`BUDGETS`) at each of its step budgets, with three learning rates a factor 2 apart
   (:data:`LEARNING_RATES`), seed 0. The schedule (warm-up + cosine, ``LlamaLM``) spans the run's own ``max_steps``,
   so every run ends annealed; it is scored by the validation of its final (consensus) model.
2. ``extend``: where the best learning rate of a budget is at the edge of those tried, the next one outward (x2 or
   /2), :data:`MAX_EXTENSIONS` time(s); a budget whose best is still at an edge is marked so in the report.
3. ``seeds``: seeds 1 and 2 at each budget's best learning rate. A seed sets the data order and the initial weights.
4. ``hsdp_check``: HSDP at the largest budget with FSDP's learning rate. HSDP and FSDP compute the same update from
   the same global batch, so HSDP's curve is FSDP's (this run checks it) and the report charges it HSDP's step
   times.
5. ``options``: FL+FSDP's sync options at its largest budget and best learning rate, three seeds: what each option
   costs in perplexity, beside what it saves in time.

The results go to ``benchmarks/results/race.json``, rewritten after every run; a run already there is not run again,
so an interrupted race continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.cluster import EmulatedCluster, namespaces_available
from benchmarks.launch import RunFailed, launch
from benchmarks.run import RESULTS, _throughput_base, _write, machine, prepare_data
from benchmarks.train import RunConfig

#: Step budgets per curve. HSDP shares FSDP's curve (see stage 4). The federated runs end on a sync step, so their
#: final model is the consensus.
BUDGETS: dict[str, tuple[int, ...]] = {
    "fsdp": (8, 16, 24, 32, 48, 64),
    "fl_fsdp": (8, 16, 32, 64),
    "fl_hsdp": (8, 16, 32, 64),
}
#: The learning rates tried at every budget (seed 0), by budget: the two shortest budgets ran first and preferred
#: the largest rate everywhere, with 1.5e-3 far behind, so the longer budgets start one step higher.
LEARNING_RATES: dict[int, tuple[float, ...]] = {8: (1.5e-3, 3e-3, 6e-3), 16: (1.5e-3, 3e-3, 6e-3)}
LONGER_BUDGET_RATES: tuple[float, ...] = (3e-3, 6e-3, 1.2e-2)
MAX_EXTENSIONS = 1
SEEDS: tuple[int, ...] = (0, 1, 2)
STAGES = ("tune", "extend", "seeds", "hsdp_check", "options")
#: FL+FSDP's sync options compared at its largest budget (name -> RunConfig changes).
OPTIONS: dict[str, dict[str, Any]] = {
    "bf16": {"reduce_dtype": "bfloat16"},
    "int8": {"reduce_dtype": "int8"},
    "int4ef-f4-d1": {"reduce_dtype": "int4", "error_feedback": True, "fragments": 4, "sync_delay": 1},
    "nesterov": {"outer_optimizer": "nesterov"},
    # Added after the first options: the package's new default (int4 + error feedback) alone, and with a delay.
    "int4ef": {"reduce_dtype": "int4", "error_feedback": True},
    "int4ef-d1": {"reduce_dtype": "int4", "error_feedback": True, "sync_delay": 1},
}


def race_base(cache: Path) -> RunConfig:
    """The race's run, before strategy, budget, learning rate and seed: the throughput preset's model and batch, with
    a larger validation set (every run is scored by it)."""
    return replace(_throughput_base(Path(), cache), max_val_windows=128)


def run_name(strategy: str, steps: int, lr: float, seed: int, option: str = "") -> str:
    """The name of one race run (unique in ``race.json``)."""
    kind = f"{strategy}-{option}" if option else strategy
    return f"{kind}-s{steps}-lr{lr:g}-seed{seed}"


def final_ppl(run: dict[str, Any]) -> float:
    """Validation perplexity of a run's final model (the validation at its last step)."""
    last = run["vals"][-1]
    if last["step"] != run["config"]["max_steps"]:
        raise ValueError(f"run {run['name']!r} has no validation at its last step {run['config']['max_steps']}")
    return float(last["val_ppl"])


def tried(runs: list[dict[str, Any]], strategy: str, steps: int, option: str = "") -> dict[float, float]:
    """Seed-0 learning rates tried for ``(strategy, steps, option)`` and their final perplexity."""
    return {
        run["config"]["lr"]: final_ppl(run)
        for run in runs
        if run.get("kind") == (strategy, steps, option) and run["config"]["seed"] == 0
    }


def best_lr(runs: list[dict[str, Any]], strategy: str, steps: int) -> float:
    """The seed-0 learning rate with the lowest final perplexity."""
    scores = tried(runs, strategy, steps)
    if not scores:
        raise ValueError(f"no tuning run of {strategy} at {steps} steps")
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


class Race:
    """Runs the stages on one cluster and keeps ``results`` on disk after every run."""

    def __init__(self, work: Path, results_file: Path, cluster: EmulatedCluster) -> None:
        self.work = work
        self.results_file = results_file
        self.cluster = cluster
        self.base = race_base(work / "data")
        self.results: dict[str, Any] = {"preset": "race", "runs": [], "failed": []}
        if results_file.exists():
            self.results = json.loads(results_file.read_text())
        self.results["machine"] = machine("benchmarks.race")
        self._launches = 0

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.results["runs"]

    def run(self, stage: str, strategy: str, steps: int, lr: float, seed: int, option: str = "") -> None:
        """One run, unless ``race.json`` already has it."""
        name = run_name(strategy, steps, lr, seed, option)
        if any(run["name"] == name for run in self.runs):
            return
        changes = OPTIONS[option] if option else {}
        cfg = replace(
            self.base,
            strategy=strategy,
            max_steps=steps,
            val_every=steps,
            lr=lr,
            seed=seed,
            init_seed=seed,
            out=str(self.work / name),
            **changes,
        )
        self._launches += 1
        print(f"[{stage} {len(self.runs) + 1}] {name}", flush=True)
        try:
            result = launch(self.cluster, cfg, port=29500 + self._launches % 400, timeout=900.0)
        except RunFailed as error:
            print(f"  FAILED: {error}", flush=True)
            self.results["failed"].append({"name": name, "error": str(error)[-2000:]})
            return
        result.pop("steps", None)  # per-step clocks: not needed to score a run, and most of the file's size
        result.update(name=name, stage=stage, kind=(strategy, steps, option), ended=time.time())
        result["load_after"] = list(os.getloadavg())
        self.runs.append(result)
        print(f"  val_ppl {final_ppl(result):.1f}, wall {result['driver']['wall_seconds']:.0f} s", flush=True)
        _write(self.results_file, self.results)

    def _budgets(self) -> Iterator[tuple[str, int]]:
        # Shortest budgets first, so an interrupted race has every curve's short end.
        for steps in sorted({s for budgets in BUDGETS.values() for s in budgets}):
            for strategy, budgets in BUDGETS.items():
                if steps in budgets:
                    yield strategy, steps

    def tune(self) -> None:
        for strategy, steps in self._budgets():
            for lr in LEARNING_RATES.get(steps, LONGER_BUDGET_RATES):
                self.run("tune", strategy, steps, lr, seed=0)

    def extend(self) -> None:
        for strategy, steps in self._budgets():
            for _ in range(MAX_EXTENSIONS):
                lr = next_lr(tried(self.runs, strategy, steps))
                if lr is None:
                    break
                self.run("extend", strategy, steps, lr, seed=0)

    def seeds(self) -> None:
        for strategy, steps in self._budgets():
            lr = best_lr(self.runs, strategy, steps)
            for seed in SEEDS[1:]:
                self.run("seeds", strategy, steps, lr, seed)

    def hsdp_check(self) -> None:
        steps = max(BUDGETS["fsdp"])
        self.run("hsdp_check", "hsdp", steps, best_lr(self.runs, "fsdp", steps), seed=0)

    def options(self) -> None:
        steps = max(BUDGETS["fl_fsdp"])
        lr = best_lr(self.runs, "fl_fsdp", steps)
        for seed in SEEDS:
            for option in OPTIONS:
                self.run("options", "fl_fsdp", steps, lr, seed, option)


def _normalize(results: dict[str, Any]) -> None:
    # JSON keeps the kinds' tuples as lists.
    for run in results["runs"]:
        run["kind"] = tuple(run["kind"])


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description="Race to perplexity: tuned learning rates, 3 seeds (unthrottled).")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-race"), help="scratch folder")
    parser.add_argument("--results", type=Path, default=RESULTS / "race.json")
    parser.add_argument("--stages", nargs="*", choices=STAGES, default=list(STAGES), help="stages to run, in order")
    args = parser.parse_args(argv)
    if (reason := namespaces_available()) is not None:
        raise SystemExit(f"Cannot emulate a cluster: {reason}.")
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HOME": str(args.work / "hf_home"), "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RESULTS.parents[1]), env.get("PYTHONPATH", "")) if p)
    with EmulatedCluster(4) as cluster:
        race = Race(args.work, args.results, cluster)
        _normalize(race.results)
        prepare_data(race.base, env)
        cluster.set_bandwidth(None)
        for stage in args.stages:
            getattr(race, stage)()
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
