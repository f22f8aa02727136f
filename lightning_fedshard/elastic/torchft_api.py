"""The one module that imports torchft: every part of it the elastic federation uses, and which of them are private.

torchft is imported on first use, so the package imports without it. The parts, as torchft 0.2.0 has them:

- public: ``torchft.manager.Manager`` (quorum, commit vote, heal), ``torchft.checkpointing.HTTPTransport`` (a heal's
  transport), ``torchft.process_group.ProcessGroupGloo`` (the reconfigurable fed rings),
  ``torchft.coordination.LighthouseServer`` (an in-process lighthouse);
- private: ``Manager._client`` (the quorum call, wrapped to record each quorum's step; see
  :class:`~lightning_fedshard.elastic.rings.QuorumRecorder`), ``ProcessGroupGloo.configure``'s arguments (each ring's
  rendezvous), ``torchft.checkpointing._serialization._streaming_load`` (loading a heal's answer as it arrives),
  ``HTTPTransport._server`` (the heal server, offered as ``ElasticCommunicator.heal_server`` for fault injection).

Every job of one federation must run the same torchft release: the lighthouse, the managers and the heal transport
talk a protocol of that release. Moving to another torchft release (0.3 reconfigures torch's native process groups
and needs torch 2.14 or newer) changes this module and what it returns, not its callers.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, BinaryIO

#: The torchft releases the elastic tests pass with.
TESTED_TORCHFT = ("0.2.0",)


def torchft_version() -> str:
    """The installed torchft release, or ``"not installed"``."""
    try:
        return version("torchft")
    except PackageNotFoundError:
        return "not installed"


def manager_class() -> type:
    """Torchft's ``Manager``: one per rank, its group's quorum, commit vote and heal."""
    from torchft.manager import Manager

    return Manager


def http_transport_class() -> type:
    """Torchft's ``HTTPTransport``: the base of the heal transport (``lightning_fedshard.elastic.heal``)."""
    from torchft.checkpointing import HTTPTransport

    return HTTPTransport


def process_group_gloo_class() -> type:
    """Torchft's reconfigurable ``ProcessGroupGloo``, the base of the fed rings (:mod:`.rings`)."""
    from torchft.process_group import ProcessGroupGloo

    return ProcessGroupGloo


def lighthouse_server_class() -> type:
    """Torchft's in-process ``LighthouseServer`` (the demo's and the tests' lighthouse)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer


def streaming_load(stream: BinaryIO) -> Any:
    """A state sent by a peer's heal transport, read from ``stream`` as it arrives (torchft's private reader)."""
    from torchft.checkpointing._serialization import _streaming_load

    return _streaming_load(stream, weights_only=False)


def heal_server(transport: Any) -> Any:
    """The ``http.server`` server of a heal transport built on torchft's ``HTTPTransport`` (its private ``_server``)."""
    return transport._server


def wrap_quorum_client(manager: Any, wrap: Any) -> None:
    """Put ``wrap(client)`` between ``manager`` and its quorum client (torchft's private ``Manager._client``)."""
    manager._client = wrap(manager._client)


__all__ = [
    "TESTED_TORCHFT",
    "heal_server",
    "http_transport_class",
    "lighthouse_server_class",
    "manager_class",
    "process_group_gloo_class",
    "streaming_load",
    "torchft_version",
    "wrap_quorum_client",
]
