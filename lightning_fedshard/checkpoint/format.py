"""The checkpoint format: the two kinds of checkpoint, the ``"fedshard"`` section, its entries and its layout.

A **full** checkpoint is one file written by global rank 0: Lightning's checkpoint dict with the consensus as
``"state_dict"`` and the section under :data:`FEDSHARD_KEY`, including every entry. A **sharded** checkpoint is a
folder: DCP files holding ``{"model": <consensus>}``, Lightning's metadata file :data:`METADATA_FILENAME` (with the
section, without entries) and one file per entry in the :data:`FEDSHARD_KEY` sub-folder. Entries are named
``group{g}/shard{s}``, ``outer/shard{s}`` and ``rng/rank{r}`` (see :mod:`lightning_fedshard.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_fedshard.core.transport.topology import FederationTopology

#: Top-level key of the federation section in a checkpoint, and folder of the entry files of a sharded one.
FEDSHARD_KEY = "fedshard"
#: Version of the ``"fedshard"`` section this code writes; it reads this one and older.
FORMAT_VERSION = 1
#: Key of what the Fabric strategies add to a checkpoint (their step count and the user's key of the model).
FABRIC_KEY = "fedshard_fabric"
#: Lightning's metadata file in a sharded checkpoint folder; its presence is what makes a folder a checkpoint. The same
#: name as Lightning's ``FSDPStrategy`` uses, so that each can read the other's sharded checkpoints.
METADATA_FILENAME = "meta.pt"

StateDictType = Literal["full", "sharded"]


# -- the two kinds ---------------------------------------------------------------------------------------------------


def checkpoint_kind(path: Path) -> StateDictType:
    """Whether ``path`` is a full (a file) or a sharded (a folder with :data:`METADATA_FILENAME`) checkpoint.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If ``path`` exists but is neither.
    """
    if path.is_dir() and (path / METADATA_FILENAME).is_file():
        return "sharded"
    if path.is_file():
        return "full"
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    raise ValueError(
        f"{str(path)!r} is not a checkpoint: expected a file (full) or a directory with {METADATA_FILENAME!r}"
        " (sharded)."
    )


def read_full(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Open a full checkpoint without reading its tensors yet: they are memory-mapped and read when touched.

    So one rank reads its own entries only, not every group's. Copy (``clone``) what must outlive the file.

    Args:
        path: The checkpoint file.
        weights_only: Passed to ``torch.load``; ``None`` means ``False``, as Lightning does for its own full
            checkpoints (they may hold hyper-parameters of any type).
    """
    return torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))


def in_memory(obj: Any) -> Any:
    """``obj`` with every tensor copied into memory, e.g. out of a checkpoint opened by :func:`read_full`."""
    return apply_to_collection(obj, Tensor, Tensor.clone)


@dataclass(frozen=True)
class ModelKey:
    """Where a checkpoint holds the model's weights (the consensus).

    Args:
        full: Its key in a full checkpoint file.
        sharded: Its key in the DCP files of a sharded checkpoint.
    """

    full: str = "state_dict"
    sharded: str = "model"


#: The Trainer's layout, as Lightning's ``FSDPStrategy`` writes it: ``"state_dict"`` in a file, ``"model"`` in DCP.
TRAINER_MODEL_KEY = ModelKey()


def fabric_model_key(user_key: str) -> ModelKey:
    """The layout of a Fabric checkpoint, as Lightning's Fabric ``FSDPStrategy`` writes it: the user's own key."""
    return ModelKey(full=user_key, sharded=user_key)


def pop_state_dict(checkpoint: dict[str, Any], path: Path, key: str = TRAINER_MODEL_KEY.full) -> dict[str, Tensor]:
    """Remove and return the model weights (the consensus) of a full checkpoint, held under ``key``.

    Raises:
        ValueError: If the checkpoint holds no ``key``.
    """
    if key not in checkpoint:
        raise ValueError(f"Checkpoint {str(path)!r} holds no {key!r}; its keys are {sorted(checkpoint)}.")
    return checkpoint.pop(key)


# -- entries ---------------------------------------------------------------------------------------------------------


def group_entry(group: int, shard: int) -> str:
    """Name of the entry with group ``group``'s own weights and inner optimizer states at shard position ``shard``."""
    return f"group{group}/shard{shard}"


def replica_entry(group: int, replica: int, shard: int) -> str:
    """Name of the entry with what replica ``replica`` of group ``group``'s shard ``shard`` holds alone.

    That is the error-feedback residuals of the part of the shard this replica sums over the groups.
    """
    return f"group{group}/replica{replica}/shard{shard}"


def outer_entry(shard: int) -> str:
    """Name of the entry with the anchor and outer optimizer state at shard position ``shard``."""
    return f"outer/shard{shard}"


def rng_entry(rank: int) -> str:
    """Name of the entry with rank ``rank``'s random number generator states."""
    return f"rng/rank{rank}"


def entry_file(name: str) -> str:
    """File name of entry ``name`` in the :data:`FEDSHARD_KEY` folder of a sharded checkpoint."""
    return name.replace("/", ".") + ".pt"


# -- the section -----------------------------------------------------------------------------------------------------


def layout(topology: FederationTopology, hybrid: bool, shards: Sequence[Tensor], fragments: int = 1) -> dict[str, Any]:
    """What must be equal for per-group state to be restored: topology, kind, local shard sizes and dtypes, fragments.

    Args:
        topology: The job's groups, replicas and shards.
        hybrid: FL+HSDP (``True``) or FL+FSDP.
        shards: This rank's local parameter shards.
        fragments: Streaming fragments (each has its own outer optimizer state).
    """
    return {
        "world_size": topology.world_size,
        "num_groups": topology.num_groups,
        "num_replicas": topology.num_replicas,
        "shard_size": topology.shard_size,
        "hybrid": hybrid,
        "shard_numels": [s.numel() for s in shards],
        "shard_dtypes": [str(s.dtype).removeprefix("torch.") for s in shards],
        "fragments": fragments,
    }


def section(writer_layout: dict[str, Any], started: bool, last_synced_step: int, num_syncs: int) -> dict[str, Any]:
    """The ``"fedshard"`` section without its entries.

    Args:
        writer_layout: The writer's :func:`layout`.
        started: Whether the federation had started (taken its first anchor) when the checkpoint was written.
        last_synced_step: The optimizer step of the last sync.
        num_syncs: How many syncs ran.
    """
    return {
        "format_version": FORMAT_VERSION,
        "layout": writer_layout,
        "started": started,
        "schedule": {"last_synced_step": last_synced_step, "num_syncs": num_syncs},
    }


def layout_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between the layout a checkpoint was written with (upgraded) and the current one."""
    return [
        f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key in current
        if saved.get(key) != current.get(key)
    ]


def check_version(path: Path, fedshard: dict[str, Any]) -> None:
    """Refuse a section written by a newer version of this package.

    Raises:
        ValueError: If the section's ``format_version`` is missing or newer than :data:`FORMAT_VERSION`.
    """
    version = fedshard.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"Checkpoint {str(path)!r} has federation format version {version!r}; this version of lightning_fedshard"
            f" reads versions up to {FORMAT_VERSION}. Upgrade lightning_fedshard, or use `export_consensus`."
        )
