"""The planner's measured tokens-to-target factors: which setups have one, and the ranking by time to target."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan import CLUSTERS, MODELS, TrainSetup, quality, sweep
from lightning_fedshard.plan.sweep import relative_time_to_target

FACTORS = {
    (8, 1, "float32", 0, None, "fedavg"): (1.0, "fedavg_f32", (1.0, 1.0)),
    (8, 1, "int4", 0, None, "fedavg"): (1.5, "int4ef", (1.4, 1.6)),
    ("fsdp",): (0.9, "fsdp", (0.9, 0.9)),
}


@pytest.fixture(autouse=True)
def _factors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quality, "FACTORS", FACTORS)


def test_a_setup_gets_the_factor_of_its_sync_options_and_only_those() -> None:
    int4 = TrainSetup("fl_fsdp", FederationConfig(sync_every=8))
    assert quality.tokens_to_target(int4) == quality.TokensToTarget(1.5, "int4ef", (1.4, 1.6))
    assert quality.tokens_to_target(TrainSetup("fsdp")).factor == 0.9  # type: ignore[union-attr]
    assert quality.tokens_to_target(TrainSetup("fl_fsdp", FederationConfig(sync_every=32))) is None
    nesterov = TrainSetup("fl_fsdp", FederationConfig(sync_every=8, outer_optimizer="nesterov"))
    assert quality.tokens_to_target(nesterov) is None


def test_the_sweep_ranks_measured_setups_by_time_to_target_then_the_others_by_tokens_per_s() -> None:
    base = TrainSetup("fl_fsdp", micro_batch=2, param_bytes=2, grad_bytes=2)
    grid = dict(sync_every=(8, 32), fragments=(1,), reduce_dtypes=("float32", "int4"), sync_delays=(0,))
    grid["eager_updates"] = (False,)
    model, cluster = MODELS["llama-3.1-8b"], CLUSTERS["leonardo-512"]
    ranked = sweep(model, cluster, base, top=1000, rank="time_to_target", **grid)
    times = [relative_time_to_target(p) for p in ranked]
    measured = [t for t in times if t is not None]
    assert measured and measured == sorted(measured)
    assert times[: len(measured)] == measured  # the measured first
    by_throughput = sweep(model, cluster, base, top=1000, **grid)
    unmeasured = [p.setup for p in by_throughput if relative_time_to_target(p) is None]
    assert [p.setup for p in ranked[len(measured) :]] == unmeasured  # in the throughput ranking's order
    with pytest.raises(ValueError, match="`rank='perplexity'` must be one of"):
        sweep(model, cluster, replace(base), rank="perplexity")
