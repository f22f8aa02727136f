"""``fedshard simulate``: a ``fedshard fit`` config simulated on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.simulate import Simulator
from lightning_fedshard.simulate.command import main
from tests.simulate.worker import Module, ToyData


def _config(tmp_path: Path, strategy: object) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "num_nodes": 2,
            "strategy": strategy,
            "max_steps": 4,
            "val_check_interval": 2,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}},
        },
        "model": {"class_path": "tests.simulate.worker.Module"},
        "data": {"class_path": "tests.simulate.worker.ToyData"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_config_is_simulated_with_its_groups_of_several_ranks(tmp_path: Path) -> None:
    strategy = {
        "class_path": "lightning_fedshard.FLHSDPStrategy",
        "init_args": {"num_groups": 2, "shard_size": 1, "sync_every": 2, "reduce_dtype": "float32"},
    }
    result = main(["--config", str(_config(tmp_path, strategy))])
    # 2 nodes x 2 devices in 2 groups: each group's step takes the batches of its 2 ranks; validation every 2 steps
    assert result.trainers[0].accumulate_grad_batches == 2
    assert (tmp_path / "lightning_logs" / "version_0" / "validation.png").exists()
    assert result.metrics["syncs"] == 2
    torch.manual_seed(0)
    by_hand = Simulator(
        FederationConfig(num_groups=2, sync_every=2, reduce_dtype="float32"),
        ranks_per_group=2,
        accelerator="cpu",
        max_steps=4,
        val_check_interval=2,  # validation draws a data loader seed from each group's generator, as in the config
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    ).fit(Module(), datamodule=ToyData())
    for a, b in zip(result.modules[0].parameters(), by_hand.modules[0].parameters()):
        assert torch.equal(a, b)


def test_a_strategy_that_is_not_federated_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(_config(tmp_path, "ddp"))])
    assert exit.value.code == 2
    assert "the simulator simulates a federated strategy" in capsys.readouterr().err


def test_help_names_its_own_options_and_defers_the_rest_to_fit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert "--groups" in out and "--ranks_per_group" in out and "`fedshard fit` argument" in out


def _paced_hsdp(**extra: object) -> dict:
    args = {"num_groups": 2, "shard_size": 1, "sync_every": 2, "reduce_dtype": "float32", **extra}
    return {"class_path": "lightning_fedshard.FLHSDPStrategy", "init_args": args}


def test_a_plan_check_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, _paced_hsdp(plan="leonardo-512"))
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(config)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "`plan=...` checks a run's pace" in err and "Traceback" not in err


def test_groups_that_a_pace_does_not_fit_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pace = {"class_path": "lightning_fedshard.Pace", "init_args": {"speeds": [1.0, 0.5]}}
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(_config(tmp_path, _paced_hsdp(pace=pace))), "--groups", "3"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "fedshard simulate: error:" in err and "Traceback" not in err
    assert "3" in err and "speeds" in err


def test_a_run_says_what_it_simulates_once_and_nothing_the_user_did_not_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder, monkeypatch
) -> None:
    monkeypatch.setattr("sys.argv", ["fedshard", "simulate", "--config", "x.yaml"])  # as the console script sees it
    with caplog.at_level("INFO"):
        main(["--config", str(_config(tmp_path, _paced_hsdp()))])
    assert sum("GPU available" in r.getMessage() for r in caplog.records) == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fl_simulated:")]
    summary = [line for line in lines if "outer step every" in line]
    assert len(summary) == 1 and "a group's step the batches of 2 rank(s) (`ranks_per_group=2`)" in summary[0]
    assert not any("replica(s)" in line for line in lines), lines
    assert not [w for w in recwarn if "command line arguments" in str(w.message)]


@pytest.mark.parametrize(("flag", "value"), [("--groups", "0"), ("--groups", "-2"), ("--ranks_per_group", "0")])
def test_a_count_below_one_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(_config(tmp_path, _paced_hsdp())), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2
    assert err[-1] == f"fedshard simulate: error: `{flag} {value}` must be at least 1."


@pytest.mark.parametrize(
    "args",
    [["--trainer.devices", "2"], ["--trainer.devices=4"], ["--trainer.num_nodes", "3"]],
    ids=["devices", "devices=", "num_nodes"],
)
def test_devices_and_nodes_on_the_command_line_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(_config(tmp_path, _paced_hsdp())), *args])
    err = capsys.readouterr().err.strip().splitlines()
    flag, value = args[0].partition("=")[0], args[-1].rpartition("=")[2]
    assert exit.value.code == 2
    assert err[-1].startswith(f"fedshard simulate: error: `{flag} {value}`: the simulator runs every group on one")


def test_the_devices_the_simulator_uses_may_be_given() -> None:
    from lightning_fedshard.simulate.command import without_own_devices

    rest = ["--config", "c.yaml", "--trainer.devices", "1", "--trainer.num_nodes=1", "--trainer.max_steps", "4"]
    assert without_own_devices(rest) == ["--config", "c.yaml", "--trainer.max_steps", "4"]
    assert without_own_devices(["--trainer.devices", "auto"]) == []
