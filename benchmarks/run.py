"""The one benchmark command: build an emulated cluster, run the sweep, write JSON results and plots, tear down.

Run as root from the repository root::

    sudo PYTHONPATH=. python -m benchmarks.run --preset full

Presets:

``full``
    4 nodes x 2 ranks (8 ranks). FSDP, HSDP, FL+FSDP (group = node, 4 groups) and FL+HSDP (2 groups of 2 nodes,
    shard inside a node, 2 replicas per group) at every link bandwidth; then ``sync_every`` and the outer
    optimizer (fedavg vs nesterov) for the federated strategies at the slowest link.
``sync_options``
    Issue 8's targets: FL+FSDP (4 nodes x 2 ranks, 4 groups, ``sync_every=8``) on a 50 Mbit/s link, without syncs
    (``sync_every`` > ``max_steps``: the no-sync pace) and with each sync option (reduce dtype, error feedback,
    streaming fragments, overlap), :data:`SYNC_OPTIONS_REPEATS` times, round robin over the configurations within each
    repeat. ``python -m benchmarks.sync_report`` turns the results into the tables of docs/benchmarks.md.
``throughput``
    Issue 9's noise-robust throughput and byte counts: FSDP, HSDP, FL+FSDP (4 groups) and FL+HSDP (2 groups of 2
    nodes) on links of :data:`THROUGHPUT_LINKS`, with the no-sync pace of the federated ones (FL+FSDP sends nothing
    across nodes between syncs, so its no-sync pace is measured once per repeat, unthrottled) and the int8 and
    int4 + error feedback + 4 fragments + ``sync_delay=1`` sync options on the slow links.
    :data:`THROUGHPUT_REPEATS` repeats; within a repeat every configuration runs once (round robin, the order
    reversed every other repeat), so machine load drifts over all of them alike.
``sync_grid``
    Issue 9's sync options side by side: FL+FSDP at 50 Mbit/s (the utilization target's link) with each option of
    :data:`SYNC_GRID_OPTIONS` changed alone from the default (outer traffic in bfloat16, int8, int4 + error
    feedback; 4 fragments with ``sync_delay=1``; ``sync_delay=2``; ``sync_every=32``), plus int8 with
    ``sync_delay=4``, and the unthrottled no-sync run; interleaved like ``throughput`` (~18 minutes).
``defaults``
    The package's default sync (int4 outer traffic with error feedback, since issue 9) against FSDP at 20 Mbit/s,
    with float32 beside it, interleaved like ``throughput`` (~15 minutes): the 8.04x target for what users get.
``quick``
    A ~10 minute check of a change: the ``throughput`` configurations of FSDP and FL+FSDP at 50 Mbit/s, once.
``smoke``
    2 nodes x 1 rank, a tiny model, a few FL+FSDP steps on a throttled link: keeps the harness working (tests).

Every run writes ``<work>/<name>/run.json`` and Lightning's CSV metrics; the driver collects them into
``benchmarks/results/<preset>.json`` (rewritten after every run, so an interrupted sweep keeps what it measured)
and draws the plots. The cluster is removed at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.cluster import EmulatedCluster, namespaces_available
from benchmarks.launch import REPO, RunFailed, launch
from benchmarks.train import RunConfig

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Job:
    """One run of the sweep: a training configuration on a link of a given bandwidth (Mbit/s, None = unthrottled)."""

    name: str
    link_mbit: float | None
    config: RunConfig
    sweep: str = "bandwidth"
    """Which comparison the run belongs to: "bandwidth", "sync_every" or "outer_optimizer"."""


@dataclass(frozen=True)
class Preset:
    """A sweep: the cluster shape and the runs."""

    num_nodes: int
    devices: int
    jobs: list[Job]
    timeout: float


def _full(work: Path, cache: Path) -> Preset:
    nodes, devices = 4, 2
    base = RunConfig(
        strategy="fsdp",
        num_nodes=nodes,
        devices=devices,
        out="",
        cache_dir=str(cache),
        num_groups=2,
        sync_every=8,
        outer_optimizer="nesterov",
        max_steps=64,
        val_every=8,
        size="xs",
        seq_len=128,
        batch_size=4,
        max_val_windows=32,
    )
    jobs = []

    def add(sweep: str, link: float | None, **changes: Any) -> None:
        cfg = replace(base, **changes)
        fed = f"-H{cfg.sync_every}-{cfg.outer_optimizer}" if cfg.federated else ""
        name = f"{cfg.strategy}{fed}-{'unthrottled' if link is None else f'{link:g}mbit'}"
        jobs.append(Job(name, link, replace(cfg, out=str(work / name)), sweep))

    # Bandwidth sweep, slowest link last; within one bandwidth the four strategies run back to back.
    for link in (None, 200.0, 50.0):
        for strategy in ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"):
            add("bandwidth", link, strategy=strategy)
    # sync_every and the outer optimizer, on the slowest link (where syncs cost the most).
    for sync_every in (4, 32):
        add("sync_every", 50.0, strategy="fl_fsdp", sync_every=sync_every)
    for strategy in ("fl_fsdp", "fl_hsdp"):
        add("outer_optimizer", 50.0, strategy=strategy, outer_optimizer="fedavg")
    return Preset(nodes, devices, jobs, timeout=900.0)


#: The configurations of the ``sync_options`` preset: name -> changes to its base RunConfig.
SYNC_OPTIONS: dict[str, dict[str, Any]] = {
    "nosync": {"sync_every": 1024},  # no outer step during training: the no-sync pace
    "float32": {},
    "bfloat16": {"reduce_dtype": "bfloat16"},
    "int8": {"reduce_dtype": "int8"},
    "int4_ef": {"reduce_dtype": "int4", "error_feedback": True},
    "frag4": {"fragments": 4},
    "frag4_d1": {"fragments": 4, "sync_delay": 1},
    "int8_frag4_d1": {"reduce_dtype": "int8", "fragments": 4, "sync_delay": 1},
    "int4_ef_frag4_d1": {"reduce_dtype": "int4", "error_feedback": True, "fragments": 4, "sync_delay": 1},
}
SYNC_OPTIONS_REPEATS = 3
SYNC_OPTIONS_LINK_MBIT = 50.0


def _sync_options(work: Path, cache: Path, repeats: int = SYNC_OPTIONS_REPEATS) -> Preset:
    nodes, devices = 4, 2
    base = RunConfig(
        strategy="fl_fsdp",
        num_nodes=nodes,
        devices=devices,
        out="",
        cache_dir=str(cache),
        sync_every=8,
        outer_optimizer="fedavg",  # the package default
        # 40 steps: the pace is measured over steps 9-40, i.e. four whole rounds of 8 steps after the first sync
        # (see benchmarks/sync_report.py); one validation, at the end.
        max_steps=40,
        val_every=40,
        size="xs",
        seq_len=128,
        batch_size=4,
        max_val_windows=32,
    )
    jobs = []
    for repeat in range(repeats):
        for option, changes in SYNC_OPTIONS.items():
            name = f"{option}-r{repeat}"
            cfg = replace(base, out=str(work / name), **changes)
            jobs.append(Job(name, SYNC_OPTIONS_LINK_MBIT, cfg, sweep="sync_options"))
    return Preset(nodes, devices, jobs, timeout=900.0)


#: Link rates of the ``throughput`` preset (Mbit/s; None: unthrottled).
THROUGHPUT_LINKS: tuple[float | None, ...] = (None, 200.0, 50.0, 20.0)
THROUGHPUT_REPEATS = 3
#: Sync options measured beside the default on the slow links (name -> RunConfig changes).
THROUGHPUT_OPTIONS: dict[str, dict[str, Any]] = {
    "int8": {"reduce_dtype": "int8"},
    "int4ef-f4-d1": {"reduce_dtype": "int4", "error_feedback": True, "fragments": 4, "sync_delay": 1},
}
NOSYNC: dict[str, Any] = {"sync_every": 1024}  # longer than the run: no outer step during training


def _throughput_base(work: Path, cache: Path) -> RunConfig:
    return RunConfig(
        strategy="fsdp",
        num_nodes=4,
        devices=2,
        out="",
        cache_dir=str(cache),
        num_groups=2,
        sync_every=8,
        outer_optimizer="fedavg",
        # 16 steps: the pace window is steps 9-16, one whole round after the first sync (see benchmarks/pace.py).
        max_steps=16,
        val_every=16,
        size="xs",
        seq_len=128,
        batch_size=4,
        max_val_windows=8,
    )


def _throughput_configs(
    base: RunConfig,
    links: tuple[float | None, ...],
    strategies: tuple[str, ...] = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp"),
    options: dict[str, dict[str, Any]] = THROUGHPUT_OPTIONS,
) -> list[tuple[str, float | None, RunConfig]]:
    """One repeat's configurations: ``(name, link, config)``."""
    configs = []
    for link in links:
        label = "unthrottled" if link is None else f"{link:g}mbit"
        for strategy in strategies:
            configs.append((f"{strategy}-{label}", link, replace(base, strategy=strategy)))
        if "fl_hsdp" in strategies:  # FL+HSDP's replicas talk across nodes every step: its no-sync pace needs the link
            configs.append((f"fl_hsdp-nosync-{label}", link, replace(base, strategy="fl_hsdp", **NOSYNC)))
        if "fl_fsdp" in strategies and link is None:
            configs.append((f"fl_fsdp-nosync-{label}", link, replace(base, strategy="fl_fsdp", **NOSYNC)))
        if "fl_fsdp" in strategies and link is not None and link <= 50:
            for option, changes in options.items():
                configs.append((f"fl_fsdp-{option}-{label}", link, replace(base, strategy="fl_fsdp", **changes)))
    return configs


