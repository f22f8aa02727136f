"""Simulate a federation's learning on one device: every group a Lightning ``Trainer`` in a thread of this process.

The groups run the strategies' own federation (rounds, outer step, codecs, error feedback, eager updates, outer
topologies) through an in-process communicator, one group's thread at a time, each with random generators of its
own. A group holds the whole model (a group of one rank): the simulation lands on the weights a Trainer run of
``fl_fsdp2`` with one rank per group reaches on the same data and seeds. What a group of several ranks adds
(a larger batch per step) is ``ranks_per_group``: each group accumulates that many batches per optimizer step.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torchmetrics import Metric

from lightning_fedshard._arguments import FederatedArguments
from lightning_fedshard.core.backends.sharding import UNSHARDED
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.transport.inprocess import GROUP_THREAD_PREFIX, Baton, InProcessGroups, run_threads
from lightning_fedshard.core.transport.mesh import FederationMesh
from lightning_fedshard.runtime import FederatedRuntime
from lightning_fedshard.simulate.strategy import InProcessMesh, SimulatedStrategy
from lightning_fedshard.trainer.strategy import refuse_pace_with_manual_optimization

#: Trainer arguments the simulator sets itself: every group trains on one device of this process.
_OWN_TRAINER_ARGS = ("strategy", "devices", "num_nodes")
#: Trainer arguments that count batches of one rank when given as integers.
_BATCH_COUNTS = ("limit_train_batches", "limit_val_batches", "val_check_interval")


@dataclass
class SimulationResult:
    """What a simulation leaves.

    Attributes:
        trainers: Every group's Trainer (group 0's holds the loggers and the checkpoint callbacks' paths).
        modules: Every group's LightningModule; after ``fit`` each holds the consensus.
    """

    trainers: list[Trainer]
    modules: list[LightningModule]
    datamodules: list[LightningDataModule | None] = field(default_factory=list)
    groups: InProcessGroups | None = None
    baton: Baton | None = None

    def run(self, method: str, **kwargs: Any) -> list[Any]:
        """Call ``trainer.<method>(module, datamodule=..., **kwargs)`` of every group at once, each in its thread.

        ``datamodule`` is each group's own copy unless dataloaders are given. Returns each group's result.
        """
        assert self.groups is not None and self.baton is not None
        groups, baton = self.groups, self.baton

        def held(g: int) -> Any:
            with baton.held(g):
                own = {} if "dataloaders" in kwargs else {"datamodule": self.datamodules[g]}
                return getattr(self.trainers[g], method)(self.modules[g], **own, **kwargs)

        with _group_zero_logs_only():
            return run_threads(len(self.trainers), held, on_error=groups.abort)

    def validate(self, dataloaders: Any = None) -> list[dict[str, float]]:
        """Validate the trained model (every group holds the consensus) as ``Trainer.validate`` would, on all groups.

        Returns group 0's results (metrics logged with ``sync_dist=True`` are averaged over the groups).
        """
        return self.run("validate", **({"dataloaders": dataloaders} if dataloaders is not None else {}))[0]

    def test(self, dataloaders: Any = None) -> list[dict[str, float]]:
        """Test the trained model as ``Trainer.test`` would, on all groups; group 0's results."""
        return self.run("test", **({"dataloaders": dataloaders} if dataloaders is not None else {}))[0]

    @property
    def metrics(self) -> dict[str, float]:
        """Group 0's ``callback_metrics`` as floats (validation metrics are averaged over the groups)."""
        return {k: float(v) for k, v in self.trainers[0].callback_metrics.items()}

    def plot_validation(self, path: str | Path | None = None) -> Path | None:
        """Draw every ``val_*`` metric of group 0's CSV log against the optimizer step (matplotlib).

        Args:
            path: The picture; default ``validation.png`` next to the CSV log.

        Returns:
            Where it was drawn, or ``None`` without a CSV logger or a validation.
        """
        csv_logger = next((lg for lg in self.trainers[0].loggers if isinstance(lg, CSVLogger)), None)
        if csv_logger is None:
            return None
        metrics = Path(csv_logger.log_dir) / "metrics.csv"
        curves = validation_curves(metrics) if metrics.exists() else {}
        if not curves:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.5), squeeze=False)
        for ax, (name, points) in zip(axes[0], sorted(curves.items())):
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".")
            ax.set_xlabel("optimizer step")
            ax.set_title(name)
            ax.grid(alpha=0.3)
        figure.tight_layout()
        out = Path(path) if path is not None else metrics.with_name("validation.png")
        figure.savefig(out, dpi=110)
        plt.close(figure)
        return out


