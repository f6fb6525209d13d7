"""Two publishers fetching each other's fresh packet at once, against one fetch alone.

    python -m tools.netlab.crossing [--rate-mbps 10] [--delay-ms 20] [--packet-bytes 1570000]
                                    [--links both|uplink|none] [--rounds 6] [--json]

Two hosts of the network lab (tools/netlab/topology.py), a real `P2PExchange` in each, both
stating their links as a node's `--uplink-mbps` / `--downlink-mbps` do (`--links`: both, the
uplink only, or neither). Each round both publish a fresh packet; then either host 1 alone
fetches host 0's ("alone", the baseline) or each fetches the other's at the same moment
("crossing": each sends its first copy while it receives the other's), alternating which kind
goes first. Prints the median time of each kind and their ratio, and the ideal: the packet's
bytes at the link's rate. Needs root, as the lab does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

from tools.netlab.stripes import read_answer, two_hosts
from tools.netlab.topology import LinkSpec

RUN_ID = "crossing-bench"


async def _peer(ip: str, rate_mbps: float, links: str, initial_peers: list[str]) -> None:
    """Per stdin line, publish a fresh packet ("publish") or fetch one ("fetch"); answer in JSON."""
    from node.exchange.config import ExchangeConfig
    from node.exchange.p2p import P2PExchange

    stated = {"both": {"uplink_mbps": rate_mbps, "downlink_mbps": rate_mbps}, "uplink": {"uplink_mbps": rate_mbps}}
    config = ExchangeConfig(
        run_id=RUN_ID, host_maddrs=(f"/ip4/{ip}/tcp/0",), initial_peers=tuple(initial_peers), **stated.get(links, {})
    )
    exchange = await P2PExchange.create(config)
    print(json.dumps({"ready": list(exchange.visible_maddrs)}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            round, name = request["round"], request["name"]
            if request["op"] == "publish":
                data = random.Random(f"{round}/{name}").randbytes(request["size"])
                ann = await exchange.publish(round, name, data)
                await exchange.forget_before(round)
                print(json.dumps({"digest": ann.digest, "maddrs": ann.multiaddrs}), flush=True)
            else:
                started = time.perf_counter()
                got = await exchange.fetch(round, {name: request["digest"]}, {name: request["maddrs"]}, timeout_s=120)
                print(json.dumps({"seconds": time.perf_counter() - started, "ok": name in got}), flush=True)
    finally:
        await exchange.shutdown()


def _send(process: subprocess.Popen, request: dict) -> None:
    process.stdin.write(json.dumps(request) + "\n")
    process.stdin.flush()


def run(args: argparse.Namespace) -> dict:
    link = LinkSpec(rate_mbps=args.rate_mbps, delay_ms=args.delay_ms)
    with two_hosts(link, "tools.netlab.crossing") as (topology, spawn_module):

        def spawn(host: int, *initial_peers: str) -> subprocess.Popen:
            role = ["--role", "peer", "--ip", topology.hosts[host].ip, "--links", args.links]
            return spawn_module(host, *role, "--rate-mbps", str(args.rate_mbps), *initial_peers)

        first = spawn(0)
        bootstrap = read_answer(first)["ready"]
        second = spawn(1, *bootstrap)
        read_answer(second)
        peers = [first, second]
        times: dict[str, list[float]] = {"alone": [], "crossing": []}
        round = 0
        for trial in range(args.rounds + 1):  # the first: warm-up, not counted
            for kind in ["alone", "crossing"] if trial % 2 else ["crossing", "alone"]:
                round += 1
                anns = []
                for i, peer in enumerate(peers):
                    _send(peer, {"op": "publish", "round": round, "name": f"p{i}", "size": args.packet_bytes})
                    anns.append(read_answer(peer))
                fetchers = [1] if kind == "alone" else [1, 0]
                for i in fetchers:  # host i fetches the other's packet
                    _send(peers[i], {"op": "fetch", "round": round, "name": f"p{1 - i}", **anns[1 - i]})
                answers = [read_answer(peers[i]) for i in fetchers]
                if not all(a["ok"] for a in answers):
                    raise RuntimeError(f"round {round}: a {kind} fetch failed")
                if trial:
                    times[kind].append(max(a["seconds"] for a in answers))
                time.sleep(args.pause_s)
    alone, crossing = statistics.median(times["alone"]), statistics.median(times["crossing"])
    return {
        "rate_mbps": args.rate_mbps,
        "delay_ms": args.delay_ms,
        "packet_bytes": args.packet_bytes,
        "links": args.links,
        "rounds": args.rounds,
        "alone_s": alone,
        "crossing_s": crossing,
        "crossing_over_alone": crossing / alone,
        "ideal_s": args.packet_bytes * 8 / (args.rate_mbps * 1e6),
        "times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.netlab.crossing", description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbps", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way, on each host's link")
    parser.add_argument("--packet-bytes", type=int, default=1_570_000)
    parser.add_argument("--links", choices=["both", "uplink", "none"], default="both", help="what the peers state")
    parser.add_argument("--rounds", type=int, default=6, help="fetches of each kind, after one warm-up")
    parser.add_argument("--pause-s", type=float, default=1.0, help="idle time between rounds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=["peer"], help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("initial_peers", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "peer":
        asyncio.run(_peer(args.ip, args.rate_mbps, args.links, args.initial_peers))
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.rate_mbps:g} Mbps, {args.delay_ms:g} ms one way, {args.packet_bytes:,} bytes, links stated: "
            f"{args.links}; medians of {args.rounds}: alone {result['alone_s']:.3f} s, both at once "
            f"{result['crossing_s']:.3f} s ({result['crossing_over_alone']:.2f}x); ideal {result['ideal_s']:.3f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
