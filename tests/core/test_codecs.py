"""Block-wise int8/int4 quantization (core.codecs): the round-trip bound, rounding, packing, arguments."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.core.codecs import QMAX, BlockQuantizer, dequantize, quantize
from tests.core.test_reducers import _round_trip_bound


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
