"""One replica group killed mid-run: torchft's own DiLoCo against this package's elastic federation.

    PYTHONPATH=. .venv/bin/python -m benchmarks.torchft_kill         # as root; about 15 minutes on 2 cores
    PYTHONPATH=. .venv/bin/python -m benchmarks.report --write-docs  # the table and the target

The emulated cluster of the ``torchft`` preset: 4 nodes of one rank, one replica group (federation group) per node,
the example Llama on Shakespeare, 8 x 128 tokens per group and step, a sync every 8 steps, float32 outer traffic and
the outer Nesterov step (0.7, 0.9) on both sides, every node's link at :data:`LINK_MBIT`. Both sides use one
lighthouse configuration, the elastic demo's (:func:`benchmarks.elastic.lighthouse_argv`: at least one group, a
heartbeat timeout of 2 s, a join timeout of 60 s), in the switch outside every node's link. Group 1 is killed
(SIGKILL, its whole job) after step :data:`KILL_AT`, inside a round: the survivors learn of it at the next sync.

- ``torchft``: :mod:`benchmarks.harness.torchft_train`, torchft's ``DiLoCo`` in a plain loop; the victim kills itself
  right after the step, every node writes its events.
- ``fedshard``: the elastic demo (:class:`lightning_fedshard.examples.elastic.ElasticDemo`) with the same federation;
  the driver kills the victim's job once a group has reported the step.

Recorded per run, from each side's events and by one rule:

- ``stall_seconds``: what the kill cost the survivors in blocked time. For each survivor, the syncs after the kill up
  to its first committed one, each less the survivor's median sync before the kill, summed; the largest over the
  survivors.
- ``committed_tokens_per_s``: tokens in committed syncs (the groups that contributed x the round's steps x 1024),
  over the time from the first group's start of training to the last group's end. A sync that fails loses its round.
- ``lost_syncs`` and the participants of each sync.

Results go to ``benchmarks/results/torchft_kill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.elastic import demo_run, lighthouse_argv
from benchmarks.harness.cluster import EmulatedCluster, namespaces_available
from benchmarks.harness.config import TORCHFT, RunConfig
from benchmarks.harness.launch import TORCHFT_SCRIPT, kill_session, node_env, start_node
from benchmarks.harness.machine import machine
from benchmarks.harness.sweep import RESULTS
from benchmarks.harness.torchft_train import EVENTS_ENV, KILL_AT_ENV, MIN_GROUPS_ENV
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.examples.elastic import BATCH, SEQ_LEN, DemoConfig, Fault

NODES, VICTIM, KILL_AT, STEPS, SYNC_EVERY, LINK_MBIT = 4, 1, 28, 64, 8, 50.0
TOKENS_PER_GROUP_STEP = BATCH * SEQ_LEN
#: Both sides' federation: the demo's, with torchft's settings (float32 traffic, outer Nesterov 0.7 / 0.9).
DEMO = DemoConfig(
    groups=NODES, ranks_per_group=1, max_steps=STEPS, sync_every=SYNC_EVERY, reduce_dtype="float32",
    outer_optimizer="nesterov", faults=[Fault("kill", VICTIM, KILL_AT)],
)  # fmt: skip
SIDES = ("torchft", "fedshard")


def torchft_config(out: Path, cache_dir: str) -> RunConfig:
    """The torchft side as a harness run: the demo's model, data and schedule."""
    return RunConfig(
        strategy=TORCHFT, num_nodes=NODES, devices=1, out=str(out), cache_dir=cache_dir, max_steps=STEPS,
        val_every=10 * STEPS, batch_size=BATCH, seq_len=SEQ_LEN, lr=DEMO.lr, size=DEMO.size,
        federation=FederationConfig(sync_every=SYNC_EVERY, outer_optimizer="nesterov", reduce_dtype="float32"),
    )  # fmt: skip


