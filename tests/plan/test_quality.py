"""The planner's measured tokens-to-target factors: which setups have one, and the ranking by time to target."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.plan import CLUSTERS, MODELS, TrainSetup, quality, sweep
from lightning_fedshard.plan.sweep import relative_time_to_target

FACTORS = {
    (8, 1, "float32", 0, None, "fedavg"): (1.0, "fedavg_f32", (1.0, 1.0), False),
    (8, 1, "int4", 0, None, "fedavg"): (1.5, "int4ef", (1.4, 1.6), True),
    ("fsdp",): (0.9, "fsdp", (0.9, 0.9), False),
}


@pytest.fixture(autouse=True)
def _factors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quality, "FACTORS", FACTORS)


def test_a_setup_gets_the_factor_of_its_sync_options_and_only_those() -> None:
    int4 = TrainSetup("fl_fsdp", FederationConfig(sync_every=8))
    assert quality.tokens_to_target(int4) == quality.TokensToTarget(1.5, "int4ef", (1.4, 1.6), looser=True)
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


def test_node_speeds_rank_by_the_barriers_pace_a_slow_node_hurting_compute_bound_setups_most() -> None:
    """A slow link (50 Mbit/s): float32 syncs are link-bound, int4 ones compute-bound (factors 1.0 and 1.5 here)."""
    from lightning_fedshard.plan.inputs import PlannerInputs

    cluster = PlannerInputs(cluster="emulated-4x2", step_seconds=0.1, inter_gbit_per_s=0.05).cluster_spec()
    base = TrainSetup("fl_fsdp", micro_batch=4, param_bytes=4, grad_bytes=4, federation=FederationConfig(num_groups=4))
    grid = dict(sync_every=(8,), fragments=(1,), reduce_dtypes=("float32", "int4"), sync_delays=(0,))
    grid["eager_updates"] = (False,)
    even = sweep(MODELS["xs"], cluster, base, top=10, rank="time_to_target", **grid)
    slow = sweep(MODELS["xs"], cluster, base, top=10, rank="time_to_target", node_speeds=[1, 1, 1, 0.1], **grid)
    dtypes = [[str(p.setup.federation.effective_reduce_dtype) for p in ranked] for ranked in (even, slow)]
    assert dtypes[0][0] == "int4" and dtypes[1][0] == "float32", dtypes
    with_speeds = [relative_time_to_target(p, [1, 1, 1, 0.1]) for p in slow]
    assert all(t is not None and t > relative_time_to_target(p) for t, p in zip(with_speeds, slow))  # type: ignore[operator]


def test_a_factor_measured_at_a_looser_target_is_marked_in_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_fedshard.plan.command import plan

    plan(model="xs", cluster="emulated-4x2", sweep=True, top=30, num_groups=4)
    out = capsys.readouterr().out
    assert "(1.500* tokens)" in out and "(1.000 tokens)" in out and "a factor marked * is measured" in out


def test_plain_fsdp_is_ranked_with_the_federations_and_shown_below_the_top_rows_where_it_ranks_lower() -> None:
    """On a slow link the federations reach FSDP's quality sooner despite their factors; FSDP's row stays visible."""
    from lightning_fedshard.plan.inputs import PlannerInputs

    cluster = PlannerInputs(cluster="emulated-4x2", step_seconds=0.1, inter_gbit_per_s=0.05).cluster_spec()
    base = TrainSetup("fl_fsdp", micro_batch=4, param_bytes=4, grad_bytes=4)
    grid = dict(sync_every=(8,), fragments=(1,), reduce_dtypes=("float32", "int4"), sync_delays=(0,))
    grid["eager_updates"] = (False,)
    ranked = sweep(MODELS["xs"], cluster, base, top=100, rank="time_to_target", **grid)
    strategies = [p.setup.strategy for p in ranked]
    assert strategies.count("fsdp") == 1 and strategies[0] != "fsdp"
    times = [relative_time_to_target(p) for p in ranked]
    fsdp = ranked[strategies.index("fsdp")]
    assert relative_time_to_target(fsdp) == pytest.approx(0.9 / fsdp.tokens_per_second)  # its factor, 0.9 here
    assert times == sorted(times)  # every row measured: in order, FSDP among them
    top = sweep(MODELS["xs"], cluster, base, top=2, rank="time_to_target", **grid)
    assert [p.setup.strategy for p in top][-1] == "fsdp" and len(top) == 3
    assert all(p.setup.federated for p in sweep(MODELS["xs"], cluster, base, top=100, **grid))  # by tokens/s: none


def test_a_slow_node_slows_every_step_of_plain_fsdp_by_its_compute() -> None:
    from lightning_fedshard.plan.hetero import lockstep_tokens_per_second
    from lightning_fedshard.plan.inputs import PlannerInputs
    from lightning_fedshard.plan.predict import predict

    inputs = PlannerInputs()  # Llama-3.1-8B on 128 nodes: FSDP is compute-bound, its collectives overlapped
    p = predict(inputs.model_spec(), inputs.cluster_spec(), replace(inputs.setup(FederationConfig()), strategy="fsdp"))
    assert p.bottleneck == "compute" and p.collective_seconds < p.compute_seconds
    assert lockstep_tokens_per_second(p, [1.0] * 128) == pytest.approx(p.tokens_per_second)
    slowed = lockstep_tokens_per_second(p, [1.0] * 127 + [0.5])  # one node at half speed: every step waits for it
    assert slowed == pytest.approx(p.tokens_per_second * p.step_seconds / (2 * p.compute_seconds))
