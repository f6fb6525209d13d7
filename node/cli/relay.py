"""`locoswarm node relay`: a libp2p circuit relay for nodes behind NAT, which trains nothing.

    locoswarm node relay --host-maddrs /ip4/0.0.0.0/tcp/31338 --announce-maddrs /ip4/<public IP>/tcp/31338
    # prints "relay listening on /ip4/<public IP>/tcp/31338/p2p/<id>"; nodes behind NAT join with
    # --relay-via that address, and peers reach them through this process

One p2pd with relay service and public reachability forced (node/exchange/host.py: what that
p2pd's relay allows), no DHT node and no run: a relay needs a public address and nothing else.
It prints each address it can be dialled at, one line each, then runs until Ctrl+C or SIGTERM,
when it stops its p2pd. A node that trains can relay as well (`node join --relay`).

p2pd 0.5.0.hivemind1 starts two relay services, its configured one (4 GiB, 30 min per relayed
connection) and one with libp2p's defaults (128 KiB, 2 min), and whichever registers last
answers: a race, which the relay's p2pd wins by running its Go code on one thread (node/exchange/
host.py, "Circuit relays"), though not by construction. So the relay checks itself before it
prints its address: a probe host reserves a slot through it (at its listen address when it
announces others: `local_address`) and a second one sends it PROBE_BYTES, more than the default
allows; a relay that cuts them is restarted, up to MAX_STARTS times (then it runs with what it
has, and says so).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger("locoswarm.node")

EXIT_REFUSED = 2
LISTENING = "relay listening on "  # the line's prefix that scripts (tools/netlab) read the address from
PROBE_PROTOCOL = "/locoswarm/relay-probe/1"
PROBE_BYTES = 256 << 10  # twice libp2p's default allowance per relayed connection
MAX_STARTS = 6
PROBE_TIMEOUT_S = 30.0  # the probe host's reservation, then the transfer


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
    for start in range(1, MAX_STARTS + 1):
        p2p = await start_daemon(config, idle_timeout_s=0)
        try:
            local = await local_address(p2p, host_maddrs, announce_maddrs)
            carried = local is None or await probe(local)
        except BaseException:
            await p2p.shutdown()
            raise
        if local is None:
            log.warning(
                "relay: not checked: it listens on port 0 and announces other addresses, so the check cannot dial it"
            )
        if carried:
            break
        log.warning("relay: start %d relays at most libp2p's default 128 KiB per connection", start)
        if start < MAX_STARTS:
            await p2p.shutdown()
    else:
        log.warning("relay: running with libp2p's default limits after %d starts: packets over 128 KiB", MAX_STARTS)
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


async def local_address(relay, host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...]) -> str | None:
    """An address of `relay` (a started P2P) that this machine can listen beside and dial, with
    /p2p/<id>: the first it lists, unless it announces others (a public IP behind port forwarding,
    often no address of this machine); then its first listen address with an explicit port, an
    unspecified IP read as loopback. None: it listens on port 0 only (p2pd lists no real port)."""
    if not announce_maddrs:
        return str((await relay.get_visible_maddrs())[0])
    for maddr in host_maddrs:
        _, family, ip, transport, port = (maddr.split("/") + [""] * 5)[:5]
        if transport == "tcp" and port not in ("", "0"):
            ip = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
            return f"/{family}/{ip}/tcp/{port}/p2p/{relay.peer_id.to_base58()}"
    return None


async def probe(relay_maddr: str) -> bool:
    """Whether PROBE_BYTES pass through the relay at `relay_maddr` (ending in /p2p/<id>) on one
    relayed connection: a host reachable only through it (`relay_via`) counts what a second host
    sends it there."""
    from node.exchange.config import ExchangeConfig
    from node.exchange.host import start_daemon

    listen = relay_maddr.split("/tcp/")[0] + "/tcp/0"  # beside the relay: the probe needs no other network
    relayed = await start_daemon(ExchangeConfig(run_id="relay", host_maddrs=(listen,), relay_via=(relay_maddr,)))
    try:
        sender = await start_daemon(ExchangeConfig(run_id="relay", host_maddrs=(listen,)))
        try:
            return await asyncio.wait_for(_carried(relay_maddr, relayed, sender), PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            return False
        finally:
            await sender.shutdown()
    finally:
        await relayed.shutdown()


async def _carried(relay_maddr: str, relayed, sender) -> bool:
    from hivemind.p2p import PeerID

    from node.exchange.host import dial_addresses
    from node.exchange.reachability import circuit_address

    async def count(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while got < PROBE_BYTES and (chunk := await reader.read(1 << 16)):
            got += len(chunk)
        writer.write(got.to_bytes(8, "big"))
        await writer.drain()
        writer.close()

    await relayed.add_binary_stream_handler(PROBE_PROTOCOL, count)
    relay_id = relay_maddr.rpartition("/p2p/")[2]
    await relayed._client.connect(PeerID.from_base58(relay_id), dial_addresses(relay_id, [relay_maddr]))
    holder = relayed.peer_id.to_base58()
    while True:  # NO_RESERVATION until the relayed host's p2pd reserved a slot (seconds)
        try:
            await sender._client.connect(
                relayed.peer_id, dial_addresses(holder, [circuit_address(relay_maddr, holder)])
            )
            break
        except Exception:  # p2pd's ControlFailure: the circuit was refused
            await asyncio.sleep(0.5)
    _, reader, writer = await sender.call_binary_stream_handler(relayed.peer_id, PROBE_PROTOCOL)
    try:
        writer.write(bytes(PROBE_BYTES))
        await writer.drain()
        return int.from_bytes(await reader.readexactly(8), "big") == PROBE_BYTES
    finally:
        writer.close()
