"""Checkpoints of FL+FSDP / FL+HSDP runs that resume bit-identically, shared by the Trainer and Fabric strategies.

Between two syncs every federation group holds its own weights and inner optimizer state, and every rank holds its
shard of the anchor and of the outer optimizer state. Stock FSDP checkpoints lose most of that: a sharded (DCP)
checkpoint de-duplicates equal ``(key, offset)`` chunks and so mixes the groups, a full one keeps group 0 alone, and
callback state comes from rank 0 only. A checkpoint written by :class:`FederationCheckpointer` holds:

* ``state_dict`` (full) / the DCP key ``"model"`` (sharded): the **consensus**, i.e. the anchor of the last sync, in
  the plain key layout of the module, so tools that know nothing about this package can load it;
* ``"fedshard"``: ``format_version``, ``layout`` (topology and local shard sizes of the writer), ``schedule``
  (``last_synced_step``, ``num_syncs``) and **entries**, each owned by one rank:

  - ``group{g}/shard{s}``: group ``g``'s own local weight shards at in-group shard position ``s`` and its inner
    optimizer states (written by the group's first replica; the other replicas hold identical copies);
  - ``outer/shard{s}``: the anchor shards and outer optimizer state at position ``s`` (identical in every group,
    written by group 0) and the schedule;
  - ``rng/rank{r}``: rank ``r``'s torch random number generator states.

A **full** checkpoint gathers every entry to global rank 0, which writes one file. A **sharded** checkpoint is a
directory: DCP files for the consensus, Lightning's ``meta.pt`` and ``fedshard/<entry>.pt``, one file per entry written
by its owner. Both are first written next to the target (``.<name>.partial``) and renamed into place when complete,
so an interrupted save never damages an existing checkpoint.

Nothing here depends on the Lightning ``Trainer``; it works on an FSDP-wrapped module, its optimizers and a
:class:`~lightning_fedshard.core.federation.Federation`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import (
    _METADATA_FILENAME,
    _distributed_checkpoint_load,
    _distributed_checkpoint_save,
    _get_sharded_state_dict_context,
    _is_full_checkpoint,
    _is_sharded_checkpoint,
)
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fedshard._compat import cpu_safe_full_state_dict
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.fsdp import local_shards
from lightning_fedshard.core.outer import NonFiniteOuterGradientError
from lightning_fedshard.core.topology import FederationTopology

#: Top-level key of the federation section in a checkpoint, and folder of the entry files of a sharded one.
FEDSHARD_KEY = "fedshard"
#: Version of the ``"fedshard"`` section this code writes; it reads this one and older.
FORMAT_VERSION = 1

StateDictType = Literal["full", "sharded"]


class CheckpointTopologyWarning(UserWarning):
    """A checkpoint was loaded into another topology: training continues from the consensus only."""


class FederationCheckpointer:
    """Saves and restores everything one rank of a federation needs to continue bit-identically.

    Every method is collective: all ranks of the job call it at the same point.

    Args:
        topology: The job's groups, replicas and shards.
        hybrid: FL+HSDP (``True``) or FL+FSDP; stored so that a checkpoint says what wrote it.
        rank: This process' global rank.
        federation: This rank's federation (anchor, outer optimizer, schedule).
        module: The FSDP-wrapped root module.
        on_write: Called after the local shards were overwritten in place (drops FSDP's gathered copies).
    """

    def __init__(
        self,
        topology: FederationTopology,
        hybrid: bool,
        rank: int,
        federation: Federation,
        module: Module,
        on_write: Callable[[], None],
    ) -> None:
        self.topology = topology
        self.hybrid = hybrid
        self.rank = rank
        self.federation = federation
        self.module = module
        self.on_write = on_write
        self.group, self.replica, self.shard = topology.coords(rank)

    # -- what a checkpoint holds --------------------------------------------------------------------------------

    @property
    def group_entry(self) -> str:
        """Name of the entry with this group's own weights and inner optimizer state at this shard position."""
        return f"group{self.group}/shard{self.shard}"

    @property
    def outer_entry(self) -> str:
        """Name of the entry with the anchor and outer optimizer state at this shard position."""
        return f"outer/shard{self.shard}"

    @property
    def rng_entry(self) -> str:
        """Name of the entry with this rank's random number generator states."""
        return f"rng/rank{self.rank}"

    def layout(self) -> dict[str, Any]:
        """What must be equal for per-group state to be restored: topology, kind, local shard sizes and dtypes."""
        shards = local_shards(self.module)
        return {
            "world_size": self.topology.world_size,
            "num_groups": self.topology.num_groups,
            "num_replicas": self.topology.num_replicas,
            "shard_size": self.topology.shard_size,
            "hybrid": self.hybrid,
            "shard_numels": [s.numel() for s in shards],
            "shard_dtypes": [str(s.dtype).removeprefix("torch.") for s in shards],
        }

    def local_entries(self, optimizer_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The entries this rank owns (see the module docstring), on the CPU.

        Args:
            optimizer_states: This rank's own (local, unsharded-by-FSDP) ``optimizer.state_dict()`` of each inner
                optimizer.
        """
        entries: dict[str, Any] = {self.rng_entry: _rng_state()}
        if not self.federation.started or self.replica != 0:
            return entries
        weights = [s.detach().to("cpu", copy=True) for s in local_shards(self.module)]
        entries[self.group_entry] = {"weights": weights, "optimizers": _to_cpu(list(optimizer_states))}
        if self.group == 0:
            entries[self.outer_entry] = _to_cpu(self.federation.state_dict())
        return entries

    def _section(self) -> dict[str, Any]:
        federation = self.federation
        return {
            "format_version": FORMAT_VERSION,
            "layout": self.layout(),
            "started": federation.started,
            "schedule": {
                "last_synced_step": federation.last_synced_step,
                "num_syncs": federation.outer.num_syncs if federation.started else 0,
            },
        }

    # -- saving -------------------------------------------------------------------------------------------------

    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | Path,
        state_dict_type: StateDictType,
        optimizer_states: Sequence[dict[str, Any]],
    ) -> None:
        """Write ``checkpoint`` plus this federation's state to ``path``, atomically.

        Args:
            checkpoint: Lightning's checkpoint dict. ``"state_dict"`` must hold the consensus: a full state dict on
                rank 0 (``"full"``) or FSDP's sharded state dict on every rank (``"sharded"``). It must not hold
                ``"optimizer_states"`` (pass them as ``optimizer_states``).
            path: Target file (full) or directory (sharded); the same on every rank.
            state_dict_type: ``"full"`` or ``"sharded"``.
            optimizer_states: This rank's local inner optimizer state dicts.

        Raises:
            ValueError: For a URL (only local or mounted file systems can be renamed atomically) or an unknown
                ``state_dict_type``.
        """
        path = _local_path(path)
        entries = self.local_entries(optimizer_states)
        if state_dict_type == "full":
            self._save_full(checkpoint, path, entries)
        elif state_dict_type == "sharded":
            self._save_sharded(checkpoint, path, entries)
        else:
            raise ValueError(f"Unknown `state_dict_type={state_dict_type!r}`; choose 'full' or 'sharded'.")
        dist.barrier()

    def _save_full(self, checkpoint: dict[str, Any], path: Path, entries: dict[str, Any]) -> None:
        # Every group's state must reach the one file: rank 0 receives every rank's entries (about G copies of a
        # rank's share of the model and inner optimizer state; use sharded checkpoints for large models).
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(entries, gathered, dst=0)
        if self.rank != 0:
            return
        assert gathered is not None
        checkpoint[FEDSHARD_KEY] = {**self._section(), "entries": {k: v for part in gathered for k, v in part.items()}}
        staging = _staging_path(path)
        staging.parent.mkdir(parents=True, exist_ok=True)
        _save_file(checkpoint, staging)
        _move_into_place(staging, path)

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, entries: dict[str, Any]) -> None:
        staging = _staging_path(path)
        if self.rank == 0:
            _remove(staging)  # left over by an earlier, interrupted save
            (staging / FEDSHARD_KEY).mkdir(parents=True)
        dist.barrier()
        # The consensus is identical in every group, so DCP's de-duplication of equal chunks is harmless here.
        _distributed_checkpoint_save({"model": checkpoint.pop("state_dict")}, staging)
        for name, payload in entries.items():
            _save_file(payload, staging / FEDSHARD_KEY / _entry_file(name))
        if self.rank == 0:
            checkpoint[FEDSHARD_KEY] = self._section()
            _save_file(checkpoint, staging / _METADATA_FILENAME)
        dist.barrier()  # every part is on disk before the directory is moved into place
        if self.rank == 0:
            _move_into_place(staging, path)

    # -- loading ------------------------------------------------------------------------------------------------

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
            weights_only: Passed to ``torch.load`` for Lightning's metadata.

        Returns:
            The rest of the checkpoint (loops, callbacks, schedulers, ...), without weights and federation state.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            ValueError: If ``path`` is not a checkpoint, or was written by a newer version of this package.
            RuntimeError: If the checkpoint lacks an entry this rank needs (an incomplete checkpoint), or holds a
                different number of inner optimizers than configured.
        """
        path = _local_path(path)
        if _is_sharded_checkpoint(path):
            metadata, read = self._load_sharded(path, strict, weights_only)
        elif _is_full_checkpoint(path):
            metadata, read = self._load_full(path, strict)
        elif not path.exists():
            raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
        else:
            raise ValueError(
                f"{str(path)!r} is not a checkpoint: expected a file (full) or a directory with {_METADATA_FILENAME!r}"
                " (sharded)."
            )
        section = metadata.pop(FEDSHARD_KEY, None)
        if optimizers is not None:
            self._restore(path, section, read, optimizers)
        return metadata

    def _load_full(self, path: Path, strict: bool) -> tuple[dict[str, Any], Callable[[str], Any]]:
        checkpoint = _lazy_load(path)  # tensors are read when touched: other groups' entries are never loaded
        if "state_dict" not in checkpoint:
            raise ValueError(f"Checkpoint {str(path)!r} holds no 'state_dict'; its keys are {sorted(checkpoint)}.")
        with cpu_safe_full_state_dict(_device_of(self.module)):
            _load_raw_module_state(
                checkpoint.pop("state_dict"), module=self.module, world_size=dist.get_world_size(), strict=strict
            )
        section = checkpoint.get(FEDSHARD_KEY) or {}
        entries = section.pop("entries", {})
        return _materialize_tensors(checkpoint), lambda name: _materialize_tensors(entries.get(name))

    def _load_sharded(
        self, path: Path, strict: bool, weights_only: bool | None
    ) -> tuple[dict[str, Any], Callable[[str], Any]]:
        with _get_sharded_state_dict_context(self.module):  # type: ignore[attr-defined]  # a context manager at runtime
            module_state = {"model": self.module.state_dict()}
            _distributed_checkpoint_load(module_state, path)
            self.module.load_state_dict(module_state["model"], strict=strict)
        metadata = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=weights_only)

        def read(name: str) -> Any:
            file = path / FEDSHARD_KEY / _entry_file(name)
            return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None

        return metadata, read

    def _restore(
        self, path: Path, section: dict[str, Any] | None, read: Callable[[str], Any], optimizers: Sequence[Optimizer]
    ) -> None:
        if section is None:
            self._warn(
                f"Checkpoint {str(path)!r} holds no federation state (it was not written by 'fl_fsdp'/'fl_hsdp'):"
                " every group starts from its weights, with fresh inner and outer optimizer states."
            )
            return
        _check_version(path, section)
        schedule = section["schedule"]
        self.federation.start(local_shards(self.module), step=int(schedule["last_synced_step"]), on_write=self.on_write)
        if not section["started"]:
            return  # saved before training started: the weights are all there is
        differences = layout_differences(section["layout"], self.layout())
        if differences:
            self.federation.outer.num_syncs = int(schedule["num_syncs"])
            self._warn(_topology_message(path, differences))
            return
        self._restore_exactly(path, read, optimizers)

    def _restore_exactly(self, path: Path, read: Callable[[str], Any], optimizers: Sequence[Optimizer]) -> None:
        outer, group, rng = read(self.outer_entry), read(self.group_entry), read(self.rng_entry)
        for name, entry in ((self.outer_entry, outer), (self.group_entry, group)):
            if entry is None:
                raise RuntimeError(f"Checkpoint {str(path)!r} is incomplete: entry {name!r} is missing.")
        if len(group["optimizers"]) != len(optimizers):
            raise RuntimeError(
                f"Checkpoint {str(path)!r} holds {len(group['optimizers'])} inner optimizer state(s), but this run"
                f" configures {len(optimizers)} optimizer(s)."
            )
        self.federation.load_state_dict(outer)
        with torch.no_grad():
            for shard, saved in zip(local_shards(self.module), group["weights"]):
                shard.copy_(saved)
        for optimizer, state in zip(optimizers, group["optimizers"]):
            optimizer.load_state_dict(state)
        if rng is not None:
            _set_rng_state(rng)
        self.on_write()

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, CheckpointTopologyWarning, stacklevel=3)


