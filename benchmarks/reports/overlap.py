"""Sparse outer traffic, eager updates and FL+HSDP's single cross-group send: their targets and their table.

Inputs: the ``eager`` sweep (paces and link bytes at 5 and 20 Mbit/s), the race's option runs (perplexity after 64
steps at FL+FSDP's tuned learning rate, three seeds, unthrottled: perplexity per step does not depend on the link) and
``hsdp_fed_bytes.json`` (:mod:`benchmarks.hsdp_fed_bytes`).

- **bytes per sync** of a configuration: the link bytes of its sync windows (the recorder's windows around each
  landing, all nodes, the sync's NaN/Inf flags and statistics included) minus the two world barriers inside each
  window, which belong to the measurement; median over the landings in the pace window and over the repeats.
- **perplexity paired by seed**: per seed ``ppl(option) / ppl(reference) - 1``, then the mean over the seeds.
- **at equal wall time**: with one step budget per option, ``A`` is ahead of ``B`` on a link when it reaches a
  perplexity at least as low after the same 64 steps in less time (64 x its median step time on that link).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks import metrics
from benchmarks.reports.instrumentation import barrier_bytes
from benchmarks.reports.sweep import config_key, median_range
from lightning_fedshard.plan.specs import CLUSTERS

#: Sparse traffic per sync against float32 (SparseLoCo / Covenant-72B: about 0.0068x).
SPARSE_BYTES_BOUND = 0.01
SPARSE_PPL_BOUND = 0.02
EAGER_UTILIZATION_BOUND = 0.97
EAGER_PPL_BOUND = 0.01
EAGER_LINKS = (5.0, 20.0)
BYTES_LINK = 20.0
RACE_STEPS = 64
#: The float32 anchors of the split and of the copies agree to this many units in the last place (summation order).
MAX_ULPS = 4
#: Barriers inside one sync window (the second of its opening, the one of its closing).
WINDOW_BARRIERS = 2
TARGET_IDS = (
    "sparse-bytes",
    "sparse-ppl",
    "sparse-ppl-weights",
    "eager-utilization-5mbit",
    "eager-utilization-20mbit",
    "eager-ppl",
    "eager-ppl-local",
    "eager-equal-time",
    "hsdp-fed-bytes",
    "gossip-bytes",
)
#: Gossip with one peer against the ring, bytes per sync (a ring all-reduce sends 2 (G-1)/G of a shard, gossip 1).
GOSSIP_BYTES_BOUND = 0.67

Row = dict[str, Any]


def sync_bytes(run: dict[str, Any]) -> float:
    """Median link bytes of the run's landings in the pace window, the windows' own barriers taken out."""
    window = metrics.pace_window(run)
    mtu = CLUSTERS["emulated-4x2"].tcp_mtu
    assert mtu is not None
    barriers = WINDOW_BARRIERS * barrier_bytes(run["world_size"], run["config"]["devices"], mtu)
    landed = [s["tx_bytes"] - barriers for s in run["syncs"] if s["step"] in window]
    return statistics.median(landed) if landed else math.nan


def bytes_by_config(results: dict[str, Any], link: float) -> dict[str, list[float]]:
    """Bytes per sync of every repeat of every configuration of the sweep on ``link``."""
    found: dict[str, list[float]] = {}
    for run in results["runs"]:
        ident = metrics.identity(run)
        if ident.link_mbit == link:
            found.setdefault(ident.configuration, []).append(sync_bytes(run))
    return found


def race_ppl(race: dict[str, Any] | None, steps: int = RACE_STEPS) -> dict[str, dict[int, float]]:
    """Final perplexity by configuration and seed of the race's runs at ``steps`` (FL+FSDP's tuned rate)."""
    found: dict[str, dict[int, float]] = {}
    if race is None:
        return found
    rates = {
        run["config"]["lr"]
        for run in race["runs"]
        if metrics.identity(run).configuration == "fl_fsdp-sparse" and run["config"]["max_steps"] == steps
    }
    for run in race["runs"]:
        config = run["config"]
        if config["max_steps"] != steps or (rates and config["lr"] not in rates):
            continue
        found.setdefault(metrics.identity(run).configuration, {})[config["seed"]] = metrics.final_ppl(run)
    return found


def paired(ppl: dict[str, dict[int, float]], option: str, reference: str) -> tuple[float, list[float]]:
    """Mean over the shared seeds of ``ppl(option) / ppl(reference) - 1``, and the per-seed values."""
    seeds = sorted(set(ppl.get(option, {})) & set(ppl.get(reference, {})))
    per_seed = [ppl[option][s] / ppl[reference][s] - 1 for s in seeds]
    return (statistics.fmean(per_seed) if per_seed else math.nan), per_seed


def _row(target_id: str, target: str, measured: float, bound: float, met: bool, runs: int, **more: Any) -> Row:
    measured_or_none = None if math.isnan(measured) else measured
    return {"id": target_id, "target": target, "measured": measured_or_none, "bound": bound, "met": met, "runs": runs,
            **more}  # fmt: skip


def targets(eager: dict[str, Any] | None, configs: dict[str, Any], race: dict[str, Any] | None,
            hsdp: dict[str, Any] | None, gossip: dict[str, Any] | None = None) -> list[Row]:  # fmt: skip
    """The rows of the targets table (``configs``: the eager sweep's per-configuration summary)."""
    rows: list[Row] = []
    ppl = race_ppl(race)
    if eager is not None:
        by_config = bytes_by_config(eager, BYTES_LINK)
        sparse, dense = by_config.get("fl_fsdp-sparse", []), by_config.get("fl_fsdp", [])
        ratio = statistics.median(sparse) / statistics.median(dense) if sparse and dense else math.nan
        rows.append(_row(
            "sparse-bytes", "sparse outer traffic per sync on the wire against float32 (20 Mbit/s, all nodes)",
            ratio, SPARSE_BYTES_BOUND, ratio <= SPARSE_BYTES_BOUND, len(sparse) + len(dense),
            sparse_bytes=statistics.median(sparse) if sparse else None,
            float32_bytes=statistics.median(dense) if dense else None,
        ))  # fmt: skip
    mean, per_seed = paired(ppl, "fl_fsdp-sparse", "fl_fsdp")
    rows.append(_row(
        "sparse-ppl", f"sparse outer traffic: perplexity after {RACE_STEPS} steps against float32, paired by seed",
        mean, SPARSE_PPL_BOUND, mean <= SPARSE_PPL_BOUND, 2 * len(per_seed), per_seed=per_seed,
    ))  # fmt: skip
    mean, per_seed = paired(ppl, "fl_fsdp-sparse-weights", "fl_fsdp")
    rows.append(_row(
        "sparse-ppl-weights",
        f"sparse outer traffic with error feedback in the weights: perplexity after {RACE_STEPS} steps against"
        " float32, paired by seed",
        mean, SPARSE_PPL_BOUND, mean <= SPARSE_PPL_BOUND, 2 * len(per_seed), per_seed=per_seed,
    ))  # fmt: skip
    for link in EAGER_LINKS:
        s = configs.get(config_key("fl_fsdp-sparse-eager", link))
        value = s["pace_ratio"]["median"] if s else math.nan
        runs = s["pace_ratio"]["n"] if s else 0
        rows.append(_row(
            f"eager-utilization-{link:g}mbit",
            f"pace of eager updates with sparse traffic at {link:g} Mbit/s, sync_every=8: tokens/s against the same"
            " repeat's no-sync pace (judged by it; the in-run effective utilization beside)",
            value, EAGER_UTILIZATION_BOUND, value >= EAGER_UTILIZATION_BOUND, runs,
            spread=s["pace_ratio"] if s else None,
            in_run=s["effective_utilization"] if s else None,
        ))  # fmt: skip
    for suffix, option in (("", "fl_fsdp-sparse-eager"), ("-local", "fl_fsdp-sparse-eager-local")):
        mean, per_seed = paired(ppl, option, "fl_fsdp-sparse")
        rule = "the paper's rule" if not suffix else "the local rule"
        rows.append(_row(
            f"eager-ppl{suffix}",
            f"eager updates ({rule}) with sparse traffic: perplexity after {RACE_STEPS} steps against the same codec"
            " without overlap, paired by seed",
            mean, EAGER_PPL_BOUND, mean <= EAGER_PPL_BOUND, 2 * len(per_seed), per_seed=per_seed,
        ))  # fmt: skip
    rows.append(equal_time_row(configs, ppl))
    rows.append(hsdp_row(hsdp))
    rows.append(gossip_row(gossip))
    return rows


def gossip_row(gossip: dict[str, Any] | None) -> Row:
    """``Gossip(peers=1)``'s link bytes per sync against the default ring's, 4 groups (``benchmarks.gossip_bytes``)."""
    target = "Gossip(peers=1) link bytes per sync against the ring all-reduce, 4 groups x 2 shards, float32"
    if gossip is None:
        return _row("gossip-bytes", target, math.nan, GOSSIP_BYTES_BOUND, False, 0)
    ratio = gossip["summary"]["ratio"]
    runs = 2 * len({r["repeat"] for r in gossip["rows"]})
    return _row("gossip-bytes", target, ratio, GOSSIP_BYTES_BOUND, ratio <= GOSSIP_BYTES_BOUND, runs)


def equal_time_row(configs: dict[str, Any], ppl: dict[str, dict[int, float]]) -> Row:
    """Whether the best eager + sparse option is ahead of the int4 default at equal wall time on both links."""
    verdicts, details = [], {}
    for link in EAGER_LINKS:
        default = configs.get(config_key("fl_fsdp-int4ef", link))
        best = None
        for option in ("fl_fsdp-sparse-eager", "fl_fsdp-sparse-eager-local"):
            s = configs.get(config_key("fl_fsdp-sparse-eager", link))  # both rules send and wait alike
            if s is None or default is None or option not in ppl or "fl_fsdp-int4ef" not in ppl:
                continue
            faster = s["step_time"]["median"] <= default["step_time"]["median"]
            gap, _ = paired(ppl, option, "fl_fsdp-int4ef")
            ahead = faster and gap <= 0
            if best is None or gap < best[1]:
                best = (option, gap, faster, ahead, s["step_time"]["median"] / default["step_time"]["median"])
        if best is not None:
            option, gap, faster, ahead, time_ratio = best
            details[f"{link:g}mbit"] = {"option": option, "ppl_gap": gap, "time_ratio": time_ratio, "ahead": ahead}
            verdicts.append(ahead)
    met = bool(verdicts) and all(verdicts)
    return _row(
        "eager-equal-time",
        "eager updates with sparse traffic ahead of the int4 default at equal wall time, 5 and 20 Mbit/s",
        float(sum(verdicts)), float(len(EAGER_LINKS)), met, len(verdicts), links=details,
    )  # fmt: skip


def hsdp_row(hsdp: dict[str, Any] | None) -> Row:
    """FL+HSDP's cross-group bytes per sync, each replica summing 1/R of its shard against every replica all of it."""
    if hsdp is None:
        return _row("hsdp-fed-bytes", "FL+HSDP cross-group bytes per sync reduced by R", math.nan, 2.0, False, 0)
    summary, replicas = hsdp["summary"], hsdp["devices"]
    float32 = summary["float32"]
    ulps = float32.get("max_ulps", 0.0 if float32["same_anchor_every_rank"] else math.inf)
    met = float32["reduction"] >= replicas * (1 - 0.03) and ulps <= MAX_ULPS
    return _row(
        "hsdp-fed-bytes",
        f"FL+HSDP cross-group link bytes per sync reduced by R = {replicas} (float32, the same anchor up to float32"
        f" rounding: at most {MAX_ULPS} units in the last place)",
        float32["reduction"], float(replicas), met, 2 * len({r["repeat"] for r in hsdp["rows"]}),
        int4_reduction=summary["int4"]["reduction"], same_anchor_bitwise=float32["same_anchor_every_rank"],
        max_ulps=ulps,
    )  # fmt: skip


def table(configs: dict[str, Any], eager: dict[str, Any] | None, race: dict[str, Any] | None) -> str:
    """Per option and link: pace, both utilizations, bytes per sync; and the perplexity after 64 steps by seed."""
    ppl = race_ppl(race)
    sync = {link: bytes_by_config(eager, link) for link in EAGER_LINKS} if eager else {}
    lines = [
        "| configuration | link | tokens/s median (min-max) | pace / no-sync pace | in-run utilization |"
        " effective utilization | MB per sync | ppl after 64 steps (seeds 0, 1, 2) | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in sorted(configs.items(), key=lambda kv: (metrics.link_order(kv[1]["link"]), kv[1]["kind"])):
        per_sync = sync.get(s["link"], {}).get(s["kind"], [])
        mb = f"{statistics.median(per_sync) / 1e6:.3f}" if per_sync and not math.isnan(per_sync[0]) else "-"
        seeds = ppl.get(s["kind"], {})
        scores = ", ".join(f"{seeds[k]:.1f}" for k in sorted(seeds)) or "-"
        lines.append(
            f"| {s['kind']} | {metrics.link_label(s['link'])} | {median_range(s['tokens_per_s'])} |"
            f" {median_range(s['pace_ratio'], '{:.2f}')} | {median_range(s['inrun_utilization'], '{:.3f}')} |"
            f" {median_range(s['effective_utilization'], '{:.3f}')} | {mb} | {scores} | {s['tokens_per_s']['n']} |"
        )
    return "\n".join(lines)


def cpu_table(configs: dict[str, Any]) -> str:
    """Where each configuration's CPU goes, per rank: training threads per step, the background sum per landing,
    every other thread per step (gloo's, torch's pools), beside its pace against the no-sync pace."""
    lines = [
        "| configuration | link | pace / no-sync pace | training thread CPU s/step | background sum CPU s/sync |"
        " other threads CPU s/step | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, s in sorted(configs.items(), key=lambda kv: (metrics.link_order(kv[1]["link"]), kv[1]["kind"])):
        if not s["training_cpu_per_step"]["n"]:
            continue
        lines.append(
            f"| {s['kind']} | {metrics.link_label(s['link'])} | {median_range(s['pace_ratio'], '{:.2f}')} |"
            f" {median_range(s['training_cpu_per_step'], '{:.3f}')} |"
            f" {median_range(s['background_cpu_per_sync'], '{:.3f}')} |"
            f" {median_range(s['other_cpu_per_step'], '{:.3f}')} | {s['training_cpu_per_step']['n']} |"
        )
    return "\n".join(lines)


def horizon_table(horizon: dict[str, Any], steps: int = 256) -> str:
    """Perplexity after ``steps`` by option and seed (``benchmarks.horizon``), and each option's paired gap."""
    ppl = race_ppl(horizon, steps)
    references = {
        "fl_fsdp-int4ef": "fl_fsdp",
        "fl_fsdp-sparse": "fl_fsdp",
        "fl_fsdp-int4ef-eager-local": "fl_fsdp-int4ef",
        "fl_fsdp-sparse-eager-local": "fl_fsdp-sparse",
        "fl_fsdp-sparse-weights": "fl_fsdp",
    }
    lines = [f"| configuration | ppl after {steps} steps, by seed | against | paired gap |", "|---|---|---|---|"]
    for option in sorted(ppl):
        scores = ", ".join(f"{ppl[option][k]:.1f}" for k in sorted(ppl[option]))
        reference = references.get(option)
        gap = "-"
        if reference is not None:
            mean, per_seed = paired(ppl, option, reference)
            gap = f"{mean:+.1%} ({', '.join(f'{g:+.1%}' for g in per_seed)})" if per_seed else "-"
        lines.append(f"| {option} | {scores} | {reference or '-'} | {gap} |")
    return "\n".join(lines)


def load_bytes_record(path: Path) -> dict[str, Any] | None:
    """A bytes benchmark's results (FL+HSDP's, gossip's), if it was run."""
    return json.loads(path.read_text()) if path.exists() else None
