"""Meta-device initialization helpers on plain torch models (one process; FSDP on a one-rank gloo group)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_fedshard.examples.meta_init import (
    install_reset_parameters,
    materialize,
    materialized_bytes,
    module_seed,
)
from tests.launch import free_port


class Scale(nn.Module):
    """Holds a parameter but has no `reset_parameters` of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = Scale(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self, width: int = 8, vocab: int = 16, depth: int = 3, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def init_net(module: nn.Module) -> None:
    """A full init function for Net, in the style of transformers' `_init_weights`."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, Scale):
        nn.init.ones_(module.weight)


def meta_net(seed: int = 0, **kwargs: object) -> Net:
    with torch.device("meta"):
        net = Net(**kwargs)  # type: ignore[arg-type]
    install_reset_parameters(net, seed, init_net)
    return net


def materialized(seed: int = 0, **kwargs: object) -> Net:
    net = meta_net(seed, **kwargs)
    materialize(net, "cpu")
    return net


def test_materialize_initializes_every_tensor_from_the_seed_only() -> None:
    torch.manual_seed(1)
    first = materialized(seed=3)
    torch.manual_seed(2)
    state = torch.random.get_rng_state()
    second = materialized(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert not a.is_meta
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert not torch.equal(first.embed.weight, materialized(seed=4).embed.weight)
    # Each module draws from its own seed: equal shapes, different values.
    assert not torch.equal(first.blocks[0].linear.weight, first.blocks[1].linear.weight)
    assert torch.equal(first.blocks[0].scale.weight, torch.ones(8))
    assert torch.equal(first.blocks[0].linear.bias, torch.zeros(8))
    assert first.embed.weight.std().item() == pytest.approx(0.02, rel=0.25)


def test_values_depend_on_the_module_name_not_on_the_order() -> None:
    net = meta_net(seed=5)
    # Materialize the blocks back to front, then the rest: same values as breadth-first.
    for block in reversed(net.blocks):
        materialize(block, "cpu")
    materialize(net, "cpu")
    reference = materialized(seed=5)
    for (name, a), b in zip(net.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert module_seed(5, "blocks.0.linear") != module_seed(5, "blocks.1.linear")


def test_tied_parameters_stay_tied() -> None:
    net = materialized()
    assert net.head.weight is net.embed.weight
    untied = materialized(tied=False)
    assert untied.head.weight is not untied.embed.weight
    assert not torch.equal(untied.head.weight, untied.embed.weight)


def test_a_module_without_reset_parameters_is_named() -> None:
    with torch.device("meta"):
        net = Net()
    with pytest.raises(ValueError, match=r"Module `blocks.0.scale` \(Scale\) holds tensors but has no"):
        install_reset_parameters(net, seed=0)


def test_default_init_uses_each_class_reset_parameters() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    install_reset_parameters(net, seed=0)
    materialize(net, "cpu")
    assert torch.equal(net[1].weight, torch.ones(4))
    assert net[0].weight.abs().max() <= 0.5  # nn.Linear's own uniform init, bound 1/sqrt(4)


def test_hooks_survive_pickle_and_deepcopy() -> None:
    net = meta_net(seed=2)
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        materialize(clone, "cpu")
        assert clone.head.weight is clone.embed.weight
        torch.testing.assert_close(clone.state_dict(), materialized(seed=2).state_dict(), rtol=0, atol=0)


def test_materialized_bytes_sees_the_whole_model_without_fsdp() -> None:
    """The counter the memory test relies on: without FSDP it reaches the full model (it can fail the bound)."""
    net = meta_net()
    assert materialized_bytes(net) == (0, 0)
    materialize(net, "cpu")
    full = sum(p.numel() for p in net.parameters()) * 4
    assert materialized_bytes(net) == (0, full)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("tied", [True, False])
def test_fsdp_materializes_unit_by_unit_to_the_same_values(tied: bool) -> None:
    """FSDP1's own path (no `param_init_fn`): to_empty + our reset_parameters, one unit at a time."""
    net = meta_net(seed=7, tied=tied)
    seen: list[int] = []
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            reset = module.reset_parameters

            def counted(reset=reset) -> None:
                reset()
                seen.append(materialized_bytes(net)[1])

            module.reset_parameters = counted
    wrapped = FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True
    )
    reference = materialized(seed=7, tied=tied)
    block_bytes = sum(p.numel() for p in reference.blocks[0].parameters()) * 4
    # Each block is wrapped (flattened) before the next one is materialized.
    assert seen[:2] == [8 * 8 * 4 + 8 * 4, block_bytes]  # blocks.0.linear, then blocks.0.scale
    assert max(seen[: 2 * 3]) == block_bytes
    with FullyShardedDataParallel.summon_full_params(wrapped):
        assert (net.head.weight.data_ptr() == net.embed.weight.data_ptr()) is tied
        for (name, a), b in zip(net.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
