"""Block-wise int8/int4 quantization (core.codecs): the round-trip bound, rounding, packing, arguments."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fedshard.core.wire.codecs import (
    QMAX,
    BlockQuantizer,
    FloatCodec,
    SparseTopK,
    dequantize,
    quantize,
    resolve_codec,
)
from tests.core.wire.test_reducers import _round_trip_bound


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [1, 7, 32, 128])
@pytest.mark.parametrize(
    "case",
    ["normal_odd_length", "with_zero_blocks", "huge", "tiny", "mixed_magnitudes", "single_value", "outlier"],
)
def test_round_trip_within_documented_bound(bits, block_size, case):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1001, generator=gen)
    if case == "with_zero_blocks":
        x[:300] = 0.0
        x[700:] = 0.0
    elif case == "huge":
        x = x * 1e30
    elif case == "tiny":
        x = x * 1e-30
    elif case == "mixed_magnitudes":
        x = x * torch.logspace(-20, 20, x.numel())
    elif case == "single_value":
        x = torch.tensor([-3.5])
    elif case == "outlier":
        x[500] = 1e6
    q = quantize(x, bits, block_size)
    y = dequantize(q)
    assert y.shape == (x.numel(),) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= _round_trip_bound(x, bits, block_size)).all()
    assert q.scales.numel() == -(-q.codes.numel() * 8 // bits // block_size)
    codes = q.codes.view(torch.int8).int() if bits == 8 else torch.stack((q.codes & 15, q.codes >> 4), 1).int() - 8
    assert codes.abs().max() <= QMAX[bits]


@pytest.mark.parametrize("bits", [8, 4])
def test_bound_is_tight_and_rounding_is_to_nearest(bits):
    qmax = QMAX[bits]
    # One block with absmax qmax, so scale = 1: the codes are x rounded to the nearest integer (half to even).
    x = torch.tensor([float(qmax), 0.49, 0.51, -1.5, 2.5, -2.2, 0.0, -float(qmax)])
    y = dequantize(quantize(x, bits, block_size=8))
    assert y.tolist() == [qmax, 0.0, 1.0, -2.0, 2.0, -2.0, 0.0, -qmax]
    assert (y - x).abs().max().item() == pytest.approx(0.5)  # = scale / 2: the bound is reached


def test_all_zero_blocks_have_zero_scale_and_decode_to_zero():
    x = torch.zeros(300)
    x[200:] = torch.linspace(-1, 1, 100)
    for bits in (8, 4):
        q = quantize(x, bits, block_size=100)
        assert q.scales[:2].tolist() == [0.0, 0.0]
        y = dequantize(q)
        assert not torch.isnan(y).any()
        assert y[:200].eq(0).all()


def test_int4_packs_two_values_per_byte_and_int8_one():
    x = torch.randn(1000)
    assert quantize(x, 8, 100).codes.numel() == 1000
    q4 = quantize(x, 4, 100)
    assert q4.codes.dtype == torch.uint8 and q4.codes.numel() == 500 and q4.scales.numel() == 10
    assert q4.nbytes == 500 + 4 * 10
    # An odd block size with an odd number of blocks gets one padding block so the values pair up.
    assert quantize(torch.randn(7), 4, 7).codes.numel() == 7
    # The layout: element 2i in the low nibble, 2i+1 in the high nibble, each stored as q + 8.
    q = quantize(torch.tensor([7.0, -7.0, 1.0, 0.0]), 4, 4)
    assert q.codes.tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4)]


def test_quantizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.ones(4), 2, 4)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.ones(4), 8, 0)
    with pytest.raises(ValueError, match="block_size"):
        BlockQuantizer(8, block_size=-1)


# ------------------------------------------------------------------------------------------------ sparse


def _reference_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest magnitudes per row, ties to the lower index, ascending (by a stable full sort)."""
    order = rows.abs().sort(dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values


@pytest.mark.parametrize(("density", "chunk_size"), [(1 / 64, 4096), (0.1, 64), (0.5, 7), (1.0, 16)])
def test_sparse_top_k_picks_the_largest_magnitudes_per_chunk(density, chunk_size):
    codec = SparseTopK(density=density, chunk_size=chunk_size)
    rows = torch.randn(5, chunk_size, generator=torch.Generator().manual_seed(0))
    assert codec.kept == math.ceil(density * chunk_size)
    assert torch.equal(codec.select(rows), _reference_top_k(rows, codec.kept))


def test_sparse_top_k_breaks_ties_by_the_lower_index():
    codec = SparseTopK(density=0.25, chunk_size=8)  # keeps 2 of 8
    rows = torch.tensor([[1.0, -3.0, 3.0, 3.0, -3.0, 0.0, 0.0, 1.0], [0.0] * 8, [2.0, -2.0, 2.0, 5.0, 0, 0, 0, 0]])
    assert codec.select(rows).tolist() == [[1, 2], [0, 1], [0, 3]]


@pytest.mark.parametrize("value_bits", [1, 2, 3, 8])
def test_sparse_round_trip_keeps_signs_and_is_within_the_level_bound(value_bits):
    codec = SparseTopK(density=0.1, value_bits=value_bits, chunk_size=64)
    x = torch.randn(640, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 640)
    y = codec.decode_pieces(codec.encode_pieces(x, 2), 320).reshape(-1)
    rows, decoded = x.view(-1, 64), y.view(-1, 64)
    index = _reference_top_k(rows, codec.kept)
    kept, sent = rows.gather(1, index), decoded.gather(1, index)
    assert (decoded != 0).sum() <= index.numel() and torch.equal(sent.sign(), kept.sign())
    assert decoded.scatter(1, index, 0.0).abs().sum() == 0  # nothing else travels
    lo, hi = kept.abs().amin(1, keepdim=True), kept.abs().amax(1, keepdim=True)
    levels = 2 ** (value_bits - 1)
    bound = (hi - lo) / (2 * (levels - 1)) if levels > 1 else (hi - lo) / 2
    assert ((sent - kept).abs() <= bound * (1 + 1e-5) + hi * 2**-22).all()


def test_sparse_residual_plus_sent_is_the_input():
    # What error feedback keeps (input - sent) gives the input back: exactly where nothing was sent, and up to the
    # float32 rounding of the subtraction where a value was.
    codec = SparseTopK()
    x = torch.randn(3 * 4096, generator=torch.Generator().manual_seed(2))
    sent = codec.decode_pieces(codec.encode_pieces(x, 3), 4096).reshape(-1)
    residual = x - sent
    unsent = sent == 0
    assert torch.equal(residual[unsent], x[unsent]) and unsent.sum() == x.numel() - 3 * codec.kept
    assert torch.equal(sent + residual, x)  # here every subtraction is exact (Sterbenz: sent within 2x of x)


def test_sparse_bytes_and_piece_layout():
    codec = SparseTopK()  # 64 of 4096, 12-bit indices, 2-bit values
    assert (codec.kept, codec.index_bits, codec.piece_bytes(4096)) == (64, 12, 8 + 96 + 16)
    assert codec.padded_length(1, 4) == 4 * 4096 and codec.padded_length(4 * 4096 + 1, 4) == 8 * 4096
    assert codec.encode_pieces(torch.randn(2 * 4096), 2).shape == (2, 120)
    assert SparseTopK(density=0.5, value_bits=3, chunk_size=5).piece_bytes(10) == 16 + 3 + 3  # 6 entries x (3 + 3) bits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"value_bits": 0}, "value_bits"),
        ({"value_bits": 9}, "value_bits"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"density": True}, "density"),
    ],
)
def test_sparse_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseTopK(**kwargs)


def test_sparse_by_name_and_as_an_object():
    from lightning_fedshard import FederationConfig

    assert FederationConfig(reduce_dtype="sparse").codec == SparseTopK()
    config = FederationConfig(reduce_dtype=SparseTopK(density=0.03, value_bits=4))
    assert config.compressed and config.reducer().feedback is not None
    assert "sparse top-3%" in config.describe() and "with error feedback" in config.describe()


@pytest.mark.parametrize(
    ("name", "codec"),
    [
        ("lightning_fedshard.SparseTopK", SparseTopK()),
        ("SparseTopK", SparseTopK()),
        ("lightning_fedshard.core.wire.codecs.BlockQuantizer", BlockQuantizer()),
        ("lightning_fedshard.FloatCodec", FloatCodec()),
    ],
)
def test_a_codec_class_path_alone_is_the_codec_with_its_defaults(name, codec):
    """A command line or YAML gives ``lightning_fedshard.SparseTopK`` without init arguments as a string."""
    assert resolve_codec(name) == codec
    with pytest.raises(ValueError, match="Unsupported `reduce_dtype='lightning_fedshard.NoSuchCodec'`"):
        resolve_codec("lightning_fedshard.NoSuchCodec")
