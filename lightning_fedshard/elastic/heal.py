"""How a group takes the federation's state from a peer: torchft's HTTP transport, and copies safe to send.

A peer's state is sent from torchft's own thread while the sender goes on with its quorum: :func:`cloned` takes
copies that nothing changes later, and :func:`heal_transport` serves them at the address the other groups reach.
"""

from __future__ import annotations

import copy
import logging
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from torch import Tensor

log = logging.getLogger(__name__)


def heal_transport(base: type, timeout: timedelta, hostname: str | None) -> Any:
    """The HTTP transport of torchft for heals, advertised at ``hostname`` (torchft advertises the host name).

    On a cluster the host name may not be what the other groups reach (a node's cluster interface, a container):
    the heal server then answers at the address the manager is advertised at. Its access log (one line on stderr per
    request of a healing peer, from Python's ``http.server``) is silenced.
    """
    if hostname is None:
        return _quiet_access_log(base(timeout=timeout, num_chunks=0))

    class AddressedHTTPTransport(base):  # type: ignore[misc, valid-type]
        def address(self) -> str:
            url = urlparse(super().address())
            return url._replace(netloc=f"{hostname}:{url.port}").geturl()

    return _quiet_access_log(AddressedHTTPTransport(timeout=timeout, num_chunks=0))


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


__all__ = ["cloned", "heal_transport"]
