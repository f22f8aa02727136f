"""How a group takes the federation's state from a peer: torchft's HTTP transport, and copies safe to send.

A peer's state is sent from torchft's own thread while the sender goes on with its quorum: :func:`cloned` takes
copies that nothing changes later, and :func:`heal_transport` serves them at the address the other groups reach.

With a federation secret (``Elastic(secret=...)``) both ends prove it: a request carries the HMAC of its path under
the secret (:data:`PROOF_HEADER`), a server answers only such requests (others get ``403`` and one log line), and its
answer carries the HMAC of the path and the request's proof, which the requesting group checks before it loads a byte
of the state (torchft's transport unpickles what it receives). The server then listens on the address the group is
advertised at, not on every interface.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlparse

from torch import Tensor

from lightning_fedshard.core.options.elastic import FederationError, proof, proves
from lightning_fedshard.elastic.torchft_api import streaming_load

log = logging.getLogger(__name__)

#: The HTTP header that carries a proof of the federation's secret, in a heal's request and in its answer.
PROOF_HEADER = "X-Fedshard-Proof"


class SecretRefused(FederationError):
    """A heal server refused this job's request: it does not hold the federation's secret, or holds another one."""


def heal_transport(base: type, timeout: timedelta, hostname: str | None, secret: bytes | None = None) -> Any:
    """The HTTP transport of torchft for heals, advertised at ``hostname`` (torchft advertises the host name).

    On a cluster the host name may not be what the other groups reach (a node's cluster interface, a container):
    the heal server then answers at the address the manager is advertised at. Its access log (one line on stderr per
    request of a healing peer, from Python's ``http.server``) is silenced. With ``secret`` every heal proves it both
    ways (see the module), and the server listens on the advertised address only.
    """
    cls = _fetching(base if hostname is None else _advertised_at(base, hostname), secret)
    if secret is None:
        return _quiet_access_log(cls(timeout=timeout, num_chunks=0))
    transport = _quiet_access_log(_authenticated(cls, secret)(timeout=timeout, num_chunks=0))
    _listen_on(transport, hostname)
    return transport


def _advertised_at(base: type, hostname: str) -> type:
    class AddressedHTTPTransport(base):  # type: ignore[misc, valid-type]
        def address(self) -> str:
            url = urlparse(super().address())
            return url._replace(netloc=f"{hostname}:{url.port}").geturl()

    return AddressedHTTPTransport


def _fetching(base: type, secret: bytes | None) -> type:
    """``base`` whose client fetches a peer's state with :func:`fetch_state` (proving ``secret``, if any)."""

    class FetchingHTTPTransport(base):  # type: ignore[misc, valid-type]
        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            return fetch_state(f"{metadata}{step}/full", secret, timeout)

    return FetchingHTTPTransport


def _authenticated(base: type, secret: bytes) -> type:
    """``base`` whose server answers only requests that prove ``secret``."""

    class AuthenticatedHTTPTransport(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._server.RequestHandlerClass = _checking(self._server.RequestHandlerClass, secret)

    return AuthenticatedHTTPTransport


def _checking(handler: type, secret: bytes) -> type:
    """A request handler that refuses a request without the proof of ``secret`` and proves it in its answer."""

    class CheckingHandler(handler):  # type: ignore[misc, valid-type]
        _answer_proof: str | None = None

        def do_GET(self) -> None:
            claimed = self.headers.get(PROOF_HEADER)
            if not proves(secret, claimed, "heal request", self.path):
                log.warning(
                    f"Refused a heal request from {self.client_address[0]}: it does not prove the federation's secret."
                )
                self.send_error(403, "the request does not prove the federation's secret")
                return
            self._answer_proof = proof(secret, "heal answer", self.path, claimed)
            super().do_GET()

        def end_headers(self) -> None:
            if self._answer_proof is not None:
                self.send_header(PROOF_HEADER, self._answer_proof)
            super().end_headers()

    return CheckingHandler


def fetch_state(url: str, secret: bytes | None, timeout: timedelta) -> Any:
    """A peer's state from its heal server at ``url``, proving ``secret``; loaded only if the answer proves it too.

    Without a secret the request proves nothing and the answer is loaded as it comes (torchft's own heal).

    Raises:
        SecretRefused: If the server refused the request (this job's secret is not the federation's, or it has none).
        FederationError: If the answer does not prove the secret: nothing of it was loaded.
    """
    path = urlparse(url).path
    claimed = None if secret is None else proof(secret, "heal request", path)
    request = urllib.request.Request(url, headers={} if claimed is None else {PROOF_HEADER: claimed})
    try:
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as answer:
            answered = answer.headers.get(PROOF_HEADER)
            if secret is not None and not proves(secret, answered, "heal answer", path, claimed):
                raise FederationError(
                    f"The heal server at {urlparse(url).netloc} did not prove the federation's secret: nothing it sent"
                    " was loaded."
                )
            try:
                return cast(Any, streaming_load(answer))
            except (ValueError, EOFError, RuntimeError) as error:  # torch's reader on a stream that ended early
                raise ConnectionError(
                    f"The heal from {urlparse(url).netloc} ended before the whole state arrived (the peer is gone?):"
                    f" {error}"
                ) from None
    except urllib.error.HTTPError as error:
        if error.code == 403:
            raise SecretRefused(
                f"the heal server at {urlparse(url).netloc} refused this job: it does not hold the federation's secret"
                " (or holds another one)"
            ) from error
        raise


def _listen_on(transport: Any, hostname: str | None) -> None:
    """Serve ``transport``'s heals on the address ``hostname`` (default: the host name) resolves to.

    Not on every interface; but kept on every interface when the host name (no ``hostname`` given) resolves to a
    loopback address, which the other nodes could not reach.
    """
    try:
        address = socket.getaddrinfo(hostname or socket.gethostname(), None, type=socket.SOCK_STREAM)[0]
    except OSError:
        return
    family, host = address[0], str(address[4][0])
    if hostname is None and (host.startswith("127.") or host == "::1"):
        return
    handler = transport._server.RequestHandlerClass
    transport._server.shutdown()
    transport._thread.join()
    transport._server.server_close()

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

    transport._server = Server((host, 0), handler)
    transport._thread = threading.Thread(target=transport._serve, daemon=True)
    transport._thread.start()


def _quiet_access_log(transport: Any) -> Any:
    """Route the access log of ``transport``'s HTTP server to this module's logger at DEBUG, off the console.

    torchft's ``HTTPTransport`` serves through a ``http.server`` handler class of its own (``_server``, private),
    whose ``log_message`` writes every request to stderr; the server builds a handler per request, so replacing its
    class takes effect at the next one. Errors are still logged by torchft itself.
    """
    server = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if server is None or handler is None:
        return transport

    class QuietHandler(handler):  # type: ignore[misc, valid-type]
        def log_message(self, format: str, *args: Any) -> None:
            log.debug(f"heal server: {format % args}")

    server.RequestHandlerClass = QuietHandler
    return transport


def cloned(state: Any) -> Any:
    """A copy of ``state`` whose tensors are detached CPU copies (what a heal may send while training goes on)."""
    if isinstance(state, Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(v) for v in state)
    return copy.deepcopy(state)


__all__ = ["PROOF_HEADER", "SecretRefused", "cloned", "fetch_state", "heal_transport"]
