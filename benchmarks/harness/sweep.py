"""Running jobs on an emulated cluster and keeping their results on disk, shared by every sweep command.

A results file is one JSON object: ``preset``, ``invocations`` (one per command that added to it: its ``machine``
record, :func:`~benchmarks.harness.machine.machine`, with the commit, and ``started`` / ``finished``), ``runs`` (each
rank 0's ``run.json`` plus its ``name``, ``identity``, the driver's view, the machine's load and the ``invocation``
that ran it) and ``failed`` (each failed run's name, error and invocation); ``machine`` and ``started`` repeat the
latest invocation's. A new command adds to the file: no run is ever replaced or removed, and a rerun is another run
(``benchmarks.records.load`` selects which runs a report uses, by a documented rule). The file is rewritten after
every run, failed ones included, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster import EmulatedCluster, namespaces_available
from benchmarks.harness.config import Job, RunConfig
from benchmarks.harness.launch import REPO, RunFailed, launch
from benchmarks.harness.machine import machine

RESULTS = REPO / "benchmarks" / "results"
BASE_PORT = 29500
PORTS = 400


@dataclass
class ResultsFile:
    """A sweep's results, written to ``path`` after every change.

    Args:
        path: The JSON file.
        data: Its content; see the module docstring.
    """

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(cls, path: Path, preset: str, module: str) -> ResultsFile:
        """An empty results file of ``preset``, recorded as measured by ``python -m module``."""
        invocation = {"machine": machine(module), "started": time.time()}
        data = {"preset": preset, **invocation, "invocations": [invocation], "runs": [], "failed": []}
        return cls(path, data)

    @classmethod
    def open(cls, path: Path, preset: str, module: str) -> ResultsFile:
        """``preset``'s results file at ``path`` with a new invocation (``python -m module``) to add runs to.

        Every run already there stays. A file written before invocations were recorded becomes invocation 0.

        Raises:
            ValueError: If the file holds another preset's runs.
        """
        if not path.exists():
            return cls.new(path, preset, module)
        data = json.loads(path.read_text())
        if data.get("preset") != preset:
            raise ValueError(f"{path} holds the runs of preset {data.get('preset')!r}, not {preset!r}.")
        if "invocations" not in data:
            first = {key: data[key] for key in ("machine", "started", "finished") if key in data}
            data["invocations"] = [first]
            for record in [*data["runs"], *data["failed"]]:
                record.setdefault("invocation", 0)
        invocation = {"machine": machine(module), "started": time.time()}
        data["invocations"].append(invocation)
        data.update(invocation)
        return cls(path, data)

    @property
    def invocation(self) -> int:
        """The index of this command's invocation."""
        return len(self.data.get("invocations", [None])) - 1

    @property
    def runs(self) -> list[dict[str, Any]]:
        """The finished runs."""
        return self.data["runs"]

    def has(self, name: str) -> bool:
        """Whether a run of this name finished."""
        return any(run["name"] == name for run in self.runs)

    def add_run(self, run: dict[str, Any]) -> None:
        """Keep a finished run and write the file."""
        run["invocation"] = self.invocation
        self.runs.append(run)
        self._finished()
        self.write()

    def add_failure(self, name: str, error: RunFailed) -> None:
        """Keep a failed run's error and write the file."""
        self.data["failed"].append({"name": name, "error": str(error)[-2000:], "invocation": self.invocation})
        self._finished()
        self.write()

    def _finished(self) -> None:
        self.data["finished"] = time.time()
        if self.data.get("invocations"):
            self.data["invocations"][-1]["finished"] = self.data["finished"]

    def write(self) -> None:
        """Write atomically (a reader never sees half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def require_namespaces() -> None:
    """Exit with the reason when this process cannot emulate a cluster.

    Raises:
        SystemExit: Without root or iproute2.
    """
    if (reason := namespaces_available()) is not None:
        raise SystemExit(f"Cannot emulate a cluster: {reason}.")


def prepare_data(cfg: RunConfig, work: Path) -> None:
    """Export, tokenize and cache the corpus once, before any node starts (in a child: it imports a lot)."""
    env = {**os.environ, "HF_HOME": str(work / "hf_home"), "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    code = (
        "import sys; from lightning_fedshard.examples import ShakespeareDataModule as D;"
        "D(cache_dir=sys.argv[1], vocab_size=int(sys.argv[2])).prepare_data()"
    )
    subprocess.run([sys.executable, "-c", code, cfg.cache_dir, str(cfg.vocab_size)], env=env, check=True)


def run_job(
    cluster: EmulatedCluster,
    job: Job,
    index: int,
    timeout: float,
    results: ResultsFile,
    between_sites_mbit: float | None = None,
) -> dict[str, Any]:
    """Run ``job`` on ``cluster`` (its link set to the job's rate) and keep the run, or its failure, in ``results``.

    Args:
        cluster: The emulated cluster.
        job: The run.
        index: The job's position in the sweep (it picks the rendezvous port).
        timeout: Seconds the run may take.
        results: Where the run or its failure is kept.
        between_sites_mbit: The rate between the cluster's sites, if it has several.

    Raises:
        RunFailed: After keeping the failure.
    """
    cluster.set_bandwidth(job.identity.link_mbit, between_sites_mbit)
    if cluster.latency or job.identity.rtt_ms:
        cluster.set_rtt(job.identity.rtt_ms)
    load_before = list(os.getloadavg())
    try:
        run = launch(cluster, job.config, job.identity, port=BASE_PORT + index % PORTS, timeout=timeout)
    except RunFailed as error:
        results.add_failure(job.name, error)
        raise
    run.update(name=job.name, loadavg_before=load_before, loadavg_after=list(os.getloadavg()), ended=time.time())
    results.add_run(run)
    return run
