"""`locoswarm bench codec|exchange`: the benchmarks that performance claims cite.

    locoswarm bench codec [--json] [--device cpu|cuda] [--repeats 5] [--peers 16]
    locoswarm bench exchange [--json] [--peers 8] [--rounds 3] [--packet-bytes N]
    locoswarm bench digest [--json] [--preset 512m] [--device cpu|cuda] [--repeats 3]
    locoswarm bench snapshot [--json] [--preset small] [--state]
    locoswarm bench load [--json] [--peers 500] [--duration-s 30] [--round-watchers N]
    locoswarm bench memory [--json] [--preset 1b] [--device cuda] [--placement host] [--measure]
    locoswarm bench dht [--json] [--nodes 32,64] [--publishers 16] [--fetch 8] [--sizes 16,64,...]

Each prints its figures beside a baseline measured in the same run: the codec against the plain
path (torch.topk + int64 indices + uint8 codes; tools/bench/codec.py), the exchange against one
unloaded libp2p stream (tools/bench/exchange.py), the parameter digest against one SHA-256 over the
same tensors (tools/bench/digest.py), a streamed snapshot against the whole-bytes path of
the first build (tools/bench/snapshot.py), a coordinator under N heartbeating peers against
the same requests one at a time (tools/bench/load.py), a round's DHT announcements and lookups
against one ping between two idle nodes of the lab (tools/bench/dht.py). The arguments go to the benchmark's own parser
(`locoswarm bench codec --help` lists them), which is imported only when it runs: the codec
benchmark imports torch.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {  # name: (module, help)
    "codec": ("tools.bench.codec", "packet size and encode/decode speed against the plain path"),
    "exchange": ("tools.bench.exchange", "N node processes swap packets over the real DHT and libp2p streams"),
    "digest": ("tools.bench.digest", "the hash-tree parameter digest against one SHA-256, GB/s"),
    "snapshot": ("tools.bench.snapshot", "host memory to serve and load a parameter snapshot, streamed vs whole"),
    "load": ("tools.bench.load", "N signed peers heartbeating a real coordinator: latency vs one at a time"),
    "memory": ("tools.bench.memory", "device and host bytes per parameter by category, against the first build"),
    "dht": ("tools.bench.dht", "a lab of K DHT nodes: RPCs and time per announcement and lookup, record sizes"),
}


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: the codec, the packet exchange")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        parser = bench_sub.add_parser(name, help=help_text, add_help=False)
        # Every argument after the benchmark's name is its own parser's (locoswarm.cli passes them on).
        parser.set_defaults(
            func=lambda args, module_name=module_name: importlib.import_module(module_name).main(
                args.passthrough, prog=f"locoswarm bench {args.bench_command}"
            ),
            passthrough=[],
        )
