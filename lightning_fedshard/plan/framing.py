"""Bytes on the link of gloo's TCP transport: the payload plus gloo's, TCP's, IP's and Ethernet's framing.

A collective's payload (what :meth:`~lightning_fedshard.core.wire.reducers.Reducer.wire_bytes` and the ring formulas
count) is not what a link's byte counter shows. Over gloo's TCP transport every message of ``n`` payload bytes costs:

- **gloo**: three operations, each with a 48-byte header (``Op::preamble`` in ``gloo/transport/tcp/pair.h``: six
  8-byte fields): the receiver's ``NOTIFY_RECV_READY``, the sender's ``NOTIFY_SEND_READY`` and the sender's
  ``SEND_UNBOUND_BUFFER`` that carries the ``n`` bytes (``pair.cc``: ``recv``, ``send``, ``sendUnboundBuffer``).
- **TCP/IP/Ethernet**: each operation leaves in its own frames (gloo writes each with one ``writev`` on a
  ``TCP_NODELAY`` socket). A frame carries 66 header bytes: Ethernet 14 (Linux's ``tx_bytes`` counts the Ethernet
  header, not the preamble, FCS or gap), IPv4 20, TCP 20 + 12 for the timestamps option (on by default in Linux).
  A data operation of ``n + 48`` bytes is cut into TSO/GSO super-packets of at most ``⌊65536 / MSS⌋ · MSS`` bytes
  (MSS = MTU − 20 − 32 = 1448 at an MTU of 1500: 45 segments, 65,160 bytes): a veth pair forwards a super-packet
  whole and its counter sees one frame per super-packet, not one per segment.
- **ACKs**: the receiver acknowledges each data super-packet with one pure ACK (66 bytes) in the reverse direction,
  which the receiver's own counter sees; the ACK of a notification rides on the data that answers it.

So a message of ``n`` bytes costs ``n + 3 · 48 + (2 + 2k) · 66`` bytes, ``k = ⌈(n + 48) / S⌉`` with ``S`` the
super-packet size (:func:`framed_bytes`). The ACK count is the least certain term: Linux delays ACKs and merges them
into outgoing data when traffic flows both ways, and sends one per segment in quick-ack mode (after an idle spell
longer than the retransmission timeout), so a small message costs between ``n + 342`` (no pure ACK) and ``n + 540``
(three) bytes; one per data super-packet is the middle of that range, and the rule for bulk transfers (TCP
acknowledges at least every second full-sized segment, and each super-packet holds many).

The message counts of gloo's algorithms (``gloo/allreduce.cc``, ``allgather.cc``, ``alltoall.cc``,
``broadcast.cc``, ``barrier.cc``) are below, as messages one rank sends per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: gloo's TCP header of every operation: ``Op::preamble``, six ``size_t`` fields.
GLOO_HEADER_BYTES = 48
#: gloo operations per message: the receiver's ``NOTIFY_RECV_READY``, the sender's ``NOTIFY_SEND_READY`` and data.
GLOO_OPS_PER_MESSAGE = 3
#: Ethernet header as Linux's ``tx_bytes`` counts it (no preamble, FCS or inter-frame gap).
ETHERNET_HEADER_BYTES = 14
IPV4_HEADER_BYTES = 20
#: 20 bytes plus the 12 of the timestamps option (``net.ipv4.tcp_timestamps=1``, Linux's default).
TCP_HEADER_BYTES = 32
#: Header bytes of one frame (a segment, a TSO/GSO super-packet or a pure ACK).
FRAME_HEADER_BYTES = ETHERNET_HEADER_BYTES + IPV4_HEADER_BYTES + TCP_HEADER_BYTES
#: The largest TSO/GSO super-packet (``GSO_LEGACY_MAX_SIZE``); a veth forwards it whole.
GSO_MAX_BYTES = 65536
#: The default Ethernet MTU, which the emulated cluster's veth links keep.
DEFAULT_MTU = 1500
#: gloo's ring all-reduce cuts its buffer into segments of at most this many bytes (``kMaxSegmentSize``).
GLOO_MAX_SEGMENT_BYTES = 1024 * 1024


def mss(mtu: int = DEFAULT_MTU) -> int:
    """TCP payload bytes per segment at an MTU: ``mtu - 20 (IPv4) - 32 (TCP with timestamps)`` (1448 at 1500).

    Raises:
        ValueError: If the MTU leaves no room for payload.
    """
    size = mtu - IPV4_HEADER_BYTES - TCP_HEADER_BYTES
    if size < 1:
        raise ValueError(f"`mtu={mtu}` leaves no room for TCP payload.")
    return size


def super_packet_bytes(mtu: int = DEFAULT_MTU, gso_bytes: int = GSO_MAX_BYTES) -> int:
    """Payload bytes of the largest frame the link counter sees: ``⌊gso_bytes / MSS⌋ · MSS`` (at least one MSS).

    ``gso_bytes=mtu`` describes a counter that sees every segment on the wire (a NIC that counts after TSO).
    """
    segment = mss(mtu)
    return max(1, gso_bytes // segment) * segment


def framed_bytes(payload: float, messages: float, mtu: int = DEFAULT_MTU, gso_bytes: int = GSO_MAX_BYTES) -> float:
    """Link bytes of ``messages`` gloo messages that carry ``payload`` bytes together, in equal parts.

    ``payload + messages · (3 · 48 + (2 + 2k) · 66)``, ``k = ⌈(payload / messages + 48) / S⌉``, with
    ``S = ⌊gso_bytes / MSS⌋ · MSS`` and ``MSS = mtu − 52``: per message three 48-byte gloo headers, two notification
    frames, ``k`` data frames and one ACK per data frame, each frame 66 header bytes (module docstring).

    Args:
        payload: Bytes the messages carry (both directions of the exchange counted, as the link counters do).
        messages: Messages (fractional for an average over ranks); 0 with a payload of 0.
        mtu: The link's MTU.
        gso_bytes: The largest frame the counter sees (see :func:`super_packet_bytes`).

    Raises:
        ValueError: For a negative payload or message count, or a payload without messages.
    """
    if payload < 0 or messages < 0:
        raise ValueError(f"`payload={payload}` and `messages={messages}` must be >= 0.")
    if messages == 0:
        if payload:
            raise ValueError(f"A payload of {payload} bytes needs at least one message.")
        return 0.0
    data_frames = math.ceil((payload / messages + GLOO_HEADER_BYTES) / super_packet_bytes(mtu, gso_bytes))
    per_message = GLOO_OPS_PER_MESSAGE * GLOO_HEADER_BYTES + (2 + 2 * data_frames) * FRAME_HEADER_BYTES
    return payload + messages * per_message


def ring_allreduce_messages(nbytes: int, ranks: int, element_size: int = 4) -> float:
    """Messages one rank sends (on average over the ring) in gloo's ring all-reduce of ``nbytes``.

    gloo cuts the buffer into ``s = roundup(max(⌈nbytes / 1 MiB⌉, 2 · ranks), ranks)`` segments of
    ``roundup(⌈nbytes / s⌉, element_size)`` bytes; the reduce-scatter and the all-gather each send every non-empty
    segment around the ring but the ``s / ranks`` of one rank, so the ring sends ``2 (ranks − 1)`` messages per
    non-empty segment. Tiny tensors have fewer non-empty segments than ``s``.
    """
    if ranks < 2 or nbytes <= 0:
        return 0.0
    max_segment = element_size * max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = _round_up(max(-(-nbytes // max_segment), 2 * ranks), ranks)
    segment_bytes = _round_up(-(-nbytes // segments), element_size)
    nonempty = -(-nbytes // segment_bytes)
    return 2 * (ranks - 1) * nonempty / ranks


def allgather_messages(ranks: int) -> int:
    """Messages one rank sends in gloo's ring all-gather: each piece in two halves, ``2 (ranks − 1)``."""
    return 2 * (ranks - 1) if ranks > 1 else 0


def alltoall_messages(ranks: int) -> int:
    """Messages one rank sends in gloo's all-to-all: one to every other rank, ``ranks − 1``."""
    return max(ranks - 1, 0)


def broadcast_edges(ranks: Sequence[int], root: int = 0) -> list[tuple[int, int]]:
    """The (sender, receiver) messages of gloo's binomial-tree broadcast over ``ranks`` from ``ranks[root]``."""
    size = len(ranks)
    edges = []
    step = 1
    while step < size:
        for vrank in range(step):
            if vrank + step < size:
                edges.append((ranks[(vrank + root) % size], ranks[(vrank + step + root) % size]))
        step *= 2
    return edges


def barrier_edges(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The (sender, receiver) messages of gloo's dissemination barrier: ``i`` to ``i + d`` for ``d = 1, 2, 4, ...``."""
    size = len(ranks)
    edges = []
    distance = 1
    while distance < size:
        edges += [(ranks[i], ranks[(i + distance) % size]) for i in range(size)]
        distance *= 2
    return edges


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
