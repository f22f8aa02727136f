"""A switch in user space that delays every frame between nodes: latency for the emulated cluster without ``netem``.

The kernels this was written on have no ``netem`` qdisc (``tc qdisc ... netem``: "Specified qdisc kind is unknown"),
nor ``fq`` for timestamped departures. This relay takes the place of the switch's bridge: it reads every Ethernet
frame that arrives on a switch port (an ``AF_PACKET`` socket per port), learns which port each MAC address sits
behind, and sends the frame out of the destination's port (every other port for a broadcast or an unknown address)
``delay`` seconds after it arrived. A frame between two node ports waits ``delay`` (half the round trip); a frame to or
from the service port (the switch's own address, where e.g. a lighthouse listens) waits nothing: a service on the
switch sits outside every node's link.

What it models: a fixed propagation delay per direction on every path between nodes, in both directions, with the
links' bandwidth still set by ``tc tbf`` on the veth pairs (a frame leaves its node at the link's rate, waits
``delay``, then enters the destination node's link at its rate). What it does not: jitter, loss, reordering (frames
keep their order: every frame of a port waits the same delay), queueing in the wide-area network, and TCP offloads
(segmentation and checksums are turned off on every port, so frames stay below the MTU and carry full checksums;
the stack then does that work in software). One Python process forwards every frame: about 1 Gbit/s between two
ports at no delay on a 2-core machine, 185 Mbit/s for one TCP stream at a 100 ms round trip (its window over the round
trip), far above the throttled links it is meant for.

Run in the switch's namespace (:class:`~benchmarks.harness.cluster.EmulatedCluster` does it)::

    python -m benchmarks.harness.relay --delay-file FILE --ports p0 p1 p2 p3 --service svc0

The delay in milliseconds per direction is read from ``--delay-file`` (written by the cluster) every
``RELOAD_SECONDS``, so one relay serves runs at different round trips.
"""

from __future__ import annotations

import argparse
import heapq
import select
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Every protocol (``ETH_P_ALL``).
ETH_P_ALL = 3
#: Seconds between two readings of the delay file.
RELOAD_SECONDS = 0.2
#: Largest frame read (an MTU of 1500 plus the Ethernet header, with room to spare).
MAX_FRAME = 65600


@dataclass
class Relay:
    """The forwarding state: ports, where each MAC address was seen, the frames waiting for their departure.

    Args:
        ports: Node ports (frames between two of them wait the delay).
        service: Ports whose frames wait nothing.
        delay: Seconds a frame between two node ports waits.
    """

    ports: list[str]
    service: list[str] = field(default_factory=list)
    delay: float = 0.0
    _sockets: dict[int, tuple[str, socket.socket]] = field(default_factory=dict, init=False)
    _where: dict[bytes, int] = field(default_factory=dict, init=False)
    _waiting: list[tuple[float, int, int, bytes]] = field(default_factory=list, init=False)
    _sequence: int = field(default=0, init=False)

    def open(self) -> None:
        """Bind one raw socket per port."""
        for name in [*self.ports, *self.service]:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.bind((name, 0))
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            self._sockets[sock.fileno()] = (name, sock)

    def receive(self, fd: int, now: float) -> None:
        """Read every frame waiting on port ``fd`` and schedule its departure."""
        name, sock = self._sockets[fd]
        while True:
            try:
                frame, address = sock.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if address[2] == socket.PACKET_OUTGOING:
                continue  # what this relay itself sent out of the port
            self._where[frame[6:12]] = fd
            for out in self._targets(fd, frame):
                delay = self.delay if name in self.ports and self._sockets[out][0] in self.ports else 0.0
                self._sequence += 1
                heapq.heappush(self._waiting, (now + delay, self._sequence, out, frame))

    def _targets(self, fd: int, frame: bytes) -> list[int]:
        destination = self._where.get(frame[0:6])
        if destination is not None and not frame[0] & 1:  # a known unicast address
            return [destination] if destination != fd else []
        return [other for other in self._sockets if other != fd]

    def send_due(self, now: float) -> float | None:
        """Send every frame whose time has come; the seconds until the next one, if any."""
        while self._waiting and self._waiting[0][0] <= now:
            _, _, out, frame = heapq.heappop(self._waiting)
            try:
                self._sockets[out][1].send(frame)
            except OSError:
                pass  # a full queue or a port gone: the frame is lost, as on a congested switch
        return self._waiting[0][0] - now if self._waiting else None

    def serve(self, delay_file: Path | None = None) -> None:
        """Forward frames until the process is killed."""
        poller = select.epoll()
        for fd in self._sockets:
            poller.register(fd, select.EPOLLIN)
        next_reload = 0.0
        timeout: float | None = 0.0
        while True:
            now = time.monotonic()
            if delay_file is not None and now >= next_reload:
                self.delay = read_delay(delay_file, self.delay)
                next_reload = now + RELOAD_SECONDS
            wait = RELOAD_SECONDS if timeout is None else min(timeout, RELOAD_SECONDS)
            for fd, _ in poller.poll(wait):
                self.receive(fd, time.monotonic())
            timeout = self.send_due(time.monotonic())


def read_delay(path: Path, current: float) -> float:
    """The delay (seconds) the file gives in milliseconds; ``current`` while it is missing or being rewritten."""
    try:
        return float(path.read_text()) / 1000.0
    except (OSError, ValueError):
        return current


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ports", nargs="+", required=True, help="node ports: frames between them are delayed")
    parser.add_argument("--service", nargs="*", default=[], help="ports whose frames are not delayed")
    parser.add_argument("--delay-file", type=Path, help="milliseconds per direction, read every 0.2 s")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="the delay when there is no file")
    args = parser.parse_args(argv)
    relay = Relay(args.ports, args.service, args.delay_ms / 1000.0)
    relay.open()
    relay.serve(args.delay_file)


if __name__ == "__main__":
    main()
