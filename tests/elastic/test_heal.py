"""The transport of a heal, and the copies of the state it sends."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.elastic.heal import cloned, heal_transport


def test_the_heal_server_writes_no_access_log(capfd):
    # torchft's HTTP transport serves a healing peer through Python's http.server, which logs every request to stderr.
    import urllib.request
    from datetime import timedelta

    pytest.importorskip("torchft")
    from torchft.checkpointing import HTTPTransport

    for hostname in (None, "127.0.0.1"):
        transport = heal_transport(HTTPTransport, timedelta(seconds=10), hostname)
        try:
            transport.send_checkpoint(
                dst_ranks=[1], step=3, state_dict={"w": torch.ones(2)}, timeout=timedelta(seconds=10)
            )
            address = transport.metadata()  # http://host:port/checkpoint/
            with urllib.request.urlopen(f"{address.rstrip('/')}/3/full", timeout=10) as response:
                assert response.status == 200
        finally:
            transport.shutdown(wait=False)
    assert "GET /checkpoint" not in capfd.readouterr().err


def test_a_heal_sends_detached_cpu_copies_that_later_training_does_not_change():
    weight = torch.ones(3, requires_grad=True)
    state = {"outer": {"anchor": [weight]}, "sync": (0, 8), "step": 8, "host": {"loop": [1, 2]}}
    copy = cloned(state)
    with torch.no_grad():
        weight.add_(1.0)
    state["host"]["loop"].append(3)
    anchor = copy["outer"]["anchor"][0]
    assert torch.equal(anchor, torch.ones(3)) and not anchor.requires_grad and anchor.device.type == "cpu"
    assert copy["sync"] == (0, 8) and isinstance(copy["sync"], tuple) and copy["host"] == {"loop": [1, 2]}