def _round_robin(work: Path, configs: list[tuple[str, float | None, RunConfig]], repeats: int, sweep: str) -> list[Job]:
    jobs = []
    for repeat in range(repeats):
        for name, link, cfg in configs if repeat % 2 == 0 else configs[::-1]:
            run_name = f"{name}-r{repeat}"
            jobs.append(Job(run_name, link, replace(cfg, out=str(work / run_name)), sweep=sweep))
    return jobs


def _throughput(work: Path, cache: Path, repeats: int = THROUGHPUT_REPEATS) -> Preset:
    configs = _throughput_configs(_throughput_base(work, cache), THROUGHPUT_LINKS)
    return Preset(4, 2, _round_robin(work, configs, repeats, "throughput"), timeout=900.0)


#: The ``sync_grid`` preset: FL+FSDP's sync options one at a time around the default (float32, 1 fragment, no delay,
#: ``sync_every=8``), on :data:`SYNC_GRID_LINKS` (name -> RunConfig changes).
SYNC_GRID_OPTIONS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bf16": {"reduce_dtype": "bfloat16"},
    "int8": {"reduce_dtype": "int8"},
    "int4ef": {"reduce_dtype": "int4", "error_feedback": True},
    "f4-d1": {"fragments": 4, "sync_delay": 1},
    "d2": {"sync_delay": 2},
    "int8-d4": {"reduce_dtype": "int8", "sync_delay": 4},
    "H32": {"sync_every": 32, "max_steps": 32, "val_every": 32},  # one whole round, like H=8's 16 steps
}
SYNC_GRID_LINKS: tuple[float, ...] = (50.0,)


