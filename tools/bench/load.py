"""Coordinator load benchmark: N signed peers heartbeating against a real coordinator process.

    python -m tools.bench.load --peers 500 [--duration-s 30] [--json]
    python -m tools.bench.load --peers 500 --replicas 2 --db postgresql://...
    locoswarm bench load --peers 500 ...

It starts ``coordinator serve`` (uvicorn on 127.0.0.1 port 0, a temporary SQLite file) in a
subprocess, or with `--db postgresql://...` `--replicas` of them on a fresh schema of that server
(dropped after; tools/bench/postgres.py starts a throwaway server), creates a run (round
deadlines every `--round-timeout-s`, so rounds close and open under the load) and joins N peers, each with its own Ed25519 key and the signed-request scheme of
`protocol.http` that nodes use; peer i talks to replica i mod R, as a balancer would spread them,
and so do the status readers and round watchers. Then, in the same run:

1. one at a time: each endpoint alone, `--idle-samples` requests in a row, nothing else running;
   this is the baseline the loaded figures are divided by;
2. under load for `--duration-s`: every peer heartbeats every `--interval-s`, by default the period
   the coordinator tells in its heartbeat answers, as a node beats (one heartbeat of every peer,
   before the load, reads it: it grows with the swarm, max(heartbeat_timeout_s / 4, N /
   ``membership.max_heartbeats_per_s``), so the heartbeat rate stays bounded), the peers' phases
   spread evenly;
   `--readers` status readers each read ``status?history=0`` (the member list, as nodes read it
   each round) every `--reader-interval-s`, the first of them the full status; ``/healthz`` is
   probed four times a second and ``/readyz`` once a second, on every replica. With `--round-watchers W`, W peers
   also do what a node does each round: read the member list, then long-poll the round until it
   closes (``round_wake``: how long after the close their answer came).

The table gives, per endpoint, the one-at-a-time p50, the loaded p50 and p99, and loaded / alone.

The load generator shares the machine with the server, so it is built to cost little: one asyncio
process, one keep-alive connection per peer (as real peers have), a minimal HTTP/1.1 client on
asyncio streams, and every heartbeat rendered and signed before the load starts (nonces are the
planned send times). Its CPU use, each replica's (and which one led), and how late its own event
loop wakes a short sleep (``loop lag``: large means the generator, not the server, was the
bottleneck) are printed beside the figures, with the machine's load average: on a shared machine,
other work slows both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from coordinator.process import launch_coordinator
from protocol.http import sign_request
from protocol.signing import PeerKey

ADMIN_TOKEN = "bench-load-admin-token-0123456789"
CLOCK_TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ENDPOINTS = ("heartbeat", "status_members", "status_full", "healthz", "readyz", "round_wake")


@dataclass
class Latencies:
    """Seconds per request of one endpoint, and how many failed (no answer, or not the status expected)."""

    seconds: list[float] = field(default_factory=list)
    num_failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def add(self, seconds: float, ok: bool, why: str = "") -> None:
        self.seconds.append(seconds)
        if not ok:
            self.num_failed += 1
            self.failures[why] = self.failures.get(why, 0) + 1


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the server ----------------------------------------------------------------------------------


class Server:
    """`coordinator serve` in a subprocess (coordinator/process.py); `url` once it listens."""

    def __init__(self, db_url: str, log_path: Path, timeout_s: float = 60.0):
        self._coordinator = launch_coordinator(db_url, log_path, ADMIN_TOKEN, timeout_s)
        self.process, self.url, self.log_path = self._coordinator.process, self._coordinator.url, log_path

    def cpu_s(self) -> float:
        """User + system CPU seconds the server process used so far (Linux /proc)."""
        return _cpu_s(self.process.pid)

    def stop(self) -> None:
        self._coordinator.stop(timeout_s=15)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` used so far (Linux /proc; NaN once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_S


def _database_backends(db_url: str) -> list[int]:
    """The PostgreSQL server processes of the other sessions on `db_url`'s database (the
    replicas' connections), when the server runs on this machine; [] on SQLite."""
    if not db_url.startswith(("postgresql://", "postgres://")):
        return []
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return [pid for (pid,) in rows if Path(f"/proc/{pid}").exists()]


