"""The simulator in one process: repeatable with random draws, checkpoints that resume bit for bit, bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_fedshard import Elastic, FLHSDPStrategy, Hierarchical, Pace
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.step.participation import pace_schedule
from lightning_fedshard.simulate import Simulator
from tests.simulate.worker import Module
from tests.toy import IndexedRegression

# Two fragments whose sums are in flight one step, int4 with error feedback, outer Nesterov: state in every corner.
CONFIG = FederationConfig(num_groups=3, sync_every=4, fragments=2, sync_delay=1, outer_optimizer="nesterov")
QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


def data(n: int = 72) -> DataLoader:
    return DataLoader(IndexedRegression(n), batch_size=4, shuffle=True)  # 72 / 3 groups / 4 = 6 steps an epoch


def fit(max_steps: int, callbacks: list[Any] | None = None, ckpt_path: Path | None = None, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    kwargs.setdefault("enable_checkpointing", callbacks is not None)
    simulator = Simulator(kwargs.pop("config", CONFIG), max_steps=max_steps, callbacks=callbacks, **QUIET, **kwargs)
    return simulator.fit(Module(), data(), ckpt_path=None if ckpt_path is None else str(ckpt_path))


def weights(result: Any) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in m.parameters()] for m in result.modules]


def test_a_simulation_is_repeatable_and_every_group_ends_with_the_consensus() -> None:
    first, second = weights(fit(7)), weights(fit(7))
    assert all(torch.equal(a, b) for ga, gb in zip(first, second) for a, b in zip(ga, gb))
    assert all(torch.equal(a, b) for g in first[1:] for a, b in zip(first[0], g))


#: The last of the 3 groups half as fast: it trains the first 2 steps of every round of 4 and skips the others.
PACED = dataclasses.replace(CONFIG, pace=Pace(speeds=(1.0, 1.0, 0.5)))


@pytest.mark.parametrize("config", [CONFIG, PACED], ids=["plain", "paced"])
def test_a_checkpoint_mid_round_resumes_bit_for_bit(tmp_path: Path, config: FederationConfig) -> None:
    every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    straight = fit(10, callbacks=[every], config=config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]
    for name in ("step=6.ckpt",):  # an epoch's end (a plain DataLoader cannot resume mid-epoch), mid-round
        resumed = fit(10, ckpt_path=tmp_path / name, enable_checkpointing=False, config=config)
        assert all(torch.equal(a, b) for ga, gb in zip(weights(straight), weights(resumed)) for a, b in zip(ga, gb))
        if config.pace is not None:  # the same schedule, taken from the checkpoint: the same merges
            merges = [
                pace_schedule(r.trainers[0].strategy.runtime.federation.participation).merges
                for r in (straight, resumed)
            ]
            assert merges[0] == merges[1] and any(counts[2] < counts[0] for _, _, counts in merges[0])


def test_a_checkpoint_of_other_settings_is_refused_before_training(tmp_path: Path) -> None:
    every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3)
    fit(3, callbacks=[every])
    other = FederationConfig(num_groups=3, sync_every=4, outer_optimizer="nesterov")
    with pytest.raises(ValueError, match=r"other settings \(federation: saved"):
        fit(6, ckpt_path=tmp_path / "step=3.ckpt", config=other, enable_checkpointing=False)
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    with pytest.raises(ValueError, match="is not a checkpoint of `fedshard simulate`"):
        fit(6, ckpt_path=plain, enable_checkpointing=False)


@pytest.mark.parametrize(
    ("federation", "kwargs", "message"),
    [
        (FederationConfig(num_groups=2, elastic=Elastic(group=0)), {}, r"`elastic=\.\.\.` is for groups that run"),
        (FederationConfig(), {}, "Give `num_groups`"),
        (FederationConfig(num_groups=2, pace=Pace()), {}, r"measures each group's speed.*Pace\(speeds="),
        (FederationConfig(num_groups=2), {"num_groups": 3}, "`num_groups=3` differs from the federation's"),
        (FederationConfig(num_groups=2), {"ranks_per_group": 0}, "`ranks_per_group=0` must be at least 1"),
        (FederationConfig(num_groups=2), {"devices": 2}, "drop the Trainer argument.s. `devices=2`"),
        (FederationConfig(num_groups=2), {"strategy": "ddp"}, "`strategy='ddp'`"),
        (FederationConfig(num_groups=2), {"accelerator": "tpu"}, "`accelerator='tpu'`"),
        (FederationConfig(num_groups=2), {"accumulate_grad_batches": {0: 2}}, "`accumulate_grad_batches="),
        (FederationConfig(sync_every=2, outer_topology=Hierarchical({2: 2, 4: 4})), {"num_groups": 6}, "6"),
        ("fl_hsdp", {}, "must be a FederationConfig or a federated strategy"),
    ],
)
def test_bad_input_is_refused_before_anything_is_built(federation: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        Simulator(federation, **kwargs)


def test_a_strategy_gives_its_federation_options_and_its_plan_check_is_refused() -> None:
    simulator = Simulator(FLHSDPStrategy(num_groups=2, sync_every=5, outer_optimizer="nesterov"))
    assert (simulator.num_groups, simulator.config.sync_every, simulator.config.outer_optimizer) == (2, 5, "nesterov")
    with pytest.raises(ValueError, match="`plan=...` checks a run's pace"):
        Simulator(FLHSDPStrategy(num_groups=2, plan={"cluster": "emulated-4x2"}))


def test_ranks_per_group_accumulates_their_batches_and_counts_of_one_ranks_batches_follow() -> None:
    simulator = Simulator(
        FederationConfig(num_groups=2),
        ranks_per_group=4,
        accumulate_grad_batches=2,
        limit_train_batches=96,
        val_check_interval=48,
        limit_val_batches=0.5,
    )
    assert simulator.accumulate == 8
    assert simulator.trainer_kwargs == {"limit_train_batches": 384, "val_check_interval": 192, "limit_val_batches": 0.5}


class _Failing(Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == 1 and self.trainer.global_step == 2:
            raise RuntimeError("group 1 broke at step 2")
        return super().training_step(batch, batch_idx)


def test_an_error_in_one_group_ends_the_simulation_with_that_error() -> None:
    torch.manual_seed(0)
    simulator = Simulator(CONFIG, max_steps=6, enable_checkpointing=False, **QUIET)
    with pytest.raises(RuntimeError, match="group 1 broke at step 2"):
        simulator.fit(_Failing(), data())  # the other groups wait at the sync of step 4: they are released


@pytest.mark.parametrize("pace", [None, Pace(speeds=(1.0, 0.5))], ids=["barrier", "paced"])
def test_the_boring_model_with_the_trainers_defaults_fits_then_validates_and_tests(
    tmp_path: Path, pace: Pace | None
) -> None:
    """A module nobody here wrote, with the sanity check, the validation loop, checkpoints and the CSV log on."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    torch.manual_seed(0)
    config = FederationConfig(num_groups=2, sync_every=2, pace=pace)
    simulator = Simulator(config, max_steps=6, default_root_dir=tmp_path)
    result = simulator.fit(BoringModel())
    assert result.trainers[0].global_step == 6
    assert (tmp_path / "simulate" / "version_0" / "metrics.csv").exists()
    assert list((tmp_path / "simulate" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert result.trainers[0].sanity_checking is False and result.trainers[1].num_sanity_val_steps == 2
    assert len(result.validate()) == 1 and len(result.test()) == 1  # one result per dataloader, groups in step
    assert all(t.validate_loop.batch_progress.total.completed == 32 for t in result.trainers)  # each its half of 64
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in result.modules)))