def _sync_grid(work: Path, cache: Path, repeats: int = THROUGHPUT_REPEATS) -> Preset:
    base = replace(_throughput_base(work, cache), strategy="fl_fsdp")
    configs: list[tuple[str, float | None, RunConfig]] = [("fl_fsdp-nosync-unthrottled", None, replace(base, **NOSYNC))]
    for link in SYNC_GRID_LINKS:
        for option, changes in SYNC_GRID_OPTIONS.items():
            name = "fl_fsdp" if option == "float32" else f"fl_fsdp-{option}"
            configs.append((f"{name}-{link:g}mbit", link, replace(base, **changes)))
    return Preset(4, 2, _round_robin(work, configs, repeats, "sync_grid"), timeout=900.0)


def _defaults(work: Path, cache: Path, repeats: int = THROUGHPUT_REPEATS) -> Preset:
    base = _throughput_base(work, cache)
    int4ef = {"reduce_dtype": "int4", "error_feedback": True}
    configs: list[tuple[str, float | None, RunConfig]] = [
        ("fsdp-20mbit", 20.0, base),
        ("fl_fsdp-20mbit", 20.0, replace(base, strategy="fl_fsdp")),
        ("fl_fsdp-int4ef-20mbit", 20.0, replace(base, strategy="fl_fsdp", **int4ef)),
    ]
    return Preset(4, 2, _round_robin(work, configs, repeats, "defaults"), timeout=900.0)


def _quick(work: Path, cache: Path, repeats: int = 1) -> Preset:
    configs = _throughput_configs(_throughput_base(work, cache), (50.0,), strategies=("fsdp", "fl_fsdp"), options={})
    return Preset(4, 2, _round_robin(work, configs, repeats, "quick"), timeout=900.0)


def _smoke(work: Path, cache: Path) -> Preset:
    cfg = RunConfig(
        strategy="fl_fsdp",
        num_nodes=2,
        devices=1,
        out=str(work / "fl_fsdp-smoke"),
        cache_dir=str(cache),
        sync_every=2,
        max_steps=4,
        val_every=4,
        seq_len=32,
        batch_size=2,
        vocab_size=256,
        max_train_windows=64,
        max_val_windows=4,
        model_overrides={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
    )
    return Preset(2, 1, [Job("fl_fsdp-smoke", 20.0, cfg)], timeout=120.0)


PRESETS: dict[str, Callable[..., Preset]] = {
    "defaults": _defaults,
    "full": _full,
    "quick": _quick,
    "smoke": _smoke,
    "sync_grid": _sync_grid,
    "sync_options": _sync_options,
    "throughput": _throughput,
}


def prepare_data(cfg: RunConfig, env: dict[str, str]) -> None:
    """Export, tokenize and cache the corpus once, before any node starts (in a child: it imports a lot)."""
    code = (
        "import sys, json; from lightning_fedshard.examples import ShakespeareDataModule as D;"
        "D(cache_dir=sys.argv[1], vocab_size=int(sys.argv[2])).prepare_data()"
    )
    subprocess.run([sys.executable, "-c", code, cfg.cache_dir, str(cfg.vocab_size)], env=env, check=True)


def machine(module: str = "benchmarks.run") -> dict[str, Any]:
    """What produced the numbers (``module``: the command's module, for the record)."""
    import lightning
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
    }
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    # Read-only (no index refresh): which tracked files differ from the commit, and untracked ones.
    status = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True
    )
    git_ok = commit.returncode == 0 and status.returncode == 0  # None below: not a git checkout (e.g. a copy)
    info["git_commit"] = commit.stdout.strip() if git_ok else None
    info["git_status"] = status.stdout.splitlines() if git_ok else None
    info["git_dirty"] = bool(status.stdout.strip()) if git_ok else None
    info["source_sha256"] = source_digest(REPO)
    info["source_root"] = str(REPO)
    return info


