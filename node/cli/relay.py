"""`locoswarm node relay`: a libp2p circuit relay for nodes behind NAT, which trains nothing.

    locoswarm node relay --host-maddrs /ip4/0.0.0.0/tcp/31338 --announce-maddrs /ip4/<public IP>/tcp/31338
    # prints "relay listening on /ip4/<public IP>/tcp/31338/p2p/<id>"; nodes behind NAT join with
    # --relay-via that address, and peers reach them through this process

One p2pd with relay service and public reachability forced (node/exchange/host.py: what that
p2pd's relay allows), no DHT node and no run: a relay needs a public address and nothing else.
It prints each address it can be dialled at, one line each, then runs until Ctrl+C or SIGTERM,
when it stops its p2pd. A node that trains can relay as well (`node join --relay`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

EXIT_REFUSED = 2
LISTENING = "relay listening on "  # the line's prefix that scripts (tools/netlab) read the address from


def register(node_sub) -> None:
    relay = node_sub.add_parser(
        "relay",
        help="run a libp2p circuit relay for nodes behind NAT (trains nothing)",
        description="Offer libp2p circuit relay service to nodes behind NAT: they join with "
        "--relay-via <the address printed here>, and peers reach them through this process.",
    )
    relay.add_argument(
        "--host-maddrs",
        nargs="+",
        required=True,
        metavar="MULTIADDR",
        help="where to listen: a fixed public port, /ip4/0.0.0.0/tcp/PORT",
    )
    relay.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MULTIADDR",
        help="addresses to advertise instead (the public IP behind port forwarding), explicit ports",
    )
    relay.set_defaults(func=_relay)


def _relay(args: argparse.Namespace) -> int:
    from node.cli.logs import configure_logging

    configure_logging(verbose=False)
    try:
        return asyncio.run(serve_relay(tuple(args.host_maddrs), tuple(args.announce_maddrs)))
    except ValueError as e:  # a listen or announce address p2pd would not take
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED


async def serve_relay(host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...] = ()) -> int:
    """Run a relay until SIGINT or SIGTERM; print its addresses once it is up."""
    from node.exchange.config import ExchangeConfig
    from node.exchange.host import start_daemon

    config = ExchangeConfig(run_id="relay", host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, relay=True)
    p2p = await start_daemon(config, idle_timeout_s=0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for maddr in await p2p.get_visible_maddrs():
            print(f"{LISTENING}{maddr}", flush=True)
        await stop.wait()
    finally:
        await p2p.shutdown()
    return 0
