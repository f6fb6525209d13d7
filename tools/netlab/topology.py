"""The network lab's hosts: Linux network namespaces on a bridge, links shaped by tc.

    topology = Topology(num_hosts=4, link=LinkSpec(rate_mbps=100, delay_ms=20))
    topology = Topology(num_hosts=4, link=LinkSpec(rate_mbps=100), rates_mbps=[1000, 50, 100, 100])  # per host
    topology.up()                       # namespaces lsnl-<pid>-h0..h3 and lsnl-<pid>-br
    subprocess.run([*topology.exec_args(1), "python", ...])   # a program on host h1
    topology.probe_rate(sender=1, receiver=2)                 # measured TCP rate, Mbps
    topology.down()                     # removes exactly what up() made
    topology = Topology(num_hosts=4, link=..., nat_hosts=[3], relay=True)  # h3 behind a NAT router; a spare host

Two ways to build the links (`shaper`):

- "tc": each veth pair is made inside the bridge's namespace with its far end placed straight into
  the host's, so nothing appears in the root namespace and the hosts' addresses (10.213.X.0/24)
  exist only in the lab. Rate: tbf on the host's eth0 (its upload) and on the bridge-side veth
  (its download). Delay and loss: netem as the root of the host's eth0 with the tbf under it.
- "userspace": each host's eth0 is a TUN device and tools/netlab/linkem.py, a child process of the
  lab, carries the packets between them with the rate, delay and loss applied (for kernels
  without netem). No bridge namespace.

"auto" (the default) takes tc, unless delay or loss is asked for and the kernel has no netem.

The hosts in `nat_hosts` sit behind a router namespace each (tools/netlab/nat.py): the router's
uplink is the member of the shared segment, with the host's address and rate, and the host is on a
private LAN behind it. `relay=True` adds one more public member, `<prefix>relay`, with nothing
running in it: reserved for a relay service. Every member's default route leads into the segment,
where a packet for an address outside the lab is dropped without an answer (by the emulator, or by
a blackhole route in the bridge's namespace, the gateway `.254`), as the internet drops one for a
private address: a dial to a NAT'd host's private address times out.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.netlab.nat import plan_nat

LAB_PREFIX = "lsnl-"
STALE_NAME = re.compile(rf"^{LAB_PREFIX}(\d+)[.-]")
TBF_LATENCY_MS = 100  # queue depth of the shaper, in time at the link rate
TBF_MIN_BURST_BYTES = 15_000  # about ten MTU-sized packets
PROBE_SECONDS = 0.5  # the link probe sends this long's worth of bytes at the nominal rate
# The segment's default gateway (tc): a packet for an address outside the lab goes there and is
# dropped without an answer, as the internet drops one for a private address.
OUTSIDE_GATEWAY = 254
CONNECT_TIMEOUT_S = 1.5  # the NAT probe's connection attempts: no answer by then is a timeout (round trips < 0.5 s)
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout whose code the lab's processes run (their cwd)
_lab_counter = 0


class LabError(RuntimeError):
    """The lab could not be built, or the swarm in it failed; the message says which and where."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """The hosts' access links: every host gets this, bar the rates `Topology(rates_mbps=...)` sets."""

    rate_mbps: float  # both directions; 0 = unshaped
    delay_ms: float = 0.0  # one-way, added on the host's egress
    loss_pct: float = 0.0  # on the host's egress


@dataclass(frozen=True, slots=True)
class Host:
    namespace: str
    ip: str  # the address its programs bind to (behind a NAT: its private one)


@dataclass(frozen=True, slots=True)
class SegmentPort:
    """A member of the lab's shared segment: a public host, a NAT router, or the relay host."""

    name: str  # its link's name on the bridge (tc) and in the JSON: h0, nat3, relay
    namespace: str
    ip: str
    rate_mbps: float


