"""DHT benchmark: what one round's announcements and lookups cost a lab of K real DHT nodes.

    locoswarm bench dht --nodes 32,64 [--publishers 16] [--fetch 8] [--rounds 2] [--json]
    locoswarm bench dht --nodes 8 --sizes 16,64,256,1024,4096,16384   # the packets key's size

For each K in `--nodes`, K nodes start on 127.0.0.1 in this one asyncio process, each the node's own
`node.exchange.host.Host` (its own p2pd child and a `DHTNode`): node 0 alone, nodes 1-3 from it,
the others from a random two of the first four, with the time-outs of `LAB_SETTINGS` (longer than
a node's: the lab shares a few busy cores); the report gives the smallest routing table (0 would be
an island). Each round is then emulated with the node's real
`node.exchange.announce.Announcer`, one phase after another:

1. announce: P publishers (spread over the nodes) each store their record under the round's
   packets key (`announce_packet`, one `DHTNode.store`);
2. lookup: every node does the fetch-time lookup for F wanted publishers (`lookup`: one
   `get_many` of the packets key and F holders keys, `latest`), and checks it found all P records;
3. hold: every node announces itself as a holder of the F packets it "verified"
   (`announce_holder` F times, flushed as one `store_many`; `holder_batch_s` is 0 here, so the
   time is the store's, not the batching pause).

RPCs are counted where they arrive: before any node starts, `DHTProtocol.rpc_ping`, `rpc_store`
and `rpc_find` are wrapped on the class (hivemind registers each node's bound methods as its p2pd
handlers at start-up), so every RPC any node of the lab receives is counted, with the node that
received it and the number of keys it carried. Every RPC of the lab is sent by a lab node, so
"received" is all the RPCs an operation caused. A phase's count divided by its operations is the
per-operation cost; `max/node` is the most any one node received in the phase (the nodes nearest a
key serve every lookup of it). Wall time is per operation (median and 90th percentile), with at
most `--concurrency` operations in flight, on a shared CPU: it is the lab's time, not a WAN's.

Record size: after each round one node reads the packets key and one holders key and the merged
dictionary a lookup returns is serialized as hivemind sends it (MSGPackSerializer); its bytes per
record give where a key crosses 16 KB (values past ~16 KB crash the `hivemind.DHT` wrapper's pipe;
the node runs `DHTNode` in its own loop and does not use it) and 4 MiB, the message limit of the
p2pd control connection that a find response must fit (`MAX_MSG_BYTES`). `--sizes` stores that
many records under one key (in batches of 256) and reads them back from another node, to find where
a read fails: past the limit the serving node's answer fails inside hivemind (a ValueError it
logs), and the reader gets, after its RPC time-outs, no error but a partial dictionary or none
(`complete` false).

Baseline, measured in the same run before the rounds: one `call_ping` between two idle nodes of the
lab (median of 20); the table gives each operation's median in pings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

RPC_NAMES = ("rpc_ping", "rpc_store", "rpc_find")
PHASES = ("announce", "lookup", "hold")
# p2pd's control-connection message limit (hivemind DEFAULT_MAX_MSG_SIZE): a find response must fit.
# Measured with --sizes: a 4.09 MB dictionary reads back whole, a 4.36 MB one does not.
MAX_MSG_BYTES = 4 * 1024**2
WRAPPER_LIMIT_BYTES = 16 * 1024  # values past this crash the hivemind.DHT wrapper's pipe
SIZE_BATCH = 256  # records per store_many in the --sizes sweep (one store request must fit too)
RUN_ID = "bench-dht"
# Time-outs for K nodes sharing a few busy cores: a node that misses its bootstrap starts a DHT of its
# own, and an RPC past its time-out drops a record; neither says anything about the design's cost.
LAB_SETTINGS = {
    "holder_batch_s": 0.0,
    "bootstrap_timeout_s": 30.0,
    "startup_timeout_s": 120.0,
    "dht_wait_timeout_s": 10.0,
}
SEED = 0


@dataclass
class RpcCounter:
    """RPCs received by every DHT node of this process, by method and by receiving node."""

    calls: Counter = field(default_factory=Counter)  # method -> RPCs
    keys: Counter = field(default_factory=Counter)  # method -> keys carried
    by_node: Counter = field(default_factory=Counter)  # id(protocol) -> RPCs

    def snapshot(self) -> tuple[Counter, Counter, Counter]:
        return Counter(self.calls), Counter(self.keys), Counter(self.by_node)


@contextlib.contextmanager
def counting_rpcs():
    """Wrap DHTProtocol's rpc_* on the class while the block runs; nodes must start inside it."""
    from hivemind.dht.protocol import DHTProtocol

    counter = RpcCounter()
    originals = {name: getattr(DHTProtocol, name) for name in RPC_NAMES}

    def wrap(name, method):
        @functools.wraps(method)  # hivemind reads the handler's request and response types from its annotations
        async def counted(self, request, context):
            counter.calls[name] += 1
            counter.keys[name] += len(getattr(request, "keys", ()))
            counter.by_node[id(self)] += 1
            return await method(self, request, context)

        return counted

    for name, method in originals.items():
        setattr(DHTProtocol, name, wrap(name, method))
    try:
        yield counter
    finally:
        for name, method in originals.items():
            setattr(DHTProtocol, name, method)