def validation_curves(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of every ``val_*`` column of a Lightning CSV log (the last value per step)."""
    curves: dict[str, dict[int, float]] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name.startswith("val_") and value:
                    curves.setdefault(name, {})[int(row["step"])] = float(value)
    return {name: sorted(points.items()) for name, points in curves.items()}


class Simulator:
    """Runs the federated training of one LightningModule with ``num_groups`` groups on one device.

    Args:
        federation: The federation's options: a :class:`~lightning_fedshard.core.config.FederationConfig`, or a
            federated strategy (e.g. ``FLHSDPStrategy(num_groups=4, sync_every=8)``) whose options are taken. Its
            FSDP arguments do not apply: a group holds the whole model, and fragments are cut at parameters.
        num_groups: Groups to simulate; default: the federation's ``num_groups``.
        ranks_per_group: Ranks of a group of the real run: each group's optimizer step takes that many batches
            (gradient accumulation), as a group of that many ranks would. Trainer arguments that count one rank's
            batches (``limit_train_batches``, ``limit_val_batches``, ``val_check_interval`` as integers) are
            multiplied by it, so that they mean the same optimizer steps as in the real run.
        **trainer_kwargs: Arguments of every group's ``Trainer`` (``max_steps``, ``accelerator``, ``callbacks``,
            ``logger``, ...). Callbacks are copied into every group (collectives of e.g. ``ModelCheckpoint`` need
            all); loggers and the progress bar are group 0's only (default logger: a ``CSVLogger`` under
            ``default_root_dir``, name ``simulate``). Checkpoints hold every group in one file.

    Raises:
        ValueError: For options the simulator cannot run exactly, naming them, before anything is built.
    """

    def __init__(
        self,
        federation: FederationConfig | FederatedArguments,
        num_groups: int | None = None,
        ranks_per_group: int = 1,
        **trainer_kwargs: Any,
    ) -> None:
        self.config = _config_of(federation)
        self.num_groups = _num_groups(self.config, num_groups)
        if ranks_per_group < 1:
            raise ValueError(f"`ranks_per_group={ranks_per_group}` must be at least 1.")
        self.ranks_per_group = ranks_per_group
        given = [k for k in _OWN_TRAINER_ARGS if trainer_kwargs.get(k) not in (None, 1, "auto")]
        if given:
            raise ValueError(
                f"The simulator runs every group on one device of this process; drop the Trainer argument(s)"
                f" {', '.join(f'`{k}={trainer_kwargs[k]!r}`' for k in given)}."
            )
        accumulate = trainer_kwargs.pop("accumulate_grad_batches", 1)
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"`accumulate_grad_batches={accumulate!r}` must be a positive integer in a simulation.")
        self.accumulate = accumulate * ranks_per_group
        self.device = _device(trainer_kwargs.pop("accelerator", "auto"))
        for key in _OWN_TRAINER_ARGS:
            trainer_kwargs.pop(key, None)
        for key in _BATCH_COUNTS:  # counted in one rank's batches: a simulated group takes `ranks_per_group` a step
            value = trainer_kwargs.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                trainer_kwargs[key] = value * ranks_per_group
        self.trainer_kwargs = trainer_kwargs

    @property
    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this simulation must have been written with to be resumed."""
        return {
            "num_groups": self.num_groups,
            "ranks_per_group": self.ranks_per_group,
            "accumulate_grad_batches": self.accumulate,
            "federation": repr(self.config),
        }

    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
    ) -> SimulationResult:
        """Train ``model`` as every group of the federation would, from the same initial weights.

        Every group trains a copy of ``model`` (and of ``datamodule``) taken before training; ``model`` itself is
        group 0's. Data loaders are sharded over the groups as a multi-rank run shards them over its ranks.

        Args:
            model: The LightningModule (group 0's copy).
            train_dataloaders: As ``Trainer.fit`` takes them (shared by the groups: each samples its part).
            val_dataloaders: As ``Trainer.fit`` takes them.
            datamodule: As ``Trainer.fit`` takes it (copied for every group).
            ckpt_path: A checkpoint this simulator wrote (``ModelCheckpoint`` or ``save_checkpoint``), to resume.
        """
        refuse_pace_with_manual_optimization(model, self.config.pace)
        models = [model] + [copy.deepcopy(model) for _ in range(self.num_groups - 1)]
        datamodules = [datamodule] + [copy.deepcopy(datamodule) for _ in range(self.num_groups - 1)]
        groups = InProcessGroups(self.num_groups, self.config.site_blocks(self.num_groups))
        baton = Baton(self.num_groups)  # every group starts with this process's generator states, as ranks would
        trainers = [self._trainer(groups, 0, baton)]
        with _info_silenced():  # Lightning's "GPU available: ..." once, not once per group
            trainers += [self._trainer(groups, g, baton) for g in range(1, self.num_groups)]

        def run(g: int) -> None:
            _sync_metrics(models[g], trainers[g].strategy)
            trainers[g].fit(models[g], train_dataloaders, val_dataloaders, datamodules[g], ckpt_path=ckpt_path)

        def held(g: int) -> None:
            with baton.held(g):
                run(g)

        with _group_zero_logs_only():
            run_threads(self.num_groups, held, on_error=groups.abort)
        return SimulationResult(trainers, models, datamodules, groups, baton)

    def _trainer(self, groups: InProcessGroups, group: int, baton: Baton) -> Trainer:
        kwargs = dict(self.trainer_kwargs)
        device = self.device
        runtime = FederatedRuntime(
            self.config,
            hybrid=False,
            name="fl_simulated",
            backend=UNSHARDED,
            mesh=lambda topology, device_type, sites: cast(FederationMesh, InProcessMesh(groups, group)),
            shape=(
                f"{self.num_groups} group(s) on one {device.type} device, a group's step the batches of"
                f" {self.ranks_per_group} rank(s) (`ranks_per_group={self.ranks_per_group}`)"
            ),
        )
        strategy = SimulatedStrategy(runtime, groups, group, device, baton, self.settings)
        callbacks = kwargs.pop("callbacks", None) or []
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        if kwargs.get("logger") in (None, True):  # CSV by default: the validation curves are drawn from it
            kwargs["logger"] = CSVLogger(kwargs.get("default_root_dir") or os.getcwd(), name="simulate")
        if group > 0:
            callbacks = copy.deepcopy(callbacks)
            kwargs["logger"] = False  # the progress bar and the model summary show on the global zero only
        return Trainer(
            accelerator=device.type,
            devices=1,
            strategy=strategy,
            accumulate_grad_batches=self.accumulate,
            callbacks=callbacks,
            **kwargs,
        )


