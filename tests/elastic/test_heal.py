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


SECRET, OTHER = b"a" * 16 + b"federation", b"b" * 16 + b"stranger"


def _serving(secret, hostname="127.0.0.1"):
    from datetime import timedelta

    pytest.importorskip("torchft")
    from torchft.checkpointing import HTTPTransport

    transport = heal_transport(HTTPTransport, timedelta(seconds=10), hostname, secret)
    transport.send_checkpoint(dst_ranks=[1], step=3, state_dict={"w": torch.arange(4.0)}, timeout=timedelta(seconds=10))
    return transport


def test_with_a_secret_a_heal_proves_it_both_ways_and_loads_the_state():
    from datetime import timedelta

    from torchft.checkpointing import HTTPTransport

    server = _serving(SECRET)
    client = heal_transport(HTTPTransport, timedelta(seconds=10), "127.0.0.1", SECRET)
    try:
        state = client.recv_checkpoint(0, server.metadata(), 3, timedelta(seconds=10))
        assert torch.equal(state["w"], torch.arange(4.0))
    finally:
        server.shutdown(wait=False)
        client.shutdown(wait=False)


def test_a_request_without_the_secret_or_with_another_one_is_refused_with_a_log_line(caplog):
    import logging
    import urllib.error
    import urllib.request
    from datetime import timedelta

    from lightning_fedshard.elastic.heal import PROOF_HEADER, SecretRefused, fetch_state

    server = _serving(SECRET)
    url = f"{server.metadata().rstrip('/')}/3/full"
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_fedshard.elastic.heal"):
            for headers in ({}, {PROOF_HEADER: "0" * 64}):  # a stranger's plain fetch, and a made-up proof
                with pytest.raises(urllib.error.HTTPError) as error:
                    urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
                assert error.value.code == 403
            with pytest.raises(SecretRefused, match="refused this job: it does not hold the federation's secret"):
                fetch_state(url, OTHER, timedelta(seconds=10))
        refusals = [r for r in caplog.records if "Refused a heal request from 127.0.0.1" in r.getMessage()]
        assert len(refusals) == 3
        assert all(SECRET.decode() not in r.getMessage() for r in caplog.records)
    finally:
        server.shutdown(wait=False)


def test_a_joining_group_loads_nothing_from_a_server_that_does_not_prove_the_secret():
    from datetime import timedelta

    from lightning_fedshard.core.options.elastic import FederationError
    from lightning_fedshard.elastic.heal import fetch_state

    impostor = _serving(None)  # serves anyone, proves nothing
    try:
        with pytest.raises(FederationError, match="did not prove the federation's secret: nothing it sent was loaded"):
            fetch_state(f"{impostor.metadata().rstrip('/')}/3/full", SECRET, timedelta(seconds=10))
    finally:
        impostor.shutdown(wait=False)


def test_with_a_secret_the_heal_server_listens_on_the_advertised_address_only():
    server = _serving(SECRET, hostname="127.0.0.1")
    try:
        assert server._server.server_address[0] == "127.0.0.1"  # not "::" (every interface)
    finally:
        server.shutdown(wait=False)


def test_a_heal_cut_off_by_a_peer_that_died_is_a_clear_connection_error():
    # A source group killed while it sends the state: the joining group's heal fails (it heals at its next quorum).
    import io
    import threading
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from torchft.checkpointing._serialization import _streaming_save

    from lightning_fedshard.elastic.heal import fetch_state

    whole = io.BytesIO()
    _streaming_save({"w": torch.arange(4096.0)}, whole)

    class Dying(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(whole.getvalue()[: len(whole.getvalue()) // 2])  # then the connection closes

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/3/full"
        with pytest.raises(ConnectionError, match=r"The heal from 127\.0\.0\.1:\d+ ended before the whole state"):
            fetch_state(url, None, timedelta(seconds=10))
    finally:
        server.shutdown()
        server.server_close()
