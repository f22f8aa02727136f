"""The elastic benchmark's faults: the demo's driver (kill, stop, restart) and the faults only the benchmarks inject.

:class:`FaultyDemo` is the example's :class:`~lightning_fedshard.examples.elastic.ElasticDemo` with more kinds of fault
(:data:`FAULT_KINDS`), injected through the seams the elastic communicator offers for it (``on_sum``, ``heal_server``):

- ``hang:G@S`` stops group G inside the sum over the groups of its sync at step S (a multiple of ``sync_every``): the
  group's job stops itself (SIGSTOP, every rank) as it enters that sum, after the quorum of that sync included it, so
  the others are left waiting inside the sum; a later ``restart:G@S`` ends it as it ends a group stopped between syncs;
- ``healkill:G@S`` starts a new job for group G as ``restart`` does (with standbys: a new standby), and the first group
  that serves a heal from then on (the new job's or a standby's, normally) is killed (SIGKILL, every rank) while the
  state is in transit, after its first :data:`HEAL_KILL_AFTER` bytes;
- ``lighthouse:0@S`` takes the lighthouse down for :data:`LIGHTHOUSE_DOWN` seconds and starts a new one at the same
  address (its group is not used); the groups ride the outage out;
- with a federation ``secret`` three faults play a stranger on the same machine: ``nosecret:G@S`` and
  ``badsecret:G@S`` start a job for group G without the secret or with another one, and ``fetch:G@S`` fetches the
  whole state from group G's heal server with plain HTTP. The report says what became of each (``strangers``: the
  exit code and the refusal the job printed; a fetch's HTTP status in its fault).

A group job of a :class:`FaultyDemo` runs :data:`GROUP_SCRIPT`, which adds the faults inside a job (:class:`HangInSum`,
:class:`DieWhileHealing`) to the example's group job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_fedshard.examples.elastic import FAULT_KINDS as DEMO_FAULT_KINDS
from lightning_fedshard.examples.elastic import (
    DemoConfig,
    ElasticDemo,
    EventLog,
    Fault,
    Incarnation,
    Launch,
    local_launch,
)
from lightning_fedshard.examples.elastic import parse_faults as parse_demo_faults

#: Every fault the benchmarks inject: the demo's, and a hang inside a sum, a heal whose source dies, a lighthouse
#: restart, and the strangers to a federation with a secret.
FAULT_KINDS = (*DEMO_FAULT_KINDS, "hang", "healkill", "lighthouse", "nosecret", "badsecret", "fetch")
#: The faults that play a stranger: they need the demo's ``secret``.
STRANGER_FAULTS = ("nosecret", "badsecret", "fetch")
#: The file whose presence arms the kill of the next group that serves a heal (``healkill``), in the demo's folder.
HEAL_KILL_MARKER = "healkill.armed"
#: The bytes of a heal a ``healkill`` source sends before it dies.
HEAL_KILL_AFTER = 256 * 1024
#: Seconds a ``lighthouse`` fault keeps the lighthouse down.
LIGHTHOUSE_DOWN = 2.0
#: The secret a ``badsecret`` stranger holds.
ANOTHER_SECRET = "not-the-federations-secret"
#: The script a group job of a :class:`FaultyDemo` runs.
GROUP_SCRIPT = Path(__file__).with_name("elastic_group.py")

#: A stranger's fetch of a URL: prints the HTTP status (what a plain ``urllib`` request gets).
_FETCH = """
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as answer:
        print(answer.status)
except urllib.error.HTTPError as error:
    print(error.code)
