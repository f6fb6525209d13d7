"""Network lab: a swarm on shaped links, N hosts as Linux network namespaces on one machine.

    sudo .venv/bin/python -m tools.netlab --peers 8 --rate-mbps 100 --delay-ms 20 --rounds 3 [--json] [--overlap]
    sudo .venv/bin/python -m tools.netlab --peers 8 --rate-mbps 10,100,100,100   # each node's link, in turn
    sudo .venv/bin/python -m tools.netlab --peers 8 --nat 3 [--relay-host]   # h6..h8 behind NAT routers
    sudo .venv/bin/python -m tools.netlab --cleanup-stale     # labs left by a process killed with SIGKILL

Builds hosts h0..hN (namespaces `lsnl-<pid>-h0` ...) joined by veth pairs to a bridge that lives in
its own namespace (`lsnl-<pid>-br`), so nothing is added to the root namespace and every address
(10.213.X.0/24) exists only inside the lab. Each host's link is shaped in both directions with tbf:
on the host's egress (its veth end) and on its ingress (the bridge-side veth's egress); delay and
loss use netem on the host's egress where the kernel has it (one-way delay d per host: a round trip
between two hosts takes 2d), and the output says plainly when it does not. A TCP probe between two
hosts measures the shaped rate before the run.

With `--nat K` the last K node hosts each sit behind a NAT router namespace of their own
(tools/netlab/nat.py): they dial out, nobody dials them, as checked before the run, and their nodes
start with `--client-mode`, as the README tells a volunteer nobody can dial. `--relay-host` adds a
public host with nothing in it, reserved for a relay.

The coordinator runs in h0, one node in each of h1..hN (`--host-maddrs /ip4/<ip>/tcp/0`); requests
from this process to the coordinator go through a short-lived helper in h0
(tools/netlab/helpers.py). After R rounds the nodes' --report files give the per-round table of
tools/netlab/report.py, and the coordinator's closed rounds say whose packets their final
manifests held. Everything the lab made, it removes, in a `finally` that also runs on Ctrl+C,
SIGTERM and SIGHUP: its processes by their handles (then any process still inside its namespaces:
descendants such as p2pd daemons), then its namespaces, which takes their veths, the bridge and the
routers' nftables rules with them. See tools/netlab/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from node.cli.demo import progress_line
from node.cli.processes import stop_processes
from node.cli.relay import LISTENING as RELAY_LISTENING
from protocol.http import peer_id_from_public_key
from protocol.signing import PeerKey
from tools.netlab import store
from tools.netlab.nat import firewall_available, nat_hosts
from tools.netlab.report import format_peers, format_table, peer_rows, replay_over_ideal, summarize, summarize_peers
from tools.netlab.topology import (
    REPO_ROOT,
    SHAPERS,
    LabError,
    LinkSpec,
    Topology,
    cleanup_stale,
    lab_available,
    read_line,
)


class LabSwarm:
    """A coordinator in host 0 and one node in each other host, as child processes this object owns."""

    def __init__(
        self,
        topology: Topology,
        workdir: Path,
        *,
        rounds: int,
        preset: str,
        inner_steps: int,
        top_k: int,
        batch_size: int,
        seq_len: int,
        overlap: bool,
        say,
        linger_s: float = 30.0,
        compute_floor_s: float = 0.0,
        tree_fanout: int = 2,
        scored_peers: int | None = None,
        stripes: int | None = None,
        state_uplinks: bool = True,
        state_downlinks: bool = True,
        nat_client_mode: bool = True,
        nat_push: bool = True,
        mirror: bool = False,
        relay: bool = False,
    ):
        self.topology, self.workdir, self.rounds, self.say = topology, workdir, rounds, say
        self.preset, self.inner_steps, self.top_k = preset, inner_steps, top_k
        self.batch_size, self.seq_len, self.tree_fanout = batch_size, seq_len, tree_fanout
        self.overlap = overlap
        self.scored_peers = scored_peers  # run option scoring.max_peers_per_round (None: the run's default)
        self.stripes = stripes  # node option network.stripes (None: the node's default)
        self.compute_floor_s = compute_floor_s  # emulated accelerator time per round (slow-compute fault)
        self.state_uplinks = state_uplinks  # each node states its host's link rate at join (--uplink-mbps)
        self.state_downlinks = state_downlinks  # ...and paces its downloads by it (--downlink-mbps)
        self.nat_client_mode = nat_client_mode  # nodes behind NAT join with --client-mode (the README's advice)
        self.nat_push = nat_push  # nodes behind NAT push their packets to reachable peers (off: --no-push)
        self.mirror = mirror  # a packet mirror: an S3 store in host 0 (tools/netlab/store.py)
        self.store: subprocess.Popen | None = None
        self.store_url = ""
        self.relay = relay  # a relay runs in the relay host; nodes behind NAT join with --relay-via it
        self.relay_process: subprocess.Popen | None = None
        self.relay_maddr = ""
        self.num_peers = len(topology.hosts) - 1
        self.admin_token = os.urandom(16).hex()
        self.coordinator: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.peer_ids: dict[int, str] = {}  # host -> its node's peer id (from the key the lab made for it)
        self.url = self.run_id = ""
        self.linger_s = linger_s  # how long nodes may run on after the last round closed
        self.stragglers: list[dict] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("AWS_")}
        return env | {"LOCOSWARM_ADMIN_TOKEN": self.admin_token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def _spawn(
        self,
        host: int,
        args: list[str],
        log_name: str,
        stdout=None,
        env: dict[str, str] | None = None,
        namespace: str | None = None,
    ) -> subprocess.Popen:
        log = open(self.workdir / log_name, "ab")
        where = ["ip", "netns", "exec", namespace] if namespace else self.topology.exec_args(host)
        # A session of its own: Ctrl+C reaches only the lab, which then stops its children in order.
        return subprocess.Popen(
            [*where, sys.executable, "-m", *args],
            stdout=stdout or log,
            stderr=log,
            env=self._env() | (env or {}),
            cwd=REPO_ROOT,
            start_new_session=True,
        )

    def start_store(self, timeout_s: float = 60.0) -> None:
        """The packet mirror's S3 store, in host 0 beside the coordinator."""
        self.store = self._spawn(
            0, ["tools.netlab.store", self.topology.hosts[0].ip, "netlab"], "store.log", stdout=subprocess.PIPE
        )
        self.store_url = read_line(self.store.stdout, timeout_s, "store listening on ").split()[-1]

    def start_coordinator(self, timeout_s: float = 90.0) -> None:
        h0 = self.topology.hosts[0]
        self.coordinator = self._spawn(
            0,
            [
                "locoswarm",
                "coordinator",
                "serve",
                "--db",
                f"sqlite:///{self.workdir / 'coordinator.db'}",
                "--host",
                h0.ip,
                "--port",
                "0",
            ],
            "coordinator.log",
            stdout=subprocess.PIPE,
            env=store.CREDENTIALS if self.mirror else None,  # only the coordinator holds the store's keys
        )
        stdout = self.coordinator.stdout
        self.url = read_line(stdout, timeout_s, "coordinator listening on ").split()[-1]

        def drain() -> None:  # keep the pipe from filling once nobody waits on it
            with open(self.workdir / "coordinator.out", "ab") as out:
                while chunk := os.read(stdout.fileno(), 65536):
                    out.write(chunk)

        threading.Thread(target=drain, daemon=True).start()

    def start_relay(self, timeout_s: float = 60.0) -> None:
        """`locoswarm node relay` in the relay host; its printed address is what NAT'd nodes relay through."""
        relay = self.topology.relay
        self.relay_process = self._spawn(
            0,
            ["locoswarm", "node", "relay", "--host-maddrs", f"/ip4/{relay.ip}/tcp/0"],
            "relay.log",
            stdout=subprocess.PIPE,
            namespace=relay.namespace,
        )
        line = read_line(self.relay_process.stdout, timeout_s, RELAY_LISTENING)
        self.relay_maddr = line.removeprefix(RELAY_LISTENING).strip()

    def http(self, method: str, path: str, body: dict | None = None, timeout_s: float = 45.0) -> dict:
        """One request to the coordinator, made from inside h0; returns the parsed JSON body."""
        args = [
            *self.topology.exec_args(0),
            sys.executable,
            "-m",
            "tools.netlab.helpers",
            "http",
            method,
            f"{self.url}{path}",
            "--token-env",
            "LOCOSWARM_ADMIN_TOKEN",
        ]
        result = subprocess.run(
            args,
            input=json.dumps(body).encode() if body is not None else b"",
            capture_output=True,
            timeout=timeout_s,
            env=self._env(),
            cwd=REPO_ROOT,
        )
        if result.returncode != 0:
            raise LabError(f"{method} {path}: {result.stderr.decode(errors='replace').strip()[-500:]}")
        answer = json.loads(result.stdout)
        if answer["status"] >= 400:
            raise LabError(f"{method} {path}: HTTP {answer['status']}: {answer['body']}")
        return answer["body"]

    def create_run(self) -> str:
        H = self.inner_steps
        config = {
            "name": "netlab",
            "max_rounds": self.rounds,
            "model": {"preset": self.preset, "num_data_shards": self.num_peers},
            "inner": {
                "steps": H,
                "batch_size": self.batch_size,
                "seq_len": self.seq_len,
                "warmup_steps": H,
                "total_steps": H * self.rounds,
            },
            "outer": {"strategy": "sparseloco", "top_k": self.top_k, "overlap": self.overlap},
            "exchange": {
                "tree_fanout": self.tree_fanout,
                **({"mirror": {"endpoint_url": self.store_url, "bucket": "netlab"}} if self.mirror else {}),
            },
            **({"scoring": {"max_peers_per_round": self.scored_peers}} if self.scored_peers else {}),
            "membership": {"min_peers": self.num_peers, "heartbeat_timeout_s": 60.0},
            "deadline": {"kind": "fixed", "round_timeout_s": 300.0},
        }
        self.run_id = self.http("POST", "/v1/runs", config)["run_id"]
        return self.run_id

    def start_node(self, host: int) -> None:
        ip, rate = self.topology.hosts[host].ip, self.topology.rates_mbps[host]
        uplink = ["--uplink-mbps", f"{rate:g}"] if self.state_uplinks and rate > 0 else []
        # a node refuses a stated downlink under 1 Mbps (node/config.py): such a link goes unpaced
        downlink = ["--downlink-mbps", f"{rate:g}"] if self.state_downlinks and rate >= 1 else []
        behind_nat = (
            (
                ["--relay-via", self.relay_maddr]  # served through the relay: not a client, which serves nobody
                if self.relay
                else ["--client-mode"]
                if self.nat_client_mode
                else []
            )
            + ([] if self.nat_push else ["--no-push"])
            if host in self.topology.nat
            else []
        )
        # The lab makes the key, so that it knows the node's peer id even if the node never reports.
        key_path = self.workdir / f"node{host}.key"
        self.peer_ids[host] = peer_id_from_public_key(PeerKey.load_or_create(key_path).public_bytes)
        self.nodes.append(
            self._spawn(
                host,
                [
                    "locoswarm",
                    "node",
                    "join",
                    "--coordinator",
                    self.url,
                    "--run",
                    self.run_id,
                    "--device",
                    "cpu",
                    "--key",
                    str(key_path),
                    "--host-maddrs",
                    f"/ip4/{ip}/tcp/0",
                    *behind_nat,
                    "--threads",
                    "1",
                    "--no-progress",
                    "--report",
                    str(self.report_path(host)),
                    *uplink,
                    *downlink,
                    *(["--stripes", str(self.stripes)] if self.stripes else []),
                    *(["--inject", f"slow-compute@min_s={self.compute_floor_s}"] if self.compute_floor_s > 0 else []),
                ],
                f"node{host}.log",
            )
        )

    def report_path(self, host: int) -> Path:
        return self.workdir / f"node{host}.report.json"

    def status(self) -> dict:
        return self.http("GET", f"/v1/runs/{self.run_id}/status")

    def closed_rounds(self, status: dict) -> dict[int, dict]:
        """The coordinator's view of each closed round in `status` (its final manifest, what was dropped)."""
        return {
            h["round"]: self.http("GET", f"/v1/runs/{self.run_id}/rounds/{h['round']}")
            for h in status.get("history", [])
        }

    def _check_nodes(self) -> None:
        stopped = {s["host"] for s in self.stragglers}
        for host, node in enumerate(self.nodes, start=1):
            if node.poll() not in (None, 0) and f"h{host}" not in stopped:
                raise LabError(f"node in h{host} exited with {node.returncode}; see {self.workdir / f'node{host}.log'}")

    def run(self, timeout_s: float) -> tuple[list[dict], dict]:
        """Start everything, wait for the last round; return the nodes' reports and the final status."""
        deadline = time.monotonic() + timeout_s
        if self.mirror:
            self.start_store()
        self.start_coordinator()
        self.create_run()
        self.say(f"coordinator {self.url} in {self.topology.hosts[0].namespace}; run {self.run_id}")
        if self.relay:
            self.start_relay()
            self.say(f"relay {self.relay_maddr} in {self.topology.relay.namespace}")
        # The first node founds the DHT; the others enter it through the live members' addresses.
        self.start_node(1)
        while not any(p["status"] == "live" for p in self.status()["peers"]):
            self._check_nodes()
            if time.monotonic() > deadline:
                raise LabError("the first node did not join in time")
            time.sleep(0.5)
        for host in range(2, self.num_peers + 1):
            self.start_node(host)
        last_line, next_poll, finished_at = "", 0.0, None
        while any(node.poll() is None for node in self.nodes):
            self._check_nodes()
            now = time.monotonic()
            if now > deadline:
                raise LabError(
                    f"the swarm did not finish {self.rounds} rounds in {timeout_s:.0f} s; logs in {self.workdir}"
                )
            if finished_at is not None and now - finished_at > self.linger_s:
                self._stop_stragglers(now - finished_at)
                break
            if now >= next_poll:
                status = self.status()
                if finished_at is None and status["run"]["state"] != "running" and status["history"]:
                    finished_at = now
                line = progress_line(status, self.rounds)
                if line != last_line:
                    self.say(line)
                    last_line = line
                next_poll = now + 2.0
            time.sleep(0.2)
        self._check_nodes()
        reports = []
        for host in range(1, self.num_peers + 1):
            path = self.report_path(host)
            reports.append(json.loads(path.read_text()) if path.exists() else {"peer_id": None, "rounds": []})
        return reports, self.status()

    def _stop_stragglers(self, since_s: float) -> None:
        """Nodes still running well after the run's last round closed: record them and stop them.

        A node that is still fetching the last round's packets when every holder has left cannot
        finish it (see tools/netlab/README.md); it writes its report on SIGINT with the rounds it did.
        """
        running = [(host, node) for host, node in enumerate(self.nodes, start=1) if node.poll() is None]
        for host, _ in running:
            self.stragglers.append(
                {
                    "host": f"h{host}",
                    "reason": f"still running {since_s:.0f} s after the run finished; stopped with SIGINT",
                }
            )
        self.say(
            f"the run finished {since_s:.0f} s ago; stopping nodes still running: "
            + ", ".join(f"h{host}" for host, _ in running)
        )
        stop_processes([node for _, node in running], grace_s=15.0)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every process this swarm started, nodes first, and what they left running (p2pd)."""
        others = [p for p in (self.coordinator, self.store, self.relay_process) if p is not None]
        stop_processes([*self.nodes, *others], grace_s)


def _check_nat(topology: Topology, say) -> list[dict]:
    """Probe every NAT'd host from a public one; a NAT that lets a connection in, or none out, stops the lab."""
    prober = next((i for i in range(1, len(topology.hosts)) if i not in topology.nat), 0)
    probes = []
    for host in sorted(topology.nat):
        probe = topology.probe_nat(host, prober)
        say(
            f"NAT check h{host}: from h{prober} to {probe['public_ip']} {probe['inbound_to_public_ip']}, to "
            f"{probe['private_ip']} {probe['inbound_to_private_ip']}; out to h{prober} {probe['outbound']}, "
            f"seen from {probe['outbound_seen_from']}"
        )
        if not (probe["inbound_blocked"] and probe["outbound_masqueraded"]):
            raise LabError(f"the NAT in front of h{host} does not behave as one: {probe}")
        probes.append(probe)
    return probes