# -- a minimal HTTP/1.1 client -------------------------------------------------------------------


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time: what a peer holds open to its
    coordinator. Requests are bytes made beforehand (`render`); answers are (status, body)."""

    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    def render(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, request: bytes) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._exchange(request), self.timeout_s)
        except BaseException:
            self.close()  # an answer may still come: this connection is out of step now
            raise

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(request)
        status_line = await self._reader.readline()
        if not status_line:
            raise HttpError("connection closed")
        status = int(status_line.split()[1])
        length, close = 0, False
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = b"close" in value.lower()
            elif name == b"transfer-encoding":
                raise HttpError("chunked answers are not read here")
        body = await self._reader.readexactly(length)
        if close:
            self.close()
        return status, body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def _timed(connection: Connection, into: Latencies, request: bytes, expect: int = 200) -> bytes | None:
    start = time.perf_counter()
    try:
        status, body = await connection.send(request)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HttpError, ValueError) as e:
        into.add(time.perf_counter() - start, False, type(e).__name__)
        return None
    why = f"HTTP {status}"
    if status != expect:
        try:
            why += f" {json.loads(body).get('error')}"
        except ValueError:
            pass
    into.add(time.perf_counter() - start, status == expect, why)
    return body if status == expect else None


# -- the load ------------------------------------------------------------------------------------


@dataclass
class Peer:
    key: PeerKey
    connection: Connection
    heartbeat_path: str
    planned: list[tuple[float, bytes]] = field(default_factory=list)  # (send at, request bytes)


def _signed(connection: Connection, key: PeerKey, path: str, payload: dict, nonce: int | None = None) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", **sign_request(key, "POST", path, body, nonce=nonce)}
    return connection.render("POST", path, body, headers)


async def _told_interval(peers: list[Peer], concurrency: int) -> float:
    """One heartbeat from every peer, as a node sends after joining: the longest period the
    coordinator's answers tell (coordinator/rules/membership.py: it grows with the swarm)."""
    semaphore = asyncio.Semaphore(concurrency)

    async def beat(peer: Peer) -> float:
        payload = {"round": 0, "state": "training"}
        async with semaphore:
            status, body = await peer.connection.send(_signed(peer.connection, peer.key, peer.heartbeat_path, payload))
        if status != 200:
            raise RuntimeError(f"heartbeat refused: {status} {body[:300]!r}")
        return float(json.loads(body)["heartbeat_interval_s"])

    return max(await asyncio.gather(*(beat(peer) for peer in peers)))


async def _join_all(run_id: str, peers: list[Peer], concurrency: int) -> None:
    semaphore = asyncio.Semaphore(concurrency)

    async def join(peer: Peer) -> None:
        path = f"/v1/runs/{run_id}/join"
        payload = {
            "public_key": peer.key.public_hex,
            "device": "bench",
            "listen_multiaddrs": ["/ip4/127.0.0.1/tcp/4001"],
        }
        async with semaphore:
            status, body = await peer.connection.send(_signed(peer.connection, peer.key, path, payload))
        if status != 200:
            raise RuntimeError(f"join refused: {status} {body[:300]!r}")

    await asyncio.gather(*(join(peer) for peer in peers))


def _plan_heartbeats(
    peers: list[Peer], start_at: float, wall_minus_mono: float, duration_s: float, interval_s: float
) -> None:
    """Render and sign every heartbeat of the load phase now; peer i beats at start + i/N of an
    interval, then every interval. A nonce is the beat's planned wall-clock time in ns."""
    for i, peer in enumerate(peers):
        send_at = start_at + interval_s * i / len(peers)
        beat = 0
        while send_at < start_at + duration_s:
            nonce = int((send_at + wall_minus_mono) * 1e9)
            payload = {"round": 0, "state": "training", "train_loss": 3.0, "inner_step": beat % 15}
            peer.planned.append((send_at, _signed(peer.connection, peer.key, peer.heartbeat_path, payload, nonce)))
            send_at += interval_s
            beat += 1


