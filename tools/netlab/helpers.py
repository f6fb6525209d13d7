"""Small stdlib-only programs the network lab runs inside its namespaces (`ip netns exec NS ...`).

    python -m tools.netlab.helpers http METHOD URL [--token-env VAR]   body on stdin (JSON or empty)
    python -m tools.netlab.helpers sink HOST                           prints "port P", then the result
    python -m tools.netlab.helpers source HOST PORT NUM_BYTES
    python -m tools.netlab.helpers rtt HOST                            prints {"rtt_ms": median of 5}
    python -m tools.netlab.helpers connect HOST PORT TIMEOUT_S         prints {"result": "connected", ...}
    python -m tools.netlab.helpers alltoall OWN_IP PORT BYTES START_AT PEER_IP...

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
`alltoall` is one host's part of a plain-TCP exchange among all hosts: it listens on OWN_IP:PORT,
waits until the unix time START_AT, sends BYTES to each PEER_IP on a fresh connection (all at once)
and prints {"seconds": s} from START_AT to the last byte received from every peer: the transfer a
round's packets would take with no protocol at all.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import statistics
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


def alltoall(own_ip: str, port: int, num_bytes: int, start_at: float, peers: list[str]) -> int:
    import threading

    received_at: list[float] = []
    lock = threading.Lock()

    def receive(connection: socket.socket) -> None:
        with connection:
            while connection.recv(RECV_BYTES):
                pass
        with lock:
            received_at.append(time.time())

    def send(peer: str) -> None:
        block = os.urandom(RECV_BYTES)
        for _ in range(100):  # the peer's listener may not be up yet
            try:
                connection = socket.create_connection((peer, port), timeout=60)
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        else:
            raise ConnectionRefusedError(f"{peer}:{port}")
        with connection:
            sent = 0
            while sent < num_bytes:
                piece = block[: min(len(block), num_bytes - sent)]
                connection.sendall(piece)
                sent += len(piece)

    with socket.create_server((own_ip, port), backlog=len(peers)) as server:
        receivers = []

        def accept_all() -> None:
            for _ in peers:
                connection, _ = server.accept()
                thread = threading.Thread(target=receive, args=(connection,))
                thread.start()
                receivers.append(thread)

        acceptor = threading.Thread(target=accept_all)
        acceptor.start()
        time.sleep(max(0.0, start_at - time.time()))
        senders = [threading.Thread(target=send, args=(peer,)) for peer in peers]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join()
        acceptor.join()
        for thread in receivers:
            thread.join()
    print(json.dumps({"seconds": max(received_at) - start_at}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "http":
        token_env = argv[4] if len(argv) == 5 and argv[3] == "--token-env" else None
        return http(argv[1], argv[2], token_env)
    if len(argv) == 2 and argv[0] == "sink":
        return sink(argv[1])
    if len(argv) >= 6 and argv[0] == "alltoall":
        return alltoall(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), argv[5:])
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
