"""The save and load paths: :class:`FederationCheckpointer` writes and restores one rank's share of a checkpoint."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard.checkpoint import upgrades
from lightning_fedshard.checkpoint.atomic import local_path, move_into_place, remove, save_file, staging_path
from lightning_fedshard.checkpoint.failures import collective_failures
from lightning_fedshard.checkpoint.format import (
    FEDSHARD_KEY,
    METADATA_FILENAME,
    TRAINER_MODEL_KEY,
    ModelKey,
    StateDictType,
    check_version,
    checkpoint_kind,
    entry_file,
    group_entry,
    in_memory,
    layout,
    layout_differences,
    outer_entry,
    pop_state_dict,
    read_full,
    replica_entry,
    rng_entry,
    section,
)
from lightning_fedshard.core.backends.fsdp import FSDP1, fsdp_state_dict_type
from lightning_fedshard.core.backends.fsdp2 import restore_dtensor_state
from lightning_fedshard.core.backends.sharding import ShardingBackend
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.quiet import torch_choices_silenced
from lightning_fedshard.core.transport.topology import FederationTopology

ReadEntry = Callable[[str], Any]


class CheckpointTopologyWarning(UserWarning):
    """A checkpoint was loaded into another topology: training continues from the consensus only."""


class RNGState(Stateful):
    """This process' torch random number generator states (CPU, and CUDA once initialized)."""

    def state_dict(self) -> dict[str, Any]:
        """The current states."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the states; the CUDA ones only if this process sees as many devices as the writer."""
        torch.set_rng_state(state_dict["torch"])
        cuda = state_dict["cuda"]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


