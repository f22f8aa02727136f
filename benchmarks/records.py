"""Reading results files: every run in the current form, whatever version of the harness wrote it.

A run records its configuration with the sync options as ``config["federation"]`` (every ``FederationConfig`` field,
as the strategy received it) and its place in the sweep as ``identity``. Results written before that kept the sync
options as flat ``config`` fields, with the harness's own defaults of the time (float32 outer traffic, ``"nesterov"``,
no error feedback), and named the run instead of recording its identity; :func:`upgrade_run` turns such a run into
the current form once, when it is read.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.config import BASELINES, RunConfig, RunIdentity

#: The sync options' defaults of the harness that wrote the flat records (they differ from the package's).
FLAT_DEFAULTS: dict[str, Any] = {
    "sync_every": 8,
    "outer_optimizer": "nesterov",
    "reduce_dtype": "float32",
    "error_feedback": False,
    "fragments": 1,
    "sync_delay": 0,
    "merge_alpha": 0.0,
    "quant_block_size": None,
}
#: Flat fields that left the training configuration for the federation record.
_FLAT_ONLY = ("num_groups",)


def load(path: Path, runs: str = "latest") -> dict[str, Any]:
    """A results file with its runs (and the race's stage runs) in the current form.

    Args:
        path: The results file.
        runs: Which runs a report uses: ``"latest"`` (the rule every report follows) keeps, for each cell of the sweep
            (configuration, link and round trip), the runs of the latest invocation that ran that cell, so a cell
            measured again after a change is judged on its new runs while the earlier ones stay in the file;
            ``"all"`` keeps every run.

    Raises:
        ValueError: For an unknown ``runs``.
    """
    if runs not in ("latest", "all"):
        raise ValueError(f"`runs={runs!r}` must be 'latest' or 'all'.")
    results: dict[str, Any] = json.loads(Path(path).read_text())
    for run in results["runs"]:
        upgrade_run(run, results["preset"])
    if runs == "latest":
        results["runs"] = latest_runs(results["runs"])
    return results


def latest_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each cell (configuration, link, round trip), the runs of the latest invocation that ran it, in order."""

    def cell(run: dict[str, Any]) -> tuple[Any, ...]:
        identity = run["identity"]
        return identity["configuration"], identity["link_mbit"], identity.get("rtt_ms", 0.0)

    latest: dict[tuple[Any, ...], int] = {}
    for run in runs:
        latest[cell(run)] = max(latest.get(cell(run), 0), run.get("invocation", 0))
    return [run for run in runs if run.get("invocation", 0) == latest[cell(run)]]


def load_if_exists(path: Path) -> dict[str, Any] | None:
    """:func:`load`, or ``None`` when the sweep was not run."""
    return load(path) if Path(path).exists() else None


def upgrade_run(run: dict[str, Any], preset: str) -> None:
    """Bring one run of a ``preset`` results file to the current form, in place (a current run is left as it is)."""
    if "federation" not in run["config"]:
        run["config"] = upgrade_config(run["config"])
    if "identity" not in run:
        run["identity"] = asdict(derive_identity(run, preset))
    run["config"].setdefault("cpu_quota", None)  # runs from before per-node CPU quotas had none
    run["config"].setdefault("elastic_groups", False)  # nor elastic groups
    run["config"]["federation"].setdefault("pace", None)  # nor a per-group pace
    run.pop("kind", None)  # the race's (strategy, steps, option): now its identity and config
    run.pop("sweep", None)  # now the identity's preset


def upgrade_config(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat configuration as :meth:`RunConfig.record` writes it now, the missing sync options at their old defaults.

    The strategy received one group per node for FL+FSDP, ``num_groups`` for FL+HSDP, and a single group with
    ``"fedavg"`` for the baselines; a block size of ``None`` meant the package's default.
    """
    options = {key: flat.get(key, default) for key, default in FLAT_DEFAULTS.items()}
    if options["quant_block_size"] is None:
        del options["quant_block_size"]
    strategy = flat["strategy"]
    options["num_groups"] = {"fl_fsdp": None, "fl_hsdp": flat.get("num_groups")}.get(strategy, 1)
    if strategy in BASELINES:
        options["outer_optimizer"] = "fedavg"
    training = {k: v for k, v in flat.items() if k not in FLAT_DEFAULTS and k not in _FLAT_ONLY}
    return RunConfig.from_record({**training, "federation": options}).record()


def derive_identity(run: dict[str, Any], preset: str) -> RunIdentity:
    """The identity of a run recorded without one, from what its name and configuration say.

    Sweep runs are named ``<configuration>-<link>-r<repeat>``; race runs kept their configuration in ``kind``
    (strategy, steps, option) and are repeated over seeds.
    """
    seed = run["config"].get("seed", 0)
    link = run["driver"]["link_mbit"]
    if "kind" in run:
        strategy, _, option = run["kind"]
        return RunIdentity(preset, f"{strategy}-{option}" if option else strategy, seed, link, seed)
    cell, _, repeat = run["name"].rpartition("-r")
    return RunIdentity(preset, cell.rsplit("-", 1)[0], int(repeat), link, seed)
