"""The report command: every table, plot and target of the benchmarks, regenerated from the results JSON alone.

Reads ``benchmarks/results/throughput.json`` and, where they exist, ``sync_grid.json``, ``defaults.json`` and
``race.json`` (nothing here runs a model), and writes:

- ``benchmarks/results/<sweep>_summary.json``: every derived number, per run and per configuration;
- ``benchmarks/results/targets.json``: every target as ``{"id", "target", "measured", "bound", "met", "runs"}``;
- the plots under ``docs/images/``;
- with ``--write-docs``, the generated sections of the benchmark pages (``docs/benchmarks.md`` and
  ``docs/benchmarks/*.md``) and of ``docs/plan.md``::

    python -m benchmarks.report --write-docs
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.sweep import RESULTS
from benchmarks.presets import CONFIGURATIONS
from benchmarks.recipes import load_results as recipe_results
from benchmarks.records import load, load_if_exists
from benchmarks.reports import (
    elastic,
    hetero,
    latency,
    overlap,
    paper,
    race,
    recipes,
    sweep,
    sync_options,
    throughput,
    topologies,
    torchft,
    tuning,
    walltime,
)
from benchmarks.reports.docs import page_with_section, provenance, replace_section
from benchmarks.reports.targets import targets, targets_table

ROOT = RESULTS.parents[1]
IMAGES = ROOT / "docs" / "images"
BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"
#: The benchmark pages' sub-pages: each generated section lives on one of them or on BENCHMARKS_DOC.
BENCHMARKS_PAGES = ROOT / "docs" / "benchmarks"
PLAN_DOC = ROOT / "docs" / "plan.md"


@dataclass
class Report:
    """Every sweep's results and analysis (``None`` where a sweep was not run)."""

    results: dict[str, dict[str, Any] | None]
    analyses: dict[str, dict[str, Any] | None]
    targets: list[dict[str, Any]]

    def tables(self) -> dict[str, str]:
        """Every generated table, by the name of its docs section."""
        configs = self.configs("throughput")
        tables = {
            "throughput": sweep.sweep_table(configs),
            "memory": throughput.memory_table(configs),
            "calibration": throughput.calibration_table(configs),
            "targets": targets_table(self.targets),
            "configurations": sweep.configurations_table(CONFIGURATIONS.values()),
        }
        for name in ("sync_grid", "defaults"):
            if self.analyses[name]:
                tables[name] = sweep.sweep_table(self.configs(name))
        if self.analyses["eager"]:
            tables["overlap"] = overlap.table(self.configs("eager"), self.results["eager"], self.results.get("race"))
            tables["overlap_cpu"] = overlap.cpu_table(self.configs("eager"))
        if (horizon := self.results.get("horizon")) is not None:
            tables["horizon"] = overlap.horizon_table(horizon)
        if (elastic_results := self.results.get("elastic")) is not None:
            tables["elastic"] = elastic.table(elastic_results)
        if (standby_results := self.results.get("elastic_standby")) is not None:
            tables["elastic_standby"] = elastic.standby_table(standby_results)
        if (hetero_results := self.results.get("hetero")) is not None:
            tables["hetero"] = hetero.table(hetero_results)
        if (latency_results := self.results.get("latency")) is not None:
            tables["latency"] = latency.table(latency_results)
        if (analysis := self.analyses["race"]) is not None:
            moments = race.wall_time_table(analysis)
            # markdown="1": the docs site renders the table inside (md_in_html); GitHub ignores the attribute.
            details = '<details markdown="1"><summary>Every moment compared</summary>'
            tables["race"] = f"{race.link_table(analysis)}\n\n{details}\n\n{moments}\n\n</details>"
            tables["race_budgets"] = race.budget_table(analysis)
        return tables

    def configs(self, name: str) -> dict[str, Any]:
        """A sweep's per-configuration summary (empty if it was not run)."""
        analysis = self.analyses[name]
        return analysis["configs"] if analysis else {}

    def note(self, name: str) -> str:
        """The provenance of one sweep's numbers."""
        results = self.results[name]
        assert results is not None
        return provenance(results)


