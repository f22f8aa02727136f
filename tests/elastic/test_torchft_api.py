"""torchft is reached through one module: a torchft upgrade changes it alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_fedshard.elastic import torchft_api

PACKAGE = Path(torchft_api.__file__).parents[1]


def _imports_torchft(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if any(name == "torchft" or name.startswith("torchft.") for name in names):
            return True
    return False


def test_only_the_torchft_module_imports_torchft():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _imports_torchft(p))
    assert importers == ["elastic/torchft_api.py"]


def test_the_installed_torchft_is_a_tested_release_with_every_part_the_federation_uses():
    """The elastic tests run the private parts (the quorum client, the rings' rendezvous); here they must exist."""
    pytest.importorskip("torchft")
    assert torchft_api.torchft_version() in torchft_api.TESTED_TORCHFT
    parts = (torchft_api.manager_class(), torchft_api.http_transport_class(), torchft_api.lighthouse_server_class())
    assert all(isinstance(part, type) for part in parts)
    assert callable(getattr(torchft_api.process_group_gloo_class(), "configure", None))
    from torchft.checkpointing import _serialization

    assert callable(getattr(_serialization, "_streaming_load", None))