def _config_of(federation: FederationConfig | FederatedArguments) -> FederationConfig:
    config = federation.runtime.config if isinstance(federation, FederatedArguments) else federation
    if not isinstance(config, FederationConfig):
        raise TypeError(
            f"`federation` must be a FederationConfig or a federated strategy, not {type(federation).__name__}."
        )
    refuse_unsimulated(federation)
    return config


def refuse_unsimulated(federation: FederationConfig | FederatedArguments) -> None:
    """Refuse the federation options a simulation cannot run, naming them.

    Raises:
        ValueError: For an elastic federation, a measured pace, or a strategy's ``plan`` check.
    """
    config = federation.runtime.config if isinstance(federation, FederatedArguments) else federation
    if config.elastic is not None:
        raise ValueError(
            "`elastic=...` is for groups that run as separate jobs and join over the network; the simulator runs a"
            " fixed set of groups in one process. Drop `elastic` to simulate the same federation."
        )
    if config.pace is not None and config.pace.measured:
        raise ValueError(
            f"`pace={config.pace!r}` measures each group's speed while training; the simulator's groups take turns on"
            " one device, so their speeds say nothing of a cluster's (and would make the run depend on the machine)."
            " Give the groups' relative speeds: `Pace(speeds=(1, 1, 1, 0.5))`."
        )
    if isinstance(federation, FederatedArguments) and federation.plan_check is not None:
        raise ValueError(
            "`plan=...` checks a run's pace against a cluster's prediction; a simulation runs on one device and has"
            " no cluster pace to check. Drop `plan`."
        )


def _num_groups(config: FederationConfig, num_groups: int | None) -> int:
    value = num_groups if num_groups is not None else config.num_groups
    if value is None:
        raise ValueError("Give `num_groups`: the federation's options leave it to the cluster (one group per node).")
    if value < 1:
        raise ValueError(f"`num_groups={value}` must be at least 1.")
    if config.num_groups is not None and num_groups is not None and config.num_groups != num_groups:
        raise ValueError(f"`num_groups={num_groups}` differs from the federation's `num_groups={config.num_groups}`.")
    dataclasses.replace(config, num_groups=value).topology(value, 1, False)  # e.g. sites that do not divide them
    return value


def _device(accelerator: Any) -> torch.device:
    """The device of every group: the accelerator's first device (``"auto"``: CUDA if available)."""
    name = str(accelerator).lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if name in ("cpu", "auto"):
        return torch.device("cpu")
    raise ValueError(f"`accelerator={accelerator!r}`: the simulator runs on 'cpu' or 'gpu' ('cuda').")


class _GroupZeroOnly(logging.Filter):
    """Drops log records of other groups' threads: Lightning's rank-zero messages would repeat once per group."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.threadName or ""
        return not name.startswith(GROUP_THREAD_PREFIX) or name == f"{GROUP_THREAD_PREFIX}0"


@contextmanager
def _group_zero_logs_only() -> Iterator[None]:
    handlers = {
        id(h): h for name in (None, "lightning.pytorch", "lightning.fabric") for h in logging.getLogger(name).handlers
    }
    only = _GroupZeroOnly()
    for handler in handlers.values():
        handler.addFilter(only)
    try:
        yield
    finally:
        for handler in handlers.values():
            handler.removeFilter(only)


@contextmanager
def _info_silenced() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _sync_metrics(module: LightningModule, strategy: Any) -> None:
    """Make the module's torchmetrics gather their states over the groups, as they would over ranks."""

    def gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        return strategy.gather_objects(tensor.detach().clone())

    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.dist_sync_fn = gather
            metric.distributed_available_fn = lambda: True
