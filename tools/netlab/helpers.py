"""Small stdlib-only programs the network lab runs inside its namespaces (`ip netns exec NS ...`).

    python -m tools.netlab.helpers http METHOD URL [--token-env VAR]   body on stdin (JSON or empty)
    python -m tools.netlab.helpers sink HOST                           prints "port P", then the result
    python -m tools.netlab.helpers source HOST PORT NUM_BYTES
    python -m tools.netlab.helpers rtt HOST                            prints {"rtt_ms": median of 5}
    python -m tools.netlab.helpers connect HOST PORT TIMEOUT_S         prints {"result": "connected", ...}
    python -m tools.netlab.helpers alltoall OWN_IP PORT BYTES START_AT DELAY ACCEPT push:IP|pull:IP:DELAY...

The lab's own process stays in the root namespace, where the lab's addresses do not exist, so
every request to the coordinator and every throughput probe runs as one of these short-lived
helpers inside a lab namespace. They import nothing but the standard library: a helper starts in
tens of milliseconds, so polling the coordinator this way costs little.

`http` prints one JSON object {"status": int, "body": <parsed JSON or text>} and exits 0 whatever
the HTTP status (non-zero only when no answer came). `sink` accepts one connection, reads to EOF
and prints {"bytes": n, "seconds": s, "peer": the connection's source address}, timed from the
first byte to EOF, so connection set-up and the sender's start-up do not count. `rtt` times TCP
connection attempts to a port nobody listens on (the refusal comes back after one round trip).
`connect` makes one TCP connection attempt and says how it ended: connected, refused, timeout (no
answer within TIMEOUT_S), unreachable (no route, or an ICMP error) or `error: <errno name>`.
`alltoall` is one host's part of a plain-TCP exchange among all hosts, as a round's packets would
go with no protocol at all: it listens on OWN_IP:PORT for ACCEPT connections and, at the unix time
START_AT + DELAY (when its packet is ready), sends its BYTES to each `push:IP` on a fresh connection
it dials; at each sender's START_AT + DELAY it dials each `pull:IP:DELAY` (the host is behind NAT
and the sender is not) and reads that sender's bytes over it. A connection's first byte says which
way its bytes go: `P` (the dialer sends, the unix time it started in the next 8 bytes), `G` (the
dialer receives). It prints {"seconds": s, "busy_s": b, "received": n}: from START_AT to the last
byte of its n peers' packets, and the time at least one of them was on its way (from its sender's
start to its last byte), as a node's `fetching_s` counts.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import statistics
import struct
import sys
import time
import urllib.error
import urllib.request

RECV_BYTES = 1 << 16


def http(method: str, url: str, token_env: str | None) -> int:
    body = sys.stdin.buffer.read() or None
    headers = {"Content-Type": "application/json"} if body else {}
    if token_env:
        headers["Authorization"] = f"Bearer {os.environ[token_env]}"
    # No proxies: the coordinator is on the lab's private subnet, and a proxy set in the
    # environment would be outside it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with opener.open(request, timeout=30) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    print(json.dumps({"status": status, "body": parsed}), flush=True)
    return 0


def sink(host: str) -> int:
    with socket.create_server((host, 0)) as server:
        print(f"port {server.getsockname()[1]}", flush=True)
        connection, (peer, _) = server.accept()
        with connection:
            total = len(first := connection.recv(RECV_BYTES))
            start = time.perf_counter()
            while chunk := connection.recv(RECV_BYTES):
                total += len(chunk)
            elapsed_s = time.perf_counter() - start
    # The first recv's bytes arrived before the clock started: count only what came after it.
    print(json.dumps({"bytes": total - len(first), "seconds": elapsed_s, "peer": peer}), flush=True)
    return 0


def connect(host: str, port: int, timeout_s: float) -> int:
    start = time.perf_counter()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        result = "connected"
    except ConnectionRefusedError:
        result = "refused"
    except TimeoutError:
        result = "timeout"
    except OSError as e:
        unreachable = {errno.ENETUNREACH, errno.EHOSTUNREACH}
        result = "unreachable" if e.errno in unreachable else f"error: {errno.errorcode.get(e.errno, e.errno)}"
    print(json.dumps({"result": result, "seconds": time.perf_counter() - start}), flush=True)
    return 0


def source(host: str, port: int, num_bytes: int) -> int:
    block = os.urandom(RECV_BYTES)
    with socket.create_connection((host, port), timeout=60) as connection:
        sent = 0
        while sent < num_bytes:
            piece = block[: min(len(block), num_bytes - sent)]
            connection.sendall(piece)
            sent += len(piece)
    return 0


def rtt(host: str, closed_port: int = 9, tries: int = 5) -> int:
    samples = []
    for _ in range(tries):
        start = time.perf_counter()
        try:
            socket.create_connection((host, closed_port), timeout=10).close()
        except ConnectionRefusedError:
            pass
        samples.append((time.perf_counter() - start) * 1000)
    print(json.dumps({"rtt_ms": statistics.median(samples)}), flush=True)
    return 0


def alltoall(
    own_ip: str, port: int, num_bytes: int, start_at: float, delay_s: float, accept: int, targets: list[str]
) -> int:
    import threading

    intervals: list[tuple[float, float]] = []  # each packet received: its sender's start, its last byte
    lock = threading.Lock()
    block = os.urandom(RECV_BYTES)

    def receive(connection: socket.socket, started: float) -> None:
        while connection.recv(RECV_BYTES):
            pass
        with lock:
            intervals.append((started, time.time()))

    def send(connection: socket.socket) -> None:
        sent = 0
        while sent < num_bytes:
            piece = block[: min(len(block), num_bytes - sent)]
            connection.sendall(piece)
            sent += len(piece)

    def dial(target: str) -> None:
        way, peer, *delay = target.split(":")
        time.sleep(max(0.0, start_at + (float(delay[0]) if delay else delay_s) - time.time()))
        started = time.time()
        for _ in range(100):  # the peer's listener may not be up yet
            try:
                connection = socket.create_connection((peer, port), timeout=60)
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        else:
            raise ConnectionRefusedError(f"{peer}:{port}")
        with connection:
            if way == "push":
                connection.sendall(b"P" + STARTED.pack(started))
                send(connection)
            else:
                connection.sendall(b"G")
                receive(connection, started)

    def answer(connection: socket.socket) -> None:
        with connection:
            if _read_exactly(connection, 1) == b"P":
                receive(connection, STARTED.unpack(_read_exactly(connection, STARTED.size))[0])
            else:
                send(connection)

    with socket.create_server((own_ip, port), backlog=max(1, accept)) as server:
        answers = []

        def accept_all() -> None:
            for _ in range(accept):
                connection, _ = server.accept()
                thread = threading.Thread(target=answer, args=(connection,))
                thread.start()
                answers.append(thread)

        acceptor = threading.Thread(target=accept_all)
        acceptor.start()
        dialers = [threading.Thread(target=dial, args=(target,)) for target in targets]
        for thread in dialers:
            thread.start()
        for thread in dialers:
            thread.join()
        acceptor.join()
        for thread in answers:
            thread.join()
    result = {
        "seconds": max(end for _, end in intervals) - start_at if intervals else None,
        "busy_s": _union_s(intervals),
        "received": len(intervals),
    }
    print(json.dumps(result), flush=True)
    return 0


STARTED = struct.Struct("!d")


def _read_exactly(connection: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        if not (piece := connection.recv(num_bytes - len(data))):
            raise ConnectionError(f"closed after {len(data)} of {num_bytes} bytes")
        data += piece
    return data


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "http":
        token_env = argv[4] if len(argv) == 5 and argv[3] == "--token-env" else None
        return http(argv[1], argv[2], token_env)
    if len(argv) == 2 and argv[0] == "sink":
        return sink(argv[1])
    if len(argv) >= 7 and argv[0] == "alltoall":
        return alltoall(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]), int(argv[6]), argv[7:])
    if len(argv) == 2 and argv[0] == "rtt":
        return rtt(argv[1])
    if len(argv) == 4 and argv[0] == "connect":
        return connect(argv[1], int(argv[2]), float(argv[3]))
    if len(argv) == 4 and argv[0] == "source":
        return source(argv[1], int(argv[2]), int(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