def source_digest(root: Path) -> str:
    """SHA-256 over the Python sources of the package and the harness under ``root`` (paths and contents).

    The commit does not say which code ran when the working tree is dirty; this does.
    """
    digest = hashlib.sha256()
    for path in sorted([*root.glob("lightning_fedshard/**/*.py"), *root.glob("benchmarks/*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_preset(
    name: str,
    work: Path,
    results_file: Path,
    only: list[str] | None = None,
    prefix: str | None = None,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Build the cluster, run every job of preset ``name`` and return (and keep writing) the results."""
    if (reason := namespaces_available()) is not None:
        raise SystemExit(f"Cannot emulate a cluster: {reason}.")
    cache = work / "data"
    preset = PRESETS[name](work, cache) if repeats is None else PRESETS[name](work, cache, repeats=repeats)
    jobs = [job for job in preset.jobs if not only or job.name in only]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(work / "hf_home"), "HF_DATASETS_OFFLINE": "1"}
    prepare_data(jobs[0].config, env)
    results: dict[str, Any] = {"preset": name, "machine": machine(), "started": time.time(), "runs": [], "failed": []}
    cluster = EmulatedCluster(preset.num_nodes) if prefix is None else EmulatedCluster(preset.num_nodes, prefix)
    with cluster:
        for index, job in enumerate(jobs):
            cluster.set_bandwidth(job.link_mbit)
            print(f"[{index + 1}/{len(jobs)}] {job.name}", flush=True)
            load = os.getloadavg()[0]
            loadavg_before = list(os.getloadavg())
            try:
                run = launch(cluster, job.config, port=29500 + index, timeout=preset.timeout)
            except RunFailed as error:
                print(f"  FAILED: {error}", flush=True)
                results["failed"].append({"name": job.name, "error": str(error)[-2000:]})
                continue
            run.update(name=job.name, sweep=job.sweep, load_before=load, load_after=os.getloadavg()[0])
            run.update(loadavg_before=loadavg_before, loadavg_after=list(os.getloadavg()), ended=time.time())
            results["runs"].append(run)
            print(f"  {_summary(run)}", flush=True)
            results["finished"] = time.time()
            _write(results_file, results)
    return results


def _summary(run: dict[str, Any]) -> str:
    steps = run["config"]["max_steps"]
    last = run["vals"][-1] if run["vals"] else {"val_ppl": float("nan")}
    return (
        f"{run['tokens_per_step'] * steps / run['train_seconds']:.0f} tok/s, "
        f"{run['link_tx_train'] - run['link_tx_val']:.3g} link bytes, val_ppl {last['val_ppl']:.1f}, "
        f"wall {run['driver']['wall_seconds']:.0f} s"
    )


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description="Emulated-cluster benchmark of FSDP, HSDP, FL+FSDP and FL+HSDP.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/fedshard-bench"),
        help="scratch folder: data cache, per-run logs and CSVs",
    )
    parser.add_argument("--results", type=Path, default=None, help="JSON output (default benchmarks/results/)")
    parser.add_argument("--only", nargs="*", help="run only these job names")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--prefix", help="name prefix of the namespaces (default: fsb<pid>)")
    parser.add_argument("--repeats", type=int, help="repeats of a preset that has them (sync_options, throughput)")
    args = parser.parse_args(argv)
    results_file = args.results or RESULTS / f"{args.preset}.json"
    args.work.mkdir(parents=True, exist_ok=True)
    run_preset(args.preset, args.work, results_file, args.only, args.prefix, args.repeats)
    if not args.no_plots:
        from benchmarks.plot import plot_all

        plot_all(results_file, results_file.parent / args.preset)
    print(f"results: {results_file}")


if __name__ == "__main__":
    main()
