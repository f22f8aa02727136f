"""Export the consensus model of a federated checkpoint for deployment, without processes or this package."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.nn import Module

from lightning_fedshard.checkpoint.format import (
    METADATA_FILENAME,
    checkpoint_kind,
    in_memory,
    pop_state_dict,
    read_full,
)
from lightning_fedshard.checkpoint.upgrades import model_key

#: File name of the plain PyTorch state dict written by :func:`export_consensus`.
CONSENSUS_FILENAME = "consensus.pt"


if TYPE_CHECKING:
    from transformers import PreTrainedModel


def export_consensus(checkpoint_path: str | Path, output_dir: str | Path, module: Module | None = None) -> Path:
    """Write the consensus model (the anchor of the last sync) of a checkpoint for deployment.

    Works on full (file) and sharded (directory) checkpoints of ``fl_fsdp``/``fl_hsdp`` (and of Lightning's own FSDP
    strategy), in a single process.

    Args:
        checkpoint_path: A full checkpoint file or a sharded checkpoint directory.
        output_dir: Folder to write to (created if missing).
        module: Optional model with the checkpoint's key layout (e.g. a fresh instance of the ``LightningModule``). If
            given, the consensus is loaded into it (strictly), and if it is or holds exactly one ``transformers``
            ``PreTrainedModel``, that model is written with ``save_pretrained`` (``config.json`` + safetensors).

    Returns:
        The written ``consensus.pt`` (a plain ``{name: tensor}`` state dict in the checkpoint's key layout, loadable
        with ``module.load_state_dict(torch.load(path))``), or ``output_dir`` for ``save_pretrained``.

    Raises:
        FileNotFoundError: If ``checkpoint_path`` does not exist.
        ValueError: If it is not a checkpoint, or ``module`` holds several transformers models.
        FileExistsError: If ``output_dir`` is an existing file.
        RuntimeError: If the consensus does not fit ``module`` (from ``load_state_dict``).
    """
    state_dict = read_consensus(checkpoint_path)
    out = Path(output_dir)
    if out.is_file():
        raise FileExistsError(f"`output_dir={str(out)!r}` is an existing file; pass a folder.")
    out.mkdir(parents=True, exist_ok=True)
    if module is not None:
        module.load_state_dict(state_dict, strict=True)
        pretrained = _pretrained_model(module)
        if pretrained is not None:
            pretrained.save_pretrained(str(out))
            return out
        state_dict = module.state_dict()
    target = out / CONSENSUS_FILENAME
    torch.save({k: v.detach().clone() for k, v in state_dict.items()}, target)
    return target


def read_consensus(checkpoint_path: str | Path) -> dict[str, Tensor]:
    """The consensus state dict stored in a full or sharded checkpoint, on the CPU.

    Raises:
        FileNotFoundError: If ``checkpoint_path`` does not exist.
        ValueError: If it is not a checkpoint, or holds no model weights.
    """
    path = Path(checkpoint_path)
    if checkpoint_kind(path) == "sharded":
        return _read_sharded_model(path)
    checkpoint = read_full(path)
    return in_memory(pop_state_dict(checkpoint, path, model_key(checkpoint).full))


def read_whole_checkpoint(checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Everything a checkpoint holds, as one dict, as ``fabric.load(path)`` returns it; single-process.

    A full checkpoint is read as it is. A sharded one gives its ``meta.pt`` with the consensus under the model's key.

    Args:
        checkpoint_path: A full checkpoint file or a sharded checkpoint directory.
        weights_only: Passed to ``torch.load``.
    """
    path = Path(checkpoint_path)
    if checkpoint_kind(path) == "full":
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    metadata = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=weights_only)
    return {**metadata, model_key(metadata).full: _read_sharded_model(path)}


def _read_sharded_model(path: Path) -> dict[str, Tensor]:
    """The model of a DCP checkpoint, through a temporary ``torch.save`` file (the public DCP conversion)."""
    key = model_key(torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False)).sharded
    with tempfile.TemporaryDirectory() as scratch:
        converted = Path(scratch) / "consensus.pt"
        dcp_to_torch_save(path, converted)
        # Written just now from the DCP files, which `dcp_to_torch_save` already unpickled in full.
        checkpoint = torch.load(converted, map_location="cpu", weights_only=False)
    if key not in checkpoint:
        raise ValueError(f"Sharded checkpoint {str(path)!r} holds no {key!r}; its keys are {sorted(checkpoint)}.")
    return checkpoint[key]


def _pretrained_model(module: Module) -> PreTrainedModel | None:
    if importlib.util.find_spec("transformers") is None:
        return None  # without transformers installed, no module can be one of its models
    from transformers import PreTrainedModel

    found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    outermost = [(n, m) for n, m in found if not any(_is_inside(n, other) for other, _ in found)]
    if len(outermost) > 1:
        names = [n or "<root>" for n, _ in outermost]
        raise ValueError(f"`module` holds several transformers models ({names}); pass the one to export.")
    return outermost[0][1] if outermost else None


def _is_inside(name: str, other: str) -> bool:
    """Whether module ``name`` is a descendant of module ``other`` (``""`` is the root)."""
    return name != other and (other == "" or name.startswith(f"{other}."))
