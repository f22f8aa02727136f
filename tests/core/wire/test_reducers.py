"""The sums over the federation groups (core.reducers): quantized with error feedback, and float."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fedshard.core.transport.comm import GLOO_SUM_PART_BYTES
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.core.transport.mesh import build_federation_mesh
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.core.wire.codecs import DEFAULT_BLOCK_SIZE, QMAX, FloatCodec, SparseTopK, dequantize, quantize
from lightning_fedshard.core.wire.reducers import AllReduceSum, ScatterGatherSum, make_reducer
from tests.launch import run_ranks


def _block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """absmax of every element's block, one value per element (computed independently of the module)."""
    n = x.numel()
    padded = torch.zeros(-(-n // block_size) * block_size)
    padded[:n] = x.reshape(-1).abs()
    return padded.view(-1, block_size).amax(dim=1).repeat_interleave(block_size)[:n]


def _round_trip_bound(x: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """The documented bound ``scale / 2``, plus float32 rounding of ``q * scale`` (a few ulps of the absmax)."""
    absmax = _block_absmax(x, block_size)
    return absmax / QMAX[bits] / 2 + absmax * 2**-21


def _inputs(groups: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    """One vector per group, with magnitudes that differ between groups and along the vector."""
    gen = torch.Generator().manual_seed(seed)
    ramp = torch.logspace(-3, 1, numel)
    return [torch.randn(numel, generator=gen) * ramp * (g + 1) for g in range(groups)]


#: A small sparse codec for the sums below: 7 of every 64 values, 2-bit values.
SPARSE = SparseTopK(density=0.1, value_bits=2, chunk_size=64)


def _quantized(
    bits: int | SparseTopK, block_size: int = DEFAULT_BLOCK_SIZE, error_feedback: bool = False
) -> ScatterGatherSum:
    """The reducer of int``bits`` (or of a sparse codec, which carries its own chunk size)."""
    if isinstance(bits, SparseTopK):
        reducer = make_reducer(bits, None, error_feedback)
    else:
        reducer = make_reducer(f"int{bits}", block_size, error_feedback)
    assert isinstance(reducer, ScatterGatherSum)
    return reducer


def _compressed_sums(
    inputs: list[list[torch.Tensor]],
    bits: int | SparseTopK,
    block_size: int = DEFAULT_BLOCK_SIZE,
    error_feedback: bool = False,
) -> list[tuple[list[torch.Tensor], int, dict]]:
    """Every group reduces ``inputs[k][g]`` for each call k; per group: outputs, bytes counted, final state."""
    groups = InProcessGroups(len(inputs[0]))

    def work(g, comm):
        reducer = _quantized(bits, block_size, error_feedback)
        outs = [reducer.sum_across_groups(call[g], comm, comm.num_groups) for call in inputs]
        return outs, comm.bytes_sent, reducer.state_dict()

    return groups.run(work)


# ------------------------------------------------------------------------------------------- compressed sum


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("groups", [3, 4])
def test_compressed_sum_is_within_bound_and_bitwise_identical_on_all_groups(bits, groups):
    numel, block_size = 10_007, 64
    xs = _inputs(groups, numel)
    results = _compressed_sums([xs], bits, block_size)
    outs = [r[0][0] for r in results]
    exact = torch.stack(xs).sum(0)
    # Per element: at most the sum over groups of the element's block scale on that group.
    bound = sum(_block_absmax(x, block_size) for x in xs) / QMAX[bits] * (1 + 1e-5)
    for out in outs:
        assert out.shape == exact.shape and out.dtype == torch.float32
        assert ((out - exact).abs() <= bound).all()
        assert torch.equal(out, outs[0])
    # Not exact either: the compression really happened.
    assert not torch.equal(outs[0], exact)


def test_compressed_sum_is_deterministic_and_keeps_shape_and_input():
    xs = [x.view(97, 103) for x in _inputs(3, 97 * 103, seed=5)]
    copies = [x.clone() for x in xs]
    first = _compressed_sums([xs], 4)
    second = _compressed_sums([xs], 4)
    for a, b in zip(first, second):
        assert a[0][0].shape == (97, 103)
        assert torch.equal(a[0][0], b[0][0])
    for x, c in zip(xs, copies):
        assert torch.equal(x, c)


def test_one_group_returns_an_exact_copy_and_sends_nothing():
    x = torch.randn(33)
    results = InProcessGroups(1).run(
        lambda g, comm: (_quantized(4).sum_across_groups(x, comm, comm.num_groups), comm.bytes_sent)
    )
    out, sent = results[0]
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert sent == 0 == _quantized(4).wire_bytes(33, 1)


def test_rejects_non_float32_input():
    with pytest.raises(TypeError, match="float32"):
        InProcessGroups(2).run(lambda g, comm: _quantized(8).sum_across_groups(torch.ones(4).bfloat16(), comm, 2))


# ---------------------------------------------------------------------------------------------- wire bytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("groups", "numel", "block_size"), [(2, 1, 128), (3, 10_007, 64), (4, 4096, 128), (4, 9, 3)])
def test_counted_bytes_equal_wire_bytes(bits, groups, numel, block_size):
    results = _compressed_sums([_inputs(groups, numel)], bits, block_size)
    expected = _quantized(bits, block_size).wire_bytes(numel, groups)
    assert [r[1] for r in results] == [expected] * groups


def test_wire_bytes_formula_by_hand():
    # G = 3, 1000 values, B = 64, int8: padded to 3 chunks of 6 blocks (384 values) -> piece 6 * 4 + 384 = 408 bytes
    # (all_to_all sends 2 of its 3 pieces, the ring all_gather forwards 2 pieces): 2 * 2 * 408.
    assert _quantized(8, 64).wire_bytes(1000, 3) == 4 * 408
    # int4 with an odd block size: chunks of pairs of blocks; 10 values, G = 2, B = 3 -> chunk 6, piece 2 * 4 + 3 = 11.
    assert _quantized(4, 3).wire_bytes(10, 2) == 2 * 11
    assert AllReduceSum(FloatCodec("bfloat16")).wire_bytes(1000, 4) == 2 * 3 * 1000 * 2 // 4


@pytest.mark.parametrize(("bits", "limit", "expected"), [(8, 0.27, 0.2578125), (4, 0.14, 0.1328125)])
def test_bytes_per_sync_vs_float32_at_default_block_size(bits, limit, expected):
    groups, numel = 4, 2**20
    results = _compressed_sums([_inputs(groups, numel)], bits)
    ratio = results[0][1] / AllReduceSum(FloatCodec()).wire_bytes(numel, groups)
    assert ratio == expected <= limit  # bits / 32 + 1 / 128, no padding at 2**20
    # A million values is not a multiple of G * B: the padding costs < 0.1%.
    ratio = _quantized(bits).wire_bytes(10**6, groups) / AllReduceSum(FloatCodec()).wire_bytes(10**6, groups)
    assert expected < ratio < expected * 1.001


# ------------------------------------------------------------------------------------------ error feedback


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("calls", "gain"), [(2, 1.3), (6, 3.0)])
def test_error_feedback_makes_the_sum_over_calls_track_the_inputs(bits, calls, gain):
    groups, numel = 3, 3000
    # The same pseudo-gradient every call: without feedback the quantization error adds up call after call.
    xs = _inputs(groups, numel, seed=2)
    exact_total = torch.stack(xs).sum(0) * calls
    one_call_bound = sum(_block_absmax(x, DEFAULT_BLOCK_SIZE) for x in xs) / QMAX[bits]
    errors = {}
    for feedback in (False, True):
        outs = _compressed_sums([xs] * calls, bits, error_feedback=feedback)[0][0]
        errors[feedback] = (torch.stack(outs).sum(0) - exact_total).abs()
    # With feedback, nothing is lost, only delayed: the total is off by what one call's residuals hold.
    assert (errors[True] <= one_call_bound * 1.01).all()
    # Measured gains (L2): 1.9x (int8) / 2.1x (int4) after 2 calls, 6.5x / 6.6x after 6.
    assert errors[True].norm() * gain < errors[False].norm()


def test_error_feedback_residual_has_the_input_shape_and_survives_state_dict():
    xs = [x.view(10, 50) for x in _inputs(2, 500, seed=3)]
    second = [x * 0.5 for x in xs]

    def work(g, comm):
        reducer = _quantized(4, 32, error_feedback=True)
        reducer.sum_across_groups(xs[g], comm, comm.num_groups)
        # The residual of this rank's own quantization: blocks align with the chunks, so it is the plain round trip's.
        state = reducer.state_dict()
        residual = state["residual"]
        assert residual is not None and residual.shape == (10, 50)
        assert torch.equal(residual, xs[g] - dequantize(quantize(xs[g], 4, 32)).view(10, 50))
        assert residual.abs().max() > 0
        restored = _quantized(4, 32, error_feedback=True)
        restored.load_state_dict(state)
        fresh = _quantized(4, 32, error_feedback=True)
        return [r.sum_across_groups(second[g], comm, comm.num_groups) for r in (reducer, restored, fresh)]

    for carried, restored, fresh in InProcessGroups(2).run(work):
        assert torch.equal(carried, restored)
        assert not torch.equal(carried, fresh)  # the residual really changed the next call


def test_error_feedback_shape_change_raises_until_reset():
    def work(g, comm):
        reducer = _quantized(8, 16, error_feedback=True)
        reducer.sum_across_groups(torch.randn(100), comm, comm.num_groups)
        with pytest.raises(ValueError, match="reset"):
            reducer.sum_across_groups(torch.randn(120), comm, comm.num_groups)
        reducer.reset_residual()
        out = reducer.sum_across_groups(torch.ones(120), comm, comm.num_groups)
        # Same tensor, another ring size: the sum residual no longer fits this rank's chunk.
        with pytest.raises(ValueError, match="number of groups"):
            reducer.sum_across_groups(torch.ones(120), comm, 3)
        return out

    for out in InProcessGroups(2).run(work):
        assert torch.equal(out, torch.full((120,), 2.0))


def test_without_error_feedback_no_state_is_kept():
    state = _compressed_sums([_inputs(2, 100)], 8)[0][2]
    assert state == {"residual": None, "sum_residual": None}


def test_reset_residual_makes_the_next_sync_carry_nothing():
    xs, second = _inputs(2, 500, seed=6), _inputs(2, 500, seed=7)

    def work(g, comm):
        reducer, fresh = _quantized(8, 32, error_feedback=True), _quantized(8, 32, error_feedback=True)
        reducer.sum_across_groups(xs[g], comm, comm.num_groups)
        assert all(r is not None for r in reducer.state_dict().values())
        reducer.reset_residual()
        assert reducer.state_dict() == {"residual": None, "sum_residual": None}
        return [r.sum_across_groups(second[g], comm, comm.num_groups) for r in (reducer, fresh)]

    for after_reset, fresh in InProcessGroups(2).run(work):
        assert torch.equal(after_reset, fresh)


def test_reducers_without_error_feedback_keep_no_residual():
    xs = _inputs(2, 300, seed=8)

    def work(g, comm):
        quantized, float32 = _quantized(8), AllReduceSum(FloatCodec())
        quantized.sum_across_groups(xs[g], comm, comm.num_groups)
        float32.sum_across_groups(xs[g].clone(), comm, comm.num_groups)
        for reducer in (quantized, float32):
            reducer.reset_residual()  # nothing to forget: no error
        return quantized.state_dict(), float32.state_dict()

    for quantized_state, float_state in InProcessGroups(2).run(work):
        assert quantized_state == {"residual": None, "sum_residual": None}
        assert float_state == {}


# ------------------------------------------------------------------------------------ float reducer, factory


def test_float_reducer_casts_sums_and_returns_float32():
    xs = _inputs(2, 1000, seed=4)
    exact = xs[0].bfloat16() + xs[1].bfloat16()  # the sum as a bfloat16 all-reduce computes it

    def work(g, comm):
        return AllReduceSum(FloatCodec("bfloat16")).sum_across_groups(xs[g].bfloat16(), comm, comm.num_groups)

    for out in InProcessGroups(2).run(work):
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, exact)
    float32 = AllReduceSum(FloatCodec())
    assert torch.equal(
        InProcessGroups(2).run(lambda g, comm: float32.sum_across_groups(xs[g].clone(), comm, comm.num_groups))[0],
        xs[0] + xs[1],
    )
    assert float32.state_dict() == {}


def test_make_reducer_names_and_errors():
    assert isinstance(make_reducer("float32"), AllReduceSum)
    assert make_reducer(torch.bfloat16).codec.torch_dtype == torch.bfloat16
    int4 = make_reducer("int4", block_size=64, error_feedback=True)
    assert isinstance(int4, ScatterGatherSum) and (int4.codec.bits, int4.codec.block_size) == (4, 64)
    assert int4.feedback is not None
    assert make_reducer("int8").codec.block_size == DEFAULT_BLOCK_SIZE
    with pytest.raises(ValueError, match="reduce_dtype"):
        make_reducer("int2")
    with pytest.raises(ValueError, match="error_feedback"):
        make_reducer("bfloat16", error_feedback=True)
    with pytest.raises(ValueError, match="block_size"):
        make_reducer("float32", block_size=0)


# ------------------------------------------------------------------------------------ real gloo processes


def _gloo_worker(rank: int, store: str, out_dir: str, calls: list[list[torch.Tensor]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        comm = build_federation_mesh(FederationTopology(world_size=2, num_groups=2, shard_size=1), "cpu").communicator()
        results = {}
        for bits in (8, 4, SPARSE):
            reducer = _quantized(bits, 32, error_feedback=True)
            results[str(bits)] = [reducer.sum_across_groups(call[rank], comm, comm.num_groups) for call in calls]
        # float32 sums as the outer step sends them: a large one goes in parts in flight together (and its numel is
        # not a multiple of the parts), a small one and a strided one as one all-reduce.
        for name, numel in (("large", 9 * GLOO_SUM_PART_BYTES // 4 + 3), ("small", 1001)):
            x = torch.Generator().manual_seed(10 + rank)
            value = torch.randn(numel, generator=x)
            comm.sum_over_groups(value)
            results[name] = value
        strided = torch.arange(8.0).view(2, 4).t() * (rank + 1)
        comm.sum_over_groups(strided)
        results["strided"] = strided
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_process_group_communicator_on_gloo_matches_the_thread_fake(tmp_path):
    calls = [_inputs(2, 1001, seed=6), _inputs(2, 1001, seed=7)]
    run_ranks(_gloo_worker, 2, (str(tmp_path / "store"), str(tmp_path), calls))
    for bits in (8, 4, SPARSE):
        fake = _compressed_sums(calls, bits, block_size=32, error_feedback=True)
        for rank in range(2):
            real = torch.load(tmp_path / f"rank{rank}.pt")[str(bits)]
            assert len(real) == 2 and all(torch.equal(r, f) for r, f in zip(real, fake[rank][0]))
    for name, numel in (("large", 9 * GLOO_SUM_PART_BYTES // 4 + 3), ("small", 1001)):
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
        for rank in range(2):  # two terms: the same bits in either order
            assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt")[name], inputs[0] + inputs[1])
    strided = torch.arange(8.0).view(2, 4).t() * 3
    assert all(torch.equal(torch.load(tmp_path / f"rank{r}.pt")["strided"], strided) for r in range(2))


# ------------------------------------------------------------------------------------------- sparse sum


@pytest.mark.parametrize(("groups", "numel"), [(2, 1), (3, 1001), (4, 4096)])
def test_sparse_sum_counts_its_wire_bytes_and_is_identical_on_every_group(groups, numel):
    results = _compressed_sums([_inputs(groups, numel), _inputs(groups, numel, seed=1)], SPARSE, error_feedback=True)
    expected = _quantized(SPARSE).wire_bytes(numel, groups)
    assert [r[1] for r in results] == [2 * expected] * groups  # two calls
    for call in range(2):
        assert all(torch.equal(r[0][call], results[0][0][call]) for r in results)


def test_sparse_sum_bytes_are_below_a_hundredth_of_float32_at_the_defaults():
    groups, numel = 4, 2**20
    ratio = _quantized(SparseTopK()).wire_bytes(numel, groups) / AllReduceSum(FloatCodec()).wire_bytes(numel, groups)
    assert ratio == 120 / 16384 < 0.01  # per chunk of 4096: 8 bytes of scales, 64 x (12 + 2) bits


def test_dense_sparse_sum_equals_the_exact_sum_within_the_value_bound():
    # density 1.0 keeps everything: 8-bit values (128 magnitude levels from lo to hi per chunk) bound each group's
    # rounding by (hi - lo) / 254 and the re-encoding of the sum by the same of the summed chunk.
    codec = SparseTopK(density=1.0, value_bits=8, chunk_size=64)
    groups, numel = 3, 640
    xs = _inputs(groups, numel, seed=4)
    out = _compressed_sums([xs], codec)[0][0][0]
    exact = torch.stack(xs).sum(0)

    def spread(v):
        chunks = v.abs().view(-1, 64)
        return ((chunks.amax(1) - chunks.amin(1)) / 254).repeat_interleave(64)

    bound = sum(spread(x) for x in xs) + spread(exact) * 1.01 + exact.abs() * 2**-20
    assert ((out - exact).abs() <= bound).all()


def test_sparse_error_feedback_delays_what_was_not_sent():
    groups, numel, calls = 3, 640, 12
    xs = _inputs(groups, numel, seed=5)
    exact_total = torch.stack(xs).sum(0) * calls
    without = torch.stack(_compressed_sums([xs] * calls, SPARSE)[0][0]).sum(0)
    # Without feedback the same ~10% of each chunk travels every call and the rest never does.
    assert (without - exact_total).norm() > 0.5 * exact_total.norm()
    results = _compressed_sums([xs] * calls, SPARSE, error_feedback=True)
    sent = torch.stack(results[0][0]).sum(0)
    # Nothing is lost: what was summed plus what every group and every chunk's owner still holds is the exact total.
    held = sum(state["residual"] for _, _, state in results)
    held = held + torch.cat([state["sum_residual"] for _, _, state in results])[:numel]
    assert torch.allclose(sent + held, exact_total, rtol=0, atol=1e-5 * exact_total.abs().max().item())
    assert (sent - exact_total).norm() < 0.5 * (without - exact_total).norm()
