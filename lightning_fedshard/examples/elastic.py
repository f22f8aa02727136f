"""An elastic federation on one machine: a lighthouse, one job per group, faults that end groups, and a report.

:class:`ElasticDemo` starts a torchft lighthouse and ``G`` group jobs that pre-train the example Llama on Shakespeare
(each job: ``N`` ranks of one FL+FSDP group, started like any Lightning script), kills, stops and restarts groups as a
spec says (:func:`parse_faults`: ``kill:G@S``, ``stop:G@S``, ``restart:G@S``), and writes what happened: per group its
steps, syncs committed and lost, heals and exit codes; per fault how long the surviving groups stalled; the final
consensus checksum of every live group; the committed tokens per second. ``examples/elastic_shakespeare.py`` is its
command line. The benchmarks inject more kinds of fault (a group hung inside a sum, a heal whose source dies, a
lighthouse restart, strangers to a federation with a secret) through the same driver (``benchmarks/harness/faults.py``).

With ``standbys`` (:class:`DemoConfig`), that many standby jobs start with the groups (on nodes of their own); each
takes the place of a group that is gone, and every ``restart:G@S`` fault starts a new standby, on a node no running job
holds, instead of a new job for group G. A standby counts as alive only once it trains.

A group job (:func:`run_group`) writes one JSON line per event to ``<out>/group<g>.<incarnation>/events.jsonl``: its
start, every optimizer step, every sync (the groups, who joined, whether it was lost, seconds spent healing and in the
sync) and its end with the consensus checksum. The driver reads only these files and the exit codes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from typing_extensions import override

import lightning_fedshard
from lightning_fedshard.examples.llama import LlamaLM
from lightning_fedshard.examples.shakespeare import ShakespeareDataModule

#: What the demo's faults do to a group: kill it (SIGKILL), stop it (SIGSTOP: a hung group), or start a new job for it.
FAULT_KINDS = ("kill", "stop", "restart")

#: Tokens one rank trains on per optimizer step (the demo's batch of 8 windows of 128 tokens).
BATCH, SEQ_LEN = 8, 128


@dataclass(frozen=True)
class Fault:
    """``kind`` applied to ``group`` once the furthest running group has done ``step`` optimizer steps."""

    kind: str
    group: int
    step: int


def parse_faults(spec: str, groups: int, kinds: tuple[str, ...] = FAULT_KINDS) -> list[Fault]:
    """Parse ``"kill:1@20,stop:2@40,restart:1@30"`` into faults of ``kinds``, in the order of their steps.

    Raises:
        ValueError: Naming the entry that is not ``KIND:GROUP@STEP`` with a known kind, a group in ``[0, groups)``
            and a positive step.
    """
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, _, rest = entry.partition(":")
        group, _, step = rest.partition("@")
        if kind not in kinds or not group.isdigit() or not step.isdigit():
            raise ValueError(
                f"Fault {entry!r} is not KIND:GROUP@STEP with KIND one of {list(kinds)}, e.g. 'kill:1@20'."
            )
        if not 0 <= int(group) < groups or int(step) < 1:
            raise ValueError(f"Fault {entry!r}: the group must be in [0, {groups}) and the step positive.")
        faults.append(Fault(kind, int(group), int(step)))
    return sorted(faults, key=lambda f: f.step)


# -- the driver ------------------------------------------------------------------------------------------------------


#: Builds the command that runs a group job: (group, argv, environment) -> the command line.
Launch = Callable[[int, list[str], dict[str, str]], list[str]]


def local_launch(group: int, argv: list[str], env: dict[str, str]) -> list[str]:
    """Run a group job on this machine (its environment is passed to ``Popen``)."""
    return argv


@dataclass
class Incarnation:
    """One job of one group: a process session, its event log and what became of it.

    A standby job has ``group == -1`` until it trains in a group's place (``trained_at``).
    """

    group: int
    index: int
    out: Path
    process: subprocess.Popen[bytes]
    started: float
    ended: float | None = None
    stopped_at: float | None = None
    exit_code: int | None = None
    standby: bool = False
    trained_at: float | None = None
    node: int = 0

    def took_place(self) -> bool:
        """A standby: whether it now trains as a group (sets ``group`` and ``trained_at`` from its events)."""
        if self.group < 0:
            trained = next((e for e in self.events() if e["event"] == "trained"), None)
            if trained is not None:
                self.group, self.trained_at = int(trained["group"]), float(trained["t"])
        return self.group >= 0

    def events(self) -> list[dict[str, Any]]:
        """The job's events so far."""
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half written

    def step(self) -> int:
        """The job's last optimizer step (-1 before its first)."""
        steps = [e["step"] for e in self.events() if e["event"] in ("step", "sync")]
        return max(steps, default=-1)

    @property
    def running(self) -> bool:
        """Whether the job runs and is not stopped."""
        return self.ended is None and self.stopped_at is None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every process of the job."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass


