"""Running jobs on an emulated cluster and keeping their results on disk, shared by every sweep command.

A results file is one JSON object: ``preset``, ``machine`` (:func:`~benchmarks.harness.machine.machine`),
``started`` / ``finished``, ``runs`` (each rank 0's ``run.json`` plus its ``name``, ``identity``, the driver's view and
the machine's load) and ``failed`` (each failed run's name and error). It is rewritten after every run, failed ones
included, so an interrupted sweep keeps what it measured.
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
        data = {"preset": preset, "machine": machine(module), "started": time.time(), "runs": [], "failed": []}
        return cls(path, data)

    @property
    def runs(self) -> list[dict[str, Any]]:
        """The finished runs."""
        return self.data["runs"]

    def has(self, name: str) -> bool:
        """Whether a run of this name finished."""
        return any(run["name"] == name for run in self.runs)

    def add_run(self, run: dict[str, Any]) -> None:
        """Keep a finished run and write the file."""
        self.runs.append(run)
        self.data["finished"] = time.time()
        self.write()

    def add_failure(self, name: str, error: RunFailed) -> None:
        """Keep a failed run's error and write the file."""
        self.data["failed"].append({"name": name, "error": str(error)[-2000:]})
        self.write()

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
    load_before = list(os.getloadavg())
    try:
        run = launch(cluster, job.config, job.identity, port=BASE_PORT + index % PORTS, timeout=timeout)
    except RunFailed as error:
        results.add_failure(job.name, error)
        raise
    run.update(name=job.name, loadavg_before=load_before, loadavg_after=list(os.getloadavg()), ended=time.time())
    results.add_run(run)
    return run
