"""The simulator lands on the weights of the Trainer's strategy, mode by mode, on the same data and seeds.

One launch of 4 ranks runs every scenario with ``fl_fsdp2`` and one rank per group (a group holds its whole model, as
a simulated group does); the test then simulates each scenario in this process and compares the final consensus.
The model draws dropout masks, so each simulated group must draw its own random numbers as its rank did.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.harness.config import topology_record
from lightning_fedshard import Gossip, Hierarchical, Sampled
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.step.participation import pace_schedule
from lightning_fedshard.simulate import Simulator
from tests.launch import launch
from tests.simulate.worker import Module, federation_options, loaders, trainer_options

pytestmark = pytest.mark.slow  # launches processes

WORKER = Path(__file__).with_name("worker.py")
GROUPS = 4

SCENARIOS: list[dict[str, Any]] = [
    # float32 averaging, gradient accumulation, validation mid-round (metrics averaged over the groups)
    dict(name="fedavg_f32", sync_every=3, reduce_dtype="float32", accumulate=2, max_steps=7, val_check_interval=8),
    # the defaults' codec (int4 with error feedback) under DiLoCo's outer Nesterov step
    dict(name="nesterov_int4", sync_every=2, outer_optimizer="nesterov", max_steps=7),
    dict(name="sparse", sync_every=2, reduce_dtype="sparse", max_steps=6),
    # streaming: two fragments, sums overlapped by one step, merged halfway
    dict(
        name="stream",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        merge_alpha=0.5,
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        max_steps=7,
    ),  # fmt: skip
    dict(name="eager", sync_every=4, fragments=2, eager_updates=True, outer_optimizer="nesterov", max_steps=7),
    dict(
        name="hierarchical",
        sync_every=2,
        outer_topology=topology_record(Hierarchical({2: 2, 4: 4})),
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        max_steps=7,
    ),  # fmt: skip
    dict(
        name="gossip_d1_int4",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        outer_topology=topology_record(Gossip(peers=1, seed=3)),
        max_steps=7,
    ),  # fmt: skip
    dict(
        name="sampled",
        sync_every=2,
        outer_topology=topology_record(Sampled(2, seed=1, outer_step=True)),
        outer_optimizer="nesterov",
        reduce_dtype="float32",
        max_steps=6,
    ),  # fmt: skip
    # the last group half as fast: it skips the second half of every round, the merges weigh the steps trained
    dict(name="paced_int4", sync_every=4, fragments=2, pace=dict(speeds=[1, 1, 1, 0.5]), max_steps=9),
]


@pytest.fixture(scope="module", autouse=True)
def seeded() -> Iterator[None]:
    """``seed_everything(0)`` was called, as in a script: the strategies then re-seed when they set up."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PL_GLOBAL_SEED", "0")
        yield


@pytest.fixture(scope="module")
def trainer_runs(seeded: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("simulate_exactness")
    launch(WORKER, [json.dumps(SCENARIOS), str(out)], num_nodes=1, devices=GROUPS, log_dir=out / "logs")
    return out


def simulate(spec: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    module = Module()
    config = FederationConfig(num_groups=GROUPS, **federation_options(spec))
    result = Simulator(config, accelerator="cpu", **trainer_options(spec)).fit(module, *loaders(spec))
    return result


@pytest.mark.parametrize("spec", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_the_simulation_lands_on_the_trainer_strategys_weights(spec: dict[str, Any], trainer_runs: Path) -> None:
    expected = torch.load(trainer_runs / f"{spec['name']}.pt", weights_only=False)
    result = simulate(spec)
    for module in result.modules:  # every group ends with the consensus
        got = module.state_dict()
        assert got.keys() == expected["final"].keys()
        for name, value in expected["final"].items():
            difference = (got[name] - value).abs().max().item()
            assert difference <= 1e-6, f"{spec['name']} {name}: {difference}"
    for name, value in expected["metrics"].items():
        assert result.metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    if "pace" in spec:  # the same schedule, and in it the slow group trained half of each round
        schedule = pace_schedule(result.trainers[0].strategy.runtime.federation.participation)
        assert schedule is not None and schedule.merges == expected["merges"]
        assert expected["merges"][1] == (4, 1, {0: 4, 1: 4, 2: 4, 3: 2})