def overlap_support() -> tuple[bool, str | None]:
    from protocol.run_config import OuterSection

    if "overlap" in OuterSection.model_fields:
        return True, None
    return False, "overlap is unavailable: the run config has no 'outer.overlap' field in this version"


# -- the command ---------------------------------------------------------------------------------


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def host_rates(rates_mbps: list[float], peers: int) -> list[float]:
    """Each host's link rate: the nodes' h1..hN take the given rates in turn; the coordinator's h0,
    a server, takes the fastest."""
    nodes = [rates_mbps[i % len(rates_mbps)] for i in range(peers)]
    return [0.0 if 0.0 in rates_mbps else max(rates_mbps), *nodes]


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate or a comma-separated list of rates") from None
    if any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError("rates are >= 0 (0: unshaped)")
    return rates


def run_lab(args: argparse.Namespace, say) -> dict:
    rates = host_rates(args.rate_mbps, args.peers)
    link = LinkSpec(rate_mbps=rates[0], delay_ms=args.delay_ms, loss_pct=args.loss_pct)
    overlap_ok, overlap_reason = overlap_support() if args.overlap else (False, None)
    if args.overlap and not overlap_ok:
        say(overlap_reason)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="locoswarm-netlab-"))
    workdir.mkdir(parents=True, exist_ok=True)
    behind_nat = nat_hosts(args.peers, args.nat)
    topology = Topology(
        args.peers + 1,
        link,
        shaper=args.shaper,
        sysctls=args.sysctl,
        rates_mbps=rates,
        nat_hosts=behind_nat,
        relay=args.relay_host or args.relay,
    )
    rate_text = _rates_text(args.rate_mbps)
    swarm = LabSwarm(
        topology,
        workdir,
        rounds=args.rounds,
        preset=args.preset,
        inner_steps=args.inner_steps,
        top_k=args.top_k,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        overlap=args.overlap and overlap_ok,
        say=say,
        linger_s=args.linger,
        compute_floor_s=args.compute_floor,
        tree_fanout=args.tree_fanout,
        scored_peers=args.scored_peers,
        stripes=args.stripes,
        state_uplinks=args.state_uplinks,
        state_downlinks=args.state_downlinks,
        nat_client_mode=args.nat_client_mode,
        nat_push=args.nat_push,
        mirror=args.mirror,
        relay=args.relay,
    )
    started = time.monotonic()
    result: dict = {"completed": False, "workdir": str(workdir)}
    teardown_errors: list[str] = []
    nodes_counters: dict | None = None  # the link emulator's counts while the nodes ran
    try:
        topology.up()
        say(
            f"lab {topology.prefix}*: {args.peers + 1} hosts on {topology.subnet}.0/24, "
            f"{rate_text} Mbps each way per host, {link.delay_ms:g} ms one-way, {link.loss_pct:g} % loss "
            f"({SHAPING[topology.shaper]})"
        )
        if topology.delay_requested and not topology.delay_applied:
            say(
                f"NOTE: --delay-ms {link.delay_ms:g} / --loss-pct {link.loss_pct:g} NOT applied. {topology.delay_reason}"
            )
        if behind_nat:
            say(
                f"behind NAT: {', '.join(f'h{i}' for i in behind_nat)}, each behind its own router "
                f"({topology.prefix}nat<i>); their nodes join "
                + ("with --client-mode" if args.nat_client_mode else "with the defaults (--no-nat-client-mode)")
                + ("" if args.nat_push else " and --no-push")
            )
        if args.mirror:
            say("packet mirror: an S3 store (moto) in h0, named in the run config's exchange.mirror")
        if topology.relay is not None and not args.relay:
            say(f"relay host reserved: {topology.relay.namespace} {topology.relay.ip} (nothing runs there)")
        # The probe's receiver has to be dialable: h2, else the first public node host, else h0.
        receiver = next((i for i in range(2, args.peers + 1) if i not in topology.nat), 0)
        link_check = topology.probe_rate(sender=1, receiver=receiver)
        say(
            f"link check h1 -> h{receiver}: {link_check['mbps']:.1f} Mbps (path {link_check['rate_mbps']:g} Mbps), "
            f"round trip {link_check['rtt_ms']:.1f} ms measured"
        )
        link_check |= {"sender": "h1", "receiver": f"h{receiver}"}
        if behind_nat:
            link_check["nat"] = _check_nat(topology, say)
        relay_hosts = [topology.relay] if topology.relay is not None else []
        bytes_before, relay_before = topology.interface_bytes(), topology.interface_bytes(relay_hosts)
        counters_before = topology.emulator_snapshot()  # the checks' probes are not the nodes'
        reports, status = swarm.run(args.timeout)
        bytes_after, relay_after = topology.interface_bytes(), topology.interface_bytes(relay_hosts)
        if counters_before is not None:  # the TCP reference's replay below is not the nodes' either
            nodes_counters = _counters_between(counters_before, topology.emulator_snapshot())
        result |= summarize(reports, status.get("history", []), rate_mbps=rates[1:])
        per_peer_means = summarize_peers(reports, status.get("history", []), rate_mbps=rates[1:])
        result["per_peer"] = peer_rows(
            [swarm.peer_ids.get(i) for i in range(1, args.peers + 1)],
            [i in topology.nat for i in range(1, args.peers + 1)],
            swarm.closed_rounds(status),
            reports,
            status.get("peers", []),
            relayed=[i in topology.nat and args.relay for i in range(1, args.peers + 1)],
        )
        for row, means in zip(result["per_peer"], per_peer_means):
            row |= means
        node_rx = [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(bytes_after[1:], bytes_before[1:])]
        result["summary"]["interface_rx_bytes_per_peer_round"] = sum(node_rx) / len(node_rx) / args.rounds
        if args.peers >= 2 and result["summary"]["packet_bytes"]:
            # The reference, measured in the same lab: each steady round's packets over plain TCP,
            # each sent to every other host at its submission's time (Topology.probe_alltoall).
            baseline = _tcp_reference(topology, reports, dict(enumerate(rates[1:], start=1)))
            result["tcp_alltoall"] = baseline
            result["summary"]["tcp_alltoall_over_ideal"] = baseline["over_ideal"]
        result |= {
            "completed": len(result["per_round"]) == args.rounds
            and not swarm.stragglers
            and all(row["num_peers"] == args.peers for row in result["per_round"]),
            "stragglers": swarm.stragglers,
            "link_check": link_check,
            "interface_bytes": [
                {
                    "host": h.namespace.removeprefix(topology.prefix),
                    "rx_bytes": a["rx_bytes"] - b["rx_bytes"],
                    "tx_bytes": a["tx_bytes"] - b["tx_bytes"],
                }
                for h, a, b in zip(
                    [*topology.hosts, *relay_hosts], bytes_after + relay_after, bytes_before + relay_before
                )
            ],
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
        "peers": args.peers,
        "rounds": args.rounds,
        "preset": args.preset,
        "inner_steps": args.inner_steps,
        "top_k": args.top_k,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "compute_floor_s": args.compute_floor,
        "sysctls": args.sysctl,
        "state_uplinks": args.state_uplinks,
        "state_downlinks": args.state_downlinks,
        "tree_fanout": args.tree_fanout,
        "scored_peers": args.scored_peers,
        "stripes": args.stripes,
        "namespace_prefix": topology.prefix,
        "subnet": f"{topology.subnet}.0/24",
        "nat": {
            "hosts": [f"h{i}" for i in behind_nat],
            "client_mode": args.nat_client_mode and bool(behind_nat),
            "routers": {
                f"h{i}": {"namespace": r.namespace, "public_ip": r.uplink_ip, "private_ip": r.host_lan_ip}
                for i, r in topology.nat.items()
            },
        },
        "mirror": args.mirror,
        "nat_push": args.nat_push,
        "relay_host": {"namespace": topology.relay.namespace, "ip": topology.relay.ip} if topology.relay else None,
        "relay": {"maddr": swarm.relay_maddr, "relayed_hosts": [f"h{i}" for i in behind_nat]} if args.relay else None,
        "link": {
            "rate_mbps": args.rate_mbps[0] if len(args.rate_mbps) == 1 else args.rate_mbps,
            "host_rates_mbps": rates,
            "delay_ms": link.delay_ms,
            "loss_pct": link.loss_pct,
            "delay_applied": topology.delay_applied,
            "delay_reason": topology.delay_reason,
            "shaper": topology.shaper,
            "shaping": SHAPING.get(topology.shaper),
            "emulator_counters": topology.emulator_counters,
            "emulator_counters_nodes": nodes_counters,
        },
        "overlap": {"requested": args.overlap, "in_run_config": args.overlap and overlap_ok, "reason": overlap_reason},
        "run_id": swarm.run_id,
        "elapsed_s": time.monotonic() - started,
        "teardown_errors": teardown_errors,
    }


