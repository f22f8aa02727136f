"""Elastic federations on the emulated cluster: goodput through faults, the survivors' stall, and the time to N steps
with a killed group against stopping and restarting the whole federation from a checkpoint.

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic            # about an hour on 2 cores
    PYTHONPATH=. .venv/bin/python -m benchmarks.report --write-docs    # targets, table and plot

4 emulated nodes x 2 ranks, 50 Mbit/s per node link; every node is one federation group (FL+FSDP over its 2 ranks,
int4 outer traffic, a sync every 8 steps, the example Llama on Shakespeare). The lighthouse runs in the switch, outside
every node's link. Each repeat runs, interleaved:

- ``faultfree``: the elastic federation without faults;
- ``faulted``: the same with 12 faults - 3 kills (SIGKILL), 3 hangs (SIGSTOP) and 6 restarts (a new job for a dead
  or hung group, which joins and heals) - at the steps of :data:`FAULTS`;
- ``standby``: the same faults with standby groups: ``--standbys`` standby jobs start with the groups (on nodes of
  their own), each takes the place of a group that is gone at the next sync, and every restart starts a new standby on
  a node no running job holds instead of a new job for that group;
- ``elastic_restart``: one group killed at step ``K`` and started again at once; the time until the federation
  reaches ``N`` steps;
- ``checkpoint_restart``: the same federation in one job (the single-job mode), a checkpoint every ``C`` steps; one
  node killed at step ``K`` and the job ended at once (as `srun --kill-on-bad-exit=1` does), then started again from
  its last checkpoint (an exact resume); the time until it reaches ``N`` steps, the restart included;
- ``twolost``: two groups killed within one round (:data:`TWO_LOST`), with ``--standbys`` standby jobs: the others
  commit the next sync without them and the standbys take both places;
- ``hanginsum``: three groups in turn stopped (SIGSTOP) inside the sum of a sync and later restarted (:data:`HANGS`);
  the survivors give the sum up once the lighthouse counts the hung group as gone (``Elastic(peer_check=1.0)``, the
  default); ``hanginsum_wait``: the same with ``peer_check=0``, the survivors waiting for the elastic ``timeout``;
- ``healsource``: groups killed and replaced (:data:`HEAL_SOURCE`), every other replacement (``healkill``) healing
  from a group that is killed while it sends the state; the plain replacements (``restart``) of the same run are the
  baseline of the joiners' extra seconds;
- ``mixed``: with ``--standbys`` standby jobs, 13 faults of every kind (:data:`MIXED`): kills, hangs inside a sum,
  a heal whose source is killed in transit, two groups killed at once, a lighthouse restart, and restarts (each a new
  standby); its goodput is measured against the fault-free run of the same repeat;
- ``strangers``: the fault-free federation with a secret (a new one each run, given to the jobs in their environment,
  never written), and three strangers on the same machine (:data:`STRANGERS`): a plain HTTP fetch of the state from
  a group's heal server, a job for a group without the secret and one with another secret.

Results go to ``benchmarks/results/elastic.json``. The standby runs and their fault-free baseline, each node capped at
0.4 core so that a job starting on one node does not slow the groups training on the others (the runs in
``benchmarks/results/elastic_standby.json``)::

    PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds faultfree,standby --node-cores 0.4 \
        --out benchmarks/results/elastic_standby.json

Two groups lost within one round, and the fault-free baseline (``benchmarks/results/elastic_twolost.json``)::

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds faultfree,twolost --steps 64 --node-cores 0.33 \
        --out benchmarks/results/elastic_twolost.json

A group hung inside a sum, given up on at the heartbeat and waited for (``benchmarks/results/elastic_hang.json``)::

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds hanginsum,hanginsum_wait --steps 96 \
        --out benchmarks/results/elastic_hang.json

Heals whose source is killed in transit (``benchmarks/results/elastic_healsource.json``; each node capped, as for
the standby runs, so that a replacement's start-up does not slow the others' rounds)::

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds healsource --node-cores 0.33 \
        --out benchmarks/results/elastic_healsource.json

Every kind of fault in one run, with standbys, and the fault-free baseline (``benchmarks/results/elastic_mixed.json``)::

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds faultfree,mixed --node-cores 0.33 \
        --out benchmarks/results/elastic_mixed.json

The strangers and their fault-free baseline (``benchmarks/results/elastic_strangers.json``)::

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.elastic --kinds faultfree,strangers --steps 96 \
        --out benchmarks/results/elastic_strangers.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster import NODE_IFACE, EmulatedCluster, namespaces_available
from benchmarks.harness.cpu import CpuQuotas, quotas_available
from benchmarks.harness.faults import FaultyDemo, parse_faults
from benchmarks.harness.invocations import record_invocation
from benchmarks.harness.machine import machine
from benchmarks.harness.sweep import RESULTS
from lightning_fedshard.examples.elastic import DemoConfig, Fault

ROOT = Path(__file__).parents[1]
#: Every invocation of this benchmark, whatever became of its runs (one JSON line each).
INVOCATIONS = RESULTS / "elastic_invocations.jsonl"
NODES, RANKS, LINK_MBIT = 4, 2, 50.0
#: The faulted run's faults: a kill, a hang and a restart of every group but group 0, twice for one of them.
FAULTS = (
    "kill:1@16,restart:1@24,stop:2@40,restart:2@52,kill:3@64,restart:3@72,"
    "stop:1@88,restart:1@100,kill:2@112,restart:2@120,stop:3@132,restart:3@144"
)
FAULTED_STEPS = 160
#: The restart comparison: N steps, a group (node) killed at step K, a checkpoint every C steps in one job.
RESTART_STEPS, KILL_AT, CHECKPOINT_EVERY = 96, 50, 24
#: The strangers of a ``strangers`` run: a plain fetch from group 0's heal server, then a job for group 1 without the
#: secret and one for group 2 with another secret; early enough in a 96-step run that each reaches a quorum (a job
#: takes 10-20 s to load here) before the federation ends.
STRANGERS = "fetch:0@8,nosecret:1@8,badsecret:2@12"
#: Two groups killed within one round of 8 steps (after the sync at step 16, before the one at step 24).
TWO_LOST = "kill:1@17,kill:2@19"
#: Three groups hung in turn inside the sum of a sync, each restarted two syncs later.
HANGS = "hang:1@16,restart:1@24,hang:2@40,restart:2@48,hang:3@64,restart:3@72"
#: Every kind of fault, with standbys: a kill, a hang inside a sum, a kill whose replacement's heal source dies in
#: transit, a lighthouse restart, two groups killed at once, another hang (group 0's first job: a standby that took a
#: place has no hang scheduled); each followed by a restart (a new standby).
MIXED = (
    "kill:1@12,restart:1@20,hang:2@32,restart:2@40,kill:3@52,healkill:3@53,lighthouse:0@72,"
    "kill:1@88,kill:2@89,restart:1@96,restart:2@97,hang:0@112,restart:0@120"
)
#: Groups killed and replaced (a new job takes about 40 steps to start and join), the first and the last replacement
#: healing from a source killed in transit.
HEAL_SOURCE = "kill:1@8,healkill:1@9,kill:2@56,restart:2@57,kill:3@104,healkill:3@105"
LIGHTHOUSE_PORT = 29510
#: The runs of one repeat, interleaved in this order.
KINDS = (
    "faultfree", "faulted", "standby", "elastic_restart", "checkpoint_restart", "strangers", "twolost", "hanginsum",
    "hanginsum_wait", "healsource", "mixed",
)  # fmt: skip


def _env(cluster: EmulatedCluster, env: dict[str, str]) -> dict[str, str]:
    """What a node's job needs of the driver's environment, with the node's own interface for gloo."""
    keep = ("MASTER_ADDR", "MASTER_PORT", "FEDSHARD_GROUP", "FEDSHARD_SECRET", "RUST_LOG", "OMP_NUM_THREADS",
            "PYTHONUNBUFFERED", "HOME")  # fmt: skip
    return {
        **{k: env[k] for k in keep if k in env},
        "PYTHONPATH": str(ROOT),
        "GLOO_SOCKET_IFNAME": NODE_IFACE,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }


