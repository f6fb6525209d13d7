"""Exchange benchmark: N node processes swap one round's packets over the real DHT and libp2p streams.

    locoswarm bench exchange --peers 8 --json [--rounds 3] [--packet-bytes N]

Each peer is its own process (multiprocessing spawn) with its own p2pd and DHTNode on 127.0.0.1,
bootstrapped from peer 0. Each makes one real packet: a LLaMA-shaped model of about 50M parameters
(tools.bench.codec.llama_shapes), Gaussian pseudo-gradients, error feedback and top_k 64, encoded and
signed by protocol.packet (about 0.85 MB); `--packet-bytes` replaces it with random bytes of that
size. Per round every peer publishes, then fetches the other peers' packets by digest (the
manifest), as the node's round loop does.

Baseline, measured in the same run before the rounds: one large packet (`--baseline-bytes`, 64 MiB
by default) streamed from peer 0 to peer 1 while the others idle, best of three, gives the loopback
stream throughput. Per round and peer the report gives bytes downloaded and uploaded (stream
payload, failed transfers included), the fetch's wall time, and

    ratio = transfer_s / (downloaded_bytes / baseline_bytes_per_s)

that is, how much slower the swarm moved this peer's bytes than one unloaded stream would have.
The round's `ratio` uses the slowest peer's time and the most bytes any peer downloaded. All peers
share the machine's cores, so on one host the per-peer ratio cannot fall below about the number of
peers (every byte costs the same CPU as in the baseline); `swarm_ratio` divides the round's time by
(all bytes downloaded in the swarm / baseline throughput), the figure that compares on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time

BASELINE_ROUND = 0  # the baseline transfer; benchmark rounds are numbered from 1
SEED = 0


def make_packet(index: int, packet_bytes: int | None) -> bytes:
    """One peer's packet: real (50M-parameter LLaMA shapes, top_k 64) or `packet_bytes` random bytes."""
    if packet_bytes:
        import random

        return random.Random(SEED * 1000 + index).randbytes(packet_bytes)
    import torch

    from locoswarm_kernels.sparse import error_feedback_step
    from protocol.packet import ModelSpec, encode_packet
    from protocol.signing import PeerKey
    from tools.bench.codec import BETA, OUTER_LR, llama_shapes

    spec = ModelSpec(llama_shapes(), top_k=64)
    layouts = spec.layouts()
    gen = torch.Generator().manual_seed(SEED * 1000 + index)
    selections = {}
    for name, shape in spec.shapes.items():
        delta = torch.randn(shape, generator=gen) * float(torch.rand((), generator=gen) * 1e-2 + 1e-4)
        selections[name] = error_feedback_step(torch.zeros_like(delta), delta, layouts[name], BETA, OUTER_LR)
    return encode_packet("bench", 0, f"peer{index}", bytes(32), spec, selections, PeerKey.from_seed(bytes([index])))


def peer_main(index: int, conn, initial_peers: list[str], packet_bytes: int | None) -> None:
    """A peer process: serve commands from the parent over `conn` until told to stop."""
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"peer{index} %(levelname)s %(name)s: %(message)s")
    asyncio.run(_peer_loop(index, conn, initial_peers, packet_bytes))