def peer_id_of(index: int) -> str:
    """A project peer id like the coordinator's ("p" + 16 hex chars)."""
    return "p" + hashlib.sha256(f"bench-peer-{index}".encode()).hexdigest()[:16]


def digest_of(index: int, round: int) -> str:
    return hashlib.sha256(f"packet-{index}-{round}".encode()).hexdigest()


class Lab:
    """K hosts (p2pd + DHTNode each) and their announcers; `close` stops every daemon it started."""

    def __init__(self, num_nodes: int):
        self.hosts: list = [None] * num_nodes
        self.announcers: list = [None] * num_nodes
        self.tasks: list[list[asyncio.Task]] = [[] for _ in range(num_nodes)]  # each announcer's background tasks

    async def start(self, rng: random.Random) -> None:
        from node.exchange.announce import Announcer
        from node.exchange.config import ExchangeConfig
        from node.exchange.host import Host

        async def start_one(index: int, initial_peers: tuple[str, ...]) -> None:
            config = ExchangeConfig(run_id=RUN_ID, initial_peers=initial_peers, **LAB_SETTINGS)
            host = self.hosts[index] = await Host.start(config)
            tasks = self.tasks[index]
            self.announcers[index] = Announcer(
                host.dht, config, host.holder_id, await host.visible_maddrs(), lambda c: _spawn(tasks, c)
            )

        num_nodes = len(self.hosts)
        await start_one(0, ())
        first = tuple(self.announcers[0].maddrs)
        await asyncio.gather(*(start_one(i, first) for i in range(1, min(4, num_nodes))))
        seeds = [a.maddrs[0] for a in self.announcers[:4] if a is not None]
        rest = list(range(min(4, num_nodes), num_nodes))
        for batch in range(0, len(rest), 8):  # a few at a time: each start runs p2pd and a bootstrap
            await asyncio.gather(*(start_one(i, tuple(rng.sample(seeds, 2))) for i in rest[batch : batch + 8]))

    def table_sizes(self) -> list[int]:
        """How many DHT nodes each node's routing table holds (0: an island)."""
        return [len(h.dht_peers) for h in self.hosts]

    async def close(self) -> int:
        """Stop every node started; returns how many of their p2pd daemons were still alive afterwards."""
        started = [h for h in self.hosts if h is not None]
        pids = [h.daemon_pid for h in started]
        await asyncio.gather(*(h.shutdown() for h in started), return_exceptions=True)
        return sum(os.path.exists(f"/proc/{pid}") for pid in pids if pid is not None)