def build(paths: dict[str, Path]) -> Report:
    """Load and analyze every sweep, then measure the targets (``paths``: sweep name -> results file)."""
    throughput_results = load(paths["throughput"])
    results = {"throughput": throughput_results} | {
        name: load_if_exists(path)
        for name, path in paths.items()
        if name not in ("throughput", "hsdp_fed_bytes", "gossip_bytes", "elastic", "hetero", "latency", "walltime")
    }
    configs = sweep.analyze(throughput_results)
    compute = sweep.compute_times(configs["configs"])
    analyses: dict[str, dict[str, Any] | None] = {"throughput": configs}
    for name in ("sync_grid", "defaults", "eager"):
        found = results.get(name)
        analyses[name] = sweep.analyze(found, compute) if found else None
    grid, defaults = _configs(analyses["sync_grid"]), _configs(analyses["defaults"])
    analyses["race"] = None
    if (race_results := results.get("race")) is not None:
        # The race is paced by the throughput sweep; configurations only the other sweeps ran take their pace there.
        analyses["race"] = race.analyze(race_results, {**(grid or {}), **(defaults or {}), **configs["configs"]})
    rows = targets(configs["configs"], grid, analyses["race"], defaults)
    hsdp = overlap.load_bytes_record(paths.get("hsdp_fed_bytes", RESULTS / "hsdp_fed_bytes.json"))
    gossip = overlap.load_bytes_record(paths.get("gossip_bytes", RESULTS / "gossip_bytes.json"))
    eager, race_results = results.get("eager"), results.get("race")
    rows += overlap.targets(eager, _configs(analyses["eager"]) or {}, race_results, hsdp, gossip)
    rows += topologies.targets(load_if_exists(paths.get("sites", RESULTS / "sites.json")))
    results["elastic"] = _load_json(paths.get("elastic", RESULTS / "elastic.json"))
    results["elastic_standby"] = _load_json(paths.get("elastic_standby", RESULTS / "elastic_standby.json"))
    rows += elastic.targets(results["elastic"], results["elastic_standby"])
    results["elastic_strangers"] = _load_json(paths.get("elastic_strangers", RESULTS / "elastic_strangers.json"))
    rows += elastic.stranger_targets(results["elastic_strangers"])
    results["elastic_twolost"] = _load_json(paths.get("elastic_twolost", RESULTS / "elastic_twolost.json"))
    rows += elastic.two_lost_targets(results["elastic_twolost"])
    results["elastic_hang"] = _load_json(paths.get("elastic_hang", RESULTS / "elastic_hang.json"))
    rows += elastic.hang_targets(results["elastic_hang"])
    results["elastic_healsource"] = _load_json(paths.get("elastic_healsource", RESULTS / "elastic_healsource.json"))
    rows += elastic.heal_source_targets(results["elastic_healsource"])
    results["elastic_mixed"] = _load_json(paths.get("elastic_mixed", RESULTS / "elastic_mixed.json"))
    rows += elastic.mixed_targets(results["elastic_mixed"])
    rows += torchft.targets(
        load_if_exists(paths.get("torchft", RESULTS / "torchft.json")),
        _load_json(paths.get("torchft_kill", torchft.KILL_RESULTS)),
    )
    results["hetero"] = load_if_exists(paths.get("hetero", RESULTS / "hetero.json"))
    rows += hetero.targets(results["hetero"])
    results["latency"] = load_if_exists(paths.get("latency", RESULTS / "latency.json"))
    rows += latency.targets(results["latency"])
    exact = _load_json(recipes.EXACT_RESULTS)
    differences = list(exact["max_abs_difference"].values()) if exact else []
    rows += recipes.targets(recipe_results(), max(differences) if differences else None, len(differences))
    rows += tuning.targets(recipe_results())
    rows += paper.targets(paper.load_results())
    results["walltime"] = load_if_exists(paths.get("walltime", RESULTS / "walltime.json"))
    rows.append(walltime.target(recipe_results(), results["walltime"]))
    return Report(results, analyses, rows)


def _load_json(path: Path) -> dict[str, Any] | None:
    """A results file that is not a sweep (no run records to check), or ``None`` if it does not exist."""
    return json.loads(path.read_text()) if path.exists() else None


def _configs(analysis: dict[str, Any] | None) -> dict[str, Any] | None:
    return analysis["configs"] if analysis else None


def write_results(report: Report) -> None:
    """The summaries and ``targets.json`` under ``benchmarks/results/``."""
    for name, analysis in report.analyses.items():
        if analysis is not None:
            (RESULTS / f"{name}_summary.json").write_text(json.dumps(analysis, indent=1, default=str) + "\n")
    (RESULTS / "targets.json").write_text(json.dumps(report.targets, indent=1) + "\n")


def plot(report: Report) -> list[Path]:
    """Every figure, under ``docs/images/``."""
    paths = throughput.plot(report.configs("throughput"), IMAGES)
    if report.analyses["sync_grid"]:
        paths += sync_options.plot(report.configs("sync_grid"), IMAGES)
    if (analysis := report.analyses["race"]) is not None:
        paths += race.plot(analysis, IMAGES)
    if (elastic_results := report.results.get("elastic")) is not None:
        paths += elastic.plot(elastic_results, IMAGES)
    if (hetero_results := report.results.get("hetero")) is not None:
        paths.append(hetero.plot(hetero_results, IMAGES / "hetero.png"))
    if (latency_results := report.results.get("latency")) is not None:
        paths.append(latency.plot(latency_results, IMAGES / "latency.png"))
    if study := recipe_results():
        paths.append(recipes.plot(study, IMAGES / "recipes.png"))
        if (walltime_results := report.results.get("walltime")) is not None:
            paths.append(walltime.plot(study, walltime_results, IMAGES / "walltime.png"))
    if paper_runs := paper.load_results():
        paths.append(paper.plot(paper_runs, IMAGES / "paper.png"))
    return paths