SHAPING = {
    "tc": "tbf on each host's egress and on the bridge-side veth (the host's ingress), netem for delay and loss",
    "userspace": "tools/netlab/linkem.py on TUN devices: a FIFO at the rate on each host's uplink and downlink, "
    "the one-way delay between them",
    "auto": "not built",
}


def _counters_between(before: dict, after: dict) -> dict:
    """The link emulator's counters (namespace -> name -> count) from `before` to `after`."""
    return {ns: {k: n - before[ns][k] for k, n in counts.items()} for ns, counts in after.items()}


def _tcp_reference(topology: Topology, reports: list[dict], rates_mbps: dict[int, float]) -> dict:
    """Plain TCP replaying each steady round's submissions (the nodes' `submitted_at` and packet
    sizes; `reports` in host order from h1): every host's busy time over its ideal for the same
    schedule, per round and host, and their mean (by link rate too)."""
    rounds = sorted({r["round"] for report in reports for r in report["rounds"]})
    replays = []
    for k in rounds[1:] if len(rounds) > 1 else rounds:
        mine = {i: next((r for r in rep["rounds"] if r["round"] == k), None) for i, rep in enumerate(reports, start=1)}
        if any(r is None or not r.get("submitted_at") for r in mine.values()):
            continue
        first = min(r["submitted_at"] for r in mine.values())
        schedule = {i: (r["submitted_at"] - first, r["packet_bytes"]) for i, r in mine.items()}
        probe = topology.probe_alltoall(schedule)
        no_path = {(int(a[1:]), int(b[1:])) for a, b in probe["no_path"]}
        ratios = replay_over_ideal(schedule, rates_mbps, dict(zip(schedule, probe["busy_s"])), no_path)
        replays.append({"round": k, **probe, "over_ideal": [ratios[i] for i in schedule]})
    per_host = [[x for x in column if x is not None] for column in zip(*(r["over_ideal"] for r in replays))]
    means = {i: sum(xs) / len(xs) for i, xs in enumerate(per_host, start=1) if xs}
    by_rate = {
        rate: sum(xs) / len(xs)
        for rate in sorted(set(rates_mbps.values()))
        if (xs := [m for i, m in means.items() if rates_mbps[i] == rate])
    }
    return {
        "rounds": replays,
        "no_path": replays[0]["no_path"] if replays else [],
        "over_ideal": sum(means.values()) / len(means) if means else None,
        "over_ideal_by_rate": {f"{rate:g}": x for rate, x in by_rate.items()},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.netlab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4, help="nodes, one per host h1..hN (h0 runs the coordinator)")
    parser.add_argument(
        "--rate-mbps",
        type=_rates,
        default=[100.0],
        metavar="R[,R...]",
        help="each host's link, both directions (0: unshaped); a list gives the nodes' hosts "
        "these rates in turn (h1 the first, ...) and the coordinator's the fastest",
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per host link")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="packet loss per host link, percent")
    parser.add_argument(
        "--shaper",
        choices=SHAPERS,
        default="auto",
        help="tc (tbf, netem), userspace (tools/netlab/linkem.py), or auto: tc unless delay or loss "
        "is asked for and the kernel has no netem",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, mini, small, ...)")
    parser.add_argument("--inner-steps", type=int, default=15, help="H, inner steps per round")
    parser.add_argument("--top-k", type=int, default=64, help="values kept per 4096-element chunk (packet size)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a per-namespace kernel setting on every host (repeatable), e.g. net.ipv4.tcp_slow_start_after_idle=0",
    )
    parser.add_argument(
        "--compute-floor",
        type=float,
        default=0.0,
        metavar="S",
        help="each round's inner steps take at least S seconds, the rest idle (accelerator "
        "time, emulated with the slow-compute fault, so that N nodes need not share the "
        "CPU for compute); 0: off",
    )
    parser.add_argument("--overlap", action="store_true", help="run option overlap=true (one-round-delayed outer step)")
    parser.add_argument(
        "--tree-fanout",
        type=int,
        default=2,
        help="run option exchange.tree_fanout: copies each peer forwards of a packet (1: a chain)",
    )
    parser.add_argument(
        "--scored-peers",
        type=int,
        metavar="N",
        help="run option scoring.max_peers_per_round: each node scores N peers' updates a round (one forward"
        " pass each, on every host's CPU); default: the run's",
    )
    parser.add_argument(
        "--stripes",
        type=int,
        metavar="N",
        help="node option network.stripes: a packet of a few MB is fetched over up to N streams side by side"
        " (1: one stream); default: the node's",
    )
    parser.add_argument(
        "--state-downlinks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each node states its link's rate as its download rate too (node option downlink_mbps), and takes"
        " at most nine tenths of it for packet downloads (default on)",
    )
    parser.add_argument(
        "--state-uplinks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each node states its link's rate at join (node option uplink_mbps), so that the "
        "packet trees put slower uplinks at the leaves (default on)",
    )
    parser.add_argument(
        "--nat",
        type=int,
        default=0,
        metavar="K",
        help="put the last K node hosts (h(N-K+1)..hN) each behind a NAT router of its own: they "
        "dial out, nobody dials them (needs nft)",
    )
    parser.add_argument(
        "--nat-client-mode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nodes behind NAT join with --client-mode, the README's advice for a volunteer nobody "
        "can dial (default on); off: with the defaults",
    )
    parser.add_argument(
        "--nat-push",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nodes behind NAT push their packets to reachable peers (default on); off: they join with --no-push",
    )
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="give the run a packet mirror: an S3 store (moto, from the test extra) in h0 beside the coordinator",
    )
    parser.add_argument(
        "--relay-host",
        action="store_true",
        help="add one more public host, <prefix>relay, reserved for a relay (nothing runs there yet)",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="run a relay (`locoswarm node relay`) in the relay host (implies --relay-host); nodes behind "
        "NAT join with --relay-via it instead of --client-mode, and peers fetch their packets through it",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole swarm run")
    parser.add_argument(
        "--linger",
        type=float,
        default=30.0,
        help="seconds nodes may run on after the last round closed before the lab stops them",
    )
    parser.add_argument("--workdir", default=None, help="database, logs and reports here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="only delete lab namespaces left by lab processes that no longer exist",
    )
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
    if not 0 <= args.nat <= args.peers:
        print(f"error: --nat takes 0 to --peers ({args.peers}) hosts", file=sys.stderr)
        return 2
    ok, reason = lab_available()
    if ok and args.nat:
        ok, reason = firewall_available()
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    # Ctrl+C tears the lab down, also when it was started from a background job of a shell without
    # job control, which starts it with SIGINT ignored (Python then installs no handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        print()
        print(format_peers(result["per_peer"]))
        link = result["link"]
        delay = (
            f"{link['delay_ms']:g} ms one-way, {link['loss_pct']:g} % loss"
            if link["delay_applied"]
            else "no delay or loss"
            if not (link["delay_ms"] or link["loss_pct"])
            else f"delay/loss NOT applied ({link['delay_reason']})"
        )
        if counters := link.get("emulator_counters_nodes") or link.get("emulator_counters"):
            carried = sum(c["packets"] for c in counters.values())
            up, down, lost, outside = (
                sum(c[k] for c in counters.values())
                for k in ("dropped_uplink", "dropped_downlink", "dropped_loss", "dropped_unroutable")
            )
            print(
                f"link emulator{' while the nodes ran' if link.get('emulator_counters_nodes') else ''}: "
                f"{carried:,} packets carried; dropped by full queues: {up:,} on uplinks, "
                f"{down:,} on downlinks; {lost:,} lost; {outside:,} unroutable (IPv6, addresses outside the lab)"
            )
        if baseline := result.get("tcp_alltoall"):
            by_rate = ", ".join(f"{rate} Mbps {x:.2f}x" for rate, x in baseline["over_ideal_by_rate"].items())
            unreached = (
                f"; no path between {len(baseline['no_path'])} pairs (both behind NAT), not counted"
                if baseline["no_path"]
                else ""
            )
            print(
                f"baseline: the same packets over plain TCP, each sent to every host at its submission: "
                f"xfer/ideal {_fmt(baseline['over_ideal'], 'x')}"
                + (f" ({by_rate})" if len(baseline["over_ideal_by_rate"]) > 1 else "")
                + unreached
            )
        for straggler in result["stragglers"]:
            print(f"INCOMPLETE: {straggler['host']} {straggler['reason']}")
        for group in result["summary"].get("by_rate", []):
            print(
                f"peers on {group['rate_mbps']:g} Mbps ({group['num_peers']}): fetching {_fmt(group['fetching_s'], 's')}"
                f", ideal {_fmt(group['ideal_transfer_s'], 's', 3)}, xfer/ideal {_fmt(group['transfer_over_ideal'], 'x', 1)}"
                f", round {_fmt(group['round_s'], 's')}, util {_fmt(group['compute_utilization'], '%')}"
            )
        print(
            f"\n{args.peers} peers, {_rates_text(args.rate_mbps)} Mbps links (probe: {result['link_check']['mbps']:.1f} Mbps, "
            f"round trip {result['link_check']['rtt_ms']:.1f} ms), "
            f"{delay}; overlap {'on (run option)' if result['overlap']['in_run_config'] else 'off'}"
            + (f"; compute at least {args.compute_floor:g} s a round (emulated)" if args.compute_floor else "")
            + (
                f"; behind NAT: {', '.join(result['nat']['hosts'])}"
                + (" (--client-mode)" if result["nat"]["client_mode"] else " (node defaults)")
                if result["nat"]["hosts"]
                else ""
            )
            + f"; logs in {result['workdir']}"
        )
    return 0 if result["completed"] and result["summary"]["digests_agree_every_round"] else 1


def _rates_text(rates_mbps: list[float]) -> str:
    return "/".join(f"{r:g}" for r in rates_mbps)


def _fmt(value: float | None, unit: str, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if unit == "%" else f"{value:.{digits}f}{unit}"


if __name__ == "__main__":
    sys.exit(main())
