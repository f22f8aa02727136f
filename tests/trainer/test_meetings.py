"""The Trainer settings that would make every group meet between syncs: found, named, and deferred."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import lightning as L
import pytest
import torch
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
    trainer = _trainer(callbacks=[callback], enable_checkpointing=isinstance(callback, ModelCheckpoint))
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


def test_callbacks_that_decide_nothing_per_batch_keep_their_hooks():
    untimed = [Timer(duration="00:01:00:00", interval="epoch"), ModelCheckpoint(every_n_train_steps=3)]
    changed = decide_at_syncs(_trainer(callbacks=untimed), period=4)
    assert changed == [untimed[1]], "only the checkpoint's metrics are read differently"
    assert all("on_train_batch_end" not in vars(callback) for callback in untimed)


def test_a_checkpoint_saved_while_training_reads_global_rank_zeros_metrics(monkeypatch):
    """Every rank ranks and names its checkpoints by the same values: a training step's metric is its group's."""
    callback = ModelCheckpoint(every_n_train_steps=4, monitor="loss")
    trainer = _trainer(callbacks=[callback])
    trainer.callback_metrics.update({"loss": torch.tensor(2.5)})  # what this rank's group logged
    broadcast: list[object] = []
    monkeypatch.setattr(trainer.strategy, "broadcast", lambda obj, src=0: broadcast.append(obj) or {"loss": 0.5})
    assert decide_at_syncs(trainer, period=4) == [callback]
    trainer.training = True
    assert callback._monitor_candidates(trainer) == {"loss": 0.5}, "not rank 0's metrics"
    assert broadcast and float(broadcast[0]["loss"]) == 2.5
    trainer.training = False  # validation metrics span every group already: no broadcast
    assert float(callback._monitor_candidates(trainer)["loss"]) == 2.5 and len(broadcast) == 1
    restore_callbacks([callback])
    trainer.training = True
    assert float(callback._monitor_candidates(trainer)["loss"]) == 2.5 and len(broadcast) == 1


def test_a_group_of_one_rank_checks_its_own_sigterm_flag_without_a_collective(tmp_path, monkeypatch):
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_fedshard.trainer.meetings import keep_sigterm_in_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        trainer = _trainer()
        keep_sigterm_in_group(trainer, lambda: dist.group.WORLD)
        calls: list[object] = []
        monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: calls.append(args))
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # no signal: nothing happens
        trainer._signal_connector.received_sigterm = True  # private: what a SIGTERM handler sets
        with pytest.raises(SIGTERMException):
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        assert calls == [], "a group of one rank broadcast its flag"
    finally:
        dist.destroy_process_group()
