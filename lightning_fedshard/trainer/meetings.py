"""Where Lightning's own loop and callbacks would make the groups meet between syncs, and what the strategies do.

A federation only pays off if nothing makes one group wait for another between two syncs. Lightning's training loop
and some of its callbacks issue collectives over the whole world on their own:

- before every training batch the loop broadcasts a SIGTERM flag from global rank 0 (:func:`keep_sigterm_in_group`
  broadcasts it inside each group instead);
- ``self.log(..., sync_dist=True)`` in ``training_step`` reduces over the world (the strategies' ``reduce`` keeps it
  inside the group while training);
- ``Timer`` (``Trainer(max_time=...)``) and ``ModelCheckpoint(train_time_interval=...)`` broadcast a decision from
  global rank 0 after every batch (:func:`decide_at_syncs` lets them decide only at the steps where every group meets
  anyway, the ends of the federation's rounds);
- validation and ``ModelCheckpoint(every_n_train_steps=N)`` involve every group by nature (the validation set is
  split over every rank, a checkpoint holds every group's state): :func:`meetings_between_syncs` names the settings
  that put them between syncs, for a warning.

Lightning's decisions are the same on every rank of every group, as under DDP: ``reduce_boolean_decision`` always
votes over the whole world, and it is only called where every group meets anyway (a checkpoint, the end of an epoch,
validation, the end of a round). Metrics reduced at the end of an epoch (``on_epoch=True``) reduce over the world too
(:class:`EpochBoundary`), as under DDP; a metric reduced inside a training step is its group's. A ``ModelCheckpoint``
that decides while training reads the metrics of global rank 0 (:func:`decide_at_syncs`), so every rank ranks and
names its checkpoints alike even when the groups' own metrics differ.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.utilities.exceptions import SIGTERMException

#: The instance attribute that marks a callback whose hooks this module replaced, so they can be put back.
_DEFERRED = "_fedshard_decides_at_syncs"
#: The hooks this module may replace on a callback instance (restored by :func:`restore_callbacks`).
_REPLACED = ("on_train_batch_end", "_monitor_candidates")


class EpochBoundary:
    """Whether a fitting Trainer is inside an epoch's training batches or at a point where every group meets.

    Lightning reduces the metrics logged with ``sync_dist=True`` through the strategy: a step's metrics when they are
    logged, an epoch's (``on_epoch=True``) once the epoch's batches are done. Inside the batches a reduction over the
    world would make every group wait for the others at every step, so the strategies keep it in the group; from the
    end of the epoch's batches to the next batch (epoch-end hooks, the epoch's metrics, checkpoints) every group is
    at the same point and reductions span the world, as under DDP. :class:`~lightning_fedshard.OuterSync` tells it
    where the loop is.
    """

    def __init__(self) -> None:
        self.inside = False

    def batch_started(self) -> None:
        """A training batch begins: reductions stay in the group until the epoch's batches end."""
        self.inside = True

    def reached(self) -> None:
        """The epoch's batches are done (or training starts or ends): every group meets."""
        self.inside = False


def keep_sigterm_in_group(trainer: Trainer, process_groups: Callable[[], Any]) -> None:
    """Propagate a SIGTERM inside each group instead of over the whole world at every batch.

    Lightning's training loop broadcasts a SIGTERM flag from global rank 0 to every rank before each batch, so that all
    ranks stop at the same batch. Over a federation that is a collective across every group at every step: the groups
    would wait for the slowest one at every step. Here each group broadcasts the flag from its own first rank (over its
    shard group, then its replicas). A job scheduler signals every rank of a job anyway; a group that stops alone is
    found gone by the others at their next sync, like a failed group (see docs/concepts.md).

    Args:
        trainer: The Trainer whose fit loop broadcasts the flag.
        process_groups: Returns the group's FSDP process group(s) (an ``(intra, inter)`` tuple with HSDP).
    """
    loop = trainer.fit_loop.epoch_loop

    def broadcast_in_group() -> None:
        received = getattr(trainer, "received_sigterm", False)
        groups = process_groups()
        groups = [g for g in (reversed(groups) if isinstance(groups, tuple) else (groups,)) if g.size() > 1]
        if groups:  # a group of one rank has nobody to tell
            flag = torch.tensor([1 if received else 0], device=trainer.strategy.root_device)
            for group in groups:
                dist.broadcast(flag, src=dist.get_global_rank(group, 0), group=group)
            received = flag.item() == 1
        if received:
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = broadcast_in_group  # type: ignore[method-assign]


