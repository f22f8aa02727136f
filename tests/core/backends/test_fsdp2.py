"""The FSDP2 backend's single-process parts: argument parsing and the errors raised before any sharding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_fedshard.core.backends.fsdp2 import mixed_precision_policy, parameter_roots, sharded_parameters


def test_mixed_precision_from_yaml_names():
    policy = mixed_precision_policy({"param_dtype": "bfloat16", "reduce_dtype": "torch.float32"})
    assert policy.param_dtype is torch.bfloat16 and policy.reduce_dtype is torch.float32
    assert mixed_precision_policy(None) == MixedPrecisionPolicy()
    given = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert mixed_precision_policy(given) is given


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"param_type": "bfloat16"}, r"keys \['param_type'\] are unknown"),
        ({"param_dtype": "bfloat17"}, r"`mixed_precision.param_dtype='bfloat17'` is not a torch dtype name"),
    ],
)
def test_mixed_precision_errors_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        mixed_precision_policy(spec)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.metric = nn.Identity()  # no parameters: not a root


def test_roots_are_the_children_that_hold_parameters():
    holder = _Holder()
    assert parameter_roots(holder) == [holder.body]
    holder.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"holds parameter\(s\) \['scale'\] directly"):
        parameter_roots(holder)


def test_unsharded_parameters_are_named():
    with pytest.raises(ValueError, match=r"\['weight', 'bias'\] of Linear are not sharded by FSDP2"):
        sharded_parameters(nn.Linear(2, 2))
