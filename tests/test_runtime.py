"""Single-process tests of the federated runtime: the one entry point of a sync, counting and restarts.

Each federation group is a thread with an in-process communicator; the mesh and FSDP's shard lookup are replaced by
stand-ins, so the runtime's own logic is what runs.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import lightning_fedshard.runtime as runtime_module
from lightning_fedshard import Hierarchical
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.transport.inprocess import InProcessGroups
from lightning_fedshard.core.transport.topology import FederationTopology
from lightning_fedshard.runtime import FederatedRuntime

_THREAD = threading.local()


class _FakeMesh:
    def __init__(self, communicator: Any, group: int) -> None:
        self._communicator = communicator
        self.rank = group
        self.coords = (group, 0, 0)
        self.topology = FederationTopology(2, 2, 1)

    def communicator(self) -> Any:
        return self._communicator

    def broadcast_shards(self, shards: Any) -> None:
        pass


class _UnshardedBackend:
    """A sharding backend for a plain module: its one weight is the local shard."""

    name = "unsharded"

    def local_shards(self, module: nn.Module) -> list[torch.Tensor]:
        return [module.weight.data.view(-1)]

    def check(self, module: nn.Module) -> None:
        pass

    def full_optimizer_state_dict(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        return optimizer.state_dict()

    def unit_sizes(self, module: nn.Module) -> list[int]:
        return [module.weight.numel()]

    def free_unsharded(self, module: nn.Module) -> None:
        pass

    def unit_parameter_names(self, module: nn.Module) -> list[list[str]]:
        return [["weight"]]

    def state_dict(self, module: nn.Module, state_dict_type: str) -> dict[str, Any]:
        return module.state_dict()

    def load_state_dict(self, module: nn.Module, state_dict: dict[str, Any], state_dict_type: str, strict: bool = True):
        module.load_state_dict(state_dict, strict=strict)


@pytest.fixture(autouse=True)
def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_module, "build_federation_mesh", lambda topology, device, sites=(): _THREAD.mesh)


def _runtime(group: int, communicator: Any, num_groups: int = 2, **options: Any) -> tuple[FederatedRuntime, nn.Linear]:
    _THREAD.mesh = _FakeMesh(communicator, group)
    config = FederationConfig(num_groups=num_groups, **options)
    runtime = FederatedRuntime(config, hybrid=False, name="fl_fsdp", backend=_UnshardedBackend())
    runtime.setup(num_nodes=num_groups, devices_per_node=1, device=torch.device("cpu"))
    module = runtime.model.wrap(nn.Linear(2, 1, bias=False), lambda m: m)
    with torch.no_grad():
        module.weight.fill_(1.0)
    return runtime, module


def test_a_sync_runs_once_per_due_optimizer_step_and_finish_closes_the_round():
    def work(group: int, communicator: Any) -> list[Any]:
        runtime, module = _runtime(group, communicator, sync_every=2)
        runtime.start(0)
        seen = []
        # Trainer-style counts (micro-batches of one step repeat it), then Fabric-style counting (None).
        for step in (0, 1, 1, 2, 2, 3, None, 5):
            with torch.no_grad():
                module.weight.add_(float(group + 1))  # the groups drift apart
            stats = runtime.after_optimizer_step(step)
            seen.append((runtime.step, None if stats is None else stats.num_syncs))
        final = runtime.finish()
        return [seen, final.num_syncs if final else None, module.weight.detach().clone()]

    results = InProcessGroups(2).run(work)
    seen, final_sync, weights = results[0]
    assert seen == [(0, None), (1, None), (1, None), (2, 1), (2, None), (3, None), (4, 2), (5, None)]
    assert final_sync == 3  # stopped at step 5, between two syncs
    assert torch.equal(weights, results[1][2]), "the groups do not hold the consensus after finish()"


def test_finish_right_after_a_sync_does_nothing():
    def work(group: int, communicator: Any) -> tuple[Any, Any]:
        runtime, _ = _runtime(group, communicator, sync_every=2)
        runtime.start(0)
        runtime.after_optimizer_step(1)
        synced = runtime.after_optimizer_step(2)
        return synced is not None, runtime.finish()

    assert InProcessGroups(2).run(work) == [(True, None), (True, None)]


def _step_then_break_group_one(runtime: Any, module: torch.nn.Module, group: int) -> torch.optim.Optimizer:
    """Start the runtime, take one momentum SGD step, and put a NaN into group 1's weights; returns the optimizer."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    runtime.model.set_optimizers([optimizer])
    runtime.start(0)
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    if group == 1:
        with torch.no_grad():
            module.weight[0, 0] = float("nan")  # type: ignore[index]
    return optimizer


def test_a_skipped_group_restarts_with_a_fresh_inner_optimizer_state():
    def work(group: int, communicator: Any) -> tuple[bool, Any]:
        runtime, module = _runtime(group, communicator, sync_every=1, on_nonfinite="skip_group")
        optimizer = _step_then_break_group_one(runtime, module, group)
        stats = runtime.after_optimizer_step()
        return bool(optimizer.state), stats.skipped_groups

    with pytest.warns(UserWarning, match=r"Skipped federation group\(s\) \[1\]"):  # warnings of both threads
        results = InProcessGroups(2).run(work)
    assert results == [(True, (1,)), (False, (1,))]


def test_a_group_skipped_by_a_site_sync_restarts_with_a_fresh_inner_optimizer_state():
    def work(group: int, communicator: Any) -> tuple[bool, Any, bool]:
        topology = Hierarchical({1: 2, 2: 4})
        runtime, module = _runtime(
            group, communicator, num_groups=4, sync_every=1, outer_topology=topology, on_nonfinite="skip_group"
        )
        optimizer = _step_then_break_group_one(runtime, module, group)
        stats = runtime.after_optimizer_step()  # a site sync: {0, 1} and {2, 3}
        return bool(optimizer.state), stats.skipped_groups, bool(torch.isfinite(module.weight).all())

    with pytest.warns(UserWarning, match=r"Skipped federation group\(s\) \[1\] with non-finite weights .*a site sync"):
        results = InProcessGroups(4).run(work)
    assert results == [(True, (1,), True), (False, (1,), True), (True, (1,), True), (True, (1,), True)]


@pytest.mark.parametrize(("outer_optimizer", "syncs"), [("fedavg", False), ("nesterov", True)])
def test_one_group_averaging_with_itself_runs_no_outer_step(outer_optimizer, syncs):
    def work(group: int, communicator: Any) -> tuple[bool, bool]:
        runtime, _ = _runtime(group, communicator, num_groups=1, sync_every=2, outer_optimizer=outer_optimizer)
        runtime.start(0)
        at_sync_step = runtime.after_optimizer_step(2)
        runtime.after_optimizer_step(3)
        return at_sync_step is not None, runtime.finish() is not None

    assert InProcessGroups(1).run(work) == [(syncs, syncs)]
