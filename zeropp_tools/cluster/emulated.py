"""N emulated nodes on one machine, joined by a bridge, each node's link shaped with tc.

    switch namespace  <tag>-sw : bridge br0, one port p<n> per node
    node namespaces   <tag>-n<n>: eth0 = 10.<a>.<b>.<n+1>/24, the other end of p<n>

Each node's egress (its eth0) is shaped by tc (tbf; netem for latency) to the chosen bandwidth, so
traffic between nodes crosses a slow link while traffic inside a node (to its own address)
stays on the namespace's loopback at memory speed. Names and the subnet carry a random tag,
so two clusters never collide; everything is removed on exit, also on errors and Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClusterSpec:
    num_nodes: int
    ranks_per_node: int
    bandwidth_mbit: float | None = None  # None: unshaped
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"num_nodes and ranks_per_node must be >= 1, got {self.num_nodes}, {self.ranks_per_node}")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError(f"bandwidth_mbit must be positive or None (unshaped), got {self.bandwidth_mbit}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")


UNSHAPED = ("none", "unshaped")  # how a benchmark's --bandwidths names a link left unshaped


# TCP over a 1500-byte MTU: 1448 payload bytes in a 1514-byte frame (with timestamps).
TCP_PAYLOAD_SHARE = 1448 / 1514


def payload_bytes_per_s(mbit: float) -> float:
    """What a ``mbit`` link carries of the collectives' bytes (the shaper counts frames)."""
    return mbit * 1e6 / 8 * TCP_PAYLOAD_SHARE


def shaped_mbit(bandwidth: str) -> float | None:
    """A ``--bandwidths`` entry as the shaper's Mbit/s; None for an unshaped link."""
    if bandwidth in UNSHAPED:
        return None
    try:
        mbit = float(bandwidth)
    except ValueError:
        mbit = 0.0
    if mbit <= 0:
        raise ValueError(f"--bandwidths: {bandwidth!r} is not a link; allowed values: a positive Mbit/s "
                         f"(e.g. 200) or one of {list(UNSHAPED)}")
    return mbit


def check_privileges() -> None:
    """A clear error when this machine cannot build namespaces."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"zeropp cluster needs the {' and '.join(missing)} command(s) (Debian package iproute2)")
    if os.geteuid() != 0:
        raise RuntimeError("zeropp cluster needs root (CAP_NET_ADMIN) to create network namespaces and shape links with tc")


def probe_emulation() -> str | None:
    """None when this machine can build an emulated cluster, else what is missing: tries
    what a cluster needs, a network namespace and a tc qdisc inside it, and removes both."""
    try:
        check_privileges()
    except RuntimeError as error:
        return str(error)
    name = f"zppprobe{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", name)
    except RuntimeError as error:
        return f"cannot create a network namespace: {error}"
    try:
        _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
             "tbf", "rate", "100mbit", "burst", "64kb", "latency", "50ms")
    except RuntimeError as error:
        return f"cannot shape a link with tc: {error}"
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


# Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes on every packet. The
# accounting counts collective payload; the link counters count packets. tbf splits TCP's
# 64 KB segments into MTU-sized packets when its burst is smaller (below ~200 Mbit/s here),
# so raw counters run ~5% above the payload at 50 Mbit/s and ~0.3% above at 200 Mbit/s.
HEADER_BYTES_PER_PACKET = 66


def payload_bytes(counters: dict[str, int], direction: str = "rx") -> int:
    """Bytes of TCP payload a link carried: its byte counter less each packet's headers."""
    return counters[f"{direction}_bytes"] - HEADER_BYTES_PER_PACKET * counters[f"{direction}_packets"]


def _tcp_counter(snmp: str, name: str) -> int:
    """One counter of /proc/net/snmp's Tcp table (a header line, then a value line)."""
    header, values = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
    return int(values[header.index(name)])


class EmulatedCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.tag = f"zpp{secrets.token_hex(3)}"
        token = secrets.randbelow(250 * 250)
        self._subnet = f"10.{token // 250 + 1}.{token % 250 + 1}"
        self.switch = f"{self.tag}-sw"
        self.nodes = [f"{self.tag}-n{n}" for n in range(spec.num_nodes)]

    def address(self, node: int) -> str:
        return f"{self._subnet}.{node + 1}"

    def __enter__(self) -> "EmulatedCluster":
        check_privileges()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index, namespace in enumerate(self.nodes):
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", f"p{index}", "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", f"p{index}", "master", "br0", "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            self._shape(namespace)

    def _shape(self, namespace: str) -> None:
        """Token bucket on the node's egress: the link's bandwidth. Latency needs netem,
        which not every kernel has; asking for it where it is missing is an error."""
        spec = self.spec
        if spec.latency_ms:
            command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
                       "netem", "delay", f"{spec.latency_ms}ms"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"latency needs the netem qdisc, which this kernel lacks ({result.stderr.strip()})")
        if spec.bandwidth_mbit is not None:
            self._token_bucket(namespace, spec.bandwidth_mbit)

    def _bucket_parent(self) -> list[str]:
        return ["parent", "1:1"] if self.spec.latency_ms else ["root"]

    def _token_bucket(self, namespace: str, mbit: float) -> None:
        burst = max(32_000, int(mbit * 1e6 / 8 / 250))  # >= one timer tick of data
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0", *self._bucket_parent(), "tbf",
             "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")

    def set_bandwidth(self, mbit: float) -> None:
        """Reshape every node's link to ``mbit`` while jobs run (a cluster built shaped)."""
        if self.spec.bandwidth_mbit is None:
            raise ValueError("set_bandwidth needs a cluster built with a bandwidth (its links have no shaper)")
        for namespace in self.nodes:
            # Replaced, not changed: tbf splits a TCP segment larger than its burst when it is
            # queued, so 64 KB segments queued under a fast link's burst (500 KB at 1 Gbit/s)
            # can never leave under a slow link's (32 KB). With a probe's 6 MB queued at the
            # change, `tc qdisc change` hung the job until gloo's 300 s timeout, twice.
            # Deleted, the queued segments are dropped, and TCP resends them through the new one.
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", "eth0", *self._bucket_parent())
            self._token_bucket(namespace, mbit)

    def interface_bytes(self) -> list[dict[str, int]]:
        """Bytes each node's link sent and received so far (its eth0 counters), and the TCP
        segments the node resent (bytes on the link that no collective asked for)."""
        counters = []
        for namespace in self.nodes:
            read = lambda name: int(_run("ip", "netns", "exec", namespace, "cat", f"/sys/class/net/eth0/statistics/{name}"))
            row = {name: read(name) for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}
            row["tcp_retransmitted_segments"] = _tcp_counter(_run("ip", "netns", "exec", namespace, "cat", "/proc/net/snmp"),
                                                             "RetransSegs")
            counters.append(row)
        return counters

    def set_link(self, node: int, up: bool) -> None:
        """Take node ``node``'s link down (or back up) at the switch: a cable pulled."""
        _run("ip", "-n", self.switch, "link", "set", f"p{node}", "up" if up else "down")

    def processes(self, node: int) -> dict[int, str]:
        """{pid: command line} of every process in node ``node``'s namespace."""
        listing = subprocess.run(["ip", "netns", "pids", self.nodes[node]], capture_output=True, text=True).stdout
        result = {}
        for pid in listing.split():
            try:
                result[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:  # exited meanwhile
                continue
        return result

    def popen(self, node: int, command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``command`` inside node ``node``'s namespace, output to ``log``."""
        handle = open(log, "w")
        return subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[node], *command],
            stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
        )

    def close(self) -> None:
        """Kill every process left in the namespaces, then delete them (and their links)."""
        for namespace in [*self.nodes, self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def existing_namespaces(self) -> list[str]:
        listed = _run("ip", "netns", "list")
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.tag)]
