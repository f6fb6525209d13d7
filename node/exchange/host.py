"""The libp2p daemon and DHT node the exchange runs on, and what hivemind 1.1.12 does not do for us.

    host = await Host.start(config)                  # p2pd child process + DHTNode, in this loop
    await host.serve(handler)                        # the packet stream (protocol/stream.py)
    await host.connect(peer, dial_addresses(holder_id, maddrs))
    reader, writer = await host.open_stream(peer)
    await host.shutdown()                            # stops the DHT node, then p2pd

Everything runs in the caller's asyncio loop: one `hivemind.p2p.P2P` (which starts and owns one
p2pd libp2p daemon process) and one `hivemind.dht.DHTNode` on top of it. Not the `hivemind.DHT`
wrapper: it runs the node in a forked process and passes values through a pipe, which crashes on
values above ~16 KB; in-loop, nothing is pickled and the daemon is a child of the node process.

Things hivemind 1.1.12 does not do for us, and how this module copes:

- `P2P` has no public `connect()`: the daemon client's is used, once per holder, to hand p2pd the
  holder's announced addresses; p2pd refuses addresses that still end in /p2p/<id> (the error
  reads "length greater than remaining number of bytes in buffer"), so that suffix is stripped.
- `P2P.create` turns UPnP/NAT-PMP on by default, which multicasts on the LAN; it is left off when
  every listen address is loopback (tests, local swarms).
- hivemind's msgpack serializer writes tuples as an extension type a plain msgpack reader does
  not know; records are built from lists only (protocol/dht_records.py).
- The p2pd pid is only reachable through `P2P._child` (`daemon_pid`, for tests that check it dies).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from node.exchange.reachability import is_loopback
from protocol.stream import PROTOCOL_NAME

if TYPE_CHECKING:
    from node.exchange.p2p import ExchangeConfig

StreamHandler = Callable[..., Awaitable[None]]  # (stream_info, reader, writer)


class Host:
    """One p2pd daemon (through `hivemind.P2P`) and one `DHTNode` on it; start with `Host.start`."""

    def __init__(self, p2p: P2P, dht: DHTNode):
        self.p2p, self.dht = p2p, dht

    @classmethod
    async def start(cls, config: ExchangeConfig) -> Host:
        loopback_only = all(is_loopback(Multiaddr(m)) for m in config.host_maddrs)
        nat_port_map = (not loopback_only) if config.nat_port_map is None else config.nat_port_map
        p2p = await P2P.create(
            initial_peers=list(config.initial_peers) or None,
            host_maddrs=list(config.host_maddrs),
            announce_maddrs=list(config.announce_maddrs) or None,
            use_relay=config.use_relay,
            use_auto_relay=config.use_auto_relay,
            dht_mode="client" if config.client_mode else "server",
            nat_port_map=nat_port_map,
            startup_timeout=config.startup_timeout_s,
        )
        try:
            dht = await DHTNode.create(
                p2p=p2p, initial_peers=list(config.initial_peers) or None, client_mode=config.client_mode,
                wait_timeout=config.dht_wait_timeout_s,
            )
        except BaseException:
            await p2p.shutdown()
            raise
        return cls(p2p, dht)

    @property
    def holder_id(self) -> str:
        """This node's libp2p peer id (base58)."""
        return self.p2p.peer_id.to_base58()

    @property
    def daemon_pid(self) -> int | None:
        """Process id of this node's p2pd child (hivemind keeps it in a private attribute)."""
        child = getattr(self.p2p, "_child", None)
        return child.pid if child is not None else None

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """The multiaddrs (with /p2p/<id>) p2pd says others can dial; `latest` asks it again."""
        return [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]

    async def serve(self, handler: StreamHandler) -> None:
        """Answer packet streams (PROTOCOL_NAME) with `handler(stream_info, reader, writer)`."""
        await self.p2p.add_binary_stream_handler(PROTOCOL_NAME, handler)

    async def connect(self, peer: PeerID, maddrs: list[Multiaddr]) -> None:
        """Tell p2pd where `peer` listens. P2P has no public connect(); the daemon client's does it."""
        await self.p2p._client.connect(peer, maddrs)

    async def open_stream(self, peer: PeerID) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A packet stream to `peer` (p2pd dials it if needed)."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer, PROTOCOL_NAME)
        return reader, writer

    async def shutdown(self) -> None:
        try:
            await self.dht.shutdown()
        finally:
            await self.p2p.shutdown()  # terminates p2pd and waits for it to exit


def dial_addresses(holder_id: str, maddrs: list[str]) -> list[Multiaddr]:
    """A holder's announced multiaddrs as p2pd takes them: it takes the peer id separately and
    refuses addresses that still end in /p2p/<id>."""
    suffix = f"/p2p/{holder_id}"
    return [Multiaddr(m.removesuffix(suffix)) for m in maddrs]
