"""An independent, single-process reference implementation of FL+FSDP / FL+HSDP.

It keeps one full model per federation group (no sharding, no process groups, no code from the package): a group's
gradient is the mean of its ranks' gradients (what FSDP's reduce-scatter and HSDP's all-reduce compute), each group
steps its own inner optimizer, and every ``sync_every`` steps (and at the last step) the anchor takes a hand-written
outer SGD step with optional Nesterov momentum on the mean pseudo-gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tests.toy import IndexedRegression, loss_fn, make_net


@dataclass
class Outer:
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    buffers: dict[str, Tensor] = field(default_factory=dict)

    def step(self, anchor: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for k, d in delta.items():
            update = d
            if self.momentum:
                buf = d.clone() if k not in self.buffers else self.momentum * self.buffers[k] + d
                self.buffers[k] = buf
                update = d + self.momentum * buf if self.nesterov else buf
            anchor[k] = anchor[k] - self.lr * update


OUTERS = {"nesterov": dict(lr=0.7, momentum=0.9, nesterov=True), "fedavg": dict(lr=1.0)}


def _inner_optimizer(net: nn.Module, inner: str, lr: float) -> torch.optim.Optimizer:
    if inner == "sgd":
        return torch.optim.SGD(net.parameters(), lr=lr)
    return torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def reference_run(
    initial: dict[str, Tensor],
    micro_batches: list[list[list[int]]],
    groups: list[list[int]],
    *,
    sync_every: int,
    outer: str,
    inner: str,
    lr: float,
    accumulate: int,
    max_steps: int,
) -> dict[str, object]:
    """``micro_batches[rank]`` lists the sample indices of every micro-batch that rank trained on, in order.

    Returns the anchor after every sync (by optimizer step) and each group's weights before every step.
    """
    data = IndexedRegression()
    anchor = {k.removeprefix("net."): v.clone().double().float() for k, v in initial.items()}
    nets = []
    for _ in groups:
        net = make_net()
        net.load_state_dict(anchor)
        nets.append(net)
    opts = [_inner_optimizer(net, inner, lr) for net in nets]
    outer_opt = Outer(**OUTERS[outer])
    anchors: dict[int, dict[str, Tensor]] = {0: {k: v.clone() for k, v in anchor.items()}}
    groups_before: dict[int, list[Tensor]] = {}
    for step in range(max_steps):
        groups_before[step] = [torch.cat([p.detach().reshape(-1) for p in net.parameters()]) for net in nets]
        for g, ranks in enumerate(groups):
            opts[g].zero_grad()
            for rank in ranks:
                for m in range(step * accumulate, (step + 1) * accumulate):
                    idx = torch.tensor(micro_batches[rank][m])
                    loss = loss_fn(nets[g], data.x[idx], data.y[idx]) / (accumulate * len(ranks))
                    loss.backward()
            opts[g].step()
        done = step + 1
        if done % sync_every == 0 or done == max_steps:
            states = [{k: v.detach() for k, v in net.state_dict().items()} for net in nets]
            delta = {k: anchor[k] - torch.stack([s[k] for s in states]).mean(0) for k in anchor}
            outer_opt.step(anchor, delta)
            for net in nets:
                net.load_state_dict(anchor)
            anchors[done] = {k: v.clone() for k, v in anchor.items()}
    return {"anchors": anchors, "final": anchor, "groups_before": groups_before}
