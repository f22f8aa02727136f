"""The federation device mesh and its process groups (needs an initialized default process group)."""

from __future__ import annotations

import atexit
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fedshard.core.transport.comm import ProcessGroupCommunicator
from lightning_fedshard.core.transport.topology import AXES, Axis, FederationTopology


@dataclass
class FederationMesh:
    """A ``(G, R, S)`` device mesh with axes ``("fed", "replicate", "shard")`` and this rank's place in it.

    Build it with :func:`build_federation_mesh`. In-group FSDP uses :attr:`fsdp_process_group`; the outer
    all-reduce runs over the ``"fed"`` axis only (see
    :class:`~lightning_fedshard.core.transport.comm.ProcessGroupCommunicator`).

    Attributes:
        topology: The job's shape.
        device_mesh: The torch ``DeviceMesh`` over all ranks.
        rank: This process' global rank.
    """

    topology: FederationTopology
    device_mesh: DeviceMesh
    rank: int
    #: This rank's "fed" ring as a process group of its own (see :func:`build_federation_mesh`).
    outer_group: ProcessGroup | None = None
    site_groups: dict[int, ProcessGroup] = field(default_factory=dict)

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's ``(group, replica, shard)``."""
        return self.topology.coords(self.rank)

    @property
    def group_index(self) -> int:
        """Index of this rank's federation group."""
        return self.coords[0]

    def group(self, axis: Axis | str) -> ProcessGroup:
        """The process group of this rank along one mesh axis."""
        return self.device_mesh.get_group(Axis(axis).value)

    def ranks(self, axis: Axis | str) -> list[int]:
        """Global ranks of this rank's process group along one mesh axis, in the group's rank order.

        Along ``"shard"`` they are the ranks FSDP shards one replica over, along ``"replicate"`` the HSDP replicas of
        this rank's shard, along ``"fed"`` the ring of the outer all-reduce (one rank per group, group by group).
        """
        return dist.get_process_group_ranks(self.group(axis))

    def fsdp_process_group(self, hybrid: bool) -> ProcessGroup | tuple[ProcessGroup, ProcessGroup]:
        """What to pass as FSDP's ``process_group``: the group's shard group, or ``(shard, replicate)`` for HSDP.

        With ``shard_size == 1`` HSDP is plain data parallelism inside the group: FSDP would silently turn
        HYBRID_SHARD over a one-rank shard group into NO_SHARD over that one rank and never reduce gradients
        across the replicas, so the replicate group is returned instead (use it with :meth:`fsdp_sharding`).
        """
        if hybrid and self.topology.shard_size == 1:
            return self.group(Axis.REPLICATE)
        if hybrid:
            return self.group(Axis.SHARD), self.group(Axis.REPLICATE)
        if self.topology.num_replicas != 1:
            raise ValueError(f"FL+FSDP needs one replica per group, got topology {self.topology}.")
        return self.group(Axis.SHARD)

    def fsdp_sharding(self, hybrid: bool) -> str:
        """The FSDP sharding strategy name that goes with :meth:`fsdp_process_group`."""
        if hybrid and self.topology.shard_size == 1:
            return "NO_SHARD"
        return "HYBRID_SHARD" if hybrid else "FULL_SHARD"

    def group_mesh(self, hybrid: bool) -> DeviceMesh:
        """This rank's federation group as a device mesh for FSDP2's ``fully_shard``.

        FL+FSDP: the 1-D ``"shard"`` slice; FL+HSDP: the 2-D ``("replicate", "shard")`` slice, which FSDP2 turns into
        ``(Replicate(), Shard(0))`` parameters (also with ``shard_size == 1``).
        """
        if hybrid:
            return self.device_mesh["replicate", "shard"]
        if self.topology.num_replicas != 1:
            raise ValueError(f"FL+FSDP needs one replica per group, got topology {self.topology}.")
        return self.device_mesh["shard"]

    def communicator(self) -> ProcessGroupCommunicator:
        """The collectives of this rank's syncs on this mesh: its fed ring and its replica's shard group.

        The sums over the ring run on the ring's own group (:func:`_outer_group`), the training thread's statistics on
        the mesh's ``"fed"`` group, so the two never queue behind each other.
        """
        t = self.topology
        fed = (self.outer_group or self.group(Axis.FED)) if t.num_groups > 1 else None
        stats = self.group(Axis.FED) if t.num_groups > 1 else None
        shard = self.group(Axis.SHARD) if t.shard_size > 1 else None
        replicate = self.group(Axis.REPLICATE) if t.num_replicas > 1 else None
        return ProcessGroupCommunicator(
            t.num_groups, fed, shard, replicate, stats_group=stats, site_groups=dict(self.site_groups)
        )

    @torch.no_grad()
    def broadcast_shards(self, shards: Iterable[Tensor]) -> None:
        """Make every group and replica hold replica 0 of group 0's shards (called once, after wrapping).

        After FSDP wrapping each rank keeps its own slice of its own copy of the model; broadcasting along the
        ``"replicate"`` then the ``"fed"`` axis makes all copies equal to the one model that group 0's first
        replica assembles, whatever each process initialized. It moves ``P / S`` values per rank.
        """
        shards = list(shards)
        for axis in (Axis.REPLICATE, Axis.FED):
            if self.device_mesh.size(AXES.index(axis.value)) == 1:
                continue
            group = self.group(axis)
            for shard in shards:
                dist.broadcast(shard.data, group=group, group_src=0)

    def broadcast_buffers(self, buffers: Iterable[Tensor]) -> None:
        """Make every rank hold global rank 0's ``buffers`` (whole tensors, e.g. rotary tables), once after wrapping."""
        for buffer in buffers:
            dist.broadcast(buffer, src=0)