def elastic_run(
    cluster: EmulatedCluster,
    out: Path,
    steps: int,
    faults: list[Fault],
    standbys: int = 0,
    quotas: CpuQuotas | None = None,
    secret: str | None = None,
    peer_check: float = 1.0,
) -> dict[str, Any]:
    """The elastic federation on the cluster, one group per node, with ``faults`` and ``standbys``: the report."""
    return demo_run(cluster, out, DemoConfig(groups=NODES, ranks_per_group=RANKS, max_steps=steps, faults=faults,
                                             timeout=15.0, standbys=standbys, peer_check=peer_check),
                    quotas, secret)  # fmt: skip


def lighthouse_argv(config: DemoConfig) -> list[str]:
    """torchft's lighthouse as the demo configures it, listening on :data:`LIGHTHOUSE_PORT`."""
    return [
        str(Path(sys.executable).parent / "torchft_lighthouse"),
        "--bind", f"[::]:{LIGHTHOUSE_PORT}",
        "--min_replicas", str(config.min_groups),
        "--join_timeout_ms", str(int(config.join * 1000)),
        "--heartbeat_timeout_ms", str(int(config.heartbeat * 1000)),
        "--quorum_tick_ms", "100",
    ]  # fmt: skip


def demo_run(
    cluster: EmulatedCluster,
    out: Path,
    config: DemoConfig,
    quotas: CpuQuotas | None = None,
    secret: str | None = None,
) -> dict[str, Any]:
    """The elastic demo's federation ``config`` on the cluster, one group per node, its lighthouse in the switch.

    With ``quotas`` every node's jobs run inside its CPU quota, so that a job starting on one node does not take CPU
    time from the groups training on the others (on this machine every emulated node shares its cores).
    """

    def launch(node: int, argv: list[str], env: dict[str, str]) -> list[str]:
        command = cluster.command(node, argv, _env(cluster, env))
        return command if quotas is None else quotas.wrap(node, command)

    def start_lighthouse() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            cluster.service_command(lighthouse_argv(config)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": "warn"},
        )

    lighthouse = [start_lighthouse()]

    def restart_lighthouse(down: float) -> None:
        lighthouse[0].kill()
        lighthouse[0].wait()
        time.sleep(down)
        lighthouse[0] = start_lighthouse()

    try:
        time.sleep(1.0)
        demo = FaultyDemo(
            config,
            out,
            launch=launch,
            lighthouse=f"http://{cluster.service_address}:{LIGHTHOUSE_PORT}",
            node_address=cluster.address,
            secret=secret,
            restart_lighthouse=restart_lighthouse,
        )
        return demo.run(timeout=3600)
    finally:
        lighthouse[0].kill()
        lighthouse[0].wait()