async def _one_at_a_time(
    url: str, run_id: str, peers: list[Peer], samples: int, timeout_s: float, endpoints: dict[str, Latencies]
) -> None:
    reads = Connection(url, timeout_s)
    gets = {
        name: reads.render("GET", path)
        for name, path in (
            ("status_members", f"/v1/runs/{run_id}/status?history=0"),
            ("status_full", f"/v1/runs/{run_id}/status"),
            ("healthz", "/healthz"),
            ("readyz", "/readyz"),
        )
    }
    for n in range(samples):
        peer = peers[n % len(peers)]
        heartbeat = _signed(peer.connection, peer.key, peer.heartbeat_path, {"round": 0, "state": "training"})
        await _timed(peer.connection, endpoints["heartbeat"], heartbeat)
        for name, request in gets.items():
            await _timed(reads, endpoints[name], request)
    reads.close()


async def _under_load(
    urls: list[str],
    run_id: str,
    peers: list[Peer],
    args: argparse.Namespace,
    start_at: float,
    endpoints: dict[str, Latencies],
    loop_lag_s: list[float],
) -> None:
    """Nothing new is sent after `--duration-s`; requests still in flight then get the request
    timeout to answer. A peer has one heartbeat in flight at most, like a node: a beat whose
    predecessor is still waiting goes out late (or not at all, past the end)."""
    stop_at = start_at + args.duration_s
    status = f"/v1/runs/{run_id}/status"

    async def beat(peer: Peer) -> None:
        for send_at, request in peer.planned:
            delay_s = send_at - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if time.monotonic() >= stop_at:
                return
            await _timed(peer.connection, endpoints["heartbeat"], request)

    async def every(url: str, interval_s: float, offset_s: float, name: str, path: str) -> None:
        connection = Connection(url, args.request_timeout_s)
        request = connection.render("GET", path)
        send_at = start_at + offset_s
        while send_at < stop_at:
            delay_s = send_at - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await _timed(connection, endpoints[name], request)
            send_at = max(send_at + interval_s, time.monotonic())
        connection.close()

    async def watch_rounds(url: str, round_index: int) -> None:
        connection = Connection(url, args.request_timeout_s + 30.0)
        members = connection.render("GET", status + "?history=0")
        while (left_s := stop_at - time.monotonic()) > 0:
            await _timed(connection, endpoints["status_members"], members)
            poll = connection.render("GET", f"/v1/runs/{run_id}/rounds/{round_index}?wait_s={min(30.0, left_s):.2f}")
            start = time.perf_counter()
            try:
                answered, body = await connection.send(poll)
                view = json.loads(body)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HttpError, ValueError) as e:
                endpoints["round_wake"].add(time.perf_counter() - start, False, type(e).__name__)
                continue
            if answered != 200:
                endpoints["round_wake"].add(time.perf_counter() - start, False, f"HTTP {answered}")
            elif view["state"] == "closed":
                endpoints["round_wake"].add(max(0.0, time.time() - view["closed_at"]), True)
                round_index += 1
        connection.close()

    async def loop_lag() -> None:
        """How late the generator's own event loop wakes a 20 ms sleep: its saturation, not the server's."""
        while time.monotonic() < stop_at:
            asleep_at = time.monotonic()
            await asyncio.sleep(0.02)
            loop_lag_s.append(time.monotonic() - asleep_at - 0.02)

    tasks = [beat(peer) for peer in peers]
    if args.round_watchers:
        info = Connection(urls[0], args.request_timeout_s)
        _, body = await info.send(info.render("GET", f"/v1/runs/{run_id}"))
        info.close()
        current_round = json.loads(body)["current_round"]
        tasks += [watch_rounds(urls[w % len(urls)], current_round) for w in range(args.round_watchers)]
    for r in range(args.readers):
        name, path = ("status_full", status) if r == 0 else ("status_members", status + "?history=0")
        offset_s = args.reader_interval_s * r / max(1, args.readers)
        tasks.append(every(urls[r % len(urls)], args.reader_interval_s, offset_s, name, path))
    for url in urls:
        tasks += [every(url, 0.25, 0.0, "healthz", "/healthz"), every(url, 1.0, 0.5, "readyz", "/readyz")]
    tasks.append(loop_lag())
    await asyncio.gather(*tasks)


