"""An emulated cluster on one machine: one network namespace per node, joined through a switch by throttled links.

Layout (``N`` nodes, all names carry a per-cluster prefix so several clusters can coexist)::

    <prefix>-n0 (veth0 10.77.0.1) ──┐
    <prefix>-n1 (veth0 10.77.0.2) ──┼── bridge "br0" in namespace <prefix>-sw
    ...                             ┘

With ``sites > 1`` the nodes are split into consecutive sites, each behind a switch of its own, and every site
switch reaches a core switch through one uplink (a veth pair) that all traffic between sites shares::

    <prefix>-n0, <prefix>-n1 ── bridge in <prefix>-s0 ──(uplink)──┐
    <prefix>-n2, <prefix>-n3 ── bridge in <prefix>-s1 ──(uplink)──┴── bridge in <prefix>-sw

Every node's link is a veth pair; a ``tc tbf`` qdisc on both ends limits its upload (node side) and download
(switch side) to the chosen rate, and the uplinks get the rate between sites the same way. Ranks of one node reach
each other through the node's own address, which the kernel routes over ``lo``: intra-node traffic stays fast and
only cross-node traffic pays the link. ``netem`` (delay, loss) is not available on the machines this was written
for: with ``latency=True`` a user-space relay (:mod:`benchmarks.harness.relay`) takes the bridge's place between the
node ports and delays every frame between two nodes by half the round trip set with :meth:`EmulatedCluster.set_rtt`
(one site only; it needs ``ethtool`` to turn the ports' offloads off).

Needs root (``ip netns``). :class:`EmulatedCluster` is a context manager that removes everything it created, also
when the body raises or the process receives SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

SUBNET = "10.77.0"
NODE_IFACE = "veth0"


class ClusterError(RuntimeError):
    """An ``ip``/``tc`` command failed while building or driving the emulated cluster."""


def _run(*args: str, check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def namespaces_available() -> str | None:
    """``None`` if this process can create network namespaces, else the reason why not."""
    if os.geteuid() != 0:
        return "emulating a cluster needs root (ip netns, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    probe = f"fsbprobe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip() or proc.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class EmulatedCluster:
    """``num_nodes`` network namespaces behind one switch, with a settable per-link bandwidth.

    Args:
        num_nodes: Emulated nodes.
        prefix: Prefix of every namespace and switch-side interface name (at most 8 characters).
    """

    num_nodes: int
    prefix: str = field(default_factory=lambda: f"fsb{os.getpid() % 100000}")
    sites: int = 1
    latency: bool = False
    _created: list[str] = field(default_factory=list, init=False)
    _rate_mbit: float | None = field(default=None, init=False)
    _between_sites_mbit: float | None = field(default=None, init=False)
    _rtt_ms: float = field(default=0.0, init=False)
    _relay: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.latency and self.sites > 1:
            raise ValueError(f"`latency=True` emulates one switch; got `sites={self.sites}`.")
        if self.num_nodes < 2:
            raise ValueError(f"An emulated cluster needs at least 2 nodes, got `num_nodes={self.num_nodes}`.")
        if self.sites < 1 or self.num_nodes % self.sites:
            raise ValueError(f"`sites={self.sites}` must be a positive divisor of `num_nodes={self.num_nodes}`.")
        if len(self.prefix) > 8:
            raise ValueError(f"`prefix={self.prefix!r}` is too long: interface names are limited to 15 characters.")

    # -- names and addresses ---------------------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        """Name of the switch namespace."""
        return f"{self.prefix}-sw"

    def node(self, index: int) -> str:
        """Name of node ``index``'s namespace."""
        return f"{self.prefix}-n{index}"

    def address(self, index: int) -> str:
        """IPv4 address of node ``index`` on the cluster network."""
        return f"{SUBNET}.{index + 1}"

    @property
    def service_address(self) -> str:
        """The switch's own address, for a service every node reaches (e.g. a lighthouse), outside every node's link."""
        return f"{SUBNET}.254"

    def _switch_port(self, index: int) -> str:
        return f"{self.prefix}p{index}"

    def site_of(self, index: int) -> int:
        """The site of node ``index`` (consecutive nodes share a site)."""
        return index // (self.num_nodes // self.sites)

    def _node_switch(self, index: int) -> str:
        """The namespace of the switch node ``index`` is plugged into."""
        return self.switch if self.sites == 1 else self._site_switch(self.site_of(index))

    def _site_switch(self, site: int) -> str:
        return f"{self.prefix}-s{site}"

    def _uplink(self, site: int) -> tuple[str, str]:
        """The uplink of ``site``: its interface in the site switch, and the core switch's."""
        return f"{self.prefix}u{site}", f"{self.prefix}c{site}"

    # -- life cycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.destroy()
        signal.signal(signal.SIGTERM, self._previous_sigterm)

    def create(self) -> None:
        """Create the switch, the nodes and their links (unthrottled)."""
        self._add_switch(self.switch)
        if self.sites > 1:
            for site in range(self.sites):
                self._add_switch(self._site_switch(site))
                inside, core = self._uplink(site)
                self._plug(self._site_switch(site), inside, self.switch, core)
        for index in range(self.num_nodes):
            node = self.node(index)
            self._add_namespace(node)
            switch, port = self._node_switch(index), self._switch_port(index)
            _run("ip", "link", "add", port, "netns", switch, "type", "veth", "peer", NODE_IFACE, "netns", node)
            if self.latency:  # the relay forwards between node ports
                _run("ip", "-n", switch, "link", "set", port, "up")
            else:
                _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", node, "addr", "add", f"{self.address(index)}/24", "dev", NODE_IFACE)
            _run("ip", "-n", node, "link", "set", NODE_IFACE, "up")
            _run("ip", "-n", node, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "addr", "add", f"{self.service_address}/24", "dev", "br0")
        if self.latency:
            self._start_relay()
        self._wait_for_links()

    # -- latency -----------------------------------------------------------------------------------------------------

    @property
    def _relay_ports(self) -> tuple[str, str]:
        """The veth pair between the relay (its service port) and the bridge that holds the service address."""
        return f"{self.prefix}r", f"{self.prefix}b"

    @property
    def _delay_file(self) -> Path:
        return Path(tempfile.gettempdir()) / f"{self.prefix}-relay-delay-ms"

    def _start_relay(self) -> None:
        relay_side, bridge_side = self._relay_ports
        _run("ip", "-n", self.switch, "link", "add", relay_side, "type", "veth", "peer", bridge_side)
        _run("ip", "-n", self.switch, "link", "set", bridge_side, "master", "br0", "up")
        _run("ip", "-n", self.switch, "link", "set", relay_side, "up")
        ports = [self._switch_port(i) for i in range(self.num_nodes)]
        for namespace, iface in [*((self.node(i), NODE_IFACE) for i in range(self.num_nodes)),
                                 *((self.switch, p) for p in [*ports, relay_side, bridge_side, "br0"])]:  # fmt: skip
            _no_offloads(namespace, iface)
        self._delay_file.write_text("0")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        argv = [sys.executable, "-m", "benchmarks.harness.relay", "--ports", *ports, "--service", relay_side,
                "--delay-file", str(self._delay_file)]  # fmt: skip
        self._relay = subprocess.Popen(self.service_command(argv), env=env)

    @property
    def rtt_ms(self) -> float:
        """The round trip added between two nodes (ms; 0 without ``latency``)."""
        return self._rtt_ms

    def set_rtt(self, rtt_ms: float) -> None:
        """Delay every frame between two nodes by half of ``rtt_ms`` (needs ``latency=True``).

        Raises:
            ClusterError: Without the relay, or for a negative round trip.
        """
        if not self.latency and rtt_ms:
            raise ClusterError(f"A round trip of {rtt_ms} ms needs a cluster made with `latency=True`.")
        if rtt_ms < 0:
            raise ClusterError(f"The round trip must be at least 0 ms, got {rtt_ms}.")
        if self.latency:
            self._delay_file.write_text(f"{rtt_ms / 2:g}")
            time.sleep(2 * 0.2)  # the relay reads the file every 0.2 s
        self._rtt_ms = rtt_ms

    def destroy(self) -> None:
        """Kill what still runs in the namespaces and delete them (their veth pairs go with them)."""
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait()
            self._relay = None
            self._delay_file.unlink(missing_ok=True)
        for name in reversed(self._created):
            for pid in _run("ip", "netns", "pids", name, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", name, check=False)
        self._created.clear()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _add_switch(self, name: str) -> None:
        self._add_namespace(name)
        _run("ip", "-n", name, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", name, "link", "set", "br0", "up")

    def _plug(self, switch_a: str, port_a: str, switch_b: str, port_b: str) -> None:
        """A veth pair between the bridges of two switches."""
        _run("ip", "link", "add", port_a, "netns", switch_a, "type", "veth", "peer", port_b, "netns", switch_b)
        for switch, port in ((switch_a, port_a), (switch_b, port_b)):
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")

    def _bridge_ports(self) -> list[tuple[str, str]]:
        """Every (switch namespace, port) of the cluster's bridges."""
        if self.latency:
            return [(self.switch, self._relay_ports[1])]
        ports = [(self._node_switch(i), self._switch_port(i)) for i in range(self.num_nodes)]
        for site in range(self.sites if self.sites > 1 else 0):
            inside, core = self._uplink(site)
            ports += [(self._site_switch(site), inside), (self.switch, core)]
        return ports

    def _wait_for_links(self, timeout: float = 10.0) -> None:
        # A bridge port forwards only once it has left the "learning" state (brport state 3 = forwarding).
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                _run("ip", "netns", "exec", switch, "cat", f"/sys/class/net/{port}/brport/state", check=False).strip()
                for switch, port in self._bridge_ports()
            ]
            if all(state == "3" for state in states):
                return
            time.sleep(0.1)
        raise ClusterError(f"The switch ports are not forwarding after {timeout} s.")

    # -- links -----------------------------------------------------------------------------------------------------

    @property
    def rate_mbit(self) -> float | None:
        """Current link rate in Mbit/s, ``None`` when unthrottled."""
        return self._rate_mbit

    @property
    def between_sites_mbit(self) -> float | None:
        """Current rate of every uplink between sites in Mbit/s, ``None`` when unthrottled (or one site)."""
        return self._between_sites_mbit

    def set_bandwidth(self, rate_mbit: float | None, between_sites_mbit: float | None = None) -> None:
        """Throttle every node's link to ``rate_mbit`` Mbit/s in each direction, or remove the limit (``None``).

        With several sites, every uplink between a site and the core gets ``between_sites_mbit`` the same way.
        """
        for index in range(self.num_nodes):
            for namespace, iface in (
                (self.node(index), NODE_IFACE),
                (self._node_switch(index), self._switch_port(index)),
            ):
                _throttle(namespace, iface, rate_mbit)
        for site in range(self.sites if self.sites > 1 else 0):
            inside, core = self._uplink(site)
            _throttle(self._site_switch(site), inside, between_sites_mbit)
            _throttle(self.switch, core, between_sites_mbit)
        self._rate_mbit = rate_mbit
        self._between_sites_mbit = between_sites_mbit if self.sites > 1 else None

    def site_tx_bytes(self) -> list[int]:
        """Bytes every site has sent over its uplink to the other sites so far (empty with one site)."""
        counters = []
        for site in range(self.sites if self.sites > 1 else 0):
            path = f"/sys/class/net/{self._uplink(site)[0]}/statistics/tx_bytes"
            counters.append(int(_run("ip", "netns", "exec", self._site_switch(site), "cat", path)))
        return counters

    def tx_bytes(self) -> list[int]:
        """Bytes every node has sent into its link so far (node-side interface counter)."""
        return [self.node_tx_bytes(index) for index in range(self.num_nodes)]

    def node_tx_bytes(self, index: int) -> int:
        """Bytes node ``index`` has sent into its link so far."""
        path = f"/sys/class/net/{NODE_IFACE}/statistics/tx_bytes"
        return int(_run("ip", "netns", "exec", self.node(index), "cat", path))

    def command(self, index: int, argv: Sequence[str], env: dict[str, str]) -> list[str]:
        """``argv`` wrapped to run inside node ``index`` with ``env`` (``ip netns exec`` keeps no environment)."""
        return ["ip", "netns", "exec", self.node(index), "env", *(f"{k}={v}" for k, v in env.items()), *argv]

    def service_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in the switch, reachable by every node at :attr:`service_address`."""
        return ["ip", "netns", "exec", self.switch, *argv]


def _no_offloads(namespace: str, iface: str) -> None:
    """Segmentation, receive aggregation and checksums in software: the relay forwards frames as they are."""
    _run(
        "ip", "netns", "exec", namespace, "ethtool", "-K", iface, "tx", "off", "tso", "off", "gso", "off", "gro", "off"
    )


def latency_available() -> str | None:
    """``None`` if a cluster with ``latency=True`` can be made here (besides the namespaces), else why not."""
    if shutil.which("ethtool") is None:
        return "the relay needs `ethtool` to turn the ports' offloads off (Debian: apt-get install ethtool)"
    return None


def _throttle(namespace: str, iface: str, rate_mbit: float | None) -> None:
    _run("tc", "-n", namespace, "qdisc", "del", "dev", iface, "root", check=False)
    if rate_mbit is not None:
        _run("tc", "-n", namespace, "qdisc", "add", "dev", iface, "root", *_tbf_args(rate_mbit))


def _tbf_args(rate_mbit: float) -> list[str]:
    # The bucket must hold a few milliseconds of traffic and, above all, one whole GSO/TSO super-packet (up to
    # 64 KiB plus headers on a veth): a smaller bucket drops such packets and TCP's retransmissions inflate the byte
    # counters, more the slower the link. The queue (`latency`) is deep enough that TCP backs off before packets
    # are dropped.
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(128 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "400ms"]


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
