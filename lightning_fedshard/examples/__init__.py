"""A real model and real data that work offline: a small Llama trained on Shakespeare's plays."""

import os

# Nothing in the examples may download from the Hugging Face hub. huggingface_hub and datasets read these variables
# once, at import time, so they are set before any submodule imports them (an explicit user setting wins).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from lightning_fedshard.examples.llama import LLAMA_SIZES, LlamaLM  # noqa: E402
from lightning_fedshard.examples.shakespeare import ShakespeareDataModule  # noqa: E402

__all__ = ["LLAMA_SIZES", "LlamaLM", "ShakespeareDataModule"]