async def _leads(url: str, timeout_s: float) -> bool:
    """Whether the replica at `url` says it leads (its /metrics)."""
    connection = Connection(url, timeout_s)
    _, body = await connection.send(connection.render("GET", "/metrics"))
    connection.close()
    return re.search(rb"^locoswarm_coordinator_leader 1", body, re.MULTILINE) is not None


async def _bench(args: argparse.Namespace, servers: list[Server], db_url: str) -> dict[str, Any]:
    admin = Connection(servers[0].url, args.request_timeout_s)
    config = {
        "name": "bench-load",
        "model": {"preset": "tiny"},
        # New keys are rate-limited per run and per address; here they all come from 127.0.0.1 at once.
        "membership": {
            "min_peers": 1,
            # Longer than a node's 4 intervals: the joins and the one-at-a-time phase leave the
            # first peers silent for as long as they take (tens of seconds on a busy machine), and
            # a peer marked gone would be refused for the whole load (409 peer_gone).
            "heartbeat_timeout_s": max((args.interval_s or 0.0) * 4, 120.0),
            "max_heartbeats_per_s": args.max_heartbeats_per_s,
            "join_burst": args.peers,
            "join_burst_per_address": args.peers,
        },
        "deadline": {"kind": "fixed", "round_timeout_s": args.round_timeout_s},
    }
    status, body = await admin.send(
        admin.render(
            "POST",
            "/v1/runs",
            json.dumps(config).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    )
    if status != 200:
        raise RuntimeError(f"the run was refused: {status} {body[:300]!r}")
    run_id = json.loads(body)["run_id"]
    peers = []
    for i in range(args.peers):
        key = PeerKey.from_seed(f"bench-load-{args.seed}-{i}".encode())
        url = servers[i % len(servers)].url
        peers.append(Peer(key, Connection(url, args.request_timeout_s), f"/v1/runs/{run_id}/heartbeat"))
    joined_at = time.perf_counter()
    await _join_all(run_id, peers, args.join_concurrency)
    join_s = time.perf_counter() - joined_at

    alone = {name: Latencies() for name in ENDPOINTS}
    # Alone: the first replica and the peers that talk to it.
    await _one_at_a_time(
        servers[0].url, run_id, peers[:: len(servers)], args.idle_samples, args.request_timeout_s, alone
    )

    interval_s = args.interval_s or await _told_interval(peers, args.join_concurrency)
    # Two heartbeats of every peer at least: a told period may be longer than the default phase.
    args.duration_s = args.duration_s or max(30.0, 2 * interval_s)
    start_at = time.monotonic() + 1.0  # room to sign the plan
    _plan_heartbeats(peers, start_at, time.time() - time.monotonic(), args.duration_s, interval_s)
    loaded = {name: Latencies() for name in ENDPOINTS}
    loop_lag_s: list[float] = []
    backends = _database_backends(db_url)  # the replicas' sessions live as long as they do
    backends_cpu_at = [_cpu_s(pid) for pid in backends]
    cpu_at, servers_cpu_at, wall_at = time.process_time(), [s.cpu_s() for s in servers], time.monotonic()
    urls = [s.url for s in servers]
    await _under_load(urls, run_id, peers, args, max(start_at, time.monotonic()), loaded, loop_lag_s)
    wall_s = time.monotonic() - wall_at
    generator_cpu_s = time.process_time() - cpu_at
    servers_cpu_s = [s.cpu_s() - at for s, at in zip(servers, servers_cpu_at)]
    database_cpu_s = sum(_cpu_s(pid) - at for pid, at in zip(backends, backends_cpu_at))
    leaders = [await _leads(url, args.request_timeout_s) for url in urls]
    admin.close()  # idle through the load: the server may have closed it
    admin = Connection(servers[0].url, args.request_timeout_s)
    _, body = await admin.send(admin.render("GET", f"/v1/runs/{run_id}/status?history=0"))
    final = json.loads(body)
    admin.close()
    for peer in peers:
        peer.connection.close()

    rows = {}
    for name in ENDPOINTS:
        a, b = alone[name], loaded[name]
        alone_p50, p50, p99 = quantile(a.seconds, 0.5), quantile(b.seconds, 0.5), quantile(b.seconds, 0.99)
        rows[name] = {
            "alone_p50_ms": _ms(alone_p50),
            "load_p50_ms": _ms(p50),
            "load_p99_ms": _ms(p99),
            "load_max_ms": _ms(max(b.seconds) if b.seconds else None),
            "p50_ratio": round(p50 / alone_p50, 2) if p50 and alone_p50 else None,
            "p99_ratio": round(p99 / alone_p50, 2) if p99 and alone_p50 else None,
            "num_requests": len(b.seconds),
            "num_failed": b.num_failed + a.num_failed,
            "failures": {**a.failures, **b.failures},
        }
    return {
        "peers": args.peers,
        "duration_s": args.duration_s,
        "interval_s": interval_s,
        "interval_told": args.interval_s is None,
        "readers": args.readers,
        "round_watchers": args.round_watchers,
        "join_all_s": round(join_s, 2),
        "endpoints": rows,
        "heartbeats_per_s": round(len(loaded["heartbeat"].seconds) / wall_s, 1),
        "requests_per_s": round(sum(len(v.seconds) for v in loaded.values()) / wall_s, 1),
        "generator_loop_lag_p99_ms": _ms(quantile(loop_lag_s, 0.99)),
        "generator_cpu_pct": round(100 * generator_cpu_s / wall_s, 1),
        "server_cpu_pct": round(100 * sum(servers_cpu_s) / wall_s, 1),
        "database": "postgresql" if backends else "sqlite",
        # PostgreSQL's own processes serving the replicas (SQLite runs inside the replica).
        "database_cpu_pct": round(100 * database_cpu_s / wall_s, 1) if backends else None,
        "replicas": [
            {"cpu_pct": round(100 * cpu_s / wall_s, 1), "leader": leader}
            for cpu_s, leader in zip(servers_cpu_s, leaders)
        ],
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "live_peers_after": sum(p["status"] == "live" for p in final["peers"]),
        "round_after": final["run"]["current_round"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _print_table(result: dict[str, Any]) -> None:
    watchers = f", {result['round_watchers']} round watchers" if result["round_watchers"] else ""
    print(
        f"coordinator under load: {result['peers']} peers heartbeating every {result['interval_s']:g} s, "
        f"{result['readers']} status readers{watchers}, {result['duration_s']:g} s "
        f"({result['requests_per_s']:g} requests/s; joins took {result['join_all_s']:g} s)"
    )
    header = (
        f"{'endpoint':<16}{'alone p50':>11}{'load p50':>11}{'load p99':>11}{'max':>11}{'p50 x':>8}{'p99 x':>8}"
        f"{'requests':>10}{'failed':>8}"
    )
    print(header)
    print("-" * len(header))

    def cell(value: float | None, width: int, unit: str = "") -> str:
        return f"{'-' if value is None else f'{value:g}{unit}':>{width}}"

    for name, row in result["endpoints"].items():
        if not row["num_requests"] and row["alone_p50_ms"] is None:
            continue
        print(
            f"{name:<16}{cell(row['alone_p50_ms'], 11, ' ms')}{cell(row['load_p50_ms'], 11, ' ms')}"
            f"{cell(row['load_p99_ms'], 11, ' ms')}{cell(row['load_max_ms'], 11, ' ms')}"
            f"{cell(row['p50_ratio'], 8)}{cell(row['p99_ratio'], 8)}{row['num_requests']:>10}{row['num_failed']:>8}"
        )
        if row["failures"]:
            print(f"{'':<16}failures: {row['failures']}")
    replicas = ", ".join(
        f"{i}{' (leader)' if r['leader'] else ''} {r['cpu_pct']:g} %" for i, r in enumerate(result["replicas"])
    )
    print(
        f"load generator: {result['generator_cpu_pct']:g} % of a core, its loop lag p99 "
        f"{result['generator_loop_lag_p99_ms']:g} ms; server ({len(result['replicas'])} on {result['database']}): "
        f"{result['server_cpu_pct']:g} % of a core, per replica {replicas}"
        + (
            f"; PostgreSQL's backends {result['database_cpu_pct']:g} %"
            if result["database_cpu_pct"] is not None
            else ""
        )
        + f"; {result['cpu_count']} CPUs, load average {result['load_average_1m']}"
    )
    print(
        f"after the load: {result['live_peers_after']} of {result['peers']} peers live, run at round "
        f"{result['round_after']}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=500, help="signed peers that join and heartbeat")
    parser.add_argument(
        "--duration-s", type=float, default=None, help="length of the loaded phase (default: 30 s, or two periods)"
    )
    parser.add_argument(
        "--interval-s",
        type=float,
        default=None,
        help="each peer's heartbeat period (default: the one the coordinator's heartbeat answers tell,"
        " which grows with the swarm: max(heartbeat_timeout_s / 4, peers / --max-heartbeats-per-s))",
    )
    parser.add_argument(
        "--max-heartbeats-per-s",
        type=float,
        default=100.0,
        help="the run's membership.max_heartbeats_per_s (default: the run config's default)",
    )
    parser.add_argument("--readers", type=int, default=4, help="status readers (the first reads the full status)")
    parser.add_argument("--reader-interval-s", type=float, default=1.0, help="each reader's period")
    parser.add_argument(
        "--round-watchers",
        type=int,
        default=0,
        help="peers that also watch rounds as nodes do (members, then a long-poll to the close)",
    )
    parser.add_argument("--round-timeout-s", type=float, default=10.0, help="the run's fixed round deadline")
    parser.add_argument("--idle-samples", type=int, default=30, help="one-at-a-time requests per endpoint")
    parser.add_argument("--join-concurrency", type=int, default=16, help="joins in flight at once")
    parser.add_argument("--request-timeout-s", type=float, default=30.0, help="a request unanswered by then fails")
    parser.add_argument("--seed", type=int, default=0, help="peer keys derive from it")
    parser.add_argument(
        "--db",
        default=None,
        help="postgresql://... : the replicas serve a fresh schema of that server (default: a temporary SQLite file)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="coordinator processes on the database (>1: PostgreSQL)"
    )
    parser.add_argument("--keep-log", type=Path, default=None, help="copy the server's log here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


@contextlib.contextmanager
def _database(db: str | None, work: Path) -> Iterator[str]:
    """The URL the replicas serve: a SQLite file in `work`, or a fresh schema of `db`'s server."""
    if db is None:
        yield f"sqlite:///{work / 'coordinator.db'}"
        return
    from tools.bench.postgres import drop_schema, new_schema

    schema, url = new_schema(db, prefix="bench")
    try:
        yield url
    finally:
        drop_schema(db, schema)


def run_cli(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    if args.replicas > 1 and not (args.db or "").startswith(("postgresql://", "postgres://")):
        raise SystemExit("--replicas above 1 needs --db postgresql://...: SQLite serves one process")
    with tempfile.TemporaryDirectory(prefix="locoswarm-bench-load-") as work, _database(args.db, Path(work)) as db_url:
        servers: list[Server] = []
        try:
            for i in range(args.replicas):  # one after the other: the first leads
                servers.append(Server(db_url, Path(work) / f"serve-{i}.log"))
            result = asyncio.run(_bench(args, servers, db_url))
        finally:
            for server in servers:
                server.stop()
            if args.keep_log is not None:
                args.keep_log.write_bytes(b"".join(server.log_path.read_bytes() for server in servers))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
