"""The user-space relay that adds latency to the emulated cluster: what it forwards where, and when.

The forwarding rules are checked on fake ports; a round trip through a real relay between two emulated nodes needs
root, network namespaces and ``ethtool`` (skipped with the reason otherwise).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness.cluster import EmulatedCluster, latency_available, namespaces_available
from benchmarks.harness.relay import Relay, read_delay

MAC = {name: bytes([2, 0, 0, 0, 0, i]) for i, name in enumerate(("a", "b", "c", "svc"))}
BROADCAST = b"\xff" * 6


class FakePort:
    """A port's socket: frames to read, frames sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inbox: list[bytes] = []
        self.sent: list[bytes] = []

    def recvfrom(self, size: int) -> tuple[bytes, tuple]:
        if not self.inbox:
            raise BlockingIOError
        return self.inbox.pop(0), (self.name, 0, socket.PACKET_HOST, 1, b"")

    def send(self, frame: bytes) -> int:
        self.sent.append(frame)
        return len(frame)


def _relay(delay: float) -> tuple[Relay, dict[str, int], dict[str, FakePort]]:
    relay = Relay(["a", "b", "c"], ["svc"], delay)
    ports = {name: FakePort(name) for name in ("a", "b", "c", "svc")}
    fds = {name: i for i, name in enumerate(ports)}
    relay._sockets = {fds[name]: (name, port) for name, port in ports.items()}  # type: ignore[assignment]
    return relay, fds, ports


def _frame(source: str, destination: bytes, payload: bytes = b"x") -> bytes:
    return destination + MAC[source] + b"\x08\x00" + payload


def test_a_frame_between_nodes_leaves_after_the_delay_and_one_to_the_service_at_once():
    relay, fds, ports = _relay(delay=0.05)
    ports["a"].inbox.append(_frame("a", BROADCAST, b"arp"))  # flooded: every other port learns nothing yet
    relay.receive(fds["a"], now=0.0)
    assert relay.send_due(now=0.0) == pytest.approx(0.05)  # the service got its copy at once
    assert ports["svc"].sent == [_frame("a", BROADCAST, b"arp")] and not ports["b"].sent
    relay.send_due(now=0.05)
    assert ports["b"].sent == ports["c"].sent == [_frame("a", BROADCAST, b"arp")]
    # b answers a: a's address was learned, so only a's port gets it, after the delay
    ports["b"].inbox.append(_frame("b", MAC["a"], b"reply"))
    relay.receive(fds["b"], now=1.0)
    assert relay.send_due(now=1.04) == pytest.approx(0.01) and not ports["a"].sent
    relay.send_due(now=1.05)
    assert ports["a"].sent == [_frame("b", MAC["a"], b"reply")] and ports["c"].sent == [_frame("a", BROADCAST, b"arp")]
    # the service answers a: no delay on either side of the service port
    ports["svc"].inbox.append(_frame("svc", MAC["a"], b"svc"))
    relay.receive(fds["svc"], now=2.0)
    relay.send_due(now=2.0)
    assert ports["a"].sent[-1] == _frame("svc", MAC["a"], b"svc")


def test_frames_of_a_port_keep_their_order_and_the_delay_is_read_from_its_file(tmp_path: Path):
    relay, fds, ports = _relay(delay=0.01)
    ports["b"].inbox.append(_frame("b", BROADCAST))
    relay.receive(fds["b"], now=0.0)
    ports["a"].inbox.extend(_frame("a", MAC["b"], bytes([i])) for i in range(5))
    relay.receive(fds["a"], now=1.0)
    relay.send_due(now=2.0)
    assert [frame[-1] for frame in ports["b"].sent] == list(range(5))
    delay = tmp_path / "delay-ms"
    assert read_delay(delay, 0.01) == 0.01  # no file yet: the current delay stays
    delay.write_text("50")
    assert read_delay(delay, 0.01) == 0.05


_UNAVAILABLE = namespaces_available() or latency_available()


def _round_trip_ms(cluster: EmulatedCluster, node: int, address: str) -> float:
    probe = (
        "import socket, sys, time; c = socket.create_connection((sys.argv[1], 5099)); "
        "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []\n"
        "for _ in range(5):\n t = time.perf_counter(); c.sendall(b'p'); c.recv(1)\n"
        " times.append(time.perf_counter() - t)\n"
        "print(sorted(times)[2] * 1000)"
    )
    out = subprocess.run(cluster.command(node, [sys.executable, "-c", probe, address], {}), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    return float(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"cannot emulate latency here: {_UNAVAILABLE}")
@pytest.mark.timeout(120)
def test_the_round_trip_between_two_emulated_nodes_is_the_one_set_and_the_service_pays_none():
    echo = (
        "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        "s.bind((sys.argv[1], 5099)); s.listen(8)\n"
        "while True:\n c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        " while (b := c.recv(1)): c.sendall(b)"
    )
    with EmulatedCluster(2, latency=True, prefix=f"flt{time.monotonic_ns() % 10000}") as cluster:
        subprocess.Popen(cluster.command(1, [sys.executable, "-c", echo, cluster.address(1)], {}))
        subprocess.Popen(cluster.service_command([sys.executable, "-c", echo, cluster.service_address]))
        time.sleep(1.0)
        cluster.set_rtt(100.0)
        assert 95 < _round_trip_ms(cluster, 0, cluster.address(1)) < 130
        assert _round_trip_ms(cluster, 0, cluster.service_address) < 20
        cluster.set_rtt(0.0)
        assert _round_trip_ms(cluster, 0, cluster.address(1)) < 20
        prefix = cluster.prefix
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