async def _peer_loop(index: int, conn, initial_peers: list[str], packet_bytes: int | None) -> None:
    from node.exchange.p2p import ExchangeConfig, P2PExchange

    name = f"peer{index}"
    exchange = await P2PExchange.create(ExchangeConfig(run_id="bench", initial_peers=tuple(initial_peers)))
    daemon_pid = exchange.daemon_pid
    try:
        packet = await asyncio.to_thread(make_packet, index, packet_bytes)
        conn.send(("ready", exchange.visible_maddrs, len(packet)))
        while True:
            command, *args = await asyncio.to_thread(conn.recv)  # the loop keeps serving meanwhile
            if command == "publish":
                round, data = args[0], (args[1] if len(args) > 1 else packet)
                conn.send((await exchange.publish(round, name, data)).digest)
            elif command == "fetch":
                round, manifest, timeout_s = args
                start = time.perf_counter()
                got = await exchange.fetch(round, manifest, timeout_s=timeout_s)
                conn.send((time.perf_counter() - start, sorted(got)))
            elif command == "traffic":
                await exchange.wait_background()
                t = exchange.traffic(args[0])
                conn.send((t.downloaded_bytes, t.uploaded_bytes))
            elif command == "forget_before":
                await exchange.forget_before(args[0])
                conn.send(None)
            elif command == "stop":
                break
    finally:
        await exchange.shutdown()
        conn.send(("stopped", daemon_pid, os.path.exists(f"/proc/{daemon_pid}")))


class Peers:
    """The peer processes and their command pipes; stops every process it started, by handle."""

    def __init__(self, num_peers: int, packet_bytes: int | None, reply_timeout_s: float):
        self.ctx = mp.get_context("spawn")
        self.reply_timeout_s = reply_timeout_s
        self.procs: list[mp.Process] = []
        self.conns = []
        self._start(0, [], packet_bytes)
        _, bootstrap, self.first_packet_bytes = self.recv(0)
        for i in range(1, num_peers):
            self._start(i, bootstrap, packet_bytes)
        self.packet_sizes = [self.first_packet_bytes] + [self.recv(i)[2] for i in range(1, num_peers)]

    def _start(self, index: int, initial_peers: list[str], packet_bytes: int | None) -> None:
        parent_end, child_end = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=peer_main, args=(index, child_end, initial_peers, packet_bytes), name=f"bench-peer{index}"
        )
        proc.start()
        self.procs.append(proc)
        self.conns.append(parent_end)

    def recv(self, index: int):
        if not self.conns[index].poll(self.reply_timeout_s):
            raise TimeoutError(f"peer{index} did not answer within {self.reply_timeout_s} s")
        return self.conns[index].recv()

    def ask_all(self, *command) -> list:
        for conn in self.conns:
            conn.send(command)
        return [self.recv(i) for i in range(len(self.conns))]

    def close(self) -> list[bool]:
        """Stop every peer; returns, per peer, whether its p2pd was still alive after shutdown."""
        leftovers = []
        for i, conn in enumerate(self.conns):
            try:
                conn.send(("stop",))
                leftovers.append(self.recv(i)[2])
            except (OSError, EOFError, TimeoutError):
                leftovers.append(True)
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        return leftovers


def run(num_peers: int, num_rounds: int, packet_bytes: int | None, baseline_bytes: int, timeout_s: float) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    peers = Peers(num_peers, packet_bytes, reply_timeout_s=max(120.0, 2 * timeout_s))
    leftovers: list[bool] = []
    try:
        startup_s = time.perf_counter() - started
        baseline_bps = _baseline(peers, baseline_bytes, timeout_s)
        rounds = []
        for round in range(1, num_rounds + 1):
            digests = peers.ask_all("publish", round)
            manifest = {f"peer{i}": d for i, d in enumerate(digests)}
            fetched = _fetch_all(peers, round, manifest, timeout_s)
            traffic = peers.ask_all("traffic", round)
            per_peer = []
            for i, ((elapsed, got), (down, up)) in enumerate(zip(fetched, traffic)):
                ideal_s = down / baseline_bps
                per_peer.append(
                    {
                        "peer": f"peer{i}",
                        "downloaded_bytes": down,
                        "uploaded_bytes": up,
                        "transfer_s": round_(elapsed),
                        "packets_fetched": len(got),
                        "ratio": round_(elapsed / ideal_s) if ideal_s > 0 else None,
                    }
                )
            transfer_s = max(p["transfer_s"] for p in per_peer)
            max_down = max(p["downloaded_bytes"] for p in per_peer)
            total_down = sum(p["downloaded_bytes"] for p in per_peer)
            rounds.append(
                {
                    "round": round,
                    "transfer_s": transfer_s,
                    "complete": all(p["packets_fetched"] == num_peers - 1 for p in per_peer),
                    "ratio": round_(transfer_s / (max_down / baseline_bps)),
                    "median_peer_ratio": round_(statistics.median(p["ratio"] for p in per_peer)),
                    "total_downloaded_bytes": total_down,
                    "swarm_ratio": round_(transfer_s / (total_down / baseline_bps)),
                    "peers": per_peer,
                }
            )
            peers.ask_all("forget_before", round)
    finally:
        leftovers = peers.close()
    return {
        "peers": num_peers,
        "rounds": num_rounds,
        "packet_bytes": peers.packet_sizes,
        "packet_kind": "random" if packet_bytes else "llama50M_topk64",
        "baseline_bytes": baseline_bytes,
        "baseline_mbps": round_(baseline_bps * 8 / 1e6),
        "baseline_MBps": round_(baseline_bps / 1e6),
        "startup_s": round_(startup_s),
        "results": rounds,
        "p2pd_left_alive": sum(leftovers),
        "cpu_count": os.cpu_count(),
    }


