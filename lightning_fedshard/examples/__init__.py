"""A real model and real data that work offline: a small Llama trained on Shakespeare's plays.

The names are loaded on first use (PEP 562), so importing this package is cheap: transformers' Llama code and the
``tokenizers`` library load only when the model or the data module is first named. Configs can still name
``lightning_fedshard.examples.LlamaLM`` and ``lightning_fedshard.examples.ShakespeareDataModule`` as ``class_path``.

Nothing here reaches the Hugging Face hub: the model is built from a config with random weights and the tokenizer is
trained locally.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_fedshard.examples.llama import LLAMA_SIZES, LlamaLM
    from lightning_fedshard.examples.shakespeare import ShakespeareDataModule

# Public name -> the submodule that defines it.
_LAZY = {
    "LLAMA_SIZES": "lightning_fedshard.examples.llama",
    "LlamaLM": "lightning_fedshard.examples.llama",
    "ShakespeareDataModule": "lightning_fedshard.examples.shakespeare",
}

__all__ = ["LLAMA_SIZES", "LlamaLM", "ShakespeareDataModule"]


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """List the lazy names too (for ``dir()`` and tab completion)."""
    return sorted([*globals(), *__all__])
