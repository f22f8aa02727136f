"""An emulated cluster on one machine: one network namespace per node, joined through a switch by throttled links.

Layout (``N`` nodes, all names carry a per-cluster prefix so several clusters can coexist)::

    <prefix>-n0 (veth0 10.77.0.1) ──┐
    <prefix>-n1 (veth0 10.77.0.2) ──┼── bridge "br0" in namespace <prefix>-sw
    ...                             ┘

Every node's link is a veth pair; a ``tc tbf`` qdisc on both ends limits its upload (node side) and download
(switch side) to the chosen rate. Ranks of one node reach each other through the node's own address, which the
kernel routes over ``lo``: intra-node traffic stays fast and only cross-node traffic pays the link. ``netem``
(delay, loss) is not available on the machines this was written for, so links have bandwidth but no added
latency.

Needs root (``ip netns``). :class:`EmulatedCluster` is a context manager that removes everything it created, also
when the body raises or the process receives SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    _created: list[str] = field(default_factory=list, init=False)
    _rate_mbit: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"An emulated cluster needs at least 2 nodes, got `num_nodes={self.num_nodes}`.")
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

    def _switch_port(self, index: int) -> str:
        return f"{self.prefix}p{index}"

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
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index in range(self.num_nodes):
            node = self.node(index)
            self._add_namespace(node)
            port = self._switch_port(index)
            _run("ip", "link", "add", port, "netns", self.switch, "type", "veth", "peer", NODE_IFACE, "netns", node)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", node, "addr", "add", f"{self.address(index)}/24", "dev", NODE_IFACE)
            _run("ip", "-n", node, "link", "set", NODE_IFACE, "up")
            _run("ip", "-n", node, "link", "set", "lo", "up")
        self._wait_for_links()

    def destroy(self) -> None:
        """Kill what still runs in the namespaces and delete them (their veth pairs go with them)."""
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

    def _wait_for_links(self, timeout: float = 10.0) -> None:
        # A bridge port forwards only once it has left the "learning" state (brport state 3 = forwarding).
        deadline = time.monotonic() + timeout
        states = [f"/sys/class/net/{self._switch_port(i)}/brport/state" for i in range(self.num_nodes)]
        while time.monotonic() < deadline:
            out = _run("ip", "netns", "exec", self.switch, "cat", *states, check=False).split()
            if out == ["3"] * self.num_nodes:
                return
            time.sleep(0.1)
        raise ClusterError(f"The switch ports are not forwarding after {timeout} s.")

    # -- links -----------------------------------------------------------------------------------------------------

    @property
    def rate_mbit(self) -> float | None:
        """Current link rate in Mbit/s, ``None`` when unthrottled."""
        return self._rate_mbit

    def set_bandwidth(self, rate_mbit: float | None) -> None:
        """Throttle every link to ``rate_mbit`` Mbit/s in each direction, or remove the limit (``None``)."""
        for index in range(self.num_nodes):
            for namespace, iface in ((self.node(index), NODE_IFACE), (self.switch, self._switch_port(index))):
                _run("tc", "-n", namespace, "qdisc", "del", "dev", iface, "root", check=False)
                if rate_mbit is not None:
                    _run("tc", "-n", namespace, "qdisc", "add", "dev", iface, "root", *_tbf_args(rate_mbit))
        self._rate_mbit = rate_mbit

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
