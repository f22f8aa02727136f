"""Derived measurements of a sweep and their bounds: throughput, link bytes, syncs, memory, perplexity.

Everything here reads the results JSON written by :mod:`benchmarks.run`; nothing runs a model. Run it to print
the tables that ``docs/benchmarks.md`` quotes::

    python -m benchmarks.report benchmarks/results/full.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}
#: Steps at the start of a run left out of the throughput (lazy initialization, first gathers, allocator warm-up).
WARMUP_STEPS = 1


@dataclass(frozen=True)
class Summary:
    """The measurements of one run, in the units the docs use."""

    name: str
    strategy: str
    link_mbit: float | None
    sync_every: int
    outer_optimizer: str
    tokens_per_s: float
    """Training tokens per second of all ranks together, after the warm-up steps, syncs included."""
    nosync_tokens_per_s: float
    """The same over steps without an outer step (in-run compute-only rate of the federated runs)."""
    link_bytes_per_step: float
    """Bytes sent into all inter-node links per optimizer step (validation and end-of-fit syncs excluded)."""
    sync_bytes: float
    """Mean bytes sent into all links per outer step (NaN without syncs)."""
    sync_bytes_bound: float
    """Analytic minimum of :attr:`sync_bytes`: ``W x 2 (G-1)/G x P x b / S`` (NaN without syncs)."""
    sync_seconds: float
    """Total seconds spent in outer steps (rank 0)."""
    train_seconds: float
    peak_rss_mib: float
    """Largest peak resident memory over the ranks."""
    final_ppl: float
    load: float
    """Mean 1-minute load average before and after the run (other users of the machine included)."""

    @property
    def label(self) -> str:
        return LABELS[self.strategy]

    @property
    def sync_ratio(self) -> float:
        return self.sync_bytes / self.sync_bytes_bound


def num_groups(run: dict[str, Any]) -> int:
    cfg = run["config"]
    return {"fl_fsdp": cfg["num_nodes"], "fl_hsdp": cfg["num_groups"]}.get(cfg["strategy"], 1)


def shard_size(run: dict[str, Any]) -> int:
    cfg = run["config"]
    return cfg["devices"] if cfg["strategy"] in ("hsdp", "fl_hsdp") else run["world_size"] // num_groups(run)


def sync_bytes_bound(run: dict[str, Any]) -> float:
    """Analytic minimum bytes all ranks send per outer step (ring all-reduce of every rank's shard)."""
    groups = num_groups(run)
    per_rank = 2 * (groups - 1) / groups * run["num_parameters"] * run["bytes_per_value"] / shard_size(run)
    return run["world_size"] * per_rank


def summarize(run: dict[str, Any]) -> Summary:
    """Reduce one run of the results JSON to a :class:`Summary`."""
    cfg = run["config"]
    steps = run["steps"]
    tokens_per_step = run["tokens_per_step"]
    timed = steps[WARMUP_STEPS:]
    elapsed = timed[-1]["clock"] - steps[WARMUP_STEPS - 1]["clock"]
    synced = {s["step"] for s in run["syncs"]}
    durations = [b["clock"] - a["clock"] for a, b in zip(steps[WARMUP_STEPS - 1 :], timed) if b["step"] not in synced]
    syncs = run["syncs"]
    return Summary(
        name=run["name"],
        strategy=cfg["strategy"],
        link_mbit=run["driver"]["link_mbit"],
        sync_every=cfg["sync_every"],
        outer_optimizer=cfg["outer_optimizer"],
        tokens_per_s=len(timed) * tokens_per_step / elapsed,
        nosync_tokens_per_s=tokens_per_step / (sum(durations) / len(durations)) if durations else math.nan,
        link_bytes_per_step=(run["link_tx_train"] - run["link_tx_val"] - run.get("link_tx_finish", 0))
        / cfg["max_steps"],
        sync_bytes=sum(s["tx_bytes"] for s in syncs) / len(syncs) if syncs else math.nan,
        sync_bytes_bound=sync_bytes_bound(run) if syncs else math.nan,
        sync_seconds=sum(s["seconds"] for s in syncs),
        train_seconds=run["train_seconds"],
        peak_rss_mib=max(run["maxrss_mib"]),
        final_ppl=run["vals"][-1]["val_ppl"] if run["vals"] else math.nan,
        load=(run["load_before"] + run["load_after"]) / 2,
    )


def load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def main_comparison(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bandwidth sweep: every strategy at every link rate, federated ones with the default outer step."""
    return [r for r in runs if sweep_of(r) == "bandwidth"]


def sweep_of(run: dict[str, Any]) -> str:
    """The comparison a run belongs to (inferred from its configuration in results that predate the field)."""
    if "sweep" in run:
        return str(run["sweep"])
    cfg = run["config"]
    if not cfg["strategy"].startswith("fl_"):
        return "bandwidth"
    if cfg["outer_optimizer"] != "nesterov":
        return "outer_optimizer"
    return "bandwidth" if cfg["sync_every"] == 8 else "sync_every"


def links(runs: list[dict[str, Any]]) -> list[float | None]:
    """Link rates of the runs, fastest (unthrottled) first."""
    rates = {r["driver"]["link_mbit"] for r in runs}
    return sorted(rates, key=lambda rate: -math.inf if rate is None else -rate)


def link_label(rate: float | None) -> str:
    return "unthrottled" if rate is None else f"{rate:g} Mbit/s"


def ppl_at(run: dict[str, Any], seconds: float) -> float:
    """Validation perplexity of the last evaluation at or before ``seconds`` of training (NaN if none yet)."""
    done = [v["val_ppl"] for v in run["vals"] if v["clock"] <= seconds + 1e-9]
    return done[-1] if done else math.nan


def equal_time(runs: list[dict[str, Any]]) -> dict[float | None, tuple[float, dict[str, float]]]:
    """Per link rate: when the fastest of the four strategies finished, and every run's perplexity at that time.

    Runs of the other sweeps on the same link (``sync_every``, outer optimizer) are included.
    """
    table = {}
    for rate in links(runs):
        here = [r for r in runs if r["driver"]["link_mbit"] == rate]
        main = main_comparison(here)
        if not main:
            continue
        horizon = min(r["train_seconds"] for r in main)
        table[rate] = (horizon, {r["name"]: ppl_at(r, horizon) for r in here})
    return table


def run_label(run: dict[str, Any]) -> str:
    """``FL+FSDP H=8 nesterov`` or ``FSDP``."""
    cfg = run["config"]
    label = LABELS[cfg["strategy"]]
    return label + (f" H={cfg['sync_every']} {cfg['outer_optimizer']}" if cfg["strategy"].startswith("fl_") else "")


def _fmt_mb(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / 1e6:.2f}"


def markdown_tables(results: dict[str, Any]) -> str:
    """The tables of ``docs/benchmarks.md``, generated from the results."""
    runs = results["runs"]
    summaries = {r["name"]: summarize(r) for r in runs}
    unthrottled = {s.strategy: s for r in main_comparison(runs) if (s := summaries[r["name"]]).link_mbit is None}
    lines = [
        "| run | link | tokens/s | vs unthrottled run | vs own no-sync steps | link MB / step | MB / sync | "
        "vs bound | sync s | train s | peak RSS | final ppl | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = summaries[run["name"]]
        base = unthrottled.get(s.strategy)
        ratio = f"{s.tokens_per_s / base.tokens_per_s:.2f}" if base else "-"
        own = f"{s.tokens_per_s / s.nosync_tokens_per_s:.2f}" if s.sync_seconds else "-"
        bound = f"{s.sync_ratio:.3f}" if not math.isnan(s.sync_bytes) else "-"
        lines.append(
            f"| {run_label(run)} | {link_label(s.link_mbit)} | {s.tokens_per_s:,.0f} | {ratio} | {own} | "
            f"{_fmt_mb(s.link_bytes_per_step)} | {_fmt_mb(s.sync_bytes)} | {bound} | {s.sync_seconds:.1f} | "
            f"{s.train_seconds:.0f} | {s.peak_rss_mib:.0f} MiB | {s.final_ppl:.1f} | {s.load:.1f} |"
        )
    lines += ["", "| link | at s | run | ppl then | final ppl (s) |", "|---|---|---|---|---|"]
    by_name = {r["name"]: r for r in runs}
    for rate, (horizon, ppl) in equal_time(runs).items():
        for name, value in ppl.items():
            s = summaries[name]
            lines.append(
                f"| {link_label(rate)} | {horizon:.0f} | {run_label(by_name[name])} | {value:.1f} | "
                f"{s.final_ppl:.1f} ({s.train_seconds:.0f}) |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the tables of a benchmark results JSON.")
    parser.add_argument("results", type=Path)
    print(markdown_tables(load(parser.parse_args().results)))


if __name__ == "__main__":
    main()