def _spawn(tasks: list[asyncio.Task], coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    tasks.append(task)
    return task


async def _timed(op, semaphore: asyncio.Semaphore) -> float:
    async with semaphore:
        start = time.perf_counter()
        await op()
        return time.perf_counter() - start


async def run_phase(counter: RpcCounter, ops: list, concurrency: int) -> dict:
    """Run `ops` (coroutine functions), at most `concurrency` at once; RPCs received and times."""
    calls0, keys0, nodes0 = counter.snapshot()
    semaphore = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    times = await asyncio.gather(*(_timed(op, semaphore) for op in ops))
    wall_s = time.perf_counter() - start
    calls, keys, nodes = counter.snapshot()
    n = max(1, len(ops))
    per_node = nodes - nodes0
    return {
        "ops": len(ops),
        "wall_s": wall_s,
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * sorted(times)[math.ceil(0.9 * len(times)) - 1],  # nearest rank
        "rpcs_per_op": {name: (calls[name] - calls0[name]) / n for name in RPC_NAMES},
        "keys_per_op": {name: (keys[name] - keys0[name]) / n for name in RPC_NAMES},
        "max_rpcs_one_node": max(per_node.values(), default=0),
    }


async def record_bytes(dht, keys: list[str]) -> dict[str, tuple[int, int]]:
    """Per key: (records, bytes) of the merged dictionary a `latest` read returns, serialized as a
    find response carries it (a DictionaryDHTValue of msgpack-serialized records)."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    found = await dht.get_many(keys, sufficient_expiration_time=float("inf"))
    out = {}
    for key in keys:
        item = found.get(key)
        if item is None or not isinstance(item.value, dict):
            out[key] = (0, 0)
            continue
        merged = DictionaryDHTValue()
        for subkey, entry in item.value.items():
            merged.store(subkey, MSGPackSerializer.dumps(entry.value), entry.expiration_time)
        out[key] = (len(item.value), len(MSGPackSerializer.dumps(merged)))
    return out


async def emulate_round(lab: Lab, counter: RpcCounter, round: int, publishers: int, fetch: int, concurrency: int):
    from protocol.dht_records import holders_key, packets_key

    num_nodes = len(lab.hosts)
    publisher_nodes = [i * num_nodes // publishers for i in range(publishers)]
    pkey = packets_key(RUN_ID, round)
    rng = random.Random(SEED * 1000 + round)

    def announce(node: int):
        a = lab.announcers[node]
        return lambda: a.announce_packet(pkey, a.record(digest_of(node, round), 1 << 20), peer_id_of(node), round)

    wanted = {
        n: rng.sample([p for p in publisher_nodes if p != n], min(fetch, publishers - 1)) for n in range(num_nodes)
    }
    found_counts: list[int] = []

    def lookup(node: int):
        keys = {None: pkey, **{peer_id_of(p): holders_key(RUN_ID, round, peer_id_of(p)) for p in wanted[node]}}

        async def op():
            announced, _ = await lab.announcers[node].lookup(keys, round, asyncio.get_running_loop().time() + 30.0)
            found_counts.append(len(announced))

        return op

    def hold(node: int):
        async def op():
            for p in wanted[node]:
                lab.announcers[node].announce_holder(round, peer_id_of(p), digest_of(p, round), 1 << 20)
            await asyncio.gather(*lab.tasks[node])
            lab.tasks[node].clear()

        return op

    result = {
        "announce": await run_phase(counter, [announce(n) for n in publisher_nodes], concurrency),
        "lookup": await run_phase(counter, [lookup(n) for n in range(num_nodes)], concurrency),
        "hold": await run_phase(counter, [hold(n) for n in range(num_nodes)], concurrency),
    }
    result["lookups_complete"] = sum(c == publishers for c in found_counts)
    hkey = holders_key(RUN_ID, round, peer_id_of(publisher_nodes[0]))
    sizes = await record_bytes(lab.hosts[-1].dht, [pkey, hkey])
    result["packets_key"] = {"records": sizes[pkey][0], "bytes": sizes[pkey][1]}
    result["holders_key"] = {"records": sizes[hkey][0], "bytes": sizes[hkey][1]}
    return result


async def ping_baseline(lab: Lab, samples: int = 20) -> float:
    a, b = lab.hosts[0], lab.hosts[1]
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        if await a.dht.protocol.call_ping(b.p2p.peer_id) is None:
            raise RuntimeError("the baseline ping between two lab nodes failed")
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


async def size_sweep(lab: Lab, sizes: list[int]) -> list[dict]:
    """Store n records under one fresh key per size and read it back from another node."""
    from hivemind.utils.timed_storage import get_dht_time

    out = []
    writer, reader = lab.announcers[0], lab.hosts[-1].dht
    for n in sizes:
        key = f"locoswarm/{RUN_ID}/sizes/{n}/packets"
        stored = 0
        for start in range(0, n, SIZE_BATCH):
            ids = range(start, min(n, start + SIZE_BATCH))
            records = [writer.record(digest_of(i, 0), 1 << 20) for i in ids]
            ok = await lab.hosts[0].dht.store_many(
                [key] * len(records), records, get_dht_time() + 600, subkeys=[peer_id_of(i) for i in ids]
            )
            stored += sum(bool(v) for v in ok.values())
        start = time.perf_counter()
        try:
            records, size = (await record_bytes(reader, [key]))[key]
            error = None
        except Exception as e:  # the finding: how a read of a too-large key fails
            records, size, error = 0, 0, repr(e)[:200]
        out.append(
            {
                "records": n,
                "stored": stored,
                "read_records": records,
                "bytes": size,
                "complete": records == n,
                "read_ms": 1e3 * (time.perf_counter() - start),
                "error": error,
            }
        )
    return out


async def run_lab(num_nodes: int, publishers: int, fetch: int, rounds: int, concurrency: int, sizes: list[int]):
    rng = random.Random(SEED)
    with counting_rpcs() as counter:
        lab = Lab(num_nodes)
        start = time.perf_counter()
        try:
            await lab.start(rng)
            startup_s = time.perf_counter() - start
            tables = lab.table_sizes()
            ping_ms = await ping_baseline(lab)
            results = [
                await emulate_round(lab, counter, r, publishers, fetch, concurrency) for r in range(1, rounds + 1)
            ]
            sweep = await size_sweep(lab, sizes) if sizes else []
        finally:
            left_alive = await asyncio.shield(lab.close())
    return {
        "nodes": num_nodes,
        "publishers": publishers,
        "fetch": fetch,
        "rounds": rounds,
        "startup_s": startup_s,
        "table_min": min(tables),
        "table_median": statistics.median(tables),
        "ping_ms": ping_ms,
        "phases": {phase: _merge([r[phase] for r in results]) for phase in PHASES},
        "per_round": [{phase: r[phase] for phase in PHASES} for r in results],
        "lookups_complete": sum(r["lookups_complete"] for r in results),
        "lookups": num_nodes * rounds,
        "packets_key": results[-1]["packets_key"],
        "holders_key": results[-1]["holders_key"],
        "sizes": sweep,
        "p2pd_left_alive": left_alive,
    }


def _merge(phases: list[dict]) -> dict:
    """One phase over the rounds: RPCs summed per op, the medians' median, the worst node."""
    n = len(phases)
    return {
        "ops": sum(p["ops"] for p in phases),
        "median_ms": statistics.median(p["median_ms"] for p in phases),
        "p90_ms": max(p["p90_ms"] for p in phases),
        "rpcs_per_op": {k: sum(p["rpcs_per_op"][k] for p in phases) / n for k in RPC_NAMES},
        "keys_per_op": {k: sum(p["keys_per_op"][k] for p in phases) / n for k in RPC_NAMES},
        "max_rpcs_one_node": max(p["max_rpcs_one_node"] for p in phases),
    }


def bytes_per_record(report: dict) -> float | None:
    """The packets key's serialized bytes per record, from the lab's last round."""
    key = report["packets_key"]
    return key["bytes"] / key["records"] if key["records"] else None


def print_table(report: dict) -> None:
    print(
        f"\n{report['nodes']} nodes, {report['publishers']} publishers, fetch {report['fetch']}, "
        f"{report['rounds']} rounds; start-up {report['startup_s']:.1f} s; routing tables "
        f"{report['table_min']}-{report['table_median']:g} (min-median) nodes; baseline ping {report['ping_ms']:.2f} ms; "
        f"complete lookups {report['lookups_complete']}/{report['lookups']}; p2pd left alive {report['p2pd_left_alive']}"
    )
    print(
        f"{'phase':>8} {'ops':>5} {'find/op':>8} {'store/op':>9} {'ping/op':>8} {'keys/find':>9} "
        f"{'max/node':>8} {'p50_ms':>7} {'p90_ms':>7} {'p50/ping':>8}"
    )
    for phase in PHASES:
        p = report["phases"][phase]
        rpcs, keys = p["rpcs_per_op"], p["keys_per_op"]
        per_find = keys["rpc_find"] / rpcs["rpc_find"] if rpcs["rpc_find"] else 0.0
        print(
            f"{phase:>8} {p['ops']:>5} {rpcs['rpc_find']:>8.1f} {rpcs['rpc_store']:>9.1f} {rpcs['rpc_ping']:>8.1f} "
            f"{per_find:>9.1f} {p['max_rpcs_one_node']:>8} {p['median_ms']:>7.1f} {p['p90_ms']:>7.1f} "
            f"{p['median_ms'] / report['ping_ms']:>8.1f}"
        )
    for name in ("packets_key", "holders_key"):
        key = report[name]
        print(f"{name}: {key['records']} records, {key['bytes']} bytes")
    per_record = bytes_per_record(report)
    if per_record:
        print(
            f"{per_record:.0f} bytes per record: 16 KB at {WRAPPER_LIMIT_BYTES / per_record:.0f} records, "
            f"4 MiB (the largest find response) at {MAX_MSG_BYTES / per_record:.0f}"
        )
    for s in report["sizes"]:
        print(
            f"sizes: {s['records']:>6} stored {s['stored']:>6} read {s['read_records']:>6} records, "
            f"{s['bytes']:>9} bytes, {s['read_ms']:>8.1f} ms{'' if s['complete'] else '  INCOMPLETE'}"
            f"{'  ' + s['error'] if s['error'] else ''}"
        )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_ints, default=[32, 64], help="lab sizes, comma-separated")
    parser.add_argument("--publishers", type=int, default=16, help="packets announced per round")
    parser.add_argument("--fetch", type=int, default=8, help="publishers each node looks up and then holds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="operations in flight at once")
    parser.add_argument("--sizes", type=_ints, default=[], help="record counts to store under one key and read")
    parser.add_argument("--json", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    if min(args.nodes) < 2 or not 2 <= args.publishers <= min(args.nodes) or args.fetch < 1 or args.rounds < 1:
        raise SystemExit("need --nodes >= 2, 2 <= --publishers <= nodes, --fetch >= 1, --rounds >= 1")
    logging.basicConfig(level=logging.ERROR)
    reports = [
        asyncio.run(run_lab(k, args.publishers, args.fetch, args.rounds, args.concurrency, args.sizes))
        for k in args.nodes
    ]
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        for report in reports:
            print_table(report)
    ok = all(r["lookups_complete"] == r["lookups"] and r["table_min"] and not r["p2pd_left_alive"] for r in reports)
    return 0 if ok else 1


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