def write_docs(report: Report, tables: dict[str, str]) -> None:
    """The generated sections of the benchmark pages and ``docs/plan.md``, each with its provenance."""
    throughput_note = report.note("throughput")
    notes = [report.note(name) for name, results in report.results.items() if results is not None]
    sections = {
        "targets": "\n\n".join([tables["targets"], *notes]),
        "throughput": f"{tables['throughput']}\n\n{throughput_note}",
        "memory": f"{tables['memory']}\n\n{throughput_note}",
        "configurations": tables["configurations"],
    }
    for name, table in (
        ("sync_grid", "sync_grid"),
        ("defaults", "defaults"),
        ("eager", "overlap"),
        ("eager", "overlap_cpu"),
        ("horizon", "horizon"),
        ("race", "race"),
        ("race", "race_budgets"),
        ("elastic", "elastic"),
        ("elastic_standby", "elastic_standby"),
        ("hetero", "hetero"),
        ("latency", "latency"),
    ):
        if table in tables:
            sections[table] = f"{tables[table]}\n\n{report.note(name)}"
    sections.update(_torchft_sections())
    if study := recipe_results():
        sections["recipes"] = recipes.section(study)
        sections["outer_sweep"] = tuning.outer_table(study)
        sections["critical_batch"] = tuning.critical_batch_table(study)
        sections["paper_regime"] = tuning.paper_regime_table(study)
        if (walltime_results := report.results.get("walltime")) is not None:
            sections["walltime"] = walltime.table(study, walltime_results) + f"\n\n{report.note('walltime')}"
        recipes.write_planner_factors(study)
    paper_runs = paper.load_results()
    sections["paper_arms"] = paper.table(paper_runs)
    sections["paper_longer"] = paper.longer_table(paper_runs)
    pages = [BENCHMARKS_DOC, *sorted(BENCHMARKS_PAGES.glob("*.md"))]
    for name, body in sections.items():
        replace_section(page_with_section(pages, name), name, body)
    replace_section(PLAN_DOC, "calibration", f"{tables['calibration']}\n\n{throughput_note}")


def _torchft_sections() -> dict[str, str]:
    """The tables of the side by side with torchft, for those of its results that exist."""
    sections = {}
    if (results := load_if_exists(RESULTS / "torchft.json")) is not None:
        sections["torchft"] = torchft.table(torchft.rows(results["runs"]))
    if (kill := _load_json(torchft.KILL_RESULTS)) is not None:
        sections["torchft_kill"] = torchft.kill_table(torchft.kill_rows(kill))
    return sections


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--throughput", type=Path, default=RESULTS / "throughput.json", help="the throughput sweep")
    parser.add_argument("--grid", type=Path, default=RESULTS / "sync_grid.json", help="the sync_grid sweep, if run")
    parser.add_argument("--defaults", type=Path, default=RESULTS / "defaults.json", help="the defaults sweep, if run")
    parser.add_argument("--race", type=Path, default=RESULTS / "race.json", help="the race to perplexity, if run")
    parser.add_argument("--eager", type=Path, default=RESULTS / "eager.json", help="the eager sweep, if run")
    parser.add_argument("--horizon", type=Path, default=RESULTS / "horizon.json", help="the 256-step runs, if run")
    parser.add_argument(
        "--hsdp-fed-bytes", type=Path, default=RESULTS / "hsdp_fed_bytes.json", help="FL+HSDP's bytes, if run"
    )
    parser.add_argument("--write-docs", action="store_true", help="rewrite the generated sections of the docs")
    parser.add_argument("--no-plots", action="store_true", help="skip the figures")
    args = parser.parse_args(argv)
    paths = {"throughput": args.throughput, "sync_grid": args.grid, "defaults": args.defaults, "race": args.race}
    paths |= {"eager": args.eager, "horizon": args.horizon}
    report = build({**paths, "hsdp_fed_bytes": args.hsdp_fed_bytes})
    write_results(report)
    tables = report.tables()
    for name, table in tables.items():
        print(f"## {name}\n\n{table}\n")
    if not args.no_plots:
        for path in plot(report):
            print(f"plot: {path.relative_to(ROOT)}")
    if args.write_docs:
        write_docs(report, tables)


if __name__ == "__main__":
    main()
