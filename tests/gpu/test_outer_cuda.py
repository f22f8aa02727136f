"""The outer step with shards on the GPU and the anchor in host memory; an overlapped sync on the GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups


def _train(device: str, reduce_dtype: str, sync_delay: int, steps: int = 8) -> list[torch.Tensor]:
    """Two groups, a 3-shard model, a fixed drift per step; the weights after every step, on the host."""
    config = FederationConfig(
        sync_every=4, sync_delay=sync_delay, outer_optimizer="nesterov", reduce_dtype=reduce_dtype
    )

    def work(g, comm):
        generator = torch.Generator().manual_seed(g)
        shards = [torch.randn(n, generator=generator).to(device) for n in (257, 1024, 31)]
        federation = Federation(config, comm)
        federation.start(shards, step=0)
        moves = [[0.01 * torch.randn(s.numel(), generator=generator) for s in shards] for _ in range(steps)]
        seen = []
        for step in range(1, steps + 1):
            for shard, move in zip(shards, moves[step - 1]):
                shard.add_(move.to(device))
            federation.maybe_sync(step)
            seen.append(torch.cat([s.cpu() for s in shards]))
        federation.finish(steps)
        assert all(a.device.type == "cpu" for a in federation.outer.anchor)  # the default anchor_device="cpu"
        return seen

    return InProcessGroups(2).run(work)


@pytest.mark.parametrize("reduce_dtype", ["float32", "int4"])
@pytest.mark.parametrize("sync_delay", [0, 1])
def test_device_shards_with_a_host_anchor_match_the_cpu(reduce_dtype, sync_delay):
    cuda, cpu = _train("cuda", reduce_dtype, sync_delay), _train("cpu", reduce_dtype, sync_delay)
    for group_cuda, group_cpu in zip(cuda, cpu):
        for a, b in zip(group_cuda, group_cpu):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_an_overlapped_landing_on_the_gpu_leaves_every_group_with_the_same_weights():
    """With sync_delay=1 the sum of step 3's snapshot travels in the background thread while the main thread keeps
    adding CUDA work; at the landings (after steps 4 and 8) both groups hold the same weights."""
    overlapped = _train("cuda", "float32", sync_delay=1)
    for group in overlapped:
        assert torch.isfinite(group[-1]).all()
    for step in (3, 7):  # index of the weights after steps 4 and 8
        torch.testing.assert_close(overlapped[0][step], overlapped[1][step], rtol=0, atol=0)
