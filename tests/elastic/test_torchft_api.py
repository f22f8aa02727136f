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


def test_the_heal_server_of_torchfts_transport_is_an_http_server_whose_handler_can_be_wrapped():
    """The benchmarks inject a fault into a heal in transit through this server's request handler class."""
    pytest.importorskip("torchft")
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, HTTPServer

    transport = torchft_api.http_transport_class()(timeout=timedelta(seconds=5), num_chunks=0)
    try:
        server = torchft_api.heal_server(transport)
        assert isinstance(server, HTTPServer) and issubclass(server.RequestHandlerClass, BaseHTTPRequestHandler)
    finally:
        transport.shutdown()