def checkpoint_restart_run(cluster: EmulatedCluster, out: Path, steps: int, kill_at: int, every: int) -> dict[str, Any]:
    """The single-job federation: killed at ``kill_at``, started again from its last checkpoint, run to ``steps``."""
    start = time.time()
    spec = {"out": str(out), "steps": steps, "checkpoint_every": every, "resume": None}
    first = _single_job(cluster, out, spec, kill_at=kill_at)
    resumed_from = max((out / "ckpts").glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    second = _single_job(cluster, out, {**spec, "resume": str(resumed_from)}, kill_at=None)
    return {
        "wall_seconds": time.time() - start,
        "killed_at": first["killed_at"],
        "resumed_from": resumed_from.name,
        "second_run_seconds": second["seconds"],
    }


def _single_job(cluster: EmulatedCluster, out: Path, spec: dict[str, Any], kill_at: int | None) -> dict[str, Any]:
    """Launch the single-job federation on every node; with ``kill_at``, kill node 1 there and wait for the rest."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    events.unlink(missing_ok=True)
    resume = spec["resume"]
    port = 29600 + int(time.time()) % 300
    procs = []
    started = time.time()
    for node in range(NODES):
        env = _env(cluster, {"MASTER_ADDR": cluster.address(0), "MASTER_PORT": str(port), **os.environ})
        env.update({"NODE_RANK": str(node), "OMP_NUM_THREADS": "1"})
        argv = [sys.executable, "-m", "benchmarks.elastic", "job", json.dumps(spec)]
        log = open(out / f"node{node}.{'resumed' if resume else 'first'}.log", "wb")
        procs.append(subprocess.Popen(cluster.command(node, argv, env), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=ROOT))  # fmt: skip
        log.close()
    result: dict[str, Any] = {"killed_at": None}
    try:
        if kill_at is not None:
            while _last_step(events) < kill_at:
                time.sleep(0.1)
            # A node dies and the scheduler ends the job at once (`srun --kill-on-bad-exit=1`, torchrun's agent): the
            # most favourable case for the single job, whose other groups would otherwise wait in their next sync
            # until the process group's timeout (30 minutes by default).
            os.killpg(procs[1].pid, signal.SIGKILL)
            result["killed_at"] = _last_step(events)
            for proc in procs:
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            for proc in procs:
                proc.wait(timeout=3600)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    result["seconds"] = time.time() - started
    return result


def _last_step(events: Path) -> int:
    if not events.exists():
        return -1
    steps = [json.loads(line)["step"] for line in events.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=-1)


def run_single_job(spec: dict[str, Any]) -> None:
    """One node's launcher of the single-job federation (Lightning starts the node's other rank)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_fedshard
    from lightning_fedshard.examples.elastic import EventLog, training
    from lightning_fedshard.examples.llama import LlamaLM

    config = DemoConfig()
    out = Path(spec["out"])
    model, data = training({"size": config.size, "lr": config.lr})
    strategy = lightning_fedshard.FLFSDPStrategy(
        num_groups=NODES, sync_every=config.sync_every, reduce_dtype=config.reduce_dtype,
        auto_wrap_policy=LlamaLM.wrap_policy(), state_dict_type="sharded",
    )  # fmt: skip
    callbacks: list[Any] = [
        ModelCheckpoint(
            dirpath=out / "ckpts", filename="{step}", every_n_train_steps=spec["checkpoint_every"], save_top_k=-1
        ),
    ]
    if os.environ.get("NODE_RANK") == "0":
        callbacks.append(EventLog(out))
    trainer = L.Trainer(
        accelerator="cpu", devices=RANKS, num_nodes=NODES, strategy=strategy, max_steps=spec["steps"],
        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        logger=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=spec["resume"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=FAULTED_STEPS, help="steps of the fault-free and faulted runs")
    parser.add_argument("--faults", default=FAULTS)
    parser.add_argument("--restart-steps", type=int, default=RESTART_STEPS)
    parser.add_argument("--kill-at", type=int, default=KILL_AT)
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY)
    parser.add_argument("--standbys", type=int, default=2, help="standby jobs at the start of a `standby` run")
    parser.add_argument(
        "--node-cores", type=float, default=None,
        help="CPU cores each emulated node may use (a cgroup quota per node); default: none, all nodes share the cores",
    )  # fmt: skip
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"runs of each repeat, of {','.join(KINDS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "elastic.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedshard-elastic-bench"))
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := sorted(set(kinds) - set(KINDS)):
        parser.error(f"--kinds: unknown runs {unknown}; known: {list(KINDS)}")
    if args.out.exists():
        parser.error(f"--out {args.out} exists: every invocation is kept, give this one a file of its own")
    if (reason := namespaces_available()) is not None:
        sys.exit(f"benchmarks.elastic: {reason}")
    if args.node_cores is not None and (reason := quotas_available()) is not None:
        sys.exit(f"benchmarks.elastic: --node-cores: {reason}")
    runs_planned = [f"{kind}.{repeat}" for repeat in range(args.repeats) for kind in kinds]
    record_invocation(INVOCATIONS, "benchmarks.elastic", argv if argv is not None else sys.argv[1:], runs_planned)
    _prepare_data()
    faults = parse_faults(args.faults, NODES)
    restart = parse_faults(f"kill:1@{args.kill_at},restart:1@{args.kill_at + 1}", NODES)
    runs: list[dict[str, Any]] = []
    record = {"preset": "elastic", "machine": machine("benchmarks.elastic"), "link_mbit": LINK_MBIT,
              "nodes": NODES, "ranks_per_node": RANKS, "faults": args.faults, "faulted_steps": args.steps,
              "restart": {"steps": args.restart_steps, "kill_at": args.kill_at,
                          "checkpoint_every": args.checkpoint_every}, "standbys": args.standbys, "kinds": kinds,
              "node_cores": args.node_cores,
              "runs": runs}  # fmt: skip
    nodes = NODES + (args.standbys if {"standby", "twolost", "mixed"} & set(kinds) else 0)
    quota = CpuQuotas([args.node_cores] * nodes, prefix="fedshard-elastic") if args.node_cores else None
    with EmulatedCluster(nodes) as cluster, quota if quota is not None else nullcontext() as quotas:
        cluster.set_bandwidth(LINK_MBIT)
        for repeat in range(args.repeats):
            for kind in kinds:
                work = args.work / f"{kind}.{repeat}"
                started = time.time()
                if kind == "checkpoint_restart":
                    result = checkpoint_restart_run(cluster, work, args.restart_steps, args.kill_at,
                                                    args.checkpoint_every)  # fmt: skip
                elif kind == "elastic_restart":
                    result = elastic_run(cluster, work, args.restart_steps, restart, quotas=quotas)
                elif kind == "strangers":
                    strangers = parse_faults(STRANGERS, NODES)
                    result = elastic_run(cluster, work, args.steps, strangers, quotas=quotas,
                                         secret=secrets.token_hex(16))  # fmt: skip
                elif kind in ("hanginsum", "hanginsum_wait"):
                    hangs = parse_faults(HANGS, NODES)
                    result = elastic_run(cluster, work, args.steps, hangs, quotas=quotas,
                                         peer_check=1.0 if kind == "hanginsum" else 0.0)  # fmt: skip
                elif kind == "mixed":
                    result = elastic_run(cluster, work, args.steps, parse_faults(MIXED, NODES), standbys=args.standbys,
                                         quotas=quotas)  # fmt: skip
                elif kind == "healsource":
                    result = elastic_run(cluster, work, args.steps, parse_faults(HEAL_SOURCE, NODES), quotas=quotas)
                elif kind == "twolost":
                    lost = parse_faults(TWO_LOST, NODES)
                    result = elastic_run(cluster, work, args.steps, lost, standbys=args.standbys, quotas=quotas)
                elif kind == "standby":
                    result = elastic_run(cluster, work, args.steps, faults, standbys=args.standbys, quotas=quotas)
                else:
                    result = elastic_run(cluster, work, args.steps, faults if kind == "faulted" else [], quotas=quotas)
                runs.append({"kind": kind, "repeat": repeat, "started": started, "result": result})
                print(f"{kind} #{repeat}: {time.time() - started:.0f} s", flush=True)
                args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")


def _prepare_data() -> None:
    """Tokenize the corpus once, before several jobs would do it at the same time."""
    from lightning_fedshard.examples import ShakespeareDataModule

    ShakespeareDataModule(seq_len=128, batch_size=8, vocab_size=4096).prepare_data()


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        run_single_job(json.loads(sys.argv[2]))
        sys.stdout.flush()
        os._exit(0)
    main()
