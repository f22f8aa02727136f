"""One rank of a 1 x 1 x 1 federation on gloo: enough to exercise the checkpoint files in a single process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from lightning_fedshard.checkpoint import FederationCheckpointer
from lightning_fedshard.core.backends.fsdp import free_unsharded_params, local_shards
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.mesh import build_federation_mesh
from lightning_fedshard.core.transport.topology import FederationTopology
from tests.launch import free_port
from tests.toy import make_net


class Rank:
    """One rank: an FSDP-wrapped toy net, AdamW, a started federation and its checkpointer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = FSDP(make_net(), device_id=torch.device("cpu"), use_orig_params=True)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=0.1)
        topology = FederationTopology(1, 1, 1)
        self.federation = Federation(FederationConfig(), build_federation_mesh(topology, "cpu").communicator())
        self.federation.start(local_shards(self.net), step=0)
        self.checkpointer = FederationCheckpointer(
            topology, False, 0, self.federation, self.net, lambda: free_unsharded_params(self.net)
        )

    def train_step(self) -> None:
        self.net(torch.randn(4, 6)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def checkpoint(self) -> dict[str, Any]:
        with FSDP.state_dict_type(self.net, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            return {"state_dict": self.net.state_dict(), "global_step": 1}

    def save(self, path: Path | str) -> None:
        self.checkpointer.save(self.checkpoint(), path, "full", [self.optimizer.state_dict()])

    def save_sharded(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        with FSDP.state_dict_type(self.net, StateDictType.SHARDED_STATE_DICT):
            checkpoint = {"state_dict": self.net.state_dict(), "global_step": 1, **(extra or {})}
            self.checkpointer.save(checkpoint, path, "sharded", [self.optimizer.state_dict()])

    def snapshot(self) -> list[torch.Tensor]:
        state = [v.clone() for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return [s.detach().clone() for s in local_shards(self.net)] + [self.federation.outer.anchor[0].clone()] + state


def start_one_rank() -> Rank:
    """Join a one-rank gloo job (the test's conftest destroys it) and take one training step."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    rank = Rank()
    rank.train_step()
    return rank
