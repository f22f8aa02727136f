"""The Trainer settings that would make every group meet between syncs: found, named, and deferred."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from lightning_fedshard.trainer.meetings import decide_at_syncs, meetings_between_syncs, restore_callbacks


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


def test_validation_and_step_checkpoints_off_the_syncs_are_named_with_the_multiple_to_use():
    trainer = _trainer(val_check_interval=6, callbacks=[ModelCheckpoint(every_n_train_steps=5)])
    found = meetings_between_syncs(trainer, period=8)
    assert len(found) == 2
    assert "`val_check_interval=6`" in found[0] and "multiple of 8" in found[0]
    assert "`ModelCheckpoint(every_n_train_steps=5)`" in found[1] and "multiple of 8" in found[1]


def test_settings_on_the_syncs_are_not_named():
    trainer = _trainer(val_check_interval=16, callbacks=[ModelCheckpoint(every_n_train_steps=24)])
    assert meetings_between_syncs(trainer, period=8) == []
    # under gradient accumulation validation counts batches, a sync optimizer steps
    accumulating = _trainer(val_check_interval=16, accumulate_grad_batches=2)
    assert meetings_between_syncs(accumulating, period=8) == []
    assert "multiple of 16" in meetings_between_syncs(_trainer(val_check_interval=8, accumulate_grad_batches=2), 8)[0]
    assert meetings_between_syncs(_trainer(val_check_interval=6, limit_val_batches=0), period=8) == []


@pytest.mark.parametrize("make", [lambda: Timer(duration="00:01:00:00"), lambda: ModelCheckpoint(
    train_time_interval=timedelta(minutes=5))], ids=["timer", "timed_checkpoint"])  # fmt: skip
def test_per_batch_decisions_are_taken_only_at_the_ends_of_rounds(make, monkeypatch):
    callback = make()
    trainer = _trainer(callbacks=[callback])
    seen: list[int] = []
    monkeypatch.setattr(
        type(callback), "on_train_batch_end", lambda self, trainer, *a, **k: seen.append(trainer.global_step)
    )
    assert decide_at_syncs(trainer, period=4) == [callback]
    assert decide_at_syncs(trainer, period=4) == [], "a callback is deferred once"
    for step in range(1, 10):
        callback.on_train_batch_end(SimpleNamespace(global_step=step), None, None, None, 0)
    assert seen == [4, 8]
    restore_callbacks([callback])
    callback.on_train_batch_end(SimpleNamespace(global_step=5), None, None, None, 0)
    assert seen == [4, 8, 5], "the callback's own hook is back"


def test_callbacks_that_decide_nothing_per_batch_are_left_alone():
    untimed = [Timer(duration="00:01:00:00", interval="epoch"), ModelCheckpoint(every_n_train_steps=3)]
    assert decide_at_syncs(_trainer(callbacks=untimed), period=4) == []
