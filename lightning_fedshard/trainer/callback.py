"""The Trainer callback that runs the outer step of FL+FSDP / FL+HSDP."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fedshard.core.outer import SyncStats


class OuterSync(Callback):
    """Runs the federation's outer step every ``sync_every`` optimizer steps, and once more when ``fit`` ends.

    The ``fl_fsdp`` and ``fl_hsdp`` strategies attach this callback by themselves; pass one explicitly only to
    change how it logs. Validation during ``fit`` runs on the consensus weights of the last sync (groups keep
    their own weights in between and get them back afterwards).

    Every sync writes ``fedshard/outer_grad_norm``, ``fedshard/drift`` (RMS distance of the groups from their
    mean), ``fedshard/sync_bytes`` (bytes this rank sent in the outer all-reduce), ``fedshard/sync_seconds`` and
    ``fedshard/num_syncs`` to every logger of the Trainer at the optimizer step of the sync, whatever
    ``log_every_n_steps`` says, and shows the sync count and drift in the progress bar.

    Args:
        log_stats: Log the statistics of each sync.
        prog_bar: Show ``fedshard/num_syncs`` and ``fedshard/drift`` in the progress bar too.
    """

    _PROG_BAR_KEYS = ("fedshard/num_syncs", "fedshard/drift")

    def __init__(self, log_stats: bool = True, prog_bar: bool = True) -> None:
        self.log_stats = log_stats
        self.prog_bar = prog_bar
        self._consensus = ExitStack()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = _strategy(trainer)
        strategy.start_federation(trainer.global_step)
        # A checkpoint written in `on_train_batch_end` before this callback's sync of the same step resumes with that
        # sync still due: run it now, as the uninterrupted run did.
        stats = strategy.federation.maybe_sync(trainer.global_step)
        if stats is not None:
            _restart_skipped_groups(trainer, stats)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = _strategy(trainer).federation.maybe_sync(trainer.global_step)
        if stats is not None:
            _restart_skipped_groups(trainer, stats)
            if self.log_stats:
                self._log(trainer, pl_module, stats)

    def _log(self, trainer: Trainer, pl_module: LightningModule, stats: SyncStats) -> None:
        # Straight to the loggers: `self.log` only reaches them every `log_every_n_steps`, and a sync between two
        # logging steps would be lost. The progress bar gets a short summary through Lightning.
        _log_to_loggers(trainer, stats)
        if self.prog_bar:
            for name, value in stats.as_dict().items():
                if name in self._PROG_BAR_KEYS:
                    pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=True, logger=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stats = _strategy(trainer).federation.finish(trainer.global_step)
        if stats is not None:
            _restart_skipped_groups(trainer, stats)
            if self.log_stats:
                # `self.log` is not allowed in `on_train_end`; write to the loggers directly.
                _log_to_loggers(trainer, stats)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and _strategy(trainer).federation.started:
            self._consensus.enter_context(_strategy(trainer).federation.consensus_weights())

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._consensus.close()


def _strategy(trainer: Trainer) -> Any:
    from lightning_fedshard.trainer.strategy import federated_strategy

    return federated_strategy(trainer)


def _restart_skipped_groups(trainer: Trainer, stats: SyncStats) -> None:
    _strategy(trainer).restart_skipped_groups(stats, trainer.optimizers, trainer.global_step)


def _log_to_loggers(trainer: Trainer, stats: SyncStats) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(stats.as_dict(), step=trainer.global_step)
