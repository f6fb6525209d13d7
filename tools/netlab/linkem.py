"""A userspace link emulator for the network lab: per-host rate, one-way delay and loss, on TUN devices.

    python -m tools.netlab.linkem --host NS=IP --host NS=IP ... --rate-mbps 100 --delay-ms 20 [--loss-pct 0.5]
    python -m tools.netlab.linkem --host NS=IP=RATE ...   # a host's own rate in Mbps (0: unshaped)
    python -m tools.netlab.linkem ... --route 192.168.3.0/24=IP   # that subnet is behind host IP (a router)

For kernels without netem (sch_netem), which cannot add delay or loss with `tc`. Each lab host gets
a TUN device `eth0` in its namespace instead of a veth on a bridge; this process holds all of them
and is the network between them: a packet that host A sends to host B is read from A's device,
queued on A's uplink (rate), carried for the one-way delay, queued on B's downlink (rate), and
written to B's device. A packet for an address no host has goes to the host whose `--route` covers
it (a NAT router, tools/netlab/nat.py), else it is dropped as unroutable. Both queues are FIFO
servers at the link rate with a tail-drop limit of QUEUE_LIMIT_S of queueing (tbf's `latency`), so
a link behaves as a tbf-shaped one with a propagation delay behind it: a round trip between two
hosts takes 2 x delay plus the serialization times, as with netem on each host's egress.

Cost: TCP's segmentation offload is switched on for the devices (IFF_VNET_HDR, TUNSETOFFLOAD),
so the kernel hands over segments of up to 64 kB with a virtio-net header, and they are passed on
whole; the links count every segment's headers. TCP still paces its congestion window in MTU-sized
segments (MTU 1500), so slow start and loss recovery behave as on a real link. With loss
requested the offload stays off and every 1500-byte packet is dropped with the given probability
on its own, as netem does.

Runs until SIGTERM or SIGINT, then prints one JSON line of counters (bytes and packets carried
and dropped per host). On SIGUSR1 it prints the counters so far, as `counters {JSON}`, within half
a second (the lab reads them around a phase, `Topology.emulator_snapshot`). It prints `ready` once
every device is open. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import heapq
import ipaddress
import json
import os
import random
import select
import signal
import struct
import sys
import time
from dataclasses import asdict, dataclass, field

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
ETHERNET_OVERHEAD = 14  # counted per segment, as tbf on a veth counts the Ethernet header
QUEUE_LIMIT_S = 0.1  # a packet that would wait longer than this in a link's queue is dropped
MAX_READS_PER_WAKE = 64
DEVICE = "eth0"
EMULATOR_NICE = -20  # the highest CFS weight: the wires are served before the nodes


@dataclass(slots=True)
class Counters:
    rx_bytes: int = 0  # wire bytes delivered to this host
    packets: int = 0
    dropped_loss: int = 0
    dropped_uplink: int = 0  # sent by this host into its full uplink queue
    dropped_downlink: int = 0  # sent to this host into its full downlink queue
    dropped_unroutable: int = 0


@dataclass(slots=True)
class HostLink:
    namespace: str
    ip: bytes  # 4 bytes
    seconds_per_byte: float = 0.0  # both directions; 0 = unshaped
    fd: int = -1
    uplink_free_at: float = 0.0  # when the uplink finishes sending what is queued on it
    downlink_free_at: float = 0.0
    counters: Counters = field(default_factory=Counters)


class LinkEmulator:
    def __init__(
        self,
        hosts: list[tuple[str, str, float]],
        *,
        delay_ms: float,
        loss_pct: float,
        seed: int | None = None,
        routes: list[tuple[str, str]] = (),
    ):
        """`hosts`: (namespace, IPv4 address, link rate in Mbps, 0 for unshaped) for each host;
        `routes`: (subnet "A.B.C.D/N", address of the host it lies behind)."""
        self.hosts = [
            HostLink(ns, ipaddress.IPv4Address(ip).packed, 8 / (rate * 1e6) if rate > 0 else 0.0)
            for ns, ip, rate in hosts
        ]
        self.by_ip = {h.ip: i for i, h in enumerate(self.hosts)}
        self.routes = [
            (ipaddress.IPv4Network(subnet), self.by_ip[ipaddress.IPv4Address(via).packed]) for subnet, via in routes
        ]
        self.delay_s = delay_ms / 1000
        self.loss = loss_pct / 100
        self.offload = self.loss == 0
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, int, int, int, bytes]] = []  # (due, seq, kind, host, wire bytes, packet)
        self.seq = 0
        self.running = True
        self.report_asked = False  # SIGUSR1: print the counters so far

    # -- devices ------------------------------------------------------------------------------

    def open_devices(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            for host in self.hosts:
                target = os.open(f"/run/netns/{host.namespace}", os.O_RDONLY)
                try:
                    if libc.setns(target, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {host.namespace}")
                    host.fd = self._open_tun()
                finally:
                    os.close(target)
                    if libc.setns(home, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns back to the lab's own namespace")
        finally:
            os.close(home)

    def _open_tun(self) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEVICE.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 if self.offload else 0)
        return fd

    # -- the links ----------------------------------------------------------------------------

    def wire_bytes(self, packet: bytes) -> int:
        """Bytes on the wire: a segmentation-offload packet is counted as the segments it becomes."""
        _, gso_type, hdr_len, gso_size, _, _ = VNET_HDR.unpack_from(packet)
        length = len(packet) - VNET_HDR.size
        if gso_type == 0 or gso_size == 0 or length <= hdr_len:
            return length + ETHERNET_OVERHEAD
        segments = -(-(length - hdr_len) // gso_size)
        return length + (segments - 1) * hdr_len + segments * ETHERNET_OVERHEAD

    def _push(self, due: float, kind: int, host: int, size: int, packet: bytes) -> None:
        self.seq += 1
        heapq.heappush(self.events, (due, self.seq, kind, host, size, packet))

    def sent(self, source: int, packet: bytes, now: float) -> None:
        """Host `source` sent `packet` (read from its device): queue it on its uplink."""
        src = self.hosts[source]
        ip_header = VNET_HDR.size
        if len(packet) < ip_header + 20 or packet[ip_header] >> 4 != 4:
            src.counters.dropped_unroutable += 1  # IPv6 and anything else: the lab is IPv4 only
            return
        dest = self.destination(packet[ip_header + 16 : ip_header + 20])
        if dest is None or dest == source:
            src.counters.dropped_unroutable += 1
            return
        if self.loss and self.rng.random() < self.loss:
            src.counters.dropped_loss += 1
            return
        size = self.wire_bytes(packet)
        start = max(now, src.uplink_free_at)
        if start - now > QUEUE_LIMIT_S:
            src.counters.dropped_uplink += 1
            return
        src.uplink_free_at = start + size * src.seconds_per_byte
        self._push(src.uplink_free_at + self.delay_s, 0, dest, size, packet)

    def destination(self, address: bytes) -> int | None:
        """The host a packet to `address` (4 bytes) is carried to: the host with that address, or the
        one a route puts it behind; None: unroutable."""
        dest = self.by_ip.get(address)
        if dest is None and self.routes:
            ip = ipaddress.IPv4Address(address)
            dest = next((host for subnet, host in self.routes if ip in subnet), None)
        return dest

    def arrived(self, dest: int, size: int, packet: bytes, now: float) -> None:
        """The packet (`size` wire bytes) reached the far end of the path: queue it on the
        destination's downlink."""
        dst = self.hosts[dest]
        start = max(now, dst.downlink_free_at)
        if start - now > QUEUE_LIMIT_S:
            dst.counters.dropped_downlink += 1
            return
        dst.downlink_free_at = start + size * dst.seconds_per_byte
        self._push(dst.downlink_free_at, 1, dest, size, packet)

    def deliver(self, dest: int, size: int, packet: bytes) -> None:
        dst = self.hosts[dest]
        try:
            os.write(dst.fd, packet)
        except (BlockingIOError, OSError):
            dst.counters.dropped_downlink += 1
            return
        dst.counters.rx_bytes += size
        dst.counters.packets += 1

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        poller = select.poll()
        host_of = {}
        for i, host in enumerate(self.hosts):
            poller.register(host.fd, select.POLLIN)
            host_of[host.fd] = i
        buffer_size = VNET_HDR.size + 65536
        while self.running:
            now = time.monotonic()
            while self.events and self.events[0][0] <= now:
                due, _, kind, host, size, packet = heapq.heappop(self.events)
                if kind == 0:
                    self.arrived(host, size, packet, due)  # it arrived when due, not when the loop woke
                else:
                    self.deliver(host, size, packet)
            timeout_ms = None
            if self.events:
                timeout_ms = max(0.0, (self.events[0][0] - time.monotonic()) * 1000)
            try:
                ready = poller.poll(min(timeout_ms, 500.0) if timeout_ms is not None else 500.0)
            except InterruptedError:
                continue
            if self.report_asked:
                self.report_asked = False
                print("counters " + json.dumps(self.counters()), flush=True)
            now = time.monotonic()
            for fd, _ in ready:
                source = host_of[fd]
                for _ in range(MAX_READS_PER_WAKE):
                    try:
                        packet = os.read(fd, buffer_size)
                    except BlockingIOError:
                        break
                    self.sent(source, packet, now)

    def stop(self, *_) -> None:
        self.running = False

    def ask_report(self, *_) -> None:
        self.report_asked = True

    def counters(self) -> dict:
        return {h.namespace: asdict(h.counters) for h in self.hosts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.netlab.linkem", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--host",
        action="append",
        required=True,
        metavar="NAMESPACE=IP[=MBPS]",
        help="a lab host: its namespace (holding TUN device eth0), IPv4 address, and its own "
        "link rate if it differs from --rate-mbps",
    )
    parser.add_argument(
        "--rate-mbps",
        type=float,
        default=0.0,
        help="each host's link, both directions, unless its --host gives one (0: unshaped)",
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay between a host and the network")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="loss on each host's uplink, percent")
    parser.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="SUBNET=IP",
        help="packets to SUBNET (A.B.C.D/N) go to the host with address IP (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    hosts = []
    for spec in args.host:
        namespace, ip, *rate = spec.split("=")
        if len(rate) > 1:
            parser.error(f"--host {spec!r} is not NAMESPACE=IP[=MBPS]")
        hosts.append((namespace, ip, float(rate[0]) if rate else args.rate_mbps))
    routes = [tuple(spec.split("=")) for spec in args.route]
    if any(len(route) != 2 for route in routes):
        parser.error(f"--route takes SUBNET=IP, not {args.route}")
    emulator = LinkEmulator(hosts, delay_ms=args.delay_ms, loss_pct=args.loss_pct, seed=args.seed, routes=routes)
    signal.signal(signal.SIGTERM, emulator.stop)
    signal.signal(signal.SIGINT, emulator.stop)
    signal.signal(signal.SIGUSR1, emulator.ask_report)
    # The lab owns this process: if the lab dies (SIGKILL), so does the emulator.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:
        return 1
    emulator.open_devices()
    # The emulator is the wires: the nodes' training on the same cores must not slow them down.
    # Nice -20 gives it ~88 times a default process's share of a contended core (needs root).
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, EMULATOR_NICE)
    print("ready", flush=True)
    emulator.run()
    print(json.dumps(emulator.counters()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
