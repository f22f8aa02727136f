"""int8/int4 sums with error feedback on CUDA tensors give the CPU's result, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.core.wire.reducers import make_reducer


def _sums(device: str, bits: int, calls: int = 3) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(bits)
    inputs = [[torch.randn(10_007, generator=generator) * (g + 1) for g in range(2)] for _ in range(calls)]

    def work(g, comm):
        reducer = make_reducer(f"int{bits}", 128, True)
        return [reducer.sum_across_groups(call[g].to(device), comm, 2).cpu() for call in inputs]

    return InProcessGroups(2).run(work)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_sums_with_error_feedback_match_the_cpu_bitwise(bits):
    # Every step is exact in IEEE arithmetic (absmax, one division, round half to even, one product, float32 sums in
    # ring order), so the device and the host agree to the bit, also in the residuals carried between calls.
    for cuda, cpu in zip(_sums("cuda", bits), _sums("cpu", bits)):
        for a, b in zip(cuda, cpu):
            assert torch.equal(a, b)
