"""Importing the package is cheap: no transformers, datasets, tokenizers or torchmetrics of its own.

Each check runs in a fresh interpreter, since this test process has long imported all of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes

ROOT = Path(__file__).parents[1]
HEAVY = ("transformers", "datasets", "tokenizers", "torchmetrics")
# What users import; jsonargparse resolves the examples' `class_path`s through `lightning_fedshard.examples`.
MODULES = ("lightning_fedshard", "lightning_fedshard.cli", "lightning_fedshard.examples", "lightning_fedshard.export")

# Run in a fresh interpreter: import `argv[1:]` one after the other and print, after each, the heavy modules loaded.
_PROBE = f"""
import importlib, json, sys
seen = {{}}
for name in sys.argv[1:]:
    importlib.import_module(name)
    seen[name] = sorted(m for m in sys.modules if m.partition(".")[0] in {HEAVY!r})
print(json.dumps(seen))
"""


def _heavy_modules_after(*modules: str) -> dict[str, set[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, check=True, timeout=300, env=env
    ).stdout
    return {name: set(loaded) for name, loaded in json.loads(out.splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Heavy modules loaded by ``import lightning`` alone, and then by each of :data:`MODULES` in turn."""
    return {**_heavy_modules_after("lightning"), **_heavy_modules_after(*MODULES)}


def test_package_imports_nothing_heavy_beyond_lightning(loaded: dict[str, set[str]]) -> None:
    # Lightning 2.6 itself imports torchmetrics, and torchmetrics' BERTScore and CLIPScore modules import transformers
    # (and with it tokenizers) whenever it is installed: that part is not ours to avoid.
    for module in MODULES:
        extra = sorted(loaded[module] - loaded["lightning"])
        assert not extra, f"`import {module}` loads {len(extra)} heavy module(s) Lightning does not: {extra[:5]}"


@pytest.mark.xfail(
    strict=True,
    reason="`import lightning` (2.6) loads torchmetrics, which loads transformers and tokenizers when installed",
)
def test_package_imports_none_of_the_heavy_modules(loaded: dict[str, set[str]]) -> None:
    assert not loaded["lightning_fedshard"]
