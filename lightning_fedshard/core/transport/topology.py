"""Federation topology: how W ranks split into groups, replicas and shards.

Pure arithmetic, no ``torch.distributed``: it can be validated in the launching process before any rank
starts, and tested without processes.

Global rank layout (groups are contiguous, so a group spans whole nodes)::

    rank = g * group_size + r * shard_size + s        # g in [0, G), r in [0, R), s in [0, S)

which is the row-major order of a device mesh of shape ``(G, R, S)`` with axes ``("fed", "replicate", "shard")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lightning_fedshard.core.options.checks import check_positive_int


class Axis(str, Enum):
    """Names of the federation mesh axes."""

    FED = "fed"
    REPLICATE = "replicate"
    SHARD = "shard"


AXES: tuple[str, str, str] = (Axis.FED.value, Axis.REPLICATE.value, Axis.SHARD.value)


@dataclass(frozen=True)
class FederationTopology:
    """Shape of a federated sharded job.

    Args:
        world_size: Total number of ranks ``W``.
        num_groups: Number of federation groups ``G``; each group holds ``W / G`` consecutive ranks.
        shard_size: Ranks that shard one model replica ``S``; a group holds ``R = (W / G) / S`` replicas.
            FL+FSDP uses ``S = W / G`` (one replica per group).

    Raises:
        ValueError: If a size is not positive or does not divide the one above it.
    """

    world_size: int
    num_groups: int
    shard_size: int

    def __post_init__(self) -> None:
        for name in ("world_size", "num_groups", "shard_size"):
            check_positive_int(name, getattr(self, name))
        if self.world_size % self.num_groups:
            raise ValueError(
                f"The world size ({self.world_size}) must be divisible by `num_groups={self.num_groups}`:"
                " every federation group needs the same number of ranks."
            )
        if self.group_size % self.shard_size:
            raise ValueError(
                f"The group size ({self.group_size} = world size {self.world_size} / `num_groups={self.num_groups}`)"
                f" must be divisible by `shard_size={self.shard_size}`."
            )

    @property
    def group_size(self) -> int:
        """Ranks per federation group ``F = W / G``."""
        return self.world_size // self.num_groups

    @property
    def num_replicas(self) -> int:
        """Model replicas inside one group ``R = F / S`` (1 for FL+FSDP)."""
        return self.group_size // self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """``(G, R, S)``, the shape of the federation device mesh."""
        return (self.num_groups, self.num_replicas, self.shard_size)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Mesh coordinates ``(group, replica, shard)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Rank {rank} is outside a world of size {self.world_size}.")
        group, in_group = divmod(rank, self.group_size)
        replica, shard = divmod(in_group, self.shard_size)
        return group, replica, shard

    def rank(self, group: int, replica: int, shard: int) -> int:
        """Global rank at mesh coordinates ``(group, replica, shard)``."""
        return group * self.group_size + replica * self.shard_size + shard

    def group_ranks(self, group: int) -> list[int]:
        """All ranks of one federation group, in order."""
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def shard_ranks(self, group: int, replica: int) -> list[int]:
        """Ranks that together hold one replica of the model (an FSDP sharding group)."""
        start = self.rank(group, replica, 0)
        return list(range(start, start + self.shard_size))

    def replicate_ranks(self, group: int, shard: int) -> list[int]:
        """Ranks of one group that hold the same shard in different replicas (an HSDP replication group)."""
        return [self.rank(group, r, shard) for r in range(self.num_replicas)]

    def fed_ranks(self, replica: int, shard: int) -> list[int]:
        """Ranks at the same in-group position in every group: the outer all-reduce runs among them."""
        return [self.rank(g, replica, shard) for g in range(self.num_groups)]

    def layout_warnings(self, devices_per_node: int, hybrid: bool, name: str) -> list[str]:
        """What defeats the federation in this layout on nodes of ``devices_per_node`` (one message each).

        One group (nothing to federate), groups that do not line up with nodes (their per-step traffic crosses
        nodes), and with ``hybrid`` (HSDP inside a group) shards larger than a node.
        """
        found = []
        if self.num_groups == 1:
            kind = "HSDP" if hybrid else "FSDP"
            found.append(
                f"`{name}` with a single federation group ({self}) is {kind} over all ranks: there is nothing to"
                f" federate (with `outer_optimizer='fedavg'` it is exactly plain {kind}; other outer optimizers still"
                " step the single group's weights every `sync_every` steps). Set `num_groups` > 1 to get federated"
                " training."
            )
        if self.group_size % devices_per_node and devices_per_node % self.group_size:
            found.append(
                f"Federation groups of {self.group_size} ranks do not line up with nodes of {devices_per_node}"
                " devices: some groups span parts of two nodes, so their per-step traffic crosses the slow links the"
                " federation is meant to avoid."
            )
        if hybrid and self.shard_size > devices_per_node:
            found.append(
                f"`shard_size={self.shard_size}` is larger than a node ({devices_per_node} devices): the per-step FSDP"
                " collectives of every replica cross nodes."
            )
        return found

    def __str__(self) -> str:
        return (
            f"{self.num_groups} group(s) x {self.num_replicas} replica(s) x {self.shard_size} shard(s)"
            f" = {self.world_size} ranks"
        )