def build_federation_mesh(
    topology: FederationTopology,
    device_type: str,
    site_blocks: Mapping[int, Sequence[Sequence[int]]] | None = None,
) -> FederationMesh:
    """Create the federation device mesh (collective: every rank must call it).

    Args:
        topology: The job's shape; its world size must match the default process group.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL), etc.
        site_blocks: The blocks of groups of a hierarchical outer topology below the federation, by block size (see
            :meth:`~lightning_fedshard.core.options.outer_topology.Hierarchical.site_blocks`): a process group per
            block on every fed ring.

    Raises:
        RuntimeError: If the default process group is not initialized.
        ValueError: If the topology's world size differs from the process group's.
    """
    if not dist.is_initialized():
        raise RuntimeError("The federation mesh needs an initialized default process group.")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise ValueError(f"The topology {topology} does not match the process group's world size {world}.")
    mesh = init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=AXES)
    rank = dist.get_rank()
    _destroy_process_groups_at_exit()
    sites = {size: _site_group(topology, rank, blocks) for size, blocks in (site_blocks or {}).items()}
    return FederationMesh(
        topology=topology, device_mesh=mesh, rank=rank, outer_group=_outer_group(topology, rank), site_groups=sites
    )


def _destroy_process_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits, while it is still whole (registered once).

    Lightning destroys the groups at exit for NCCL only; the meshes built here add a gloo ring per position. This
    unregisters them, which narrows but does not close a rare abort at exit on gloo ("terminate called without an
    active exception", SIGABRT, after training finished): modules and meshes still hold the groups, so a gloo worker
    thread can outlive the handler and drop the last reference to a tensor while the interpreter finalizes, and
    Python then stops the thread inside torch's destructor. A script that must never end that way can leave with
    ``os._exit`` once its results are written, as the benchmark harness does (``benchmarks/harness/process.py``).
    """
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_all_process_groups)
        _EXIT_HANDLER_REGISTERED = True


_EXIT_HANDLER_REGISTERED = False


def _destroy_all_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _site_group(topology: FederationTopology, rank: int, blocks: Sequence[Sequence[int]]) -> ProcessGroup:
    """This rank's block of groups on its fed ring (collective: every rank builds every block of every ring)."""
    mine = None
    for replica in range(topology.num_replicas):
        for shard in range(topology.shard_size):
            ring = topology.fed_ranks(replica, shard)
            for block in blocks:
                ranks = sorted(ring[group] for group in block)
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine = group
    assert mine is not None
    return mine


def _outer_group(topology: FederationTopology, rank: int) -> ProcessGroup:
    """A process group of this rank's "fed" ring that nothing else uses (collective: every rank builds every ring).

    The outer sum may run in a background thread (``sync_delay > 0``) while Lightning runs collectives on the default
    group. When the ring spans the whole world (one-rank groups) the device mesh hands back the default group itself,
    and the two would meet on one group and deadlock; a group of its own keeps them apart.
    """
    mine = None
    for replica in range(topology.num_replicas):
        for shard in range(topology.shard_size):
            ranks = topology.fed_ranks(replica, shard)
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    assert mine is not None
    return mine