@dataclass
class DemoConfig:
    """What the demo runs: the federation, the training, the faults and the timeouts (seconds).

    ``heartbeat`` is how long a silent group keeps the others waiting before the lighthouse drops it; ``join`` how long
    a quorum waits for groups that are alive but slower to reach the sync (long: a slow group is waited for, a dead or
    hung one is dropped after ``heartbeat`` anyway).
    """

    groups: int = 4
    ranks_per_group: int = 1
    max_steps: int = 96
    sync_every: int = 8
    faults: list[Fault] = field(default_factory=list)
    reduce_dtype: str = "int4"
    outer_optimizer: str = "fedavg"
    heartbeat: float = 2.0
    join: float = 60.0
    timeout: float = 15.0
    peer_check: float = 1.0
    quorum_timeout: float = 120.0
    min_groups: int = 1
    standbys: int = 0
    step_sleep: float = 0.0
    size: str = "xs"
    lr: float = 0.005


class ElasticDemo:
    """Starts the lighthouse and the group jobs, injects the faults, waits and reports.

    Args:
        config: The run.
        out: Folder for the group jobs' event logs and logs.
        launch: Builds each group job's command (default: a local process).
        lighthouse: The address of a lighthouse already running; default: one started in this process.
        node_address: The address a group's manager is reached at by the others (default: this machine's name).
        secret: The federation's secret, given to every group job as ``$FEDSHARD_SECRET`` (never written anywhere).
    """

    #: The script a group job runs (``python <script> <spec>``): this module's :func:`run_group`.
    group_script = Path(__file__).resolve()

    def __init__(
        self,
        config: DemoConfig,
        out: Path,
        launch: Launch = local_launch,
        lighthouse: str | None = None,
        node_address: Callable[[int], str] | None = None,
        secret: str | None = None,
    ) -> None:
        self.secret = secret
        self.config = config
        self.out = out
        self.launch = launch
        self._external_lighthouse = lighthouse
        self._lighthouse: Any = None
        self.node_address = node_address or (lambda group: socket.gethostname())
        self.jobs: list[Incarnation] = []
        self.fault_log: list[dict[str, Any]] = []
        self.started = time.time()

    # -- running ------------------------------------------------------------------------------------------------------

    def run(self, timeout: float = 3600.0) -> dict[str, Any]:
        """Run the federation to ``max_steps`` with the faults; return the report. Ends every process it started."""
        self.out.mkdir(parents=True, exist_ok=True)
        started = self.started = time.time()
        try:
            address = self._start_lighthouse()
            for group in range(self.config.groups):
                self._start(group, address)
            for spare in range(self.config.standbys):
                self._start(-1, address, node=self.config.groups + spare)
            pending = list(self.config.faults)
            deadline = time.monotonic() + timeout
            while any(j.running for j in self.jobs) or self._stopped_only():
                self._reap()
                step = max((j.step() for j in self.jobs if j.running), default=-1)
                while pending and step >= pending[0].step:
                    self._inject(pending.pop(0), address)
                if self._stopped_only() or self._finished_long_ago():
                    break  # only hung groups are left, or jobs that started after the federation had finished
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the elastic demo ran past {timeout:.0f} s")
                time.sleep(0.1)
            self._reap()
        finally:
            self.close()
        return self.report(time.time() - started)

    def _finished_long_ago(self) -> bool:
        """Whether a group finished training more than a heartbeat timeout and 10 s ago (the others have too)."""
        ends = [e["t"] for j in self.jobs for e in j.events() if e["event"] == "end"]
        return bool(ends) and time.time() - min(ends) > self.config.heartbeat + 10.0

    def _stopped_only(self) -> bool:
        alive = [j for j in self.jobs if j.ended is None and j.process.poll() is None]
        return bool(alive) and all(j.stopped_at is not None for j in alive)

    def _start_lighthouse(self, port: int = 0) -> str:
        if self._external_lighthouse is not None:
            return self._external_lighthouse
        os.environ.setdefault("RUST_LOG", "warn")
        from lightning_fedshard.elastic.torchft_api import lighthouse_server_class

        self._lighthouse = lighthouse_server_class()(
            bind=f"[::]:{port}",
            min_replicas=self.config.min_groups,
            join_timeout_ms=int(self.config.join * 1000),
            heartbeat_timeout_ms=int(self.config.heartbeat * 1000),
        )
        return str(self._lighthouse.address())

    def _start(
        self, group: int, lighthouse: str, node: int | None = None, secret: str | None = None, name: str = ""
    ) -> Incarnation:
        """Start a job for ``group`` (``-1``: a standby) on ``node`` (default: the group's own).

        ``secret``: the job's (default: the federation's). A job given a ``name`` of its own is not one of the
        federation's groups (:attr:`jobs`): the caller keeps it.
        """
        node = group if node is None else node
        standby = group < 0
        index = sum(j.standby for j in self.jobs) if standby else sum(j.group == group for j in self.jobs)
        stranger = bool(name)
        out = self.out / (name or (f"standby.{index}" if standby else f"group{group}.{index}"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "events.jsonl").unlink(missing_ok=True)  # left by an earlier run in the same folder
        spec = {**self._group_spec(group, lighthouse, out), "hostname": self.node_address(node)}
        argv = [sys.executable, str(self.group_script), json.dumps(spec)]
        env = {
            **os.environ,
            "MASTER_ADDR": self.node_address(node),
            "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": "1",
            "RUST_LOG": "warn",
            "PYTHONUNBUFFERED": "1",
        }
        if not standby:
            env["FEDSHARD_GROUP"] = str(group)
        env.pop("FEDSHARD_SECRET", None)
        job_secret = secret if stranger else self.secret
        if job_secret is not None:
            env["FEDSHARD_SECRET"] = job_secret
        log = open(out / "job.log", "wb")
        process = subprocess.Popen(
            self.launch(node, argv, env), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        job = Incarnation(group, index, out, process, time.time(), standby=standby, node=node)
        if not stranger:
            self.jobs.append(job)
        return job

    def _group_spec(self, group: int, lighthouse: str, out: Path) -> dict[str, Any]:
        """What a group job is told (:func:`run_group`): the run's config, its group, the lighthouse, its folder."""
        return {
            **asdict(self.config),
            "faults": [],
            "group": group,
            "lighthouse": lighthouse,
            "out": str(out),
            "hostname": self.node_address(group),
        }

    def _inject(self, fault: Fault, lighthouse: str) -> None:
        self._reap()
        record: dict[str, Any] = {**asdict(fault), "t": time.time()}
        self._apply(fault, record, lighthouse)
        self.fault_log.append(record)

    def _apply(self, fault: Fault, record: dict[str, Any], lighthouse: str) -> None:
        """Do what ``fault`` does (kill, stop or restart its group); ``record`` is its entry in the report."""
        current = [j for j in self.jobs if j.group == fault.group and j.ended is None]
        if fault.kind == "stop":
            for job in current:
                job.signal(signal.SIGSTOP)
                job.stopped_at = record["t"]
        elif fault.kind == "restart" and self.config.standbys:
            for job in current:  # a hung job of the group ends; a standby that took the group's place trains on
                if job.stopped_at is not None:
                    self._end(job)
            self._start(-1, lighthouse, node=self._free_node(fault.group))
        else:
            for job in current:
                self._end(job)
            if fault.kind == "restart":
                self._start(fault.group, lighthouse)

    def _free_node(self, preferred: int) -> int:
        """A node no running job holds (``preferred`` if it is free): a new spare must not share a training node."""
        taken = {j.node for j in self.jobs if j.running}
        nodes = range(self.config.groups + self.config.standbys)
        return preferred if preferred not in taken else next((n for n in nodes if n not in taken), preferred)

    @staticmethod
    def _end(job: Incarnation) -> None:
        job.signal(signal.SIGKILL)
        job.process.wait()
        job.ended, job.exit_code = time.time(), job.process.returncode

    def _reap(self) -> None:
        for job in self.jobs:
            if job.standby:
                job.took_place()
            if job.ended is None and job.process.poll() is not None:
                job.ended, job.exit_code = time.time(), job.process.returncode

    def close(self) -> None:
        """End every process this demo started, and the lighthouse."""
        for job in self._every_job():
            if job.ended is None:
                job.signal(signal.SIGCONT)
                job.signal(signal.SIGKILL)
                job.process.wait()
                job.ended, job.exit_code = time.time(), job.process.returncode
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None

    def _every_job(self) -> list[Incarnation]:
        """Every job this demo started (the groups' and standbys')."""
        return list(self.jobs)

    # -- the report ---------------------------------------------------------------------------------------------------

    def report(self, wall: float) -> dict[str, Any]:
        """What the group jobs recorded, per group and per fault, and the committed tokens per second."""
        for job in self.jobs:
            job.took_place()
        events = {(j.group, j.out.name): j.events() for j in self.jobs}
        syncs = _timeline(events)
        tokens_per_group_step = self.config.ranks_per_group * BATCH * SEQ_LEN
        committed = sum(committed_group_steps(s) for s in syncs) * tokens_per_group_step
        trained_steps = sum(e["event"] == "step" for evs in events.values() for e in evs)
        starts = [e["t"] for evs in events.values() for e in evs if e["event"] == "trained"]
        ends = [e["t"] for evs in events.values() for e in evs if e["event"] == "end"]
        span = (max(ends) - min(starts)) if starts and ends else math.nan
        return {
            "config": {**asdict(self.config), "faults": [asdict(f) for f in self.config.faults]},
            "wall_seconds": wall,
            "training_seconds": span,
            "finished_seconds": max(ends) - self.started if ends else math.nan,
            "groups": [self._group_report(g, events) for g in range(self.config.groups)],
            "faults": [self._fault_report(f, events) for f in self.fault_log],
            "syncs": syncs,
            "committed_tokens": committed,
            "trained_tokens": trained_steps * tokens_per_group_step,
            "committed_tokens_per_s": committed / span if span and span > 0 else math.nan,
            "alive_fraction": self._alive_fraction(min(starts, default=math.nan), max(ends, default=math.nan)),
            "checksums": {name: e["checksum"] for (_, name), evs in events.items() for e in evs if e["event"] == "end"},
            "split_syncs": split_syncs(events),
        }

    def _group_report(self, group: int, events: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
        jobs = sorted((j for j in self.jobs if j.group == group), key=lambda j: j.trained_at or j.started)
        mine = [e for j in jobs for e in events[(group, j.out.name)]]
        syncs = [e for e in mine if e["event"] == "sync"]
        return {
            "group": group,
            "steps": max((e["step"] for e in mine if e["event"] in ("step", "sync")), default=0),
            "syncs_committed": sum(not e["lost"] for e in syncs),
            "syncs_lost": sum(e["lost"] for e in syncs),
            "heals": [
                {"step": e["step"], "seconds": e["heal_seconds"]} for e in syncs if e["heal_seconds"] is not None
            ],
            "jobs": [
                {
                    "started": j.started,
                    "ended": j.ended,
                    "exit_code": j.exit_code,
                    **_job_timing(j, events[(group, j.out.name)]),
                    **self._takeover(j),
                }
                for j in jobs
            ],
        }

    def _takeover(self, job: Incarnation) -> dict[str, Any]:
        """A standby's takeover: seconds from the fault that ended its group's last job to training in its place.

        ``ready_at_fault``: whether the standby was loaded and waiting when that fault struck (else the takeover
        includes the rest of its start-up).
        """
        if not job.standby:
            return {}
        gone = [f["t"] for f in self.fault_log if f["group"] == job.group and f["kind"] in ("kill", "stop")]
        before = [t for t in gone if job.trained_at is not None and t <= job.trained_at]
        ready = next((e["t"] for e in job.events() if e["event"] == "ready"), None)
        fault = max(before) if before and job.trained_at is not None else None
        return {
            "standby": True,
            "ready_at": ready,
            "trained_at": job.trained_at,
            "takeover_seconds": None if fault is None or job.trained_at is None else job.trained_at - fault,
            "ready_at_fault": None if fault is None or ready is None else ready <= fault,
        }

    def _fault_report(
        self, fault: dict[str, Any], events: dict[tuple[int, str], list[dict[str, Any]]]
    ) -> dict[str, Any]:
        """The surviving groups' stall: how much longer their first sync after the fault took than their usual sync.

        After a restart also when the new job first committed a sync.
        """
        stalls = []
        for (group, _), evs in events.items():
            if group == fault["group"]:
                continue
            syncs = [e for e in evs if e["event"] == "sync" and e["step"] > 0]
            before = [e["seconds"] for e in syncs if e["t"] < fault["t"]]
            after = [e for e in syncs if e["t"] >= fault["t"]]
            if before and after:
                stalls.append(max(0.0, after[0]["seconds"] - statistics.median(before)))
        report = {**fault, "stall_seconds": max(stalls) if stalls else None}
        if fault["kind"] in ("restart", "healkill"):
            report.update(self._rejoin_report(fault, events))
        return report

    def _rejoin_report(
        self, fault: dict[str, Any], events: dict[tuple[int, str], list[dict[str, Any]]]
    ) -> dict[str, Any]:
        """When the new job of a restart first committed a sync (seconds from the fault)."""
        joiner = next((j for j in self.jobs if j.group == fault["group"] and j.started >= fault["t"]), None)
        syncs = [] if joiner is None else [e for e in events[(joiner.group, joiner.out.name)] if e["event"] == "sync"]
        committed = next((e for e in syncs if not e["lost"] and e["step"] > 0), None)
        return {"joined_seconds": None if committed is None else committed["t"] - fault["t"]}

    def _alive_fraction(self, start: float, end: float) -> float:
        """The time-weighted share of the planned groups that had a running (not stopped) job."""
        if not end > start:
            return math.nan
        alive = 0.0
        for job in self.jobs:
            first = job.trained_at if job.standby else job.started  # a standby is alive once it trains
            if first is None:
                continue
            last = job.stopped_at or job.ended or end
            alive += max(0.0, min(last, end) - max(first, start))
        return alive / (self.config.groups * (end - start))


def split_syncs(events: dict[tuple[int, str], list[dict[str, Any]]]) -> list[int]:
    """The steps of syncs that some groups applied and others lost, among the groups that took part and did not join.

    A group that joined at a sync may lose it alone (its heal failed: it heals at the next); any other split would
    leave the groups on different weights.
    """
    outcomes: dict[int, set[bool]] = {}
    for (group, _), evs in events.items():
        for e in evs:
            if e["event"] == "sync" and group in e["members"] and group not in e["joined"]:
                outcomes.setdefault(e["step"], set()).add(bool(e["lost"]))
    return sorted(step for step, seen in outcomes.items() if len(seen) > 1)


def committed_group_steps(sync: dict[str, Any]) -> int:
    """The steps a sync committed, over the groups that contributed to it (0 for a lost sync).

    A round carried over a lost sync is committed by the next sync (``committed_steps``); reports recorded before rounds
    were carried have only the steps since the previous sync, which was then all a sync could commit.
    """
    if "committed_steps" in sync:
        return int(sync["committed_steps"])
    return 0 if sync["lost"] else len([g for g in sync["members"] if g not in sync["joined"]]) * sync["steps"]


def _job_timing(job: Incarnation, events: list[dict[str, Any]]) -> dict[str, Any]:
    """A job's steps trained, and how long it took to start (launch to asking to join) and to join (wait and heal)."""
    trained = [e["t"] for e in events if e["event"] == "trained"]
    first_sync = next((e for e in events if e["event"] == "sync"), None)
    join = first_sync["heal_seconds"] if first_sync is not None else None
    return {
        "steps_trained": sum(e["event"] == "step" for e in events),
        "start_up_seconds": trained[0] - (join or 0.0) - job.started if trained else None,
        "join_seconds": join,
    }


def _timeline(events: dict[tuple[int, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every sync once, from whichever groups took part, with the steps of the round it closed.

    ``committed_steps``: the group-steps the sync committed: each contributor's steps since the last sync it committed
    or joined at (a lost sync carries the round, so the next one commits both).
    """
    by_step: dict[int, dict[str, Any]] = {}
    for evs in events.values():
        for e in evs:
            if e["event"] != "sync":
                continue
            if e["step"] not in by_step:
                by_step[e["step"]] = {k: e[k] for k in ("step", "members", "joined", "lost", "t")}
            by_step[e["step"]]["t"] = min(by_step[e["step"]]["t"], e["t"])  # when the first group had it
    previous, syncs = 0, []
    start: dict[int, int] = {}  # by group: the step its round started at
    for step in sorted(by_step):
        sync = by_step[step]
        start.update(dict.fromkeys(sync["joined"], step))
        contributors = [g for g in sync["members"] if g not in sync["joined"]]
        committed = 0 if sync["lost"] else sum(step - start.get(g, 0) for g in contributors)
        if not sync["lost"]:
            start.update(dict.fromkeys(sync["members"], step))
        syncs.append({**sync, "steps": step - previous, "committed_steps": committed})
        previous = step
    return syncs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def summary(report: dict[str, Any]) -> str:
    """The report in a few lines for a person."""
    lines = [f"elastic federation: {report['config']['groups']} groups x {report['config']['ranks_per_group']} rank(s)"]
    for g in report["groups"]:
        codes = [j["exit_code"] for j in g["jobs"]]
        heals = ", ".join(f"step {h['step']} in {h['seconds']:.2f} s" for h in g["heals"]) or "none"
        lines.append(
            f"  group {g['group']}: {g['steps']} steps, {g['syncs_committed']} syncs committed, {g['syncs_lost']} lost,"
            f" heals: {heals}; job exit codes {codes}"
        )
    for f in report["faults"]:
        stall = "n/a" if f["stall_seconds"] is None else f"{f['stall_seconds']:.2f} s"
        lines.append(f"  fault {f['kind']}:{f['group']}@{f['step']}: survivors stalled {stall}")
    checksums = set(report["checksums"].values())
    lines.append(
        f"  committed {report['committed_tokens']:,} tokens ({_share(report)} of those trained),"
        f" {report['committed_tokens_per_s']:,.0f} tokens/s;"
        f" groups alive {report['alive_fraction']:.0%} of the time; final consensus checksums: "
        + ("all equal" if len(checksums) == 1 else f"{len(checksums)} different")
    )
    return "\n".join(lines)


def _share(report: dict[str, Any]) -> str:
    trained = report.get("trained_tokens")
    return f"{report['committed_tokens'] / trained:.1%}" if trained else "n/a"


# -- a group job ---------------------------------------------------------------------------------------------------


class EventLog(Callback):
    """Writes one JSON line per event of a training job (rank 0 only) to ``<out>/events.jsonl``.

    Events: ``start``; ``trained`` (training starts, at ``step``); ``step`` after every optimizer step; ``sync`` after
    every sync (its groups, who joined, whether it was lost, the seconds spent healing, in the sync and blocking the
    loop); ``end`` with the checksum of the consensus every group holds.

    Args:
        out: The job's folder.
        step_sleep: Extra seconds per step (slows a demo down on a fast machine).
    """

    def __init__(self, out: Path, step_sleep: float = 0.0) -> None:
        self.step_sleep = step_sleep
        self._seen: Any = None
        self._file = open(out / "events.jsonl", "a") if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
        self._write({"event": "start", "step": -1})

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._write({"event": "ready", "step": -1})  # loaded: a standby waits for a place from here on

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is not None and runtime.standing_by:
            return  # a standby whose federation ended: it trains nothing
        group = runtime.group_index if runtime is not None else 0
        self._write({"event": "trained", "step": trainer.global_step, "group": group})
        membership = getattr(runtime, "membership", None)
        if membership is not None and membership.communicator.heal_address is not None:
            self._write(
                {"event": "heal_server", "step": trainer.global_step, "address": membership.communicator.heal_address}
            )
        self._sync(trainer)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.step_sleep:
            time.sleep(self.step_sleep)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._write({"event": "step", "step": trainer.global_step})

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is not None and runtime.standing_by:
            return
        self._sync(trainer)
        state = trainer.strategy.lightning_module_state_dict()  # the consensus (a collective inside the group)
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode())
            digest.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
        self._write({"event": "end", "step": trainer.global_step, "checksum": digest.hexdigest()[:16]})

    def _write(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({**event, "t": time.time()}) + "\n")
            self._file.flush()

    def _sync(self, trainer: L.Trainer) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        stats = runtime.last_sync_stats if runtime is not None else None
        if stats is None or stats is self._seen:
            return
        self._seen = stats
        membership = getattr(runtime, "membership", None)
        members = list(membership.members) if membership is not None else []
        self._write(
            {
                "event": "sync",
                "step": trainer.global_step,
                "members": members,
                "joined": list(stats.joined_groups),
                "lost": stats.lost,
                "heal_seconds": stats.extra.get("heal_seconds"),
                "seconds": stats.seconds,
                "exposed_seconds": stats.exposed_seconds,
                "num_syncs": stats.num_syncs,
            }
        )


def training(spec: dict[str, Any]) -> tuple[LlamaLM, ShakespeareDataModule]:
    """The demo's model and data: the example Llama on Shakespeare, the data resumable."""
    L.seed_everything(0, verbose=False)
    model = LlamaLM(size=spec["size"], vocab_size=4096, max_seq_len=SEQ_LEN, lr=spec["lr"], warmup_fraction=0.1)
    data = ShakespeareDataModule(seq_len=SEQ_LEN, batch_size=BATCH, vocab_size=4096, resumable=True)
    return model, data


def run_group(spec: dict[str, Any], more_callbacks: Callable[[EventLog], Sequence[Callback]] | None = None) -> None:
    """Train one group of the demo's federation with the Trainer, logging its events (see the module docstring).

    Args:
        spec: The group job's spec, as the demo wrote it.
        more_callbacks: Builds more of the job's callbacks from its event log (the benchmarks' faults inside a job).
    """
    standby = spec["group"] < 0
    elastic = lightning_fedshard.Elastic(
        lighthouse=spec["lighthouse"],
        group=None if standby else spec["group"],
        standby=standby,
        federation="shakespeare",
        min_groups=spec["min_groups"],
        start_groups=spec["groups"],  # the federation starts once every planned group joined
        timeout=spec["timeout"],
        peer_check=spec.get("peer_check", 1.0),
        quorum_timeout=spec["quorum_timeout"],
        hostname=spec["hostname"],
        group_timeout=max(10.0, 2 * spec["timeout"]),
    )
    strategy = lightning_fedshard.FLFSDPStrategy(
        num_groups=spec["groups"],
        sync_every=spec["sync_every"],
        reduce_dtype=spec["reduce_dtype"],
        outer_optimizer=spec.get("outer_optimizer", "fedavg"),
        elastic=elastic,
        auto_wrap_policy=LlamaLM.wrap_policy(),
    )
    model, data = training(spec)
    events = EventLog(Path(spec["out"]), spec["step_sleep"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec["ranks_per_group"],
        num_nodes=1,
        strategy=strategy,
        max_steps=spec["max_steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[events, *(more_callbacks(events) if more_callbacks else ())],
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":  # a group job, started by ElasticDemo (Lightning re-runs this for its other ranks)
    run_group(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # gloo threads may still hold tensors: leave without finalizing the interpreter
