"""torch's warnings about the package's own sharding choices stay inside the package; others still reach users."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, StateDictType

from lightning_fedshard.core.quiet import torch_choices_silenced
from tests.launch import free_port


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrap(strategy: ShardingStrategy) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", append=True)  # after the filters in force, which take precedence
        FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=torch.device("cpu"), sharding_strategy=strategy)
    return [str(w.message) for w in caught]


def test_fsdp_choices_are_silenced_inside_the_package_only(one_rank_world):
    assert any("switching to use `NO_SHARD`" in m for m in _wrap(ShardingStrategy.FULL_SHARD))
    with torch_choices_silenced():
        assert not any("NO_SHARD" in m for m in _wrap(ShardingStrategy.FULL_SHARD))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", append=True)
            warnings.warn("a user's own warning", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["a user's own warning"]


def _full_state_dict_of_one_rank_shards() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the wrapping's own warnings
        module = FullyShardedDataParallel(
            torch.nn.Linear(2, 2), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", append=True)
        with FullyShardedDataParallel.state_dict_type(module, StateDictType.FULL_STATE_DICT):
            module.load_state_dict(module.state_dict())  # saving writes "will be", loading "willbe" (torch 2.13)
    return [str(w.message) for w in caught]


def test_the_full_state_dict_of_one_rank_shards_is_silenced_inside_the_package(one_rank_world):
    assert any("full_state_dict willbe" in m for m in _full_state_dict_of_one_rank_shards())  # torch still warns
    with torch_choices_silenced():
        assert not any("full_state_dict" in m for m in _full_state_dict_of_one_rank_shards())


def test_lightning_internal_deprecation_is_filtered_by_module_only():
    import lightning_fedshard

    message = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lightning_fedshard.FLFSDPStrategy()  # installs it again, in front of "always"
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "user.py", 1, module="my_project")
    assert [w.filename for w in caught] == ["user.py"]
