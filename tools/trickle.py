"""A swarm on 127.0.0.1 with one modified node that forwards at a trickle: what it costs the others.

    python -m tools.trickle --workdir W [--rate 5000] [--peers 4] [--rounds 3] [--preset small --top-k 1024]
    python -m tools.trickle --workdir W --rate 0        # the same swarm with no trickle: the baseline
    python -m tools.trickle --workdir W --withhold      # the last node withholds its packet every round

Nodes 0..N-2 state a 100 Mbps uplink; the last states 10000 Mbps, so that every packet tree hangs
the others on it (node/exchange/topology.py), and with `--rate` > 0 it serves every packet stream
at that many bytes/s (the `trickle` fault, node/faults.py): with 4 stripes a copy, just above the
fetchers' rate floor. With `--withhold` it submits every packet and serves none (the `withhold`
fault) instead. The run has a fixed 60 s deadline and 30 s heartbeat time-out, the small
preset's 1.5 MB packets by default. Prints one JSON object: every node's exit code, each closed
round's contributors, dropped entries and manifest version, and per node and round the transfer
timer, the packets applied and its catch-ups (from the nodes' --report files), and the elapsed
time. docs/DESIGN.md ("A round waits for the peers still fetching the last one") has the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from node.cli.demo import LocalSwarm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.trickle", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=5000.0, help="bytes/s of each stream it serves (0: honest)")
    parser.add_argument("--withhold", action="store_true", help="the last node withholds its packets instead")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--top-k", type=int, default=1024)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on the nodes after this")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    n = args.peers
    extra = {i: ("--uplink-mbps", "100") for i in range(n - 1)}
    fault = "withhold" if args.withhold else f"trickle@rate={args.rate:g}" if args.rate else None
    extra[n - 1] = ("--uplink-mbps", "10000", *(("--inject", fault) if fault else ()))
    started = time.monotonic()
    with LocalSwarm(
        args.workdir,
        num_peers=n,
        preset=args.preset,
        rounds=args.rounds,
        inner_steps=3,
        top_k=args.top_k,
        quiet=True,
        extra_node_args=extra,
    ) as swarm:
        swarm.start_coordinator()
        swarm.create_run(
            {"membership.heartbeat_timeout_s": 30.0, "deadline": {"kind": "fixed", "round_timeout_s": 60.0}}
        )
        swarm.start_node(0)
        swarm.wait_for_peers(1)
        for i in range(1, n):
            swarm.start_node(i)
        codes = []
        for node in swarm.nodes:
            try:
                codes.append(node.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - started))))
            except Exception:
                codes.append(None)  # still running: stopped with the swarm
        rounds = []
        for h in swarm.status()["history"]:
            view = httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/{h['round']}", trust_env=False, timeout=30)
            body = view.json()
            rounds.append(
                {
                    "round": h["round"],
                    "contributors": h["num_contributors"],
                    "manifest_version": body["manifest_version"],
                    "dropped": len(body["dropped"]),
                }
            )
    nodes = []
    for i in range(n):
        path = args.workdir / f"node{i}.report.json"
        report = json.loads(path.read_text()) if path.exists() else {"rounds": [], "catch_ups": []}
        nodes.append(
            {
                "node": i,
                "modified": i == n - 1 and fault is not None,
                "rounds": [
                    {"round": r["round"], "transfer_s": round(r["times"]["transfer_s"], 2), "packets": r["num_packets"]}
                    for r in report["rounds"]
                ],
                "catch_ups": len(report.get("catch_ups", [])),
            }
        )
    result = {"fault": fault, "codes": codes, "rounds": rounds, "nodes": nodes}
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
