"""Exact identities of the outer step: degenerate federations that equal optimizers written independently.

Each test trains the core federation (``Federation`` over in-process groups) with an explicit inner SGD on a fixed,
nonlinear problem, and the same problem with an optimizer the federation should reduce to:

- one group syncing after every step, inner SGD at ``a``, outer SGD ``(eta, mu, nesterov)``: torch's
  ``SGD(lr=eta * a, momentum=mu, nesterov=True)`` (the pseudo-gradient is ``a`` times the gradient);
- one group syncing every ``H`` steps, outer SGD at ``alpha`` without momentum: Lookahead with ``k = H`` and
  ``alpha`` (written here from its paper's two lines);
- ``M`` groups fed the same data: one group, whatever the outer optimizer;
- eager updates with one group and plain averaging: plain training.

They hold to float32 rounding; a wrong sign, a missing momentum term or a mean over the wrong number of groups breaks
them by orders of magnitude more.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups

UNITS = 3
STEPS = 24
INNER_LR = 0.05


def _start() -> list[Tensor]:
    return [torch.linspace(-1.0, 1.0, 4) * (u + 1) for u in range(UNITS)]


def _gradient(step: int, w: Tensor, group: int = 0) -> Tensor:
    """A nonlinear problem whose minimum moves with the step (and, given ``group``, differs between groups)."""
    target = torch.cos(torch.arange(w.numel(), dtype=w.dtype) + 0.3 * step + group)
    return (w - target) + 0.2 * torch.sin(3 * w)


def _federated(options: dict[str, Any], groups: int = 1, same_data: bool = True) -> list[Tensor]:
    """Every group's final weights after ``STEPS`` steps of inner SGD and the federation's syncs."""
    config = FederationConfig(num_groups=groups, reduce_dtype="float32", **options)

    def work(g: int, comm: Any) -> Tensor:
        shards = _start()
        federation = Federation(config, comm)
        federation.start(shards, step=0)
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                for shard in shards:
                    shard -= INNER_LR * _gradient(step, shard, 0 if same_data else g)
            federation.maybe_sync(step)
        federation.finish(STEPS)
        return torch.cat([s.clone() for s in shards])

    return InProcessGroups(groups).run(work)


def _sgd(**kwargs: Any) -> Any:
    return functools.partial(torch.optim.SGD, **kwargs)


@pytest.mark.parametrize(("eta", "mu"), [(0.7, 0.9), (0.4, 0.5), (1.3, 0.0)])
def test_one_group_syncing_every_step_is_torch_sgd_at_the_product_of_the_learning_rates(eta, mu):
    nesterov = mu > 0
    (federated,) = _federated(dict(sync_every=1, outer_optimizer=_sgd(lr=eta, momentum=mu, nesterov=nesterov)))
    params = [torch.nn.Parameter(w) for w in _start()]
    optimizer = torch.optim.SGD(params, lr=eta * INNER_LR, momentum=mu, nesterov=nesterov)
    for step in range(1, STEPS + 1):
        for p in params:
            p.grad = _gradient(step, p.detach())
        optimizer.step()
    assert_close(federated, torch.cat([p.detach() for p in params]), atol=2e-6, rtol=0)
    assert (federated - torch.cat(_start())).abs().max() > 0.1, "nothing trained"


@pytest.mark.parametrize(("every", "alpha"), [(4, 0.5), (6, 0.8), (8, 1.0)])
def test_one_group_with_outer_sgd_without_momentum_is_lookahead(every, alpha):
    (federated,) = _federated(dict(sync_every=every, outer_optimizer=_sgd(lr=alpha)))
    fast = _start()
    slow = [w.clone() for w in fast]
    for step in range(1, STEPS + 1):
        fast = [w - INNER_LR * _gradient(step, w) for w in fast]
        if step % every == 0:  # Lookahead (Zhang et al. 2019): slow += alpha (fast - slow); fast = slow
            slow = [s + alpha * (f - s) for s, f in zip(slow, fast)]
            fast = [s.clone() for s in slow]
    assert_close(federated, torch.cat(fast), atol=2e-6, rtol=0)


@pytest.mark.parametrize("outer", ["fedavg", "nesterov"])
def test_groups_fed_the_same_data_are_one_group(outer):
    (alone,) = _federated(dict(sync_every=4, outer_optimizer=outer))
    together = _federated(dict(sync_every=4, outer_optimizer=outer), groups=3)
    for group in together:
        assert_close(group, alone, atol=2e-6, rtol=0)
    apart = _federated(dict(sync_every=4, outer_optimizer=outer), groups=3, same_data=False)
    assert (apart[0] - alone).abs().max() > 1e-3, "the groups' data never mattered: the test would see nothing"


def test_eager_updates_with_one_group_and_plain_averaging_are_plain_training():
    (eager,) = _federated(dict(sync_every=4, eager_updates=True))
    plain = _start()
    for step in range(1, STEPS + 1):
        plain = [w - INNER_LR * _gradient(step, w) for w in plain]
    assert_close(eager, torch.cat(plain), atol=2e-6, rtol=0)