class _Manual(Module):
    """Steps its optimizer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_a_pace_with_manual_optimization_is_refused_before_any_group_is_built() -> None:
    simulator = Simulator(FederationConfig(num_groups=2, sync_every=4, pace=Pace(speeds=(1.0, 0.5))), max_steps=8,
                          **QUIET)  # fmt: skip
    with pytest.raises(ValueError, match=r"manual optimization \(`automatic_optimization = False`\)"):
        simulator.fit(_Manual(), data())
    # without a pace, manual optimization trains (each `optimizer.step()` counts one step)
    result = Simulator(FederationConfig(num_groups=2, sync_every=4), max_steps=8, enable_checkpointing=False,
                       **QUIET).fit(_Manual(), data())  # fmt: skip
    assert result.trainers[0].global_step == 8


def test_a_checkpoint_is_a_lightning_checkpoint_of_the_consensus(tmp_path: Path) -> None:
    """``load_from_checkpoint``, ``torch.load(...)["state_dict"]`` and ``export_consensus`` read the consensus."""
    from lightning_fedshard import export_consensus

    every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    config = FederationConfig(num_groups=3, sync_every=2, reduce_dtype="float32")
    result = fit(6, callbacks=[every], config=config)
    # step 6 ends with a sync: every group holds the consensus
    loaded = Module.load_from_checkpoint(tmp_path / "step=6.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), result.modules[0].parameters()))
    exported = torch.load(export_consensus(tmp_path / "step=6.ckpt", tmp_path / "export"))
    assert all(torch.equal(exported[k], v) for k, v in result.modules[0].state_dict().items())
    # step 3 is mid-round: the file's model is the anchor of the sync at step 2, not group 0's own weights
    mid = torch.load(tmp_path / "step=3.ckpt", weights_only=False)
    own = mid["fedshard_simulation"]["groups"][0]["state_dict"]
    assert mid["global_step"] == 3 and mid["pytorch-lightning_version"] and mid["optimizer_states"] == []
    assert any(not torch.equal(mid["state_dict"][k], own[k]) for k in own), "the file holds group 0's own weights"
    anchors = [mid["fedshard_simulation"]["groups"][g]["fedshard_simulated"]["federation"] for g in range(3)]
    assert anchors[0] is not None


def test_one_groups_trainer_alone_after_the_simulation_fails_fast_naming_the_result_methods() -> None:
    result = fit(4, enable_checkpointing=False)
    val = DataLoader(IndexedRegression(24, seed=7), batch_size=4)
    with pytest.raises(RuntimeError, match=r"outside the simulation.*`result.validate\(...\)`"):
        result.trainers[0].validate(result.modules[0], val)
    assert len(result.validate(val)) == 1  # every group at once