def decide_at_syncs(trainer: Trainer, period: int) -> list[Callback]:
    """Make the callbacks that decide while training decide alike in every group, where every group meets.

    ``Timer`` with ``interval="step"`` (what ``Trainer(max_time=...)`` adds) and ``ModelCheckpoint`` with a
    ``train_time_interval`` broadcast "stop?" / "save?" from global rank 0 after every training batch. Their decision
    must be the same in every group (a group that stops or saves alone would leave the others waiting at the next
    sync), so it stays a broadcast over the world, but only at the ends of the federation's rounds (every ``period``
    optimizer steps), where every group meets anyway. A time limit or a checkpoint interval is then honoured up to
    ``period - 1`` steps late.

    A ``ModelCheckpoint`` that saves while training (``every_n_train_steps``, at the end of a training epoch, at the
    end of ``fit``) ranks and names its checkpoints by the metrics it reads; a metric logged in a training step is its
    group's, so each such save reads global rank 0's metrics (one broadcast, at a save, where every group meets).

    Returns:
        The callbacks whose hooks were replaced (see :func:`restore_callbacks`).
    """
    changed = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if _DEFERRED in vars(callback):
            continue
        if _decides_every_batch(callback):
            callback.on_train_batch_end = _at_round_ends(callback.on_train_batch_end, period)  # type: ignore[method-assign]
        if isinstance(callback, ModelCheckpoint):
            # Private hook: every save of ModelCheckpoint reads the metrics through it (no public one).
            callback._monitor_candidates = _from_rank_zero(callback._monitor_candidates)  # type: ignore[method-assign,assignment]
        if any(hook in vars(callback) for hook in _REPLACED):
            setattr(callback, _DEFERRED, True)
            changed.append(callback)
    return changed


def _at_round_ends(hook: Callable[..., None], period: int) -> Callable[..., None]:
    def at_round_ends(trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step % period == 0:
            hook(trainer, *args, **kwargs)

    return at_round_ends


def _from_rank_zero(candidates: Callable[[Trainer], dict[str, Any]]) -> Callable[[Trainer], dict[str, Any]]:
    def from_rank_zero(trainer: Trainer) -> dict[str, Any]:
        metrics = candidates(trainer)
        if not trainer.training or sys.exc_info()[1] is not None:
            return metrics  # validation metrics span every group already; after an exception no collective is safe
        return trainer.strategy.broadcast(metrics, src=0)

    return from_rank_zero


def restore_callbacks(callbacks: list[Callback]) -> None:
    """Give the callbacks changed by :func:`decide_at_syncs` their own hooks back."""
    for callback in callbacks:
        for hook in (*_REPLACED, _DEFERRED):
            vars(callback).pop(hook, None)


def _decides_every_batch(callback: Callback) -> bool:
    if isinstance(callback, Timer):
        return callback._interval == "step" and callback._duration is not None  # private: no public accessor
    if isinstance(callback, ModelCheckpoint):
        return callback._train_time_interval is not None  # private: no public accessor
    return False


def meetings_between_syncs(trainer: Trainer, period: int) -> list[str]:
    """The Trainer's settings that make every group meet at steps that are not ends of the federation's rounds.

    Args:
        trainer: The Trainer about to fit.
        period: Optimizer steps between two ends of a round (``sync_every``, or a hierarchical topology's largest
            period).

    Returns:
        One sentence per setting, naming its value and the multiple to use instead.
    """
    found = []
    batches = period * trainer.accumulate_grad_batches
    interval = trainer.val_check_interval
    if trainer.limit_val_batches != 0 and isinstance(interval, int) and interval % batches:
        found.append(
            f"`val_check_interval={interval}` validates after batches where the groups do not sync (every {batches}"
            " batches): validation reduces over every group, so all of them meet there, and it evaluates the"
            f" consensus of the last sync. Use a multiple of {batches}."
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        every = getattr(callback, "_every_n_train_steps", 0) if isinstance(callback, ModelCheckpoint) else 0
        if every and every % period:
            found.append(
                f"`ModelCheckpoint(every_n_train_steps={every})` saves at steps where the groups do not sync (every"
                f" {period} optimizer steps): a checkpoint holds every group's state, so all of them meet there. Use a"
                f" multiple of {period}."
            )
    return found