"""


def parse_faults(spec: str, groups: int) -> list[Fault]:
    """Parse a spec of every kind of :data:`FAULT_KINDS` (see the example's ``parse_faults``)."""
    return parse_demo_faults(spec, groups, FAULT_KINDS)


class FaultyDemo(ElasticDemo):
    """The elastic demo with every fault of :data:`FAULT_KINDS` (see the module).

    Args:
        config: The run.
        out: Folder for the group jobs' event logs and logs.
        launch: Builds each group job's command (default: a local process).
        lighthouse: The address of a lighthouse already running; default: one started in this process.
        node_address: The address a group's manager is reached at by the others (default: this machine's name).
        secret: The federation's secret, given to every group job as ``$FEDSHARD_SECRET`` (never written anywhere).
        restart_lighthouse: Takes the external ``lighthouse`` down for the given seconds and starts it again at the
            same address (the ``lighthouse`` fault); a lighthouse this demo started it restarts itself.
    """

    group_script = GROUP_SCRIPT

    def __init__(
        self,
        config: DemoConfig,
        out: Path,
        launch: Launch = local_launch,
        lighthouse: str | None = None,
        node_address: Callable[[int], str] | None = None,
        secret: str | None = None,
        restart_lighthouse: Callable[[float], None] | None = None,
    ) -> None:
        if lighthouse is not None and restart_lighthouse is None and any(f.kind == "lighthouse" for f in config.faults):
            raise ValueError("The lighthouse fault needs `restart_lighthouse` for a lighthouse the demo did not start.")
        if secret is None and any(f.kind in STRANGER_FAULTS for f in config.faults):
            raise ValueError("The stranger faults (nosecret, badsecret, fetch) need a federation `secret`.")
        for fault in config.faults:
            if fault.kind == "hang" and fault.step % config.sync_every:
                raise ValueError(
                    f"Fault hang:{fault.group}@{fault.step}: a group hangs inside the sum of a sync, and step"
                    f" {fault.step} is not one (not a multiple of sync_every={config.sync_every})."
                )
        super().__init__(config, out, launch, lighthouse, node_address, secret)
        self._restart_external = restart_lighthouse
        #: Jobs started as strangers (not counted as any group's).
        self.strangers: list[tuple[str, Incarnation]] = []

    @override
    def _group_spec(self, group: int, lighthouse: str, out: Path) -> dict[str, Any]:
        hangs = [f.step for f in self.config.faults if f.kind == "hang" and f.group == group]
        marker = str(self.out / HEAL_KILL_MARKER)
        return {**super()._group_spec(group, lighthouse, out), "hang_at": hangs, "heal_kill_marker": marker}

    @override
    def _apply(self, fault: Fault, record: dict[str, Any], lighthouse: str) -> None:
        if fault.kind in ("nosecret", "badsecret"):
            secret = None if fault.kind == "nosecret" else ANOTHER_SECRET
            name = f"{fault.kind}{fault.group}.{len(self.strangers)}"
            job = self._start(fault.group, lighthouse, node=fault.group, secret=secret, name=name)
            self.strangers.append((fault.kind, job))
        elif fault.kind == "fetch":
            record["status"] = self._fetch(fault.group)
        elif fault.kind == "hang":  # the job stopped itself inside the sum (its `hang` event says when)
            current = [j for j in self.jobs if j.group == fault.group and j.ended is None]
            hung = [(job, e["t"]) for job in current for e in job.events() if e["event"] == "hang"]
            for job, t in hung:
                job.stopped_at = record["t"] = t
            record["hung"] = bool(hung)
        elif fault.kind == "lighthouse":
            self._restart_lighthouse(lighthouse)
            record["up_again"] = time.time()
        elif fault.kind == "healkill":
            (self.out / HEAL_KILL_MARKER).write_text(str(fault.step))  # the next heal's source dies while sending
            super()._apply(replace(fault, kind="restart"), record, lighthouse)
        else:
            super()._apply(fault, record, lighthouse)

    def _restart_lighthouse(self, address: str) -> None:
        """Take the lighthouse down for :data:`LIGHTHOUSE_DOWN` seconds, then start a new one at ``address``."""
        if self._restart_external is not None:
            self._restart_external(LIGHTHOUSE_DOWN)
            return
        self._lighthouse.shutdown()
        time.sleep(LIGHTHOUSE_DOWN)
        self._start_lighthouse(port=int(urlparse(address).port or 0))

    def _fetch(self, group: int) -> int | None:
        """A plain HTTP fetch of the state from ``group``'s heal server by a stranger on its node: the HTTP status.

        ``None`` if no answer came.
        """
        jobs = [j for j in self.jobs if j.group == group and j.running]
        servers = [e for j in jobs for e in j.events() if e["event"] == "heal_server"]
        if not servers:
            return None
        url = f"{servers[-1]['address']}{max(0, jobs[-1].step())}/full"
        argv = [sys.executable, "-c", _FETCH, url]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("FEDSHARD_SECRET", None)
        done = subprocess.run(self.launch(group, argv, env), env=env, capture_output=True, text=True, timeout=60)
        status = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
        return int(status[0]) if status and status[0].isdigit() else None

    @override
    def _every_job(self) -> list[Incarnation]:
        return [*self.jobs, *(job for _, job in self.strangers)]

    @override
    def report(self, wall: float) -> dict[str, Any]:
        """The demo's report, with what became of each stranger."""
        return {**super().report(wall), "strangers": [_stranger_report(kind, job) for kind, job in self.strangers]}

    @override
    def _fault_report(
        self, fault: dict[str, Any], events: dict[tuple[int, str], list[dict[str, Any]]]
    ) -> dict[str, Any]:
        """The demo's fault report, with what only the benchmarks' faults show.

        After a ``hang`` (inside a sum, whose start the others' sync predates): from the moment the group stopped to
        the moment the last survivor left that sync, the time they waited for it; after a ``healkill`` also which
        group died serving a heal, and when.
        """
        if fault["kind"] == "hang":
            return {**fault, "stall_seconds": _hang_wait(fault, events)}
        report = super()._fault_report(fault, events)
        if fault["kind"] == "healkill":
            report.update(self._rejoin_report(fault, events))
            taken = [json.loads(p.read_text() or "{}") for p in self.out.glob(f"{HEAL_KILL_MARKER}.taken.*")]
            killed = sorted((k["t"], k["group"]) for k in taken if "t" in k and k["t"] >= fault["t"])
            report["source"], report["source_killed_at"] = (killed[0][1], killed[0][0]) if killed else (None, None)
        return report


def _hang_wait(fault: dict[str, Any], events: dict[tuple[int, str], list[dict[str, Any]]]) -> float | None:
    """Seconds from a group's hang inside the sum of its sync to the last survivor leaving that sync."""
    ends = [
        e["t"]
        for (group, _), evs in events.items()
        if group != fault["group"]
        for e in evs
        if e["event"] == "sync" and e["step"] == fault["step"] and e["t"] >= fault["t"]
    ]
    return max(ends) - fault["t"] if ends and fault.get("hung") else None


def _stranger_report(kind: str, job: Incarnation) -> dict[str, Any]:
    """What became of a stranger's job: its exit code, the refusal it printed, the steps it trained."""
    job.process.wait()
    log = (job.out / "job.log").read_text(errors="replace") if (job.out / "job.log").exists() else ""
    refused = next((line for line in reversed(log.splitlines()) if "FederationError: This job" in line), None)
    return {
        "kind": kind,
        "group": job.group,
        "exit_code": job.process.returncode,
        "refused": refused,
        "trained_steps": sum(e["event"] == "step" for e in job.events()),
    }


# -- the faults inside a group job ----------------------------------------------------------------------------------


class HangInSum(Callback):
    """A fault: this job stops itself inside the sum over the groups of its sync at each of ``steps``.

    As it enters that sum (the sync's quorum included it, so the other groups wait for it there), rank 0 writes a
    ``hang`` event and stops every process of the job's session (SIGSTOP), itself included. It hooks the elastic
    communicator's ``on_sum`` seam.

    Args:
        steps: The steps whose sync it hangs in.
        events: The job's event log.
    """

    def __init__(self, steps: list[int], events: EventLog) -> None:
        self.steps, self.events = set(steps), events

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if not self.steps or runtime is None or runtime.standing_by:
            return

        def hang(collective: str) -> None:  # a sum in float32 or int8, or int4's message exchange
            if trainer.global_step in self.steps and trainer.global_rank == 0:
                self.steps.discard(trainer.global_step)
                self.events._write({"event": "hang", "step": trainer.global_step})
                os.killpg(os.getpgrp(), signal.SIGSTOP)

        runtime.membership.communicator.on_sum.append(hang)


class DieWhileHealing(Callback):
    """A fault: once ``marker`` exists, the first group to serve a heal dies (SIGKILL, every rank) while sending it.

    The rank whose heal server takes the marker (an atomic rename: one rank of one group only) writes its group and
    the time into the taken marker (``<marker>.taken.<pid>``, read by the driver), sends the first
    :data:`HEAL_KILL_AFTER` bytes of the state and kills every process of its job's session. It wraps the request
    handler of the elastic communicator's ``heal_server`` seam.

    Args:
        marker: The file that arms the fault (written by the demo's driver).
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.group: int | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None or runtime.standing_by:
            return
        self.group = runtime.group_index
        server = runtime.membership.communicator.heal_server  # its request handler class is built per request
        server.RequestHandlerClass = self._dying(server.RequestHandlerClass)

    def _dying(self, handler: type) -> type:
        fault = self

        class DyingHandler(handler):  # type: ignore[misc, valid-type]
            def do_GET(self) -> None:
                if self.path.endswith("/full") and fault._take():
                    self.wfile = _DyingAfter(self.wfile, HEAL_KILL_AFTER)  # type: ignore[has-type]
                super().do_GET()

        return DyingHandler

    def _take(self) -> bool:
        taken = f"{self.marker}.taken.{os.getpid()}"
        try:
            os.rename(self.marker, taken)
        except OSError:
            return False
        Path(taken).write_text(json.dumps({"group": self.group, "t": time.time()}))
        return True


class _DyingAfter:
    """A stream that kills this job's session once ``limit`` bytes went through it."""

    def __init__(self, stream: Any, limit: int) -> None:
        self.stream, self.limit, self.sent = stream, limit, 0

    def write(self, data: Any) -> int:
        if self.sent >= self.limit:
            self.stream.flush()
            os.killpg(os.getpgrp(), signal.SIGKILL)
        self.sent += len(memoryview(data).cast("B"))
        return int(self.stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def group_callbacks(spec: dict[str, Any], events: EventLog) -> list[Callback]:
    """The faults a group job of a :class:`FaultyDemo` carries (its spec says which)."""
    heal_kill = [DieWhileHealing(spec["heal_kill_marker"])] if spec.get("heal_kill_marker") else []
    return [HangInSum(spec.get("hang_at", []), events), *heal_kill]


__all__ = [
    "ANOTHER_SECRET",
    "FAULT_KINDS",
    "HEAL_KILL_MARKER",
    "DieWhileHealing",
    "FaultyDemo",
    "HangInSum",
    "group_callbacks",
    "parse_faults",
]
