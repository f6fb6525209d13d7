"""One peer of the connection-reversal lab test, in a process of its own inside a lab namespace.

    python -m tests.integration.reversal_peer {bootstrap|holder|joiner} DIR IP

The peers listen on IP and talk through small JSON files in DIR (each written once, whole):
`bootstrap` writes its addresses to DIR/bootstrap; `holder` (behind the NAT) serves the snapshot
of `Toy(1)` for round 3 and writes DIR/holder, then dials the addresses the joiner writes to
DIR/dial with `P2PExchange.dial_peers` and writes whom it reached to DIR/dialed; `joiner` (DHT
client mode) fetches the snapshot once, hands its addresses over, fetches again once dialled, and
writes DIR/result. Every peer stops once DIR/done exists (the joiner writes it, the test too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from node.exchange.config import ExchangeConfig
from node.exchange.p2p import P2PExchange
from node.training.params import param_digest
from tests.integration.snapshot_holder import toy_snapshot
from tests.integration.test_snapshot_stream import ROUND, fresh_sink

WAIT_S = 90.0


async def read(path: Path) -> object:
    """The JSON in `path` once it exists (written whole with a rename); TimeoutError after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        await asyncio.sleep(0.1)
    return json.loads(path.read_text())


def write(path: Path, value: object) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value))
    partial.rename(path)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["bootstrap", "holder", "joiner"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("ip")
    args = parser.parse_args()
    d: Path = args.dir
    config = dict(run_id="reversal", max_packet_bytes=1 << 20, connect_timeout_s=3.0, nat_port_map=False)
    config["host_maddrs"] = (f"/ip4/{args.ip}/tcp/0",)
    if args.role != "bootstrap":
        config["initial_peers"] = tuple(await read(d / "bootstrap"))
    exchange = await P2PExchange.create(ExchangeConfig(**config, client_mode=args.role == "joiner"))
    try:
        if args.role == "bootstrap":
            write(d / "bootstrap", exchange.visible_maddrs)
        elif args.role == "holder":
            await hold(exchange, d)
        else:
            await join(exchange, d)
        await read(d / "done")
    finally:
        await exchange.shutdown()


async def hold(holder: P2PExchange, d: Path) -> None:
    _, snapshot = toy_snapshot()
    await holder.publish_params(ROUND, snapshot)
    write(d / "holder", holder.visible_maddrs)
    write(d / "dialed", await holder.dial_peers(await read(d / "dial")))


async def join(joiner: P2PExchange, d: Path) -> None:
    try:
        model, snapshot = toy_snapshot()
        await read(d / "holder")
        deadline = time.monotonic() + WAIT_S
        while not await joiner.params_holders(ROUND) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        target, state, sink = fresh_sink(param_digest(model))
        before = await joiner.fetch_params(ROUND, snapshot.digest, sink, timeout_s=6)
        before_bytes = sink.offset
        write(d / "dial", [joiner.visible_maddrs])
        dialed = await read(d / "dialed")
        after = await joiner.fetch_params(ROUND, snapshot.digest, sink, timeout_s=20)
        result = {
            "joiner": joiner.holder_id,
            "dialed": dialed,
            "before": [before, before_bytes],
            "after": [after, sink.offset, sink.total_bytes],
            "loaded_digest": param_digest(target) if after else None,
            "digest": param_digest(model),
        }
        write(d / "result", result)
    finally:
        write(d / "done", True)


if __name__ == "__main__":
    asyncio.run(main())