class FederationCheckpointer:
    """Saves and restores everything one rank of a federation needs to continue bit-identically.

    Every method is collective: all ranks of the job call it at the same point. See :mod:`lightning_fedshard.checkpoint`
    for what a checkpoint holds.

    Args:
        topology: The job's groups, replicas and shards.
        hybrid: FL+HSDP (``True``) or FL+FSDP; stored so that a checkpoint says what wrote it.
        rank: This process' global rank.
        federation: This rank's federation (anchor, outer optimizer, schedule).
        module: The FSDP-wrapped root module.
        on_write: Called after the local shards were overwritten in place (drops FSDP's gathered copies).
        backend: How ``module`` is sharded (FSDP1 or FSDP2).
    """

    def __init__(
        self,
        topology: FederationTopology,
        hybrid: bool,
        rank: int,
        federation: Federation,
        module: Module,
        on_write: Callable[[], None],
        backend: ShardingBackend = FSDP1,
    ) -> None:
        self.topology, self.hybrid, self.rank = topology, hybrid, rank
        self.federation, self.module, self.on_write = federation, module, on_write
        self.backend = backend
        self.group, self.replica, self.shard = topology.coords(rank)

    # -- saving -------------------------------------------------------------------------------------------------

    @torch_choices_silenced()
    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | Path,
        state_dict_type: StateDictType,
        optimizer_states: Sequence[dict[str, Any]],
        model_key: ModelKey = TRAINER_MODEL_KEY,
    ) -> None:
        """Write ``checkpoint`` plus this federation's state to ``path``, atomically.

        Args:
            checkpoint: Lightning's checkpoint dict. ``checkpoint[model_key.full]`` must hold the consensus: a full
                state dict on rank 0 (``"full"``) or FSDP's sharded state dict on every rank (``"sharded"``, saved
                to DCP under ``model_key.sharded``).
            path: Target file (full) or directory (sharded); the same on every rank.
            state_dict_type: ``"full"`` or ``"sharded"``.
            optimizer_states: This rank's local inner optimizer state dicts (kept in the group's entry).
            model_key: Where the checkpoint holds the consensus (the Trainer's layout by default).

        Raises:
            ValueError: For a URL (only local or mounted file systems can be renamed atomically) or an unknown
                ``state_dict_type``.
        """
        path = local_path(path)
        entries = self._local_entries(optimizer_states)
        if state_dict_type == "full":
            self._save_full(checkpoint, path, entries)
        elif state_dict_type == "sharded":
            self._save_sharded(checkpoint, path, entries, model_key)
        else:
            raise ValueError(f"Unknown `state_dict_type={state_dict_type!r}`; choose 'full' or 'sharded'.")
        with collective_failures("barrier after a checkpoint save"):
            dist.barrier()

    def _local_entries(self, optimizer_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The entries this rank owns (see :mod:`lightning_fedshard.checkpoint`), on the CPU."""
        entries: dict[str, Any] = {rng_entry(self.rank): RNGState().state_dict()}
        if not self.federation.started:
            return entries
        # Every rank first: completing a sum in flight puts the replicas' parts together, a collective among them.
        own_state = _to_cpu(self.federation.group_state_dict())  # e.g. error-feedback residuals
        if self.replica != 0:
            entries[replica_entry(self.group, self.replica, self.shard)] = {"federation": own_state}
            return entries
        weights = [s.detach().to("cpu", copy=True) for s in self.backend.local_shards(self.module)]
        optimizers = _to_cpu(list(optimizer_states))
        entries[group_entry(self.group, self.shard)] = {
            "weights": weights,
            "optimizers": optimizers,
            "federation": own_state,
        }
        if self.group == 0:
            # The local shard sizes of this in-group position: with FSDP2 they differ between positions.
            entries[outer_entry(self.shard)] = {**_to_cpu(self.federation.state_dict()), "layout": self._layout()}
        return entries

    def _section(self) -> dict[str, Any]:
        federation = self.federation
        num_syncs = federation.outer.num_syncs if federation.started else 0
        return section(self._layout(), federation.started, federation.last_synced_step, num_syncs)

    def _layout(self) -> dict[str, Any]:
        return layout(
            self.topology, self.hybrid, self.backend.local_shards(self.module), self.federation.config.fragments
        )

    def _save_full(self, checkpoint: dict[str, Any], path: Path, entries: dict[str, Any]) -> None:
        # Every group's state must reach the one file: rank 0 receives every rank's entries (about G copies of a
        # rank's share of the model and inner optimizer state; use sharded checkpoints for large models).
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        with collective_failures("gather of the checkpoint entries"):
            dist.gather_object(entries, gathered, dst=0)
        if self.rank != 0:
            return
        assert gathered is not None
        checkpoint[FEDSHARD_KEY] = {**self._section(), "entries": {k: v for part in gathered for k, v in part.items()}}
        staging = staging_path(path)
        staging.parent.mkdir(parents=True, exist_ok=True)
        save_file(checkpoint, staging)
        move_into_place(staging, path)

    def _save_sharded(
        self, checkpoint: dict[str, Any], path: Path, entries: dict[str, Any], model_key: ModelKey
    ) -> None:
        staging = staging_path(path)
        if self.rank == 0:
            remove(staging)  # left over by an earlier, interrupted save
            (staging / FEDSHARD_KEY).mkdir(parents=True)
        with collective_failures("barrier before a sharded checkpoint save"):
            dist.barrier()
        # The consensus is identical in every group, so DCP's de-duplication of equal chunks is harmless here.
        dcp.save({model_key.sharded: checkpoint.pop(model_key.full)}, checkpoint_id=staging)
        for name, payload in entries.items():
            save_file(payload, staging / FEDSHARD_KEY / entry_file(name))
        if self.rank == 0:
            checkpoint[FEDSHARD_KEY] = self._section()
            save_file(checkpoint, staging / METADATA_FILENAME)
        with collective_failures("barrier after writing a sharded checkpoint"):
            dist.barrier()  # every part is on disk before the directory is moved into place
        if self.rank == 0:
            move_into_place(staging, path)

    # -- loading ------------------------------------------------------------------------------------------------

    @torch_choices_silenced()
    def load(
        self,
        path: str | Path,
        optimizers: Sequence[Optimizer] | None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the consensus into the module and, if ``optimizers`` are given (training), the federation state.

        With the same layout (topology, shard sizes and dtypes) the anchor, outer optimizer state, schedule, this
        group's own weights, inner optimizer states and RNG states are restored exactly. Otherwise every group starts
        from the consensus with fresh inner and outer optimizer states, and a :class:`CheckpointTopologyWarning` says
        what differs.

        Args:
            path: A full checkpoint file or a sharded checkpoint directory.
            optimizers: The inner optimizers to restore, or ``None`` outside training (consensus only).
            strict: Passed to ``load_state_dict`` of the module.
            weights_only: Passed to ``torch.load`` for Lightning's metadata (``None``: ``False`` for a full
                checkpoint, torch's default for the ``meta.pt`` of a sharded one).

        Returns:
            The rest of the checkpoint (loops, callbacks, schedulers, ...), without weights and federation state.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            ValueError: If ``path`` is not a checkpoint, or was written by a newer version of this package.
            RuntimeError: If the checkpoint lacks an entry this rank needs (an incomplete checkpoint), or holds a
                different number of inner optimizers than configured.
        """
        path = local_path(path)
        if checkpoint_kind(path) == "sharded":
            metadata, read = self._load_sharded(path, strict, weights_only)
        else:
            metadata, read = self._load_full(path, strict, weights_only)
        fedshard = metadata.pop(FEDSHARD_KEY, None)
        if optimizers is not None:
            self._restore(path, fedshard, read, optimizers)
        return metadata

    @torch_choices_silenced()
    def consensus_state_dict(self, state_dict_type: StateDictType) -> dict[str, Any]:
        """The module's state dict holding the consensus (the anchor of the last sync), in its own key layout.

        Collective. ``"full"``: the whole state dict on global rank 0, an empty one elsewhere. ``"sharded"``: FSDP's
        sharded state dict on every rank.
        """
        with self.federation.consensus_weights():
            return self.backend.state_dict(self.module, state_dict_type)

    def _load_full(self, path: Path, strict: bool, weights_only: bool | None) -> tuple[dict[str, Any], ReadEntry]:
        checkpoint = read_full(path, weights_only)  # memory-mapped: other groups' entries are never read
        state_dict = pop_state_dict(checkpoint, path, upgrades.model_key(checkpoint).full)
        self.backend.load_state_dict(self.module, state_dict, "full", strict=strict)
        entries = (checkpoint.get(FEDSHARD_KEY) or {}).pop("entries", {})
        return in_memory(checkpoint), lambda name: in_memory(entries.get(name))

    def _load_sharded(self, path: Path, strict: bool, weights_only: bool | None) -> tuple[dict[str, Any], ReadEntry]:
        metadata = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=weights_only)
        key = upgrades.model_key(metadata).sharded
        module_state = {key: self.backend.state_dict(self.module, "sharded")}
        dcp.load(module_state, checkpoint_id=path)
        self.backend.load_state_dict(self.module, module_state[key], "sharded", strict=strict)

        def read(name: str) -> Any:
            file = path / FEDSHARD_KEY / entry_file(name)
            return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None

        return metadata, read

    # -- restoring the federation -------------------------------------------------------------------------------

    def _restore(
        self, path: Path, fedshard: dict[str, Any] | None, read: ReadEntry, optimizers: Sequence[Optimizer]
    ) -> None:
        if fedshard is None:
            self._warn(
                f"Checkpoint {str(path)!r} holds no federation state (it was not written by 'fl_fsdp'/'fl_hsdp'):"
                " every group starts from its weights, with fresh inner and outer optimizer states."
            )
            if self.federation.started:  # else it starts with training, at the loop's step
                self.start_afresh(self.federation.last_step)
            return
        check_version(path, fedshard)
        schedule = fedshard["schedule"]
        step = int(schedule["last_synced_step"])
        if not fedshard["started"]:
            self.start_afresh(step)  # saved before training started: the weights are all there is
            return
        outer = read(outer_entry(self.shard))
        differences = self._layout_differences(fedshard["layout"], outer)
        if differences:
            self.start_afresh(step)
            self.federation.outer.num_syncs = int(schedule["num_syncs"])
            self._warn(_topology_message(path, differences))
            return
        self.federation.start(
            self.backend.local_shards(self.module),
            step=step,
            on_write=self.on_write,
            unit_sizes=self.backend.unit_sizes(self.module),
        )
        self._restore_exactly(path, outer, read, optimizers)

    def start_afresh(self, step: int) -> None:
        """Anchor the federation on the weights the module holds now (every group's), with a fresh outer state.

        After loading weights that do not continue this federation exactly; collective.
        """
        self.federation.restart(
            self.backend.local_shards(self.module),
            step=step,
            on_write=self.on_write,
            unit_sizes=self.backend.unit_sizes(self.module),
        )

    def _layout_differences(self, section_layout: dict[str, Any], outer: dict[str, Any] | None) -> list[str]:
        """How the checkpoint's layout differs from this run's, agreed by all ranks (collective).

        Each in-group position compares with the layout it saved in its ``outer`` entry (FSDP2's local shards differ
        between positions); older checkpoints have none there, and their (FSDP1) shards were equal at every position,
        so the section's (rank 0's) layout stands for all. If any rank differs, all of them resume from the consensus.
        """
        saved = upgrades.layout((outer or {}).get("layout") or section_layout)
        differences = layout_differences(saved, self._layout())
        anywhere = torch.tensor([float(bool(differences))])
        if dist.is_initialized() and dist.get_world_size() > 1:
            with collective_failures("agreement on the checkpoint layout"):
                dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if anywhere.item() and not differences:
            differences = ["local shard sizes at another in-group position"]
        return differences

    def _restore_exactly(
        self, path: Path, outer: dict[str, Any] | None, read: ReadEntry, optimizers: Sequence[Optimizer]
    ) -> None:
        outer_name, group_name = outer_entry(self.shard), group_entry(self.group, self.shard)
        group = read(group_name)
        for name, entry in ((outer_name, outer), (group_name, group)):
            if entry is None:
                raise RuntimeError(f"Checkpoint {str(path)!r} is incomplete: entry {name!r} is missing.")
        assert outer is not None and group is not None  # checked just above
        if len(group["optimizers"]) != len(optimizers):
            raise RuntimeError(
                f"Checkpoint {str(path)!r} holds {len(group['optimizers'])} inner optimizer state(s), but this run"
                f" configures {len(optimizers)} optimizer(s)."
            )
        groups, fragments = self.topology.num_groups, self.federation.config.fragments
        self.federation.load_state_dict(upgrades.federation_state(outer, fragments, groups))
        # The residuals are a replica's own: replicas other than the first keep theirs in an entry of their own.
        own = group if self.replica == 0 else read(replica_entry(self.group, self.replica, self.shard))
        self.federation.load_group_state_dict(upgrades.group_state((own or {}).get("federation", {}), groups))
        with torch.no_grad():
            for shard, saved in zip(self.backend.local_shards(self.module), group["weights"]):
                shard.copy_(saved)
        for optimizer, state in zip(optimizers, group["optimizers"]):
            optimizer.load_state_dict(state)
            restore_dtensor_state(optimizer)  # FSDP2: the saved local shards become DTensors again
        rng = read(rng_entry(self.rank))
        if rng is not None:
            RNGState().load_state_dict(rng)
        self.on_write()

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, CheckpointTopologyWarning, stacklevel=3)


def _topology_message(path: Path, differences: list[str]) -> str:
    return (
        f"Checkpoint {str(path)!r} was written by another federation layout ({'; '.join(differences)}). Resuming from"
        " the consensus (the anchor of its last sync): each group's own weights and inner optimizer state, and the"
        " outer optimizer state, were dropped; the step counters and sync schedule are kept."
    )


def _to_cpu(obj: Any) -> Any:
    """Tensors moved to the CPU; ``DTensor`` (FSDP2 optimizer state) reduced to this rank's local shard."""
    return apply_to_collection(obj, Tensor, lambda t: _local(t).detach().to("cpu"))


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


__all__ = ["CheckpointTopologyWarning", "FederationCheckpointer", "RNGState", "fsdp_state_dict_type"]
