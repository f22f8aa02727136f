"""The GPU tier: tests that need a CUDA device, skipped with the reason everywhere else.

The same suite runs on every machine; where a GPU exists these tests run too (``scripts/device_check.sh`` runs them
with a report). They cover what only a GPU exercises: CUDA tensors in the codecs and the outer step, the anchor in
host memory while shards live on the device, the background sum of an overlapped sync beside the main thread's
CUDA work, meta-device init on the device with its memory, and the Trainer and the Shakespeare example on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REASON = (
    "GPU tier: needs a CUDA device (torch.cuda.is_available() is False here); scripts/device_check.sh runs it where"
    " one is lent"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(skip)
