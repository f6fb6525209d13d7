"""Network lab: a swarm on shaped links, N hosts as Linux network namespaces on one machine.

    sudo .venv/bin/python -m deploy.netlab --peers 8 --rate-mbps 100 --delay-ms 20 --rounds 3 [--json] [--overlap]
    sudo .venv/bin/python -m deploy.netlab --cleanup-stale     # labs left by a process killed with SIGKILL

Builds hosts h0..hN (namespaces `lsnl-<pid>-h0` ...) joined by veth pairs to a bridge that lives in
its own namespace (`lsnl-<pid>-br`), so nothing is added to the root namespace and every address
(10.213.X.0/24) exists only inside the lab. Each host's link is shaped in both directions with tbf:
on the host's egress (its veth end) and on its ingress (the bridge-side veth's egress); delay and
loss use netem on the host's egress where the kernel has it (one-way delay d per host: a round trip
between two hosts takes 2d), and the output says plainly when it does not. A TCP probe between two
hosts measures the shaped rate before the run.

The coordinator runs in h0, one node in each of h1..hN (`--host-maddrs /ip4/<ip>/tcp/0`); requests
from this process to the coordinator go through a short-lived helper in h0
(deploy/netlab_helpers.py). After R rounds the nodes' --report files give the per-round table of
deploy/netlab_report.py. Everything the lab made, it removes, in a `finally` that also runs on
Ctrl+C, SIGTERM and SIGHUP: its processes by their handles (then any process still inside its
namespaces: descendants such as p2pd daemons), then its namespaces, which takes their veths and
the bridge with them. See deploy/netlab.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.netlab_report import format_table, summarize

LAB_PREFIX = "lsnl-"
STALE_NAME = re.compile(rf"^{LAB_PREFIX}(\d+)[.-]")
TBF_LATENCY_MS = 100  # queue depth of the shaper, in time at the link rate
TBF_MIN_BURST_BYTES = 15_000  # about ten MTU-sized packets
PROBE_SECONDS = 0.5  # the link probe sends this long's worth of bytes at the nominal rate
REPO_ROOT = Path(__file__).resolve().parent.parent
_lab_counter = 0


class LabError(RuntimeError):
    """The lab could not be built, or the swarm in it failed; the message says which and where."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One host's access link; every host gets the same."""

    rate_mbps: float  # both directions, tbf; 0 = unshaped
    delay_ms: float = 0.0  # one-way, added on the host's egress (netem, where the kernel has it)
    loss_pct: float = 0.0  # on the host's egress (netem)


@dataclass(frozen=True, slots=True)
class Host:
    namespace: str
    ip: str


