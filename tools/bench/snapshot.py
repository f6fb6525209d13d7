"""Snapshot benchmark: host memory and time to serve and load a parameter snapshot over libp2p.

    locoswarm bench snapshot [--json] [--preset small] [--state]

Two exchanges on 127.0.0.1 in one process: a holder serves the preset's parameters (values
filled per tensor; with `--state`, DiLoCo's outer momentum too) and a fetcher loads them into a
second set of tensors, checked against the parameter digest. Two ways, each in a fresh process
of its own (so neither inherits the other's heap), one after the other in the same run:

- `baseline`: the first build's path, reproduced with today's exchange: the snapshot serialized
  whole (safetensors bytes) and moved as one packet (held whole by the holder, grown in a buffer
  by the fetcher, copied to bytes, parsed into tensors, digest-checked, copied into the model),
  with the packet limit raised to fit (the first build refused anything over 64 MiB);
- `stream`: `Snapshot.from_tensors` served unit by unit and received into a `SnapshotSink`
  (protocol/snapshot.py): one 4 MiB chunk buffered per side.

Per way: the peak resident memory of the process above what it held before serving (the two
sets of tensors and the exchanges), sampled every 2 ms from /proc/self/statm (the p2pd daemons
are processes of their own and not counted), and the seconds from publishing to loaded. The
report gives both and `memory_ratio_baseline_over_stream`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

RUN_ID = "bench-snapshot"
ROUND = 1


class PeakRss:
    """The highest resident set size seen by a sampling thread while in use."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak = interval_s, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


async def measure(way: str, preset: str, with_state: bool) -> dict:
    import torch

    from node.exchange.p2p import ExchangeConfig, P2PExchange
    from node.training.params import param_digest
    from node.training.snapshot import Snapshot, SnapshotSink
    from tools.bench.digest import preset_tensors

    source = preset_tensors(preset, torch.device("cpu"))
    state = {f"outer_momentum.{n}": t for n, t in source.items()} if with_state else {}
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    target_state = {n: torch.zeros_like(t) for n, t in state.items()}
    digest = param_digest(source)
    num_bytes = sum(t.numel() * 4 for t in source.values()) + sum(t.numel() * 4 for t in state.values())
    limit = num_bytes + (64 << 20)
    holder = await P2PExchange.create(ExchangeConfig(run_id=RUN_ID, max_packet_bytes=limit))
    fetcher = await P2PExchange.create(
        ExchangeConfig(
            run_id=RUN_ID, initial_peers=tuple(holder.visible_maddrs), max_packet_bytes=limit, stall_timeout_s=60
        )
    )
    try:
        meter = PeakRss()
        before = meter.rss()
        start = time.perf_counter()
        with meter:
            if way == "stream":
                snapshot = await asyncio.to_thread(Snapshot.from_tensors, source, state)
                ann = await holder.publish_params(ROUND, snapshot)
                sink = SnapshotSink(target, target_state, digest)
                assert await fetcher.fetch_params(ROUND, ann.digest, sink, timeout_s=3600)
            else:
                from safetensors.torch import load, save

                data = await asyncio.to_thread(save, {**source, **state})
                ann = await holder.publish(ROUND, "snapshot", data)
                del data  # the holder keeps its own reference, as the first build's store did
                fetched = (
                    await fetcher.fetch(
                        ROUND, {"snapshot": ann.digest}, holders_hint={"snapshot": ann.multiaddrs}, timeout_s=3600
                    )
                )["snapshot"]
                tensors = load(fetched)
                assert param_digest({n: tensors[n] for n in source}) == digest
                with torch.no_grad():
                    for name, t in {**target, **target_state}.items():
                        t.copy_(tensors[name])
                del tensors, fetched
        seconds = time.perf_counter() - start
        assert param_digest(target) == digest
        return {
            "way": way,
            "preset": preset,
            "snapshot_bytes": num_bytes,
            "rss_before_bytes": before,
            "peak_extra_bytes": meter.peak - before,
            "seconds": seconds,
        }
    finally:
        await fetcher.shutdown()
        await holder.shutdown()


def run_way(way: str, preset: str, with_state: bool) -> dict:
    """One way in a fresh interpreter: its heap starts clean."""
    command = [sys.executable, "-m", "tools.bench.snapshot", "--way", way, "--preset", preset]
    if with_state:
        command.append("--state")
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", default="small", help="model preset whose parameters make the snapshot")
    parser.add_argument("--state", action="store_true", help="add DiLoCo's outer momentum (doubles the size)")
    parser.add_argument("--way", choices=("baseline", "stream"), help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args(argv)
    if args.way:
        print(json.dumps(asyncio.run(measure(args.way, args.preset, args.state))))
        return 0
    baseline = run_way("baseline", args.preset, args.state)
    stream = run_way("stream", args.preset, args.state)
    result = {
        "preset": args.preset,
        "snapshot_bytes": stream["snapshot_bytes"],
        "baseline_peak_extra_bytes": baseline["peak_extra_bytes"],
        "baseline_s": baseline["seconds"],
        "stream_peak_extra_bytes": stream["peak_extra_bytes"],
        "stream_s": stream["seconds"],
        "memory_ratio_baseline_over_stream": baseline["peak_extra_bytes"] / max(1, stream["peak_extra_bytes"]),
        "time_ratio_baseline_over_stream": baseline["seconds"] / stream["seconds"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mb = 1 << 20
    print(
        f"snapshot benchmark: preset {args.preset}, snapshot {result['snapshot_bytes'] / mb:.1f} MiB, "
        "peak resident memory above the tensors held, one process per way"
    )
    print(f"{'':>10} {'peak MiB':>10} {'x snapshot':>11} {'s':>8}")
    for way, r in (("baseline", baseline), ("stream", stream)):
        print(
            f"{way:>10} {r['peak_extra_bytes'] / mb:>10.1f} {r['peak_extra_bytes'] / r['snapshot_bytes']:>11.2f} "
            f"{r['seconds']:>8.2f}"
        )
    print(
        f"{'ratio':>10} {result['memory_ratio_baseline_over_stream']:>9.1f}x {'':>11} "
        f"{result['time_ratio_baseline_over_stream']:>7.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