def torchft_run(cluster: EmulatedCluster, out: Path, cache_dir: str, timeout: float = 900.0) -> dict[str, Any]:
    """torchft's DiLoCo on the cluster with group :data:`VICTIM` killing itself after :data:`KILL_AT`."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = torchft_config(out, cache_dir)
    argv = [sys.executable, str(TORCHFT_SCRIPT), "--config", cfg.to_json()]
    lighthouse = subprocess.Popen(
        cluster.service_command(lighthouse_argv(DEMO)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"}, start_new_session=True,
    )  # fmt: skip
    time.sleep(1.0)
    nodes = []
    started = time.time()
    try:
        for node in range(NODES):
            env = {**node_env(cluster, node, 29400, out, torchft=True), EVENTS_ENV: str(out / f"group{node}"),
                   MIN_GROUPS_ENV: str(DEMO.min_groups)}  # fmt: skip
            if node == VICTIM:
                env[KILL_AT_ENV] = str(KILL_AT)
            nodes.append(start_node(cluster, node, argv, env, out))
        deadline = time.monotonic() + timeout
        for node, (proc, _) in enumerate(nodes):
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if node != VICTIM and code != 0:
                tail = (out / f"node{node}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"torchft node {node} exited with {code}:\n{tail}")
    finally:
        for proc, log in nodes:
            kill_session(proc)
            log.close()
        kill_session(lighthouse)
    events = {node: _events(out / f"group{node}" / "events.jsonl") for node in range(NODES)}
    killed = next(e["t"] for e in events[VICTIM] if e["event"] == "killed")
    syncs = [
        {"step": e["step"], "participants": e["participants"], "lost": not e["committed"]}
        for e in events[0] if e["event"] == "sync"
    ]  # fmt: skip
    return _measures(
        {g: [{**e, "lost": not e["committed"]} for e in evs if e["event"] == "sync"] for g, evs in events.items()},
        syncs, _span(events), killed, time.time() - started,
    )  # fmt: skip


def fedshard_run(cluster: EmulatedCluster, out: Path) -> dict[str, Any]:
    """The elastic demo with :data:`DEMO`'s federation and kill; the same measures from its events."""
    report = demo_run(cluster, out, DEMO)
    events: dict[int, list[dict[str, Any]]] = {g: [] for g in range(NODES)}
    for folder in sorted(out.glob("group*.*")):
        events[int(folder.name[len("group") :].split(".")[0])] += _events(folder / "events.jsonl")
    killed = report["faults"][0]["t"]
    syncs = [{"step": s["step"], "participants": len(s["members"]) - len(s["joined"]), "lost": s["lost"]}
             for s in report["syncs"]]  # fmt: skip
    result = _measures(
        {g: [e for e in evs if e["event"] == "sync"] for g, evs in events.items()}, syncs, _span(events), killed,
        report["wall_seconds"],
    )  # fmt: skip
    result["killed_at_step"] = report["faults"][0]["step"]
    result["demo_committed_tokens_per_s"] = report["committed_tokens_per_s"]
    return result


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _span(events: dict[int, list[dict[str, Any]]]) -> float:
    """Seconds from the first group's start of training to the last group's end."""
    starts = [e["t"] for evs in events.values() for e in evs if e["event"] == "trained"]
    ends = [e["t"] for evs in events.values() for e in evs if e["event"] == "end"]
    return max(ends) - min(starts)


def survivors_stall(syncs_by_group: dict[int, list[dict[str, Any]]], victim: int, killed: float) -> float | None:
    """The largest survivor's blocked time from the kill to its first committed sync, over its usual sync time."""
    stalls = []
    for group, syncs in syncs_by_group.items():
        if group == victim:
            continue
        syncs = [s for s in syncs if s["step"] > 0]
        before = [s["seconds"] for s in syncs if s["t"] < killed]
        after = [s for s in syncs if s["t"] >= killed]
        if not before or not after:
            continue
        usual, stall = statistics.median(before), 0.0
        for sync in after:
            stall += sync["seconds"] - usual
            if not sync["lost"]:
                break
        stalls.append(max(0.0, stall))
    return max(stalls) if stalls else None


def _measures(
    syncs_by_group: dict[int, list[dict[str, Any]]],
    syncs: list[dict[str, Any]],
    span: float,
    killed: float,
    wall: float,
) -> dict[str, Any]:
    previous, committed = 0, 0
    for sync in syncs:
        if not sync["lost"]:
            committed += sync["participants"] * (sync["step"] - previous) * TOKENS_PER_GROUP_STEP
        previous = sync["step"]
    return {
        "stall_seconds": survivors_stall(syncs_by_group, VICTIM, killed),
        "committed_tokens": committed,
        "committed_tokens_per_s": committed / span,
        "training_seconds": span,
        "wall_seconds": wall,
        "lost_syncs": sum(s["lost"] for s in syncs),
        "syncs": syncs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "torchft_kill.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-torchft-kill"))
    args = parser.parse_args(argv)
    if (reason := namespaces_available()) is not None:
        sys.exit(f"benchmarks.torchft_kill: {reason}")
    from lightning_fedshard.examples import ShakespeareDataModule

    data = ShakespeareDataModule(seq_len=SEQ_LEN, batch_size=BATCH, vocab_size=4096)
    data.prepare_data()  # once, before four nodes would tokenize at the same time
    runs: list[dict[str, Any]] = []
    record = {"preset": "torchft_kill", "machine": machine("benchmarks.torchft_kill"), "link_mbit": LINK_MBIT,
              "nodes": NODES, "victim": VICTIM, "kill_at": KILL_AT, "steps": STEPS, "sync_every": SYNC_EVERY,
              "demo": {**asdict(DEMO), "faults": [asdict(f) for f in DEMO.faults]}, "runs": runs}  # fmt: skip
    with EmulatedCluster(NODES) as cluster:
        cluster.set_bandwidth(LINK_MBIT)
        for repeat in range(args.repeats):
            for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                work = args.work / f"{side}.{repeat}"
                started = time.time()
                if side == "torchft":
                    result = torchft_run(cluster, work, str(data.cache_dir))
                else:
                    result = fedshard_run(cluster, work)
                runs.append({"side": side, "repeat": repeat, "started": started, "result": result})
                print(f"{side} #{repeat}: stall {result['stall_seconds']}, "
                      f"{result['committed_tokens_per_s']:.0f} committed tokens/s, {time.time() - started:.0f} s",
                      flush=True)  # fmt: skip
                args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
