"""The packet exchange over hivemind 1.1.12: a DHTNode for announcements, libp2p streams for bytes.

    exchange = await P2PExchange.create(ExchangeConfig(run_id="r1", initial_peers=(bootstrap,)))
    await exchange.publish(r, "peer-a", packet)             # serve + announce (protocol/dht_records.py schema)
    packets = await exchange.fetch(r, {"peer-b": digest_b})  # verified bytes, or left out
    await exchange.shutdown()                                # stops the DHT node and the p2pd child

`P2PExchange` implements `node.exchange.base.Exchange` by composing one part per concept, all in
the caller's asyncio loop:

    config.py        ExchangeConfig: the settings every part reads (imports none of them)
    host.py          the p2pd daemon and DHTNode, and the workarounds for hivemind's private API
    store.py         the copies held (whole, or still arriving and forwarded as they arrive), traffic
    announce.py      DHT records: announcing copies (batched) and looking holders up
    serve.py         the stream handler: upload slots, seed and child streams, queues, cut-through
    fetch.py         holder search with bans and busy queues, the download with its stall and rate checks
    push.py          a node nobody can dial hands its packet to a reachable holder; taking such pushes
    reachability.py  whether others can dial the addresses this node announces

The packet and push streams' wire formats are protocol/stream.py, the DHT records' protocol/dht_records.py.
A publisher serves its packet at once and announces it in the background; a fetcher that verified
a copy serves and announces it too, so a packet spreads as a tree of copies (serve.py, fetch.py).

hivemind's DHT and p2pd's control socket raise no typed errors (their own private classes,
assertions, msgpack's, EOF on a dead socket): each call into them is caught whole where a decision
is made (log and read again next pass, skip that holder, announce later), and nowhere else.

Fault-injection tests subclass `P2PExchange` and override `_serve` (the stream handler p2pd
calls) or `_payload_for` (the bytes served for a held packet, or for each unit of a snapshot).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from node.exchange.announce import Announcer
from node.exchange.base import MirrorCopy, Traffic
from node.exchange.config import ExchangeConfig
from node.exchange.fetch import PacketFetcher
from node.exchange.host import Host
from node.exchange.pace import Uplink
from node.exchange.push import AcceptPush, PushReceiver, push_packet
from node.exchange.reachability import Reachability, addresses_by_holder, assess_reachability, peers_to_dial
from node.exchange.serve import PacketServer
from node.exchange.spool import Spool
from node.exchange.store import Held, HeldSnapshot, PacketStore
from protocol.dht_records import PARAMS_ID, Announcement, holders_key, packets_key
from protocol.http import MAX_DIAL_PEERS
from protocol.packet import packet_digest
from protocol.stream import PUSH_PROTOCOL_NAME, PushOffer

if TYPE_CHECKING:
    from node.training.snapshot import Snapshot, SnapshotSink

log = logging.getLogger(__name__)

REANNOUNCE_FRACTION = 0.5  # a held snapshot's record is stored again after this share of its lifetime


class P2PExchange:
    """`node.exchange.Exchange` over hivemind; create with `await P2PExchange.create(config)`."""

    def __init__(self, config: ExchangeConfig, host: Host, maddrs: list[str]):
        self.config = config
        self._host = host
        self._background: set[asyncio.Task] = set()
        self._refreshers: set[asyncio.Task] = set()  # re-announcing held snapshots: not waited for, cancelled
        self._closed = False
        rng = random.Random()  # packet and holder order, and whom a busy answer names
        self._store = PacketStore(Spool(Path(config.spool_dir) if config.spool_dir is not None else None))
        self._announcer = Announcer(host.dht, config, host.holder_id, maddrs, self._spawn)
        self._uplink = Uplink.stated(config.uplink_mbps)  # served, forwarded and pushed bytes, in turn
        self._server = PacketServer(config, self._store, rng, self._payload_for, self._uplink)
        self._fetcher = PacketFetcher(config, host, self._store, self._announcer, rng)
        self._pushes = PushReceiver(config, self._store, self._announcer)

    @classmethod
    async def create(cls, config: ExchangeConfig) -> "P2PExchange":
        host = await Host.start(config)
        try:
            maddrs = await host.visible_maddrs()
            self = cls(config, host, maddrs)
            await host.serve(self._serve)
            await host.serve(self._pushes.handle, PUSH_PROTOCOL_NAME)
        except BaseException:
            await host.shutdown()
            raise
        log.info("exchange up: libp2p id %s at %s", self.holder_id, ", ".join(maddrs))
        return self

    @property
    def holder_id(self) -> str:
        """This node's libp2p peer id (base58): its subkey in holders records."""
        return self._host.holder_id

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) others dial; give one to new peers as their initial peer."""
        return list(self._announcer.maddrs)

    @property
    def daemon_pid(self) -> int | None:
        """Process id of this node's p2pd child."""
        return self._host.daemon_pid

    def traffic(self, round: int) -> Traffic:
        return self._store.traffic(round)

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, round: int, peer_id: str, data: bytes, announce: bool = True) -> Announcement:
        data = bytes(data)
        if not 0 < len(data) <= self.config.max_packet_bytes:
            raise ValueError(f"packet of {len(data)} bytes is empty or exceeds {self.config.max_packet_bytes}")
        digest = packet_digest(data)
        packets_key(self.config.run_id, round)
        holders_key(self.config.run_id, round, peer_id)  # fetchers must be able to announce copies under it
        self._store.held[(round, peer_id)] = Held(
            digest, await asyncio.to_thread(self._store.spool.keep, data), own=True
        )
        self._store.notify_copy()
        if announce:
            await self.announce(round, peer_id)
        return self._announcer.announcement(peer_id, round, digest, len(data))

    async def announce(self, round: int, peer_id: str) -> None:
        held = self._store.held.get((round, peer_id))
        if not isinstance(held, Held):
            raise KeyError(f"no packet of {peer_id} for round {round} published here")
        record = self._announcer.record(held.digest, len(held.data))
        # Announced beside the round, not before it: fetchers start from the addresses in the
        # coordinator's manifest and need the DHT only for other holders, or without a manifest.
        self._spawn(self._announcer.announce_packet(packets_key(self.config.run_id, round), record, peer_id, round))

    async def announcements(self, round: int) -> dict[str, Announcement]:
        return await self._announcer.announcements(round)

    async def holders(self, round: int, publisher: str) -> list[Announcement]:
        """Extra holders that announced a verified copy of `publisher`'s packet for `round`."""
        return await self._announcer.holders(round, publisher)

    # -- fetching -----------------------------------------------------------------------------

    async def fetch(
        self,
        round: int,
        wanted: dict[str, str],
        holders_hint: dict[str, list[str]] | None = None,
        timeout_s: float = 60,
        parents: dict[str, list[str]] | None = None,
        mirrors: dict[str, MirrorCopy] | None = None,
        pushed_here: Collection[str] = (),
        suspects: Collection[str] = (),
    ) -> dict[str, bytes]:
        """The wanted packets ({publisher: digest}) that some holder served and that verified.

        `holders_hint` names holders to try before asking the DHT (a manifest's addresses);
        `parents` names one holder per packet to ask first, waiting in its queue and for its copy
        to start arriving (this node's parent in the packet's distribution tree, node.exchange.
        tree_parent); without a parent, or if it fails, the search goes on as without one.
        `mirrors` names a packet's copy in the packet mirror, asked beside the peers once they
        have not delivered within `mirror_after_s`. `pushed_here`: publishers whose push to this
        node is awaited first (`push_grace_s` to start; node/exchange/fetch.py). `suspects`:
        publishers whose packet is given up once no copy of it arrives (node/exchange/fetch.py).
        """
        return await self._fetcher.fetch(
            round, wanted, holders_hint, timeout_s, parents, mirrors, pushed_here, suspects
        )

    # -- pushing (node/exchange/push.py) -----------------------------------------------------

    async def push(self, round: int, publisher: str, targets: list[list[str]], timeout_s: float = 30.0) -> str | None:
        held = self._store.held.get((round, publisher))
        if not isinstance(held, Held):
            raise KeyError(f"no packet of {publisher} for round {round} published here")
        holders = [
            (holder, addrs)
            for maddrs in targets
            for holder, addrs in addresses_by_holder(maddrs).items()
            if holder != self.holder_id
        ]
        offer = PushOffer(
            run=self.config.run_id, round=round, publisher=publisher, digest=held.digest, size=len(held.data)
        )
        data = self._payload_for(round, publisher, bytes(held.data))
        # Downloads, but packets' first copies, hold back meanwhile (PacketStore.first_copy_pending).
        with self._store.sending_first_copy((round, publisher)):
            holder = await push_packet(
                self._host,
                self.config,
                self.traffic(round),
                offer,
                data,
                holders,
                timeout_s,
                self._uplink,
                self.config.fetch_stripes,
            )
            if holder is not None:
                self._store.first_copy_out((round, publisher))
            return holder

    def accept_pushes(self, accept: AcceptPush | None) -> None:
        self._pushes.accept = accept

    def set_members(self, holder_ids: Collection[str] | None) -> None:
        self._server.members = None if holder_ids is None else frozenset(holder_ids)

    # -- serving ------------------------------------------------------------------------------

    def _payload_for(self, round: int, publisher: str, data: bytes) -> bytes:
        """The bytes served for a held packet; fault-injection tests override this."""
        return data

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The packet-stream handler p2pd calls; fault-injection tests override this."""
        await self._server.handle(stream_info, reader, writer)

    # -- parameter snapshots ----------------------------------------------------------------------

    async def publish_params(self, round: int, snapshot: Snapshot) -> Announcement:
        """Serve a snapshot of the parameters that start `round`, for peers catching up.

        Snapshots are held under the reserved publisher id `PARAMS_ID`, read unit by unit as they
        are served (serve.py, on upload slots of their own), and announced only as holder records
        (key ".../round/R/holders/params", subkey this node's libp2p id), so a round's packet
        announcements stay packets only; a peer that loaded a snapshot publishes its own (several
        donors, swarming). The record is stored again every half `announce_ttl_s` while the
        snapshot is held. Raises AnnounceFailed (node.exchange.announce) if no DHT node stored
        the record the first time.
        """
        held = HeldSnapshot(snapshot.digest, snapshot, own=True)
        self._store.hold_snapshot((round, PARAMS_ID), held)
        await self._announcer.announce_params(round, self._announcer.record(snapshot.digest, snapshot.size_bytes))
        refresher = asyncio.create_task(self._keep_announced(round, held))
        self._refreshers.add(refresher)
        refresher.add_done_callback(self._refreshers.discard)
        return self._announcer.announcement(PARAMS_ID, round, snapshot.digest, snapshot.size_bytes)

    async def _keep_announced(self, round: int, held: HeldSnapshot) -> None:
        """Store the snapshot's record again every half `announce_ttl_s` while this node still
        serves that snapshot (a durable one lasts as long as its checkpoint is the newest): a
        record left to expire would hide the holder from peers catching up later."""
        while True:
            await asyncio.sleep(self.config.announce_ttl_s * REANNOUNCE_FRACTION)
            if self._store.held.get((round, PARAMS_ID)) is not held:
                return
            await self._reannounce(round, held)

    async def _reannounce(self, round: int, held: HeldSnapshot) -> None:
        try:
            await self._announcer.announce_params(round, self._announcer.record(held.digest, held.source.size_bytes))
        except Exception as e:  # AnnounceFailed, or the DHT is away for a moment: the next pass tries again
            log.info("round %d: re-announcing the parameter snapshot failed: %r", round, e)

    async def params_holders(self, round: int) -> list[Announcement]:
        """Every announced snapshot of the parameters that start `round` (digests may differ)."""
        return await self.holders(round, PARAMS_ID)

    async def fetch_params(self, round: int, digest: str, sink: SnapshotSink, timeout_s: float = 120.0) -> bool:
        """Receive the snapshot for `round` named `digest` into `sink`, from any holders (resuming
        at the next one where one fails); True once all of it verified and is written."""
        return await self._fetcher.fetch_snapshot(round, digest, sink, timeout_s)

    async def dial_peers(self, targets: list[list[str]]) -> list[str]:
        """Connection reversal: connect to the peers loading a snapshot that the coordinator lists
        (`targets`, each a peer's multiaddrs), at most `MAX_DIAL_PEERS` of them, never this node;
        they then open their snapshot streams over these connections. The libp2p ids that answered."""
        picked = peers_to_dial(targets, self.holder_id, MAX_DIAL_PEERS)
        if not picked:
            return []
        maddrs = [m for addrs in picked.values() for m in addrs]
        answered = await self._host.dial(maddrs, self.config.bootstrap_timeout_s, what="connection reversal")
        reached = sorted({m.rpartition("/p2p/")[2] for m in answered})
        log.info(
            "connection reversal: dialled %d peer(s) loading a snapshot, %d answered: %s",
            len(picked),
            len(reached),
            ", ".join(reached) or "none",
        )
        return reached

    # -- the DHT's membership ------------------------------------------------------------------

    @property
    def dht_peers(self) -> set[str]:
        """libp2p ids of the DHT nodes this node knows (its routing table); empty: a DHT of its own."""
        return self._host.dht_peers

    async def rejoin_dht(self, maddrs: list[str]) -> list[str]:
        """Enter the DHT of the peers at `maddrs` that this node's routing table lacks (a DHT split
        into islands after a whole-swarm restart: host.py), each given `bootstrap_timeout_s`; the
        libp2p ids that joined. With any new, the parameter snapshots held here are announced
        again at once, so that the peers just met find them."""
        joined = await self._host.rejoin(maddrs, self.config.bootstrap_timeout_s)
        if joined:
            snapshots = [(k[0], c) for k, c in self._store.held.items() if isinstance(c, HeldSnapshot)]
            await asyncio.gather(*(self._reannounce(round, held) for round, held in snapshots))
        return joined

    # -- lifecycle ----------------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def wait_background(self) -> None:
        """Wait for pending holder announcements (tests and benchmarks; the round loop need not)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def forget_before(self, round: int, keep_publisher: str | None = None) -> None:
        self._store.forget_before(round, keep_publisher)
        self._pushes.min_round = max(self._pushes.min_round, round)  # pushes are others' packets

    async def reachability_check(self) -> Reachability:
        maddrs = await self._host.visible_maddrs(latest=True)
        self._announcer.maddrs = maddrs
        return assess_reachability(maddrs)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in [*self._background, *self._refreshers]:
            task.cancel()
        await asyncio.gather(*self._background, *self._refreshers, return_exceptions=True)
        await self._host.shutdown()  # the DHT node, then p2pd (waits for it to exit)
        self._store.clear()
