"""The Trainer callback that routes optimizer steps to the federated runtime, and logs its syncs."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fedshard.core.step.stats import SyncStats
from lightning_fedshard.runtime import FederatedRuntime
from lightning_fedshard.trainer.meetings import EpochBoundary


class OuterSync(Callback):
    """Routes the Trainer's steps to the federation: the outer step runs every ``sync_every`` optimizer steps.

    The ``fl_fsdp`` and ``fl_hsdp`` strategies place this callback first in the Trainer's callback list (they add one
    if none was given, and move a given one to the front), so at a sync step every other callback's
    ``on_train_batch_end`` - checkpoints included - sees the synced weights, and when ``fit`` stops between two
    syncs every other callback's ``on_train_end`` sees the consensus in every group. Pass one explicitly only to
    change how it logs. Validation during ``fit`` runs on the consensus weights of the last sync (groups keep their
    own weights in between and get them back afterwards).

    Only real optimizer steps count (``trainer.global_step``): under gradient accumulation the micro-batches of one
    step count once. Under manual optimization every ``step()`` of a ``LightningOptimizer`` counts, so with two
    optimizers stepped per batch ``sync_every`` counts both.

    Every sync writes ``fedshard/outer_grad_norm``, ``fedshard/drift`` (RMS distance of the groups from their
    mean), ``fedshard/sync_bytes`` (bytes this rank sent in the outer all-reduce), ``fedshard/sync_seconds`` and
    ``fedshard/num_syncs`` (outer steps; with a hierarchical or mixing outer topology also ``fedshard/site_syncs``,
    its site syncs and mixes) to every logger of the Trainer at the optimizer step of the sync, whatever
    ``log_every_n_steps`` says, and shows the count of syncs of every kind and the drift in the progress bar (as
    ``syncs`` and ``drift``).

    Args:
        log_stats: Log the statistics of each sync.
        prog_bar: Show the count of syncs (outer steps, site syncs and mixes) and the drift in the progress bar too
            (as ``syncs`` and ``drift``).
    """

    def __init__(self, log_stats: bool = True, prog_bar: bool = True) -> None:
        self.log_stats = log_stats
        self.prog_bar = prog_bar
        #: Where the loop is: inside an epoch's training batches (metrics stay in the group) or where groups meet.
        self.epoch_boundary = EpochBoundary()
        self._consensus = ExitStack()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epoch_boundary.reached()
        runtime = _runtime(trainer)
        runtime.model.set_optimizers(trainer.optimizers)
        runtime.start(trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.epoch_boundary.batch_started()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The first of the epoch-end hooks (this callback is first): the epoch's metrics are reduced after it.
        self.epoch_boundary.reached()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = _runtime(trainer).after_optimizer_step(trainer.global_step)
        if stats is not None and self.log_stats:
            _log_to_loggers(trainer, stats)
            if self.prog_bar:
                # Short names that fit the bar's columns; `syncs` counts every kind of sync.
                for short, value in (("syncs", float(stats.total_syncs)), ("drift", stats.drift)):
                    pl_module.log(short, value, on_step=True, on_epoch=False, prog_bar=True, logger=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epoch_boundary.reached()
        runtime = _runtime(trainer)
        stats = runtime.finish()
        if stats is not None and self.log_stats:
            _log_to_loggers(trainer, stats)  # `self.log` is not allowed in `on_train_end`
        plan_report = getattr(trainer.strategy, "plan_report", None)
        if plan_report is not None:
            report = {f"fedshard/plan/{k}": v for k, v in plan_report.items()}
            for logger in trainer.loggers:
                logger.log_metrics(report, step=trainer.global_step)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            runtime = _runtime(trainer)
            self._consensus.enter_context(runtime.consensus_weights())
            distance = runtime.federation.consensus_distance
            if distance is not None and self.log_stats:
                for logger in trainer.loggers:
                    logger.log_metrics({"fedshard/consensus_distance": distance}, step=trainer.global_step)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._consensus.close()


def _runtime(trainer: Trainer) -> FederatedRuntime:
    """The federated runtime of the trainer's strategy, or a clear error if it uses another strategy."""
    runtime = getattr(trainer.strategy, "runtime", None)
    if not isinstance(runtime, FederatedRuntime):
        raise TypeError(
            "`OuterSync` needs the 'fl_fsdp' or 'fl_hsdp' strategy, but the trainer uses"
            f" {type(trainer.strategy).__name__}."
        )
    return runtime


def _log_to_loggers(trainer: Trainer, stats: SyncStats) -> None:
    # Straight to the loggers: `self.log` only reaches them every `log_every_n_steps`, and a sync between two
    # logging steps would be lost. The progress bar gets a short summary through Lightning.
    for logger in trainer.loggers:
        logger.log_metrics(stats.as_dict(), step=trainer.global_step)
