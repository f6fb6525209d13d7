"""Stripes against one stream: one packet at a time between two lab hosts over a shaped link.

    python -m tools.netlab.stripes [--rate-mbps 100] [--delay-ms 20] [--packet-bytes 1570000]
                                   [--stripes 4] [--rounds 8] [--json]

Two hosts of the network lab (tools/netlab/topology.py: namespaces, `rate` and one-way `delay`
on each host's link, the round trip twice the delay), a real `P2PExchange` in each. Host 0
publishes a fresh packet of random bytes every round; host 1 runs two exchanges, one fetching
over one stream (`stripes` 1, the baseline) and one in `--stripes` stripes (protocol/stream.py),
and each round one of them (alternating which goes first) fetches that round's packet from the
publisher, named as the manifest names it. A warm-up round per exchange dials and opens the
connection first, as a node's earlier rounds do. Prints the median fetch time of each and their
ratio, and the ideal: the packet's bytes at the link's rate.

Nothing else runs on the hosts, so this isolates what one transfer costs; the swarm's figures
are the lab's (python -m tools.netlab). Needs root, as the lab does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from tools.netlab.topology import REPO_ROOT, LinkSpec, Topology

RUN_ID = "stripes-bench"


async def _publisher(ip: str) -> None:
    """Publish a packet of random bytes per "publish ROUND SIZE" line; answer its digest and addresses."""
    import random

    from node.exchange.config import ExchangeConfig
    from node.exchange.p2p import P2PExchange

    exchange = await P2PExchange.create(ExchangeConfig(run_id=RUN_ID, host_maddrs=(f"/ip4/{ip}/tcp/0",)))
    print(json.dumps({"ready": list(exchange.visible_maddrs)}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            _, round, size = line.split()
            data = random.Random(int(round)).randbytes(int(size))
            ann = await exchange.publish(int(round), "pub", data)
            await exchange.forget_before(int(round))
            print(json.dumps({"digest": ann.digest, "maddrs": ann.multiaddrs}), flush=True)
    finally:
        await exchange.shutdown()


async def _fetcher(ip: str, stripes: int, initial_peers: list[str]) -> None:
    """Two exchanges, one stream and `stripes`; per "fetch ROUND STRIPES DIGEST MADDRS" line, one of
    them fetches the packet and answers the seconds it took."""
    from node.exchange.config import ExchangeConfig
    from node.exchange.p2p import P2PExchange

    exchanges = {
        n: await P2PExchange.create(
            ExchangeConfig(
                run_id=RUN_ID, host_maddrs=(f"/ip4/{ip}/tcp/0",), initial_peers=tuple(initial_peers), stripes=n
            )
        )
        for n in sorted({1, stripes})
    }
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            exchange = exchanges[request["stripes"]]
            started = time.perf_counter()
            got = await exchange.fetch(
                request["round"], {"pub": request["digest"]}, {"pub": request["maddrs"]}, timeout_s=60
            )
            seconds = time.perf_counter() - started
            await exchange.forget_before(request["round"] + 1)
            print(json.dumps({"seconds": seconds, "ok": "pub" in got}), flush=True)
    finally:
        await asyncio.gather(*(x.shutdown() for x in exchanges.values()))


def _ask(process: subprocess.Popen, line: str) -> dict:
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return read_answer(process)


def read_answer(process: subprocess.Popen) -> dict:
    """The next JSON line a bench process prints (other lines, its logs, skipped)."""
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("a bench process exited")
        if line.startswith("{"):
            return json.loads(line)


def spawn_in(topology: Topology, host: int, module: str, *args: str) -> subprocess.Popen:
    """`python -m module args` in lab host `host`, stdin and stdout piped (JSON lines, `read_answer`)."""
    return subprocess.Popen(
        [*topology.exec_args(host), sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def stop(processes: list[subprocess.Popen]) -> None:
    """Stop the bench processes started here: SIGTERM, then SIGKILL after 30 s."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def two_hosts(link: LinkSpec, module: str) -> Iterator[tuple[Topology, Callable[..., subprocess.Popen]]]:
    """Two lab hosts on `link`, and `spawn(host, *args)`: `python -m module args` in one of them
    (`spawn_in`). On exit every process spawned is stopped and the hosts are removed."""
    topology = Topology(2, link)
    processes: list[subprocess.Popen] = []
    topology.up()
    try:

        def spawn(host: int, *args: str) -> subprocess.Popen:
            processes.append(spawn_in(topology, host, module, *args))
            return processes[-1]

        yield topology, spawn
    finally:
        stop(processes)
        topology.down()


def run(args: argparse.Namespace) -> dict:
    link = LinkSpec(rate_mbps=args.rate_mbps, delay_ms=args.delay_ms)
    with two_hosts(link, "tools.netlab.stripes") as (topology, spawn):
        publisher = spawn(0, "--role", "publisher", "--ip", topology.hosts[0].ip)
        bootstrap = read_answer(publisher)["ready"]
        fetcher = spawn(
            1, "--role", "fetcher", "--ip", topology.hosts[1].ip, "--stripes", str(args.stripes), *bootstrap
        )
        read_answer(fetcher)
        times: dict[int, list[float]] = {1: [], args.stripes: []}
        round = 0
        for trial in range(args.rounds + 1):  # the first: warm-up, not counted
            order = [1, args.stripes] if trial % 2 else [args.stripes, 1]
            for stripes in order:
                round += 1
                ann = _ask(publisher, f"publish {round} {args.packet_bytes}")
                answer = _ask(fetcher, json.dumps({"round": round, "stripes": stripes, **ann}))
                if not answer["ok"]:
                    raise RuntimeError(f"round {round}: the fetch with {stripes} stripes failed")
                if trial:
                    times[stripes].append(answer["seconds"])
                time.sleep(args.pause_s)
    one, striped = statistics.median(times[1]), statistics.median(times[args.stripes])
    ideal = args.packet_bytes * 8 / (args.rate_mbps * 1e6)
    return {
        "rate_mbps": args.rate_mbps,
        "delay_ms": args.delay_ms,
        "packet_bytes": args.packet_bytes,
        "stripes": args.stripes,
        "rounds": args.rounds,
        "one_stream_s": one,
        "striped_s": striped,
        "one_stream_over_striped": one / striped,
        "ideal_s": ideal,
        "one_stream_over_ideal": one / ideal,
        "striped_over_ideal": striped / ideal,
        "times_s": {str(k): v for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbps", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way, on each host's link")
    parser.add_argument("--packet-bytes", type=int, default=1_570_000)
    parser.add_argument("--stripes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8, help="fetches of each kind, after one warm-up")
    parser.add_argument("--pause-s", type=float, default=1.0, help="idle time between fetches")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=["publisher", "fetcher"], help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("initial_peers", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "publisher":
        asyncio.run(_publisher(args.ip))
        return 0
    if args.role == "fetcher":
        asyncio.run(_fetcher(args.ip, args.stripes, args.initial_peers))
        return 0
    if args.stripes < 2:
        parser.error("--stripes must be at least 2 (1 is the baseline)")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.packet_bytes:,} bytes at {args.rate_mbps:g} Mbps, {2 * args.delay_ms:g} ms round trip "
            f"(ideal {result['ideal_s']:.3f} s): one stream {result['one_stream_s']:.3f} s "
            f"({result['one_stream_over_ideal']:.2f}x ideal), {args.stripes} stripes {result['striped_s']:.3f} s "
            f"({result['striped_over_ideal']:.2f}x ideal): {result['one_stream_over_striped']:.2f}x faster "
            f"(medians of {args.rounds})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
