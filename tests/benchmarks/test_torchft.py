"""The torchft baseline's run kind: torchft's own DiLoCo on the example model and data, a few steps on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import metrics
from benchmarks.harness.config import RunConfig
from benchmarks.presets import PRESETS, TORCHFT_SMOKE
from lightning_fedshard.examples import ShakespeareDataModule

pytestmark = pytest.mark.slow  # launches processes

pytest.importorskip("torchft", reason="the torchft baseline needs torchft (the `elastic` extra)")


@pytest.mark.timeout(240)
def test_torchft_diloco_trains_the_benchmark_model_and_records_its_syncs(tmp_path: Path) -> None:
    from benchmarks.harness.local import launch_torchft_locally

    config = TORCHFT_SMOKE.run_config(
        {"num_nodes": 2, "devices": 1, "cache_dir": str(tmp_path / "data")}, out=str(tmp_path / "run")
    )
    ShakespeareDataModule(cache_dir=config.cache_dir, vocab_size=config.vocab_size).prepare_data()
    run = launch_torchft_locally(config, timeout=200)
    assert run["kind"] == "torchft" and run["world_size"] == 2
    assert RunConfig.from_record(run["config"]).federation.outer_optimizer == "nesterov"
    assert [s["step"] for s in run["syncs"]] == [2, 4] and run["outer_syncs"] == 2
    assert [v["step"] for v in run["vals"]] == [4] and metrics.final_ppl(run) > 1
    assert metrics.tokens_per_second(run) > 0


def test_the_torchft_preset_runs_both_systems_on_every_link_interleaved(tmp_path: Path) -> None:
    preset = PRESETS["torchft"]
    jobs = preset.jobs(tmp_path)
    assert preset.num_nodes == 4 and preset.devices == 1 and preset.repeats == 3
    strategies = {j.identity.configuration: j.config.strategy for j in jobs}
    assert strategies["torchft-diloco"] == "torchft" and strategies["fl_fsdp-torchft-same"] == "fl_fsdp"
    same = {j.identity.configuration: j.config.federation for j in jobs if j.identity.repeat == 0}
    assert same["torchft-diloco"] == same["fl_fsdp-torchft-same"]  # the same algorithm and settings
    assert {j.identity.link_mbit for j in jobs} == {None, 50.0, 20.0, 5.0}
    first = [j.identity.configuration for j in jobs[:5]]
    assert len(set(first)) == 5  # configurations alternate within a link: interleaved, not one after another
    assert {j.config.seed for j in jobs} == {0, 1, 2}