def _baseline(peers: Peers, baseline_bytes: int, timeout_s: float) -> float:
    blob = os.urandom(baseline_bytes)
    speeds = []
    for attempt in range(3):
        peers.conns[0].send(("publish", BASELINE_ROUND, blob[:-1] + bytes([attempt])))
        digest = peers.recv(0)
        peers.conns[1].send(("fetch", BASELINE_ROUND, {"peer0": digest}, timeout_s))
        elapsed, got = peers.recv(1)
        if got:
            speeds.append(baseline_bytes / elapsed)
        for i in (0, 1):  # peer 1 must not keep the copy: the next attempt downloads again
            peers.conns[i].send(("forget_before", BASELINE_ROUND + 1))
            peers.recv(i)
    if not speeds:
        raise RuntimeError("every baseline transfer failed")
    return max(speeds)


def _fetch_all(peers: Peers, round: int, manifest: dict[str, str], timeout_s: float) -> list:
    for i, conn in enumerate(peers.conns):
        conn.send(("fetch", round, {p: d for p, d in manifest.items() if p != f"peer{i}"}, timeout_s))
    return [peers.recv(i) for i in range(len(peers.conns))]


def round_(x: float) -> float:
    return round(x, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--packet-bytes", type=int, default=None, help="random packets of this size instead of real ones"
    )
    parser.add_argument("--baseline-bytes", type=int, default=64 << 20)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per fetch")
    parser.add_argument("--json", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    if args.peers < 2:
        raise SystemExit("--peers must be at least 2")
    report = run(args.peers, args.rounds, args.packet_bytes, args.baseline_bytes, args.timeout_s)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['peers']} peers, packets {min(report['packet_bytes'])}-{max(report['packet_bytes'])} bytes, "
            f"baseline stream {report['baseline_MBps']:.1f} MB/s, start-up {report['startup_s']:.1f} s"
        )
        print(f"{'round':>5} {'peer':>6} {'down_MB':>8} {'up_MB':>8} {'time_s':>7} {'ratio':>6}")
        for r in report["results"]:
            for p in r["peers"]:
                print(
                    f"{r['round']:>5} {p['peer']:>6} {p['downloaded_bytes'] / 1e6:>8.2f} "
                    f"{p['uploaded_bytes'] / 1e6:>8.2f} {p['transfer_s']:>7.3f} {p['ratio']:>6.2f}"
                )
            print(
                f"{r['round']:>5} {'all':>6} {'':>8} {'':>8} {r['transfer_s']:>7.3f} {r['ratio']:>6.2f}"
                f"{'' if r['complete'] else '  INCOMPLETE'}"
            )
    return 0 if all(r["complete"] for r in report["results"]) and not report["p2pd_left_alive"] else 1


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