def layout_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between the layout a checkpoint was written with and the current one."""
    return [
        f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key in current
        if saved.get(key) != current.get(key)
    ]


def _topology_message(path: Path, differences: list[str]) -> str:
    return (
        f"Checkpoint {str(path)!r} was written by another federation layout ({'; '.join(differences)}). Resuming from"
        " the consensus (the anchor of its last sync): each group's own weights and inner optimizer state, and the"
        " outer optimizer state, were dropped; the step counters and sync schedule are kept."
    )


def _check_version(path: Path, section: dict[str, Any]) -> None:
    version = section.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"Checkpoint {str(path)!r} has federation format version {version!r}; this version of lightning_fedshard"
            f" reads versions up to {FORMAT_VERSION}. Upgrade lightning_fedshard, or use `export_consensus`."
        )


# -- failures ---------------------------------------------------------------------------------------------------

_PEER_FAILURE_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo", "nccl")


def is_peer_failure(exception: BaseException | None) -> bool:
    """Whether ``exception`` is a failed collective: a peer rank died or stopped answering within the timeout."""
    if exception is None:
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exception, dist_error):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(hint in text for hint in _PEER_FAILURE_HINTS)


def unsafe_to_save(exception: BaseException | None) -> str | None:
    """Why no checkpoint may be written while ``exception`` is being handled (e.g. by ``OnExceptionCheckpoint``).

    Returns:
        The reason, or ``None`` when saving is fine.
    """
    if isinstance(exception, NonFiniteOuterGradientError):
        return (
            "the federation stopped on a non-finite outer gradient; a checkpoint now would store the broken group"
            " weights, so the last checkpoint is kept as it is."
        )
    if is_peer_failure(exception):
        return "a collective failed (a peer rank probably died), so a save could not complete."
    return None


def peer_failure_message(exception: BaseException, rank: int) -> str:
    """What to tell the user when this rank stopped because a collective failed."""
    return (
        f"lightning_fedshard: rank {rank} stopped because a collective failed ({type(exception).__name__}): a peer"
        " rank probably died or stopped answering within the strategy's `timeout`. Checkpoints already on disk are"
        " intact (saves are written to a temporary path and renamed when complete). Restart the job and resume with"
        " `trainer.fit(..., ckpt_path=<last checkpoint>)`."
    )


# -- files ------------------------------------------------------------------------------------------------------


def _local_path(path: str | Path) -> Path:
    if "://" in str(path):
        raise ValueError(
            f"Checkpoint path {str(path)!r} is a URL; federated checkpoints are written to local or mounted file"
            " systems, where they can be renamed into place atomically."
        )
    return Path(path)


def _entry_file(name: str) -> str:
    return name.replace("/", ".") + ".pt"


def _staging_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _save_file(obj: Any, path: Path) -> None:
    """``torch.save`` and flush to disk, so that a rename after it never exposes a partial file."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(staging: Path, path: Path) -> None:
    """Rename a complete checkpoint onto ``path``; an existing one there is removed only afterwards.

    Renaming a file over a file is atomic. A directory cannot replace a directory in one step, so the old one is first
    renamed aside: between the two renames ``path`` is missing but nothing is lost.
    """
    if staging.is_file() and (path.is_file() or not path.exists()):
        os.replace(staging, path)
        return
    aside = path.with_name(f".{path.name}.old")
    _remove(aside)
    if path.exists() or path.is_symlink():
        os.replace(path, aside)
    os.replace(staging, path)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# -- small helpers ----------------------------------------------------------------------------------------------


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _rng_state() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _device_of(module: Module) -> torch.device:
    return next(iter(local_shards(module))).device
