"""The measures of one run, and how runs are summed up: every report computes them here, from the results JSON.

Definitions:

- **pace window**: optimizer steps ``first_sync + 1 .. max_steps`` (steps 9-16 with ``sync_every=8`` and 16 steps):
  whole rounds after the first sync, so every configuration has the same number of syncs per step in it and lazy
  initialization is left out. A run of a single round (``sync_every == max_steps``) is measured whole; a run
  without syncs uses the window of ``sync_every=8``. **Step time**: the clock over the window / its steps.
- **run pace**: ``(train + end-of-fit sync seconds) / steps``, the whole run up to the end of the end-of-fit sync:
  rank 0 waits in that sync for the slowest group, so it is the slowest group's pace (rank 0's step clock is its own
  group's, and without syncs the groups drift apart).
- **utilization** of a federated run: the same repeat's no-sync run's pace / its pace. FL+FSDP's groups are whole
  nodes and send nothing across links between syncs, so its no-sync reference is the unthrottled one; FL+HSDP's
  replicas talk across nodes every step, so its reference runs on the same link.
- **in-run utilization**: the strategy's own figure over the pace window, ``1 - exposed sync seconds / window
  seconds`` (``fedshard/sync_exposed_seconds`` as rank 0 logged it): no second run, so no run-to-run noise.
- **effective utilization**: the in-run utilization times the share of the window's inner-step progress that the
  landings keep, ``1 - mean discarded fraction`` (``(1 - merge_alpha) sync_delay / sync_every`` per landing; 0
  without a delay and with eager updates): compute whose progress a landing threw away does not count.
- **link bytes per step**: every node's upload over training (validation and the end-of-fit syncs excluded) / steps;
  **bytes per round**: the same per round of ``sync_every`` steps (one sync of the whole model).
- **spread**: median, mean, min, max and count of a measure over the repeats (or seeds): the sweeps report the
  median, the race (3 seeds) the mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from benchmarks.harness.config import RunIdentity

#: The compute utilization the federated strategies should keep at 50 Mbit/s with their best sync option.
UTILIZATION_TARGET = 0.95
#: The first sync of the sweeps (``sync_every=8``): where the pace window of a run without syncs starts.
DEFAULT_FIRST_SYNC = 8

Spread = dict[str, float]


def link_label(rate: float | None) -> str:
    """A link rate for people: ``"50 Mbit/s"`` or ``"unthrottled"``."""
    return "unthrottled" if rate is None else f"{rate:g} Mbit/s"


def link_slug(rate: float | None) -> str:
    """A link rate in run and configuration names: ``"50mbit"`` or ``"unthrottled"``."""
    return "unthrottled" if rate is None else f"{rate:g}mbit"


def link_order(rate: float | None) -> float:
    """Sort key: unthrottled first, then the fastest link."""
    return -math.inf if rate is None else -rate


def spread(values: Iterable[float | None]) -> Spread:
    """Median, mean, min, max and count of the finite values (``None``, NaN and infinities left out)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "mean": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {
        "median": statistics.median(finite),
        "mean": statistics.fmean(finite),
        "min": min(finite),
        "max": max(finite),
        "n": len(finite),
    }


def identity(run: dict[str, Any]) -> RunIdentity:
    """Where ``run`` sits in its sweep."""
    return RunIdentity.from_record(run["identity"])


def federation(run: dict[str, Any]) -> dict[str, Any]:
    """The run's sync options, as its strategy received them."""
    fields: dict[str, Any] = run["config"]["federation"]
    return fields


def pace_window(run: dict[str, Any]) -> range:
    """The optimizer steps the step time is measured over (see the module docstring)."""
    max_steps, sync_every = run["config"]["max_steps"], federation(run)["sync_every"]
    if sync_every < max_steps:
        first = sync_every
    else:
        first = 0 if sync_every == max_steps else DEFAULT_FIRST_SYNC
    return range(first + 1, max_steps + 1)


def _clocks(run: dict[str, Any]) -> dict[int, float]:
    return {0: 0.0, **{s["step"]: s["clock"] for s in run["steps"]}}


def window_seconds(run: dict[str, Any]) -> float:
    """Training seconds over the pace window."""
    window, clocks = pace_window(run), _clocks(run)
    return clocks[window.stop - 1] - clocks[window.start - 1]


def step_time(run: dict[str, Any]) -> float:
    """Seconds per optimizer step over the pace window."""
    return window_seconds(run) / len(pace_window(run))


def tokens_per_second(run: dict[str, Any]) -> float:
    """Training tokens of all ranks per second, over the pace window."""
    return float(run["tokens_per_step"]) / step_time(run)


def run_pace(run: dict[str, Any]) -> float:
    """Seconds per step over the whole run, the end-of-fit sync included (the slowest group's pace)."""
    return (run["train_seconds"] + run.get("finish_seconds", 0.0)) / run["config"]["max_steps"]


def landings_in_window(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The syncs rank 0's strategy reported during training inside the pace window."""
    window = pace_window(run)
    return [s for s in run["strategy_syncs"][0] if s["when"] == "train" and s["step"] in window]


def inrun_utilization(run: dict[str, Any]) -> float:
    """``1 - exposed sync seconds / window seconds`` over the pace window; NaN without syncs in it."""
    landings = landings_in_window(run)
    if not run["config"]["strategy"].startswith("fl_") or not landings:
        return math.nan
    return 1 - sum(s["sync_exposed_seconds"] for s in landings) / window_seconds(run)


def discarded_fraction(run: dict[str, Any]) -> float:
    """The share of a round's inner-step progress a landing throws away, from the run's sync options."""
    fed = federation(run)
    if fed.get("eager_updates"):
        return 0.0
    return (1.0 - fed.get("merge_alpha", 0.0)) * fed.get("sync_delay", 0) / fed["sync_every"]


def effective_utilization(run: dict[str, Any]) -> float:
    """In-run utilization times the share of progress the landings keep; NaN without syncs in the window."""
    return inrun_utilization(run) * (1.0 - discarded_fraction(run))


def utilization_reference(run: dict[str, Any]) -> tuple[str, float | None] | None:
    """The no-sync run a federated run's utilization is measured against: ``(configuration, link)``, or ``None``."""
    ident = identity(run)
    strategy = run["config"]["strategy"]
    if not strategy.startswith("fl_") or "nosync" in ident.configuration:
        return None
    return f"{strategy}-nosync", None if strategy == "fl_fsdp" else ident.link_mbit


def link_bytes_per_step(run: dict[str, Any]) -> float:
    """Bytes all nodes sent per training step, validation and the end-of-fit syncs left out."""
    training = run["link_tx_train"] - run["link_tx_val"] - run.get("link_tx_finish", 0)
    return float(training) / run["config"]["max_steps"]


def bytes_per_round(run: dict[str, Any]) -> float:
    """Link bytes per round of ``sync_every`` steps (one sync of the whole model); NaN for a run without syncs."""
    sync_every = federation(run)["sync_every"]
    return link_bytes_per_step(run) * sync_every if sync_every <= run["config"]["max_steps"] else math.nan


def final_ppl(run: dict[str, Any]) -> float:
    """Validation perplexity of the run's final model (the validation at its last step).

    Raises:
        ValueError: If the run has no validation at its last step.
    """
    vals = run["vals"]
    if not vals or vals[-1]["step"] != run["config"]["max_steps"]:
        raise ValueError(f"run {run['name']!r} has no validation at its last step {run['config']['max_steps']}")
    return float(vals[-1]["val_ppl"])