def _run(args: list[str], timeout_s: float = 30.0, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, input=stdin, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {(result.stderr or result.stdout).strip()}")
    return result


def _probe(name: str, steps: list[tuple[list[str], str]]) -> tuple[bool, str]:
    """Run `steps` (command, what its failure means) in a throwaway namespace with a veth pair
    ("probe0", "probe1"); the first failure's meaning and error, or (True, "ok")."""
    probe = f"{LAB_PREFIX}{os.getpid()}-{name}"
    steps = [
        (["ip", "netns", "add", probe], "`ip netns` does not work here"),
        (
            ["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
            "veth pairs cannot be created here",
        ),
        *[([c.replace("{ns}", probe) for c in command], meaning) for command, meaning in steps],
    ]
    try:
        for command, meaning in steps:
            try:
                _run(command)
            except LabError as e:
                return False, f"{meaning}: {e}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return True, "ok"


def lab_available() -> tuple[bool, str]:
    """Whether this machine can build a lab (root, iproute2, network namespaces), and if not, why."""
    if os.geteuid() != 0:
        return False, "the network lab needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "the network lab needs iproute2 (`ip` and `tc`)"
    return _probe("probe", [])


def lab_namespaces(prefix: str = LAB_PREFIX) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix)]


def cleanup_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone; return their names."""
    removed = []
    for name in lab_namespaces():
        match = STALE_NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    return removed


def _kill_namespace_processes(namespace: str, grace_s: float = 3.0) -> list[int]:
    """End the processes still inside one of the lab's namespaces (all descend from the lab's)."""

    def pids() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
    return found


def netem_available() -> tuple[bool, str]:
    """Whether this kernel has the netem qdisc, tried on a veth in a namespace of its own."""
    return _probe(
        "netem",
        [
            (
                ["tc", "-n", "{ns}", "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"],
                "this kernel has no usable netem qdisc (sch_netem)",
            )
        ],
    )


SHAPERS = ("auto", "tc", "userspace")


class Topology:
    """The lab's namespaces and links; `up()` builds, `down()` removes."""

    def __init__(
        self,
        num_hosts: int,
        link: LinkSpec,
        shaper: str = "auto",
        sysctls: list[str] = (),
        rates_mbps: list[float] | None = None,
        nat_hosts: list[int] = (),
        relay: bool = False,
    ):
        if shaper not in SHAPERS:
            raise ValueError(f"shaper must be one of {SHAPERS}, not {shaper!r}")
        if rates_mbps is not None and (len(rates_mbps) != num_hosts or any(r < 0 for r in rates_mbps)):
            raise ValueError(f"rates_mbps needs one rate >= 0 per host ({num_hosts}), got {rates_mbps}")
        # Each host's link rate, both directions (0: unshaped).
        self.rates_mbps = list(rates_mbps) if rates_mbps is not None else [link.rate_mbps] * num_hosts
        if any("=" not in setting or "/" in setting for setting in sysctls):
            raise ValueError(f"sysctls are KEY=VALUE with a dotted key: {list(sysctls)}")
        self.sysctls = list(sysctls)  # set in every host's namespace
        global _lab_counter
        tag = str(os.getpid()) if _lab_counter == 0 else f"{os.getpid()}.{_lab_counter}"
        _lab_counter += 1
        self.prefix = f"{LAB_PREFIX}{tag}-"
        self.link = link
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.bridge_ns = f"{self.prefix}br"
        if num_hosts + relay > OUTSIDE_GATEWAY - 1:
            raise ValueError(f"a lab holds at most {OUTSIDE_GATEWAY - 1} hosts on its segment, not {num_hosts + relay}")
        if any(not 1 <= i < num_hosts for i in nat_hosts):
            raise ValueError(f"nat_hosts are among h1..h{num_hosts - 1} (h0 stays public), not {list(nat_hosts)}")
        self.nat = plan_nat(self.prefix, self.subnet, sorted(set(nat_hosts)))  # host -> the router in front of it
        self.hosts = [
            Host(f"{self.prefix}h{i}", self.nat[i].host_lan_ip if i in self.nat else f"{self.subnet}.{i + 1}")
            for i in range(num_hosts)
        ]
        # A spare public host for a relay service: on the segment at the first free address, nothing runs there.
        self.relay = Host(f"{self.prefix}relay", f"{self.subnet}.{num_hosts + 1}") if relay else None
        self.created: list[str] = []  # namespaces this object made, in order
        self.delay_requested = link.delay_ms > 0 or link.loss_pct > 0
        self.delay_applied = False  # set by up() once netem or the emulator is in place
        self.delay_reason: str | None = None if self.delay_requested else "no delay or loss requested"
        self.shaper_requested = shaper
        self.shaper = shaper  # "tc" or "userspace" once up() decided
        self.emulator: subprocess.Popen | None = None
        self.emulator_counters: dict | None = None  # the emulator's last words, after down()

    def exec_args(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def segment(self) -> list[SegmentPort]:
        """The shared segment's members, h0 first: the public hosts, the NAT routers in their
        hosts' places (with their rates), then the relay host (with h0's rate)."""
        ports = [
            SegmentPort(f"nat{i}", self.nat[i].namespace, self.nat[i].uplink_ip, rate)
            if i in self.nat
            else SegmentPort(f"h{i}", host.namespace, host.ip, rate)
            for i, (host, rate) in enumerate(zip(self.hosts, self.rates_mbps))
        ]
        if self.relay is not None:
            ports.append(SegmentPort("relay", self.relay.namespace, self.relay.ip, self.rates_mbps[0]))
        return ports

    def up(self) -> None:
        taken = set(lab_namespaces(self.prefix))
        if taken:
            raise LabError(f"namespaces {sorted(taken)} already exist; run with --cleanup-stale")
        if self.shaper == "auto":
            has_netem, reason = netem_available() if self.delay_requested else (True, "")
            self.shaper = "tc" if has_netem else "userspace"
            if not has_netem:
                self.delay_reason = f"{reason}; the userspace link emulator (tools/netlab/linkem.py) applies them"
        if self.shaper == "userspace":
            self._up_userspace()
        else:
            self._up_tc()

    def _up_userspace(self) -> None:
        segment = self.segment()
        for port in segment:
            self._add_namespace(port.namespace)
            _run(["ip", "-n", port.namespace, "tuntap", "add", "mode", "tun", "name", "eth0", "vnet_hdr"])
            _run(["ip", "-n", port.namespace, "addr", "add", f"{port.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", port.namespace, "link", "set", "eth0", "up"])
            # What is for no host of the lab goes to the emulator, which drops it as unroutable.
            _run(["ip", "-n", port.namespace, "route", "add", "default", "dev", "eth0"])
        self._up_nat()
        args = [
            sys.executable,
            "-m",
            "tools.netlab.linkem",
            *(f"--host={port.namespace}={port.ip}={port.rate_mbps:g}" for port in segment),
            # A packet for a router's LAN is carried to the router, whose filter drops it unless
            # it answers a connection the LAN opened.
            *(f"--route={r.lan_subnet}={r.uplink_ip}" for r in self.nat.values()),
            f"--delay-ms={self.link.delay_ms}",
            f"--loss-pct={self.link.loss_pct}",
        ]
        self.emulator = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT, start_new_session=True
        )
        try:
            read_line(self.emulator.stdout, 30.0, "ready")
        except LabError as e:
            self.emulator.kill()
            _, err = self.emulator.communicate()
            raise LabError(f"the link emulator did not start: {e}: {err.decode(errors='replace')[-500:]}") from e
        self.delay_applied = self.delay_requested

    def _up_tc(self) -> None:
        self._add_namespace(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        # The members' default gateway: the bridge's namespace, which discards all it is sent.
        _run(["ip", "-n", self.bridge_ns, "addr", "add", f"{self.subnet}.{OUTSIDE_GATEWAY}/24", "dev", "br0"])
        _run(["ip", "-n", self.bridge_ns, "route", "add", "blackhole", "default"])
        for port in self.segment():
            self._add_namespace(port.namespace)
            # The pair is made inside the bridge namespace with its far end placed straight into the
            # member's, so neither end ever appears in the root namespace.
            _run(
                [
                    "ip",
                    "-n",
                    self.bridge_ns,
                    "link",
                    "add",
                    port.name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    port.namespace,
                ]
            )
            _run(["ip", "-n", self.bridge_ns, "link", "set", port.name, "master", "br0"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port.name, "up"])
            _run(["ip", "-n", port.namespace, "addr", "add", f"{port.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", port.namespace, "link", "set", "eth0", "up"])
            _run(["ip", "-n", port.namespace, "route", "add", "default", "via", f"{self.subnet}.{OUTSIDE_GATEWAY}"])
        self._up_nat()
        if any(self.rates_mbps) or self.delay_requested:
            self._shape_all()

    def _up_nat(self) -> None:
        """The NAT'd hosts behind their routers, once the routers' uplinks are up."""
        for i, router in self.nat.items():
            self._add_namespace(self.hosts[i].namespace)
            for command, stdin in router.setup_commands(self.hosts[i].namespace):
                _run(command, stdin=stdin)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        routers = {r.namespace for r in self.nat.values()}
        for setting in self.sysctls if name != self.bridge_ns and name not in routers else ():
            _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", setting])

    def _shape_all(self) -> None:
        segment = self.segment()
        use_netem = False
        if self.delay_requested:
            use_netem = self._try_netem(segment[0].namespace)
        for i, port in enumerate(segment):
            if use_netem and i > 0:
                self._netem(port.namespace)
            if rate := port.rate_mbps:
                parent = ["parent", "1:1", "handle", "10:"] if use_netem else ["root", "handle", "1:"]
                _run(["tc", "-n", port.namespace, "qdisc", "add", "dev", "eth0", *parent, *self._tbf(rate)])
                _run(
                    [
                        "tc",
                        "-n",
                        self.bridge_ns,
                        "qdisc",
                        "add",
                        "dev",
                        port.name,
                        "root",
                        "handle",
                        "1:",
                        *self._tbf(rate),
                    ]
                )

    @staticmethod
    def _tbf(rate_mbps: float) -> list[str]:
        rate_bytes_per_s = rate_mbps * 1e6 / 8
        burst_bytes = max(TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * 0.005))
        return [
            "tbf",
            "rate",
            f"{rate_mbps * 1000:.0f}kbit",
            "burst",
            str(burst_bytes),
            "latency",
            f"{TBF_LATENCY_MS}ms",
        ]

    def _netem(self, namespace: str) -> None:
        args = ["limit", "100000"]
        if self.link.delay_ms > 0:
            args += ["delay", f"{self.link.delay_ms}ms"]
        if self.link.loss_pct > 0:
            args += ["loss", f"{self.link.loss_pct}%"]
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", *args])

    def _try_netem(self, namespace: str) -> bool:
        try:
            self._netem(namespace)
        except LabError as e:
            self.delay_reason = (
                f"This kernel has no netem qdisc (sch_netem); delay and loss need it. {e}"
                if "unknown" in str(e)
                else f"netem could not be set up: {e}"
            )
            return False
        self.delay_applied = True
        return True

    def interface_bytes(self, hosts: list[Host] | None = None) -> list[dict[str, int]]:
        """Bytes received and sent so far by each host's eth0 (IP and TCP headers included); `hosts`:
        these (the relay host), else h0..hN."""
        counts = []
        for host in self.hosts if hosts is None else hosts:
            out = _run(["ip", "-j", "-s", "-n", host.namespace, "link", "show", "dev", "eth0"]).stdout
            stats = json.loads(out)[0]["stats64"]
            counts.append({"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"]})
        return counts

    def down(self) -> list[str]:
        """Remove every namespace this lab made (their veths and the bridge go with them); return errors."""
        errors = self._stop_emulator()
        for name in reversed(self.created):
            killed = _kill_namespace_processes(name)
            if killed:
                errors.append(f"{name}: ended leftover processes {killed}")
            result = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if result.returncode != 0:
                errors.append(f"{name}: {result.stderr.strip()}")
        self.created.clear()
        return errors

    def emulator_snapshot(self, timeout_s: float = 10.0) -> dict | None:
        """The link emulator's counters so far (as `emulator_counters`, by namespace); None without
        the emulator (tc shaping)."""
        if self.emulator is None:
            return None
        self.emulator.send_signal(signal.SIGUSR1)
        return json.loads(read_line(self.emulator.stdout, timeout_s, "counters ").removeprefix("counters "))

    def _stop_emulator(self) -> list[str]:
        if self.emulator is None:
            return []
        errors = []
        if self.emulator.poll() is not None:
            errors.append(f"the link emulator had exited with {self.emulator.returncode}")
        self.emulator.terminate()
        try:
            out, err = self.emulator.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.emulator.kill()
            out, err = self.emulator.communicate()
            errors.append("the link emulator did not stop on SIGTERM; killed")
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            self.emulator_counters = json.loads(lines[-1]) if lines else None
        except ValueError:
            errors.append(f"the link emulator's output is not JSON: {err.decode(errors='replace')[-300:]}")
        self.emulator = None
        return errors

    def probe_alltoall(self, schedule: dict[int, tuple[float, int]], timeout_s: float = 120.0) -> dict:
        """Plain TCP among the hosts of `schedule` (host -> seconds after the first, its bytes): at
        its time each sends its bytes to every other, as a round's packets would go with no protocol.
        Per host: the seconds from the first send to its last byte, the time a packet was on its way
        to it (`busy_s`), and how many peers' bytes it got. Bytes go over a connection the receiver
        accepts, or, where the receiver is behind NAT, one it opens to the sender; two hosts both
        behind NAT have no path (`no_path`)."""
        helper = [sys.executable, "-m", "tools.netlab.helpers", "alltoall"]
        start_at = time.time() + 3.0  # every helper started and listening by then
        port = str(_alltoall_port())
        dials = {i: [] for i in schedule}  # host -> "push:IP" / "pull:IP:DELAY"
        accepts = dict.fromkeys(schedule, 0)
        no_path = []
        for sender, (delay_s, _) in schedule.items():
            for receiver in (j for j in schedule if j != sender):
                if receiver not in self.nat:
                    dials[sender].append(f"push:{self.hosts[receiver].ip}")
                    accepts[receiver] += 1
                elif sender not in self.nat:
                    dials[receiver].append(f"pull:{self.hosts[sender].ip}:{delay_s:.3f}")
                    accepts[sender] += 1
                else:
                    no_path.append([f"h{sender}", f"h{receiver}"])
        children = []
        try:
            for i, (delay_s, num_bytes) in schedule.items():
                children.append(
                    subprocess.Popen(
                        [*self.exec_args(i), *helper, self.hosts[i].ip, port, str(num_bytes), f"{start_at:.3f}"]
                        + [f"{delay_s:.3f}", str(accepts[i]), *dials[i]],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        cwd=REPO_ROOT,
                    )
                )
            answers = []
            for child in children:
                out, err = child.communicate(timeout=timeout_s)
                if child.returncode != 0:
                    raise LabError(f"all-to-all probe failed: {err.strip()[-300:]}")
                answers.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        return {"no_path": no_path, **{key: [a[key] for a in answers] for key in ("seconds", "busy_s", "received")}}

    def probe_rate(self, sender: int, receiver: int) -> dict:
        """TCP throughput from one host to another through both hosts' shapers, and the round trip."""
        shaped = [r for r in (self.rates_mbps[sender], self.rates_mbps[receiver]) if r]
        rate_mbps = min(shaped) if shaped else 0.0  # the path's bottleneck
        num_bytes = max(1 << 18, int(rate_mbps * 1e6 / 8 * PROBE_SECONDS)) if rate_mbps else 8 << 20
        helper = [sys.executable, "-m", "tools.netlab.helpers"]
        sink = subprocess.Popen(
            [*self.exec_args(receiver), *helper, "sink", self.hosts[receiver].ip],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        try:
            port = read_line(sink.stdout, 30.0, "port ").split()[1]
            _run(
                [*self.exec_args(sender), *helper, "source", self.hosts[receiver].ip, port, str(num_bytes)],
                timeout_s=60 + 10 * num_bytes * 8 / max(1e6, rate_mbps * 1e6),
            )
            result = json.loads(sink.communicate(timeout=30)[0].strip().splitlines()[-1])
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        mbps = result["bytes"] * 8 / result["seconds"] / 1e6 if result["seconds"] > 0 else None
        rtt = _run([*self.exec_args(sender), *helper, "rtt", self.hosts[receiver].ip])
        result["rtt_ms"] = json.loads(rtt.stdout.strip().splitlines()[-1])["rtt_ms"]
        return {
            "bytes": result["bytes"],
            "seconds": result["seconds"],
            "mbps": mbps,
            "rtt_ms": result["rtt_ms"],
            "rate_mbps": rate_mbps,
            "ratio_to_rate": mbps / rate_mbps if mbps and rate_mbps else None,
        }

    def probe_nat(self, host: int, prober: int) -> dict:
        """Check from public host `prober` that nobody can dial NAT'd host `host`, and that it can dial out.

        With a listener on every address of the NAT'd host, a connection from the prober to the
        router's address at the listener's port (where the NAT'd host's own connections come from),
        and one to the host's private address with the prober routing its LAN via the router for the
        attempt (the most a host on the segment can do), must both fail; a connection from the NAT'd
        host to a listener on the prober must succeed and arrive from the router's address.
        """
        router, prober_ns, prober_ip = self.nat[host], self.hosts[prober].namespace, self.hosts[prober].ip
        listener = self._helper(host, "sink", "0.0.0.0")
        try:
            port = int(read_line(listener.stdout, 30.0, "port ").split()[1])
            to_public_ip = self._connect(prober, router.uplink_ip, port)
            route = ["ip", "-n", prober_ns, "route"]
            _run([*route, "add", router.lan_subnet, "via", router.uplink_ip])
            try:
                to_private_ip = self._connect(prober, router.host_lan_ip, port)
            finally:
                _run([*route, "del", router.lan_subnet, "via", router.uplink_ip])
        finally:
            _end(listener)
        sink = self._helper(prober, "sink", prober_ip)
        try:
            outbound = self._connect(host, prober_ip, int(read_line(sink.stdout, 30.0, "port ").split()[1]))
            seen = {}
            if outbound == "connected":
                seen = json.loads(sink.communicate(timeout=10)[0].strip().splitlines()[-1])
        finally:
            _end(sink)
        return {
            "host": f"h{host}",
            "router": router.namespace,
            "prober": f"h{prober}",
            "public_ip": router.uplink_ip,
            "private_ip": router.host_lan_ip,
            "inbound_to_public_ip": to_public_ip,
            "inbound_to_private_ip": to_private_ip,
            "outbound": outbound,
            "outbound_seen_from": seen.get("peer"),
            "inbound_blocked": "connected" not in (to_public_ip, to_private_ip),
            "outbound_masqueraded": outbound == "connected" and seen.get("peer") == router.uplink_ip,
        }

    def _helper(self, host: int, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*self.exec_args(host), sys.executable, "-m", "tools.netlab.helpers", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )

    def _connect(self, host: int, ip: str, port: int) -> str:
        """One TCP connection attempt from `host`: connected, refused, timeout, unreachable or error: ..."""
        out = _run(
            [
                *self.exec_args(host),
                sys.executable,
                "-m",
                "tools.netlab.helpers",
                "connect",
                ip,
                str(port),
                str(CONNECT_TIMEOUT_S),
            ]
        ).stdout
        return json.loads(out.strip().splitlines()[-1])["result"]


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate()


def _alltoall_port() -> int:
    return 20000 + os.getpid() % 20000


def read_line(stream, timeout_s: float, prefix: str) -> str:
    """The first line of a child's stdout that starts with `prefix`, waiting at most `timeout_s`.

    Reads the raw descriptor (a buffered reader could hold the line while select() says "nothing
    to read"); what follows the line in the same read is dropped.
    """
    fd, pending = stream.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            raise LabError(f"the process exited before printing {prefix!r}")
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.decode(errors="replace").startswith(prefix):
                return line.decode(errors="replace").strip()
    raise LabError(f"no {prefix!r} line within {timeout_s:.0f} s")