def _run(args: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {(result.stderr or result.stdout).strip()}")
    return result


def lab_available() -> tuple[bool, str]:
    """Whether this machine can build a lab (root, iproute2, network namespaces), and if not, why."""
    if os.geteuid() != 0:
        return False, "the network lab needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "the network lab needs iproute2 (`ip` and `tc`)"
    probe = f"{LAB_PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except LabError as e:
        return False, f"`ip netns` does not work here: {e}"
    try:
        _run(["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
    except LabError as e:
        return False, f"veth pairs cannot be created here: {e}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return True, "ok"


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


class Topology:
    """The lab's namespaces, bridge, veth pairs and shapers; `up()` builds, `down()` removes."""

    def __init__(self, num_hosts: int, link: LinkSpec):
        global _lab_counter
        tag = str(os.getpid()) if _lab_counter == 0 else f"{os.getpid()}.{_lab_counter}"
        _lab_counter += 1
        self.prefix = f"{LAB_PREFIX}{tag}-"
        self.link = link
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.bridge_ns = f"{self.prefix}br"
        self.hosts = [Host(f"{self.prefix}h{i}", f"{self.subnet}.{i + 1}") for i in range(num_hosts)]
        self.created: list[str] = []  # namespaces this object made, in order
        self.delay_requested = link.delay_ms > 0 or link.loss_pct > 0
        self.delay_applied = False  # set by up() once netem is in place
        self.delay_reason: str | None = None if self.delay_requested else "no delay or loss requested"

    def exec_args(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def up(self) -> None:
        taken = set(lab_namespaces(self.prefix))
        if taken:
            raise LabError(f"namespaces {sorted(taken)} already exist; run with --cleanup-stale")
        self._add_namespace(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for i, host in enumerate(self.hosts):
            self._add_namespace(host.namespace)
            # The pair is made inside the bridge namespace with its far end placed straight into the
            # host's, so neither end ever appears in the root namespace.
            _run(["ip", "-n", self.bridge_ns, "link", "add", f"h{i}", "type", "veth",
                  "peer", "name", "eth0", "netns", host.namespace])
            _run(["ip", "-n", self.bridge_ns, "link", "set", f"h{i}", "master", "br0"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", f"h{i}", "up"])
            _run(["ip", "-n", host.namespace, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", host.namespace, "link", "set", "eth0", "up"])
        if self.link.rate_mbps > 0 or self.delay_requested:
            self._shape_all()

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape_all(self) -> None:
        use_netem = False
        if self.delay_requested:
            use_netem = self._try_netem(self.hosts[0].namespace)
        for i, host in enumerate(self.hosts):
            if use_netem and i > 0:
                self._netem(host.namespace)
            if self.link.rate_mbps > 0:
                parent = ["parent", "1:1", "handle", "10:"] if use_netem else ["root", "handle", "1:"]
                _run(["tc", "-n", host.namespace, "qdisc", "add", "dev", "eth0", *parent, *self._tbf()])
                _run(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", f"h{i}", "root", "handle", "1:",
                      *self._tbf()])

    def _tbf(self) -> list[str]:
        rate_bytes_per_s = self.link.rate_mbps * 1e6 / 8
        burst_bytes = max(TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * 0.005))
        return ["tbf", "rate", f"{self.link.rate_mbps * 1000:.0f}kbit", "burst", str(burst_bytes),
                "latency", f"{TBF_LATENCY_MS}ms"]

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
            self.delay_reason = (f"This kernel has no netem qdisc (sch_netem); delay and loss need it. {e}"
                                 if "unknown" in str(e) else f"netem could not be set up: {e}")
            return False
        self.delay_applied = True
        return True

    def interface_bytes(self) -> list[dict[str, int]]:
        """Bytes received and sent so far by each host's eth0 (IP and TCP headers included)."""
        counts = []
        for host in self.hosts:
            out = _run(["ip", "-j", "-s", "-n", host.namespace, "link", "show", "dev", "eth0"]).stdout
            stats = json.loads(out)[0]["stats64"]
            counts.append({"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"]})
        return counts

    def down(self) -> list[str]:
        """Remove every namespace this lab made (their veths and the bridge go with them); return errors."""
        errors = []
        for name in reversed(self.created):
            killed = _kill_namespace_processes(name)
            if killed:
                errors.append(f"{name}: ended leftover processes {killed}")
            result = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if result.returncode != 0:
                errors.append(f"{name}: {result.stderr.strip()}")
        self.created.clear()
        return errors

    def probe_rate(self, sender: int, receiver: int) -> dict:
        """TCP throughput from one host to another through both hosts' shapers."""
        num_bytes = max(1 << 18, int(self.link.rate_mbps * 1e6 / 8 * PROBE_SECONDS)) if self.link.rate_mbps else 8 << 20
        helper = [sys.executable, "-m", "deploy.netlab_helpers"]
        sink = subprocess.Popen([*self.exec_args(receiver), *helper, "sink", self.hosts[receiver].ip],
                                stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            port = _read_line(sink.stdout, 30.0, "port ").split()[1]
            _run([*self.exec_args(sender), *helper, "source", self.hosts[receiver].ip, port, str(num_bytes)],
                 timeout_s=60 + 10 * num_bytes * 8 / max(1e6, self.link.rate_mbps * 1e6))
            result = json.loads(sink.communicate(timeout=30)[0].strip().splitlines()[-1])
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        mbps = result["bytes"] * 8 / result["seconds"] / 1e6 if result["seconds"] > 0 else None
        return {"bytes": result["bytes"], "seconds": result["seconds"], "mbps": mbps,
                "ratio_to_rate": mbps / self.link.rate_mbps if mbps and self.link.rate_mbps else None}


def _read_line(stream, timeout_s: float, prefix: str) -> str:
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


class LabSwarm:
    """A coordinator in host 0 and one node in each other host, as child processes this object owns."""

    def __init__(self, topology: Topology, workdir: Path, *, rounds: int, preset: str, inner_steps: int,
                 top_k: int, batch_size: int, seq_len: int, overlap: bool, say):
        self.topology, self.workdir, self.rounds, self.say = topology, workdir, rounds, say
        self.run_options = {"preset": preset, "inner_steps": inner_steps, "top_k": top_k,
                            "batch_size": batch_size, "seq_len": seq_len}
        self.overlap = overlap
        self.num_peers = len(topology.hosts) - 1
        self.admin_token = os.urandom(16).hex()
        self.coordinator: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.url = self.run_id = ""

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        return env | {"LOCOSWARM_ADMIN_TOKEN": self.admin_token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def _spawn(self, host: int, args: list[str], log_name: str, stdout=None) -> subprocess.Popen:
        log = open(self.workdir / log_name, "ab")
        # A session of its own: Ctrl+C reaches only the lab, which then stops its children in order.
        return subprocess.Popen([*self.topology.exec_args(host), sys.executable, "-m", *args],
                                stdout=stdout or log, stderr=log, env=self._env(), cwd=REPO_ROOT,
                                start_new_session=True)

    def start_coordinator(self, timeout_s: float = 90.0) -> None:
        h0 = self.topology.hosts[0]
        self.coordinator = self._spawn(0, ["node.cli", "coordinator", "serve", "--db",
                                           f"sqlite:///{self.workdir / 'coordinator.db'}", "--host", h0.ip,
                                           "--port", "0"], "coordinator.log", stdout=subprocess.PIPE)
        stdout = self.coordinator.stdout
        self.url = _read_line(stdout, timeout_s, "coordinator listening on ").split()[-1]

        def drain() -> None:  # keep the pipe from filling once nobody waits on it
            with open(self.workdir / "coordinator.out", "ab") as out:
                while chunk := os.read(stdout.fileno(), 65536):
                    out.write(chunk)

        threading.Thread(target=drain, daemon=True).start()

    def http(self, method: str, path: str, body: dict | None = None, timeout_s: float = 45.0) -> dict:
        """One request to the coordinator, made from inside h0; returns the parsed JSON body."""
        args = [*self.topology.exec_args(0), sys.executable, "-m", "deploy.netlab_helpers", "http", method,
                f"{self.url}{path}", "--token-env", "LOCOSWARM_ADMIN_TOKEN"]
        result = subprocess.run(args, input=json.dumps(body).encode() if body is not None else b"",
                                capture_output=True, timeout=timeout_s, env=self._env(), cwd=REPO_ROOT)
        if result.returncode != 0:
            raise LabError(f"{method} {path}: {result.stderr.decode(errors='replace').strip()[-500:]}")
        answer = json.loads(result.stdout)
        if answer["status"] >= 400:
            raise LabError(f"{method} {path}: HTTP {answer['status']}: {answer['body']}")
        return answer["body"]

    def create_run(self) -> str:
        H = self.run_options["inner_steps"]
        config = {
            "name": "netlab", "strategy": "sparseloco", **self.run_options, "warmup_steps": H,
            "total_steps": H * self.rounds, "min_peers": self.num_peers, "max_rounds": self.rounds,
            "num_data_shards": self.num_peers, "heartbeat_timeout_s": 60.0,
            "deadline_policy": {"kind": "fixed", "round_timeout_s": 300.0},
        }
        if self.overlap:
            config["overlap"] = True
        self.run_id = self.http("POST", "/v1/runs", config)["run_id"]
        return self.run_id

    def start_node(self, host: int) -> None:
        ip = self.topology.hosts[host].ip
        self.nodes.append(self._spawn(host, [
            "node.cli", "node", "join", "--coordinator", self.url, "--run", self.run_id, "--device", "cpu",
            "--key", str(self.workdir / f"node{host}.key"), "--host-maddrs", f"/ip4/{ip}/tcp/0",
            "--threads", "1", "--no-progress", "--report", str(self.report_path(host))], f"node{host}.log"))

    def report_path(self, host: int) -> Path:
        return self.workdir / f"node{host}.report.json"

    def status(self) -> dict:
        return self.http("GET", f"/v1/runs/{self.run_id}/status")

    def _check_nodes(self) -> None:
        for host, node in enumerate(self.nodes, start=1):
            if node.poll() not in (None, 0):
                raise LabError(f"node in h{host} exited with {node.returncode}; see {self.workdir / f'node{host}.log'}")

    def run(self, timeout_s: float) -> tuple[list[dict], dict]:
        """Start everything, wait for the last round; return the nodes' reports and the final status."""
        deadline = time.monotonic() + timeout_s
        self.start_coordinator()
        self.create_run()
        self.say(f"coordinator {self.url} in {self.topology.hosts[0].namespace}; run {self.run_id}")
        # The first node founds the DHT; the others enter it through the live members' addresses.
        self.start_node(1)
        while not any(p["status"] == "live" for p in self.status()["peers"]):
            self._check_nodes()
            if time.monotonic() > deadline:
                raise LabError("the first node did not join in time")
            time.sleep(0.5)
        for host in range(2, self.num_peers + 1):
            self.start_node(host)
        last_line, next_poll = "", 0.0
        while any(node.poll() is None for node in self.nodes):
            self._check_nodes()
            if time.monotonic() > deadline:
                raise LabError(f"the swarm did not finish {self.rounds} rounds in {timeout_s:.0f} s; logs in {self.workdir}")
            if time.monotonic() >= next_poll:
                line = _progress_line(self.status())
                if line != last_line:
                    self.say(line)
                    last_line = line
                next_poll = time.monotonic() + 2.0
            time.sleep(0.2)
        self._check_nodes()
        reports = [json.loads(self.report_path(h).read_text()) for h in range(1, self.num_peers + 1)]
        return reports, self.status()

    def stop(self, grace_s: float = 15.0) -> None:
        children = [p for p in self.nodes if p.poll() is None]
        if self.coordinator is not None and self.coordinator.poll() is None:
            children.append(self.coordinator)
        for p in children:
            p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for p in children:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the node and its p2pd child
                except ProcessLookupError:
                    pass
                p.wait()


def _progress_line(status: dict) -> str:
    current = status.get("current_round") or {}
    peers = [p for p in status.get("peers", []) if p["status"] == "live"]
    activity = ", ".join(f"{p['peer_id'][:6]}:{p['activity']}" for p in peers)
    return (f"round {current.get('round', status['run'].get('current_round'))} {current.get('state', status['run']['state'])}"
            f" submitted {current.get('num_submitted', 0)}/{current.get('num_expected', 0)} | {activity}")


def overlap_support() -> tuple[bool, str | None]:
    from protocol.api import RunConfig

    if "overlap" in RunConfig.model_fields:
        return True, None
    return False, "overlap is unavailable: protocol.api.RunConfig has no 'overlap' field in this version"


# -- the command ---------------------------------------------------------------------------------

def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def run_lab(args: argparse.Namespace, say) -> dict:
    link = LinkSpec(rate_mbps=args.rate_mbps, delay_ms=args.delay_ms, loss_pct=args.loss_pct)
    overlap_ok, overlap_reason = overlap_support() if args.overlap else (False, None)
    if args.overlap and not overlap_ok:
        say(overlap_reason)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="locoswarm-netlab-"))
    workdir.mkdir(parents=True, exist_ok=True)
    topology = Topology(args.peers + 1, link)
    swarm = LabSwarm(topology, workdir, rounds=args.rounds, preset=args.preset, inner_steps=args.inner_steps,
                     top_k=args.top_k, batch_size=args.batch_size, seq_len=args.seq_len,
                     overlap=args.overlap and overlap_ok, say=say)
    started = time.monotonic()
    result: dict = {"completed": False, "workdir": str(workdir)}
    teardown_errors: list[str] = []
    try:
        topology.up()
        say(f"lab {topology.prefix}*: {args.peers + 1} hosts on {topology.subnet}.0/24, "
            f"{link.rate_mbps:g} Mbps each way per host")
        if topology.delay_requested and not topology.delay_applied:
            say(f"NOTE: --delay-ms {link.delay_ms:g} / --loss-pct {link.loss_pct:g} NOT applied. {topology.delay_reason}")
        link_check = topology.probe_rate(sender=1, receiver=2 if args.peers >= 2 else 0)
        say(f"link check h1 -> h2: {link_check['mbps']:.1f} Mbps measured")
        bytes_before = topology.interface_bytes()
        reports, status = swarm.run(args.timeout)
        bytes_after = topology.interface_bytes()
        result |= summarize(reports, status.get("history", []), rate_mbps=link.rate_mbps)
        node_rx = [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(bytes_after[1:], bytes_before[1:])]
        result["summary"]["interface_rx_bytes_per_peer_round"] = sum(node_rx) / len(node_rx) / args.rounds
        result |= {
            "completed": len(result["per_round"]) == args.rounds
            and all(row["num_peers"] == args.peers for row in result["per_round"]),
            "link_check": link_check,
            "interface_bytes": [{"host": h.namespace.removeprefix(topology.prefix),
                                 "rx_bytes": a["rx_bytes"] - b["rx_bytes"], "tx_bytes": a["tx_bytes"] - b["tx_bytes"]}
                                for h, a, b in zip(topology.hosts, bytes_after, bytes_before)],
        }
    finally:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            swarm.stop()
            teardown_errors = topology.down()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if teardown_errors:
            say("teardown: " + "; ".join(teardown_errors))
    return result | {
        "peers": args.peers, "rounds": args.rounds, "preset": args.preset, "inner_steps": args.inner_steps,
        "top_k": args.top_k, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "namespace_prefix": topology.prefix, "subnet": f"{topology.subnet}.0/24",
        "link": {"rate_mbps": link.rate_mbps, "delay_ms": link.delay_ms, "loss_pct": link.loss_pct,
                 "delay_applied": topology.delay_applied, "delay_reason": topology.delay_reason,
                 "shaping": "tbf on each host's egress and on the bridge-side veth (the host's ingress)"},
        "overlap": {"requested": args.overlap, "applied": args.overlap and overlap_ok, "reason": overlap_reason},
        "run_id": swarm.run_id, "elapsed_s": time.monotonic() - started, "teardown_errors": teardown_errors,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.netlab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4, help="nodes, one per host h1..hN (h0 runs the coordinator)")
    parser.add_argument("--rate-mbps", type=float, default=100.0, help="each host's link, both directions (0: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per host link (netem)")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="packet loss per host link, percent (netem)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, mini, small, ...)")
    parser.add_argument("--inner-steps", type=int, default=15, help="H, inner steps per round")
    parser.add_argument("--top-k", type=int, default=64, help="values kept per 4096-element chunk (packet size)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--overlap", action="store_true", help="run option overlap=true (one-round-delayed outer step)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole swarm run")
    parser.add_argument("--workdir", default=None, help="database, logs and reports here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="only delete lab namespaces left by lab processes that no longer exist")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cleanup_stale:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale lab namespaces" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if args.peers < 1 or args.rounds < 1:
        print("error: --peers and --rounds must be at least 1", file=sys.stderr)
        return 2
    ok, reason = lab_available()
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        result = run_lab(args, say)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the lab was torn down", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(format_table(result))
        link = result["link"]
        delay = (f"{link['delay_ms']:g} ms one-way, {link['loss_pct']:g} % loss" if link["delay_applied"]
                 else "no delay or loss" if not (link["delay_ms"] or link["loss_pct"])
                 else f"delay/loss NOT applied ({link['delay_reason']})")
        print(f"\n{args.peers} peers, {link['rate_mbps']:g} Mbps links (probe: {result['link_check']['mbps']:.1f} Mbps), "
              f"{delay}; overlap {'on' if result['overlap']['applied'] else 'off'}; logs in {result['workdir']}")
    return 0 if result["completed"] and result["summary"]["digests_agree_every_round"] else 1


if __name__ == "__main__":
    sys.exit(main())
