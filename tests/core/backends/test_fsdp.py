"""FSDP1's private parts that the backend reads are checked against the installed torch, once, with a clear error."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_fedshard.core.backends import fsdp
from lightning_fedshard.core.backends.fsdp import FSDP1_INTERNALS, check_internals, flat_params
from tests.launch import free_port
from tests.toy import make_net


@pytest.fixture(params=["one_unit", "unit_per_linear"])
def wrapped(request):
    """FSDP1 over the toy net; with a unit per Linear the root unit holds no parameters (no handle) of its own."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    policy = ModuleWrapPolicy({torch.nn.Linear}) if request.param == "unit_per_linear" else None
    try:
        yield FSDP(make_net(), device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
    finally:
        dist.destroy_process_group()


def test_the_installed_torch_has_every_fsdp1_part_the_backend_reads(wrapped):
    """Fails when a torch release renames or removes one of them: the bound in pyproject.toml must then not admit it."""
    check_internals(wrapped)
    assert sum(flat.numel() for flat in flat_params(wrapped)) >= sum(p.numel() for p in make_net().parameters())


@pytest.mark.parametrize("part", ["FullyShardedDataParallel._gone", "FlatParamHandle.gone", "FlatParameter._gone"])
def test_a_missing_part_is_named_with_the_installed_and_the_tested_torch(wrapped, monkeypatch, part):
    monkeypatch.setattr(fsdp, "FSDP1_INTERNALS", (*FSDP1_INTERNALS, part))
    message = rf"reads FSDP1's private `{part}`, which torch {re.escape(torch.__version__)} does not have \(tested with"
    with pytest.raises(RuntimeError, match=message + r".*FSDP2 strategies \('fl_fsdp2', 'fl_hsdp2'\)"):
        check_internals(wrapped)
