"""The packet exchange over hivemind 1.1.12: a DHTNode for announcements, libp2p streams for bytes.

    exchange = await P2PExchange.create(ExchangeConfig(run_id="r1", initial_peers=(bootstrap,)))
    await exchange.publish(r, "peer-a", packet)             # serve + announce (protocol/dht_records.py schema)
    packets = await exchange.fetch(r, {"peer-b": digest_b})  # verified bytes, or left out
    await exchange.shutdown()                                # stops the DHT node and the p2pd child

Everything runs in the caller's asyncio loop: one `hivemind.p2p.P2P` (which starts and owns one
p2pd libp2p daemon process) and one `hivemind.dht.DHTNode` on top of it. Not the `hivemind.DHT`
wrapper: it runs the node in a forked process and passes values through a pipe, which crashes on
values above ~16 KB; in-loop, nothing is pickled and the daemon is a child of the node process.

DHT records follow the schema in protocol/dht_records.py (packets key per round, holders key per
publisher), written with `DHTNode.store(key, value, expiration, subkey=...)` and read with
`latest=True` (`sufficient_expiration_time=inf`), so that the subkeys held by every node near the
key are merged; a plain get stops at the first non-expired copy, which may be this node's own
partial dictionary. `fetch` reads the packets key and every wanted publisher's holders key in one
batched `get_many`, and copies verified together are announced in one `store_many`: on a busy
host each DHT traversal costs tens of milliseconds of every node's CPU.

Packet stream, protocol "locoswarm.packet.v1" (a libp2p stream opened through the daemon):

    request   u32 big-endian length L (at most 1024), then L bytes of msgpack map
              {"run": str, "round": int, "peer": str (publisher peer id), "digest": hex str,
               "wait": bool (optional; true: queue for an upload slot rather than be answered busy),
               "child": bool (optional; true: the fetcher is the holder's child in the packet's
                              tree, served on one of MAX_CHILD_STREAMS streams beside the slots)}
    response  u8 status, u64 big-endian length N, then N bytes:
              status 0: the packet bytes (written in `chunk_bytes` pieces, 512 KiB by default)
              status 1: a UTF-8 error message (N at most 512), e.g. "not held"
              status 2: busy: every upload slot is taken; N bytes (at most 512) of msgpack list
                        of up to 8 libp2p peer ids (base58) with a copy: those that confirmed a
                        verified one first, then those it is being sent to now
    receipt   after status 0, the fetcher sends one byte 0x01 once the bytes hash to the digest; the
              holder keeps the upload slot until it reads it (or EOF, or `stall_timeout_s`)

A holder answers only for a packet it holds with exactly the requested digest; a request that is
malformed, for another run, or for a packet not held gets an error frame, and one that does not
arrive within `request_timeout_s` just closes the stream; the handler never raises. The fetcher
refuses a length that differs from the announced size (or exceeds `max_packet_bytes`)
before buffering, hashes while reading, drops a holder that stalls for `stall_timeout_s` or
trickles (under `min_rate_bytes_per_s` for `stall_timeout_s` while no other download runs), and on a
digest mismatch bans that holder for this fetch and tries the next one. A verified copy is kept,
served, and announced under the holders key, so later fetchers spread their load over it.

Swarming: a holder serves at most `max_uploads` streams at once, so each gets a fair share of its
uplink, and answers further requests "busy" with the peers that confirmed a verified copy. One
exception: a publisher whose packet nobody has confirmed yet serves it on up to SEED_STREAMS
extra streams, so that a fresh packet (the last one submitted is on every peer's critical path)
starts its tree at once instead of queueing behind copies of older packets this node forwards. A slot
is held until the fetcher's receipt, not until the bytes left the process: p2pd and the kernel
buffer hundreds of kilobytes, so "written" says little about "received". The
fetcher tries those at once (they hold verified copies, or will in a moment), so a packet spreads
as a tree, each copy feeding the next, instead of every peer pulling it through the publisher's
uplink at 1/(N-1) of its rate. When every holder it asked is busy, it asks one of them again with
"wait", and waits in that holder's queue (first come, first served, up to `request_timeout_s`)
for the next free slot; a holder with nobody to name queues every request the same way. Only a
queue that times out sends the fetcher into a short pause (`busy_pause_s`, doubling). Busy
answers followed by pauses had left the download link idle between transfers. The tree is cut-through: a peer asked for a packet it
is still receiving sends each piece on as it arrives, holding back the last byte until the whole
packet hashed to its digest; if its own copy fails, the onward stream ends short, and the
fetcher (which never saw a bad byte count as a whole packet) tries another holder without
banning this one. So a hop costs a piece's latency, not a whole packet's transfer time.

Trees: a caller that knows the round's members passes each packet's parent (node.exchange.
tree_parent), which the fetch asks first, as a "child", waiting in its queue. A holder asked for a
packet it does not have yet waits for its own copy to start arriving while it fetches that packet
(up to `request_timeout_s`), and up to WANT_GRACE_S for it to start fetching: children learn of a
packet at about the moment their parent does. A parent that fails sends the fetch on to the
search above.

Things hivemind 1.1.12 does not do for us, and how this module copes:

- `P2P` has no public `connect()`: the daemon client's is used, once per holder, to hand p2pd the
  holder's announced addresses; p2pd refuses addresses that still end in /p2p/<id> (the error
  reads "length greater than remaining number of bytes in buffer"), so that suffix is stripped.
- `P2P.create` turns UPnP/NAT-PMP on by default, which multicasts on the LAN; it is left off when
  every listen address is loopback (tests, local swarms).
- hivemind's msgpack serializer writes tuples as an extension type a plain msgpack reader does
  not know; records are built from lists only.
- The p2pd pid is only reachable through `P2P._child` (`daemon_pid`, for tests that check it dies).

NAT: `use_relay` (on by default, as in hivemind) lets this node reach peers through libp2p relays;
`use_auto_relay` makes a node behind NAT reachable through one; `client_mode` joins the DHT without
serving DHT requests (for nodes nobody can dial). `reachability_check()` says in plain words
whether the addresses others would dial are public.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import random
import struct
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from protocol.dht_records import PARAMS_ID, Announcement, holders_key, make_record, packets_key, parse_record
from protocol.errors import MalformedPacket, OversizedPacket, ProtocolError, WrongRound
from protocol.packet import DEFAULT_MAX_PACKET_BYTES, packet_digest

log = logging.getLogger(__name__)

HANDLER_NAME = "locoswarm.packet.v1"
REQUEST_PREFIX = struct.Struct(">I")
RESPONSE_HEADER = struct.Struct(">BQ")
STATUS_OK, STATUS_ERROR, STATUS_BUSY = 0, 1, 2
RECEIPT = b"\x01"  # the fetcher's "verified" after a packet
MAX_BUSY_NAMES = 8  # peers named in a busy answer
WANT_GRACE_S = 1.0  # how long a request for a packet this node does not have waits for it to want it
MAX_CHILD_STREAMS = 16  # streams to tree children served at once, beside the upload slots
SEED_STREAMS = 2  # streams a publisher may add beyond max_uploads for its packet's first copies
MAX_REQUEST_BYTES = 1024
MAX_ERROR_BYTES = 512
REQUEST_KEYS = frozenset({"run", "round", "peer", "digest"})
OPTIONAL_REQUEST_KEYS = frozenset({"wait", "child"})


class DigestMismatch(ProtocolError):
    """A holder sent bytes whose sha256 is not the digest asked for."""


class HolderBusy(Exception):
    """Every upload slot of the holder is taken; `holders` are peers it already sent the packet to."""

    def __init__(self, holders: list[str]):
        super().__init__(f"busy; try {len(holders)} other holders")
        self.holders = holders


class HolderRefused(ProtocolError):
    """A holder answered with an error frame (it does not hold the packet, or refused the request)."""


class AnnounceFailed(RuntimeError):
    """No DHT node accepted this node's announcement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeConfig:
    """How a node joins the swarm and moves packets."""

    run_id: str  # DHT keys are scoped by run
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where p2pd listens; a public node: /ip4/0.0.0.0/tcp/PORT
    announce_maddrs: tuple[str, ...] = ()  # addresses to advertise instead (explicit ports), e.g. behind port forwarding
    initial_peers: tuple[str, ...] = ()  # bootstrap multiaddrs with /p2p/<id>; empty starts a new swarm
    use_relay: bool = True  # may reach peers through libp2p circuit relays
    use_auto_relay: bool = False  # behind NAT: find a relay and become reachable through it
    client_mode: bool = False  # join the DHT without serving DHT requests
    nat_port_map: bool | None = None  # UPnP/NAT-PMP; None = on unless every host address is loopback
    announce_ttl_s: float = 600.0  # DHT records expire this long after publication (a few rounds)
    max_parallel_fetches: int = 3  # packets transferred at once, over all fetch() calls
    max_uploads: int = 2  # streams served at once; further requests are answered busy, or queue
    busy_pause_s: float = 0.05  # with every known holder busy, ask again after this (doubling to 0.4 s)
    chunk_bytes: int = 512 << 10  # stream write size
    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES  # refuse larger packets before buffering them
    connect_timeout_s: float = 10.0  # dial, open the stream and receive the response header
    stall_timeout_s: float = 10.0  # a holder silent this long mid-transfer is dropped
    # ...and one that sends less than this on average for stall_timeout_s while its stream is the
    # only download in progress here (a trickle that never falls silent would otherwise hold the
    # fetch until the round's time-out; with other downloads beside it, a slow stream may just be
    # sharing the link)
    min_rate_bytes_per_s: float = 16 << 10
    request_timeout_s: float = 5.0  # a server waits this long for a request
    holder_refresh_s: float = 1.0  # with every holder failed, re-read the DHT for new holders this often
    holder_batch_s: float = 0.05  # verified copies are announced together after this pause
    startup_timeout_s: float = 30.0  # p2pd start-up
    dht_wait_timeout_s: float = 3.0  # one DHT RPC

    def __post_init__(self):
        packets_key(self.run_id, 0)  # raises ValueError for a run id that cannot be part of a key
        if not self.host_maddrs:
            raise ValueError("host_maddrs must name at least one address to listen on")
        if min(self.max_parallel_fetches, self.max_uploads, self.chunk_bytes, self.max_packet_bytes) < 1:
            raise ValueError("max_parallel_fetches, max_uploads, chunk_bytes and max_packet_bytes must be positive")
        if min(self.announce_ttl_s, self.connect_timeout_s, self.stall_timeout_s, self.request_timeout_s) <= 0:
            raise ValueError("time-outs and the announcement lifetime must be positive")
        if self.min_rate_bytes_per_s < 0:
            raise ValueError("min_rate_bytes_per_s must be >= 0 (0: no floor)")


@dataclass(slots=True)
class Traffic:
    """Stream payload bytes this node moved for one round (failed transfers included)."""

    downloaded_bytes: int = 0
    uploaded_bytes: int = 0
    num_fetched: int = 0  # verified packets obtained from others
    num_served: int = 0  # complete packets sent to others
    fetch_spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each packet fetched

    def fetching_s(self) -> float:
        """Wall time during which at least one of the round's packets was being fetched (lookups,
        dials and transfers included): the time the download link had work."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self.fetch_spans):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total


@dataclass(frozen=True, slots=True)
class Reachability:
    maddrs: list[str]  # what this node announces
    public_maddrs: list[str]  # the subset on globally routable IPs
    relayed: bool  # announces a /p2p-circuit address
    loopback_only: bool
    reachable: bool  # can a peer on another network plausibly dial us
    advice: str


@dataclass(slots=True)
class _Held:
    digest: str
    data: bytes
    sent_to: list[str] = field(default_factory=list)  # libp2p ids of peers that confirmed all of it
    receiving: list[str] = field(default_factory=list)  # libp2p ids of peers being sent it now
    own: bool = False  # published by this node


@dataclass(slots=True)
class _Partial:
    """A packet still arriving, served onward as it arrives (cut-through).

    Its last byte is held back from every onward stream until the whole packet hashed to its
    digest, so a copy that fails here ends those streams short (the receivers try another
    holder) instead of handing them bad bytes that would get this honest peer banned.
    """

    digest: str
    length: int
    buffer: bytearray = field(default_factory=bytearray)
    sent_to: list[str] = field(default_factory=list)  # shared with the _Held that replaces it
    receiving: list[str] = field(default_factory=list)
    verified: bool = False
    failed: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # replaced at every notify

    def servable(self) -> int:
        """Bytes that may go onward now."""
        return len(self.buffer) if self.verified else min(len(self.buffer), self.length - 1)

    def notify(self) -> None:
        self.arrived.set()
        self.arrived = asyncio.Event()


@dataclass(slots=True)
class _FetchState:
    round: int
    publisher: str
    digest: str
    size_bytes: int | None  # from an announcement; None: unknown, bounded by max_packet_bytes
    banned: set[str] = field(default_factory=set)  # holders that sent bad bytes


class P2PExchange:
    """`node.exchange.Exchange` over hivemind; create with `await P2PExchange.create(config)`."""

    def __init__(self, config: ExchangeConfig, p2p: P2P, dht: DHTNode, maddrs: list[str]):
        self.config = config
        self._p2p, self._dht, self._maddrs = p2p, dht, maddrs
        self._held: dict[tuple[int, str], _Held] = {}
        self._partial: dict[tuple[int, str], _Partial] = {}  # packets arriving now, served as they arrive
        self._wanted: Counter[tuple[int, str, str]] = Counter()  # (round, publisher, digest) being fetched
        self._copy_added = asyncio.Event()  # replaced each time a copy (whole or arriving) is added
        self._traffic: dict[int, Traffic] = {}
        self._background: set[asyncio.Task] = set()
        self._closed = False
        self._rng = random.Random()  # holder order; tests replace it to force an order
        self._dialed: set[str] = set()  # holders p2pd has addresses for (dialing costs a daemon round trip)
        self._pending_holders: list[tuple[str, dict]] = []  # holders records not yet stored
        self._flusher: asyncio.Task | None = None
        self._fetch_slots = asyncio.Semaphore(config.max_parallel_fetches)  # shared by every fetch() call
        self._uploads = 0  # streams being served now (at most config.max_uploads)
        self._upload_queue: deque[asyncio.Future] = deque()  # requests waiting for a slot, oldest first
        self._child_uploads = 0  # streams to tree children now (at most MAX_CHILD_STREAMS)
        self._downloads = 0  # packet bodies being read now
        self._addresses: dict[str, list[str]] = {}  # libp2p id -> multiaddrs, from hints and announcements

    @classmethod
    async def create(cls, config: ExchangeConfig) -> "P2PExchange":
        loopback_only = all(_is_loopback(Multiaddr(m)) for m in config.host_maddrs)
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
        dht = None
        try:
            dht = await DHTNode.create(
                p2p=p2p, initial_peers=list(config.initial_peers) or None, client_mode=config.client_mode,
                wait_timeout=config.dht_wait_timeout_s,
            )
            maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
            self = cls(config, p2p, dht, maddrs)
            await p2p.add_binary_stream_handler(HANDLER_NAME, self._serve)
        except BaseException:
            if dht is not None:
                await dht.shutdown()
            await p2p.shutdown()
            raise
        log.info("exchange up: libp2p id %s at %s", self.holder_id, ", ".join(maddrs))
        return self

    @property
    def holder_id(self) -> str:
        """This node's libp2p peer id (base58): its subkey in holders records."""
        return self._p2p.peer_id.to_base58()

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) others dial; give one to new peers as their initial peer."""
        return list(self._maddrs)

    @property
    def daemon_pid(self) -> int | None:
        """Process id of this node's p2pd child (hivemind keeps it in a private attribute)."""
        child = getattr(self._p2p, "_child", None)
        return child.pid if child is not None else None

    def traffic(self, round: int) -> Traffic:
        return self._traffic.setdefault(round, Traffic())

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, round: int, peer_id: str, data: bytes) -> Announcement:
        data = bytes(data)
        if not 0 < len(data) <= self.config.max_packet_bytes:
            raise ValueError(f"packet of {len(data)} bytes is empty or exceeds {self.config.max_packet_bytes}")
        digest = packet_digest(data)
        key = packets_key(self.config.run_id, round)
        holders_key(self.config.run_id, round, peer_id)  # fetchers must be able to announce copies under it
        self._held[(round, peer_id)] = _Held(digest, data, own=True)
        self._notify_copy()
        record = make_record(digest, len(data), self._maddrs, self.holder_id)
        # Announced beside the round, not before it: fetchers start from the addresses in the
        # coordinator's manifest and need the DHT only for other holders, or without a manifest.
        self._spawn(self._announce(key, record, peer_id, round))
        return Announcement(peer_id, round, digest, len(data), list(self._maddrs), self.holder_id)

    async def _announce(self, key: str, record: dict, peer_id: str, round: int) -> None:
        try:
            stored = await self._dht.store(key, record, get_dht_time() + self.config.announce_ttl_s, subkey=peer_id)
        except Exception as e:  # the packet is still held and served; only DHT readers miss it
            stored = False
            log.debug("announcing %s's packet failed: %r", peer_id, e)
        if not stored:
            log.warning("round %d: no DHT node stored the announcement of %s's packet; peers reach it through "
                        "the coordinator's manifest", round, peer_id)

    async def announcements(self, round: int) -> dict[str, Announcement]:
        return {a.peer_id: a for a in await self._read(packets_key(self.config.run_id, round), round, None)}

    async def holders(self, round: int, publisher: str) -> list[Announcement]:
        """Extra holders that announced a verified copy of `publisher`'s packet for `round`."""
        return await self._read(holders_key(self.config.run_id, round, publisher), round, publisher)

    async def _read(self, key: str, round: int, publisher: str | None) -> list[Announcement]:
        return self._parse_found(key, await self._dht.get(key, latest=True), round, publisher)

    def _parse_found(self, key: str, found, round: int, publisher: str | None) -> list[Announcement]:
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, entry in found.value.items():
            try:
                out.append(parse_record(publisher or subkey, round, entry.value, self.config.max_packet_bytes))
            except ProtocolError as e:  # one bad record costs its writer, not the round
                log.warning("skipping DHT record %s[%r]: %s", key, subkey, e)
        return out

    # -- fetching -----------------------------------------------------------------------------

    async def fetch(
        self, round: int, wanted: dict[str, str], holders_hint: dict[str, list[str]] | None = None,
        timeout_s: float = 60, parents: dict[str, list[str]] | None = None,
    ) -> dict[str, bytes]:
        """The wanted packets ({publisher: digest}) that some holder served and that verified.

        `holders_hint` names holders to try before asking the DHT (a manifest's addresses);
        `parents` names one holder per packet to ask first, waiting in its queue and for its copy
        to start arriving (this node's parent in the packet's distribution tree, node.exchange.
        tree_parent); without a parent, or if it fails, the search goes on as without one.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        result = {p: h.data for p, d in wanted.items() if (h := self._held.get((round, p))) and h.digest == d}
        todo = {p: d for p, d in wanted.items() if p not in result}
        if not todo:
            return result
        run_id = self.config.run_id
        keys: dict[str | None, str] = {None: packets_key(run_id, round)}
        for publisher in list(todo):
            try:
                keys[publisher] = holders_key(run_id, round, publisher)
            except ValueError as e:  # cannot be announced under that id, so nobody can serve it
                log.warning("round %d: leaving out %r: %s", round, publisher, e)
                del todo[publisher]
        # One batched DHT search for the round's announcements and every wanted packet's extra
        # holders, made only when some packet needs it: one with hinted holders (the manifest's
        # addresses) starts at once and asks the DHT only if they fail.
        lookup_task: asyncio.Future | None = None

        def lookup() -> asyncio.Future:
            nonlocal lookup_task
            if lookup_task is None:
                lookup_task = asyncio.ensure_future(self._lookup(keys, round, deadline))
            return lookup_task

        for maddrs in [*(holders_hint or {}).values(), *(parents or {}).values()]:  # to reach peers named later
            self._addresses.update(_addresses_by_holder(maddrs))

        async def one(publisher: str, digest: str) -> bytes | None:
            state = _FetchState(round, publisher, digest, None)
            hints = _hinted_holders((holders_hint or {}).get(publisher, []), state)
            parent = next(iter(_hinted_holders((parents or {}).get(publisher, []), state)), None)
            started = loop.time()
            log.debug("round %d: fetching %s's packet, parent %s", round, publisher,
                      parent.holder[-8:] if parent else None)
            try:
                data = await asyncio.wait_for(self._fetch_one(state, hints, lookup, deadline, parent),
                                              timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.warning("round %d: no holder served %s's packet within %.1f s", round, publisher, timeout_s)
                return None
            self.traffic(round).fetch_spans.append((started, loop.time()))
            return data

        # Each fetcher takes the packets in its own random order, so that the first wave of
        # max_parallel_fetches transfers does not hit the same few publishers from every peer.
        order = self._rng.sample(list(todo.items()), len(todo))
        try:
            fetched = await asyncio.gather(*(one(p, d) for p, d in order))
        finally:
            if lookup_task is not None:
                lookup_task.cancel()
        result |= {p: data for (p, _), data in zip(order, fetched) if data is not None}
        return result

    async def _lookup(self, keys: dict[str | None, str], round: int, deadline: float):
        """The round's announcements by publisher, and each wanted publisher's extra holders."""
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(
                self._dht.get_many(list(keys.values()), sufficient_expiration_time=float("inf")),
                timeout=max(0.0, deadline - loop.time()))
        except Exception as e:  # a failed lookup leaves the hinted holders, not an error
            log.warning("round %d: reading the DHT failed (%r); trying hinted holders only", round, e)
            found = {}
        announced = {a.peer_id: a for a in self._parse_found(keys[None], found.get(keys[None]), round, None)}
        extra = {p: self._parse_found(k, found.get(k), round, p) for p, k in keys.items() if p is not None}
        return announced, extra

    async def _fetch_one(self, state: _FetchState, hints: list[Announcement], lookup: Callable[[], asyncio.Future],
                         deadline: float, parent: Announcement | None = None) -> bytes:
        """Try the parent, the hinted holders, then those the DHT knows and those busy holders name,
        re-reading the DHT for new ones, until one serves or the caller times out."""
        loop = asyncio.get_running_loop()
        known = {h.holder: h for h in hints}
        key = (state.round, state.publisher, state.digest)
        self._wanted[key] += 1  # a tree child asking us for it waits for our copy
        try:
            if parent is not None and parent.holder != self.holder_id:
                # No fetch slot: the tree gives each packet one stream into this node.
                outcome = await self._try_holder(parent, state, deadline, wait=True, child=True)
                if isinstance(outcome, bytes):
                    return self._fetched(state, outcome)
                if isinstance(outcome, HolderBusy):
                    for name in outcome.holders:
                        known.setdefault(name, self._holder_named(name, state))
            return await self._search(state, known, lookup, deadline)
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]

    def _fetched(self, state: _FetchState, data: bytes) -> bytes:
        """A verified packet, held and served from now on (_download); its copy announced."""
        self.traffic(state.round).num_fetched += 1
        self._announce_holder(state, len(data))
        return data

    async def _search(self, state: _FetchState, known: dict[str, Announcement], lookup: Callable[[], asyncio.Future],
                      deadline: float) -> bytes:
        loop = asyncio.get_running_loop()
        hints = list(known.values())
        ann, looked_up, passes, busy_pause_s = None, False, 0, self.config.busy_pause_s

        def take_announcement(found: Announcement | None) -> Announcement | None:
            """The publisher's own record: its size bounds the download, and it is a holder."""
            if found is not None and found.digest == state.digest:
                state.size_bytes = found.size_bytes
                known.setdefault(found.holder, found)
            return found

        while True:
            if not looked_up and (passes or not hints):
                announced, extra = await asyncio.shield(lookup())
                looked_up = True
                ann = take_announcement(announced.get(state.publisher))
                for h in extra.get(state.publisher, []):
                    known.setdefault(h.holder, h)
            candidates = [h for h in known.values() if h.digest == state.digest]
            queue = _order_holders(candidates, state.banned, self.holder_id,
                                   ann.holder if ann is not None else None, self._rng)
            tried, busy_at, queued = set(), [], False
            while True:
                if queue:
                    holder, wait = queue.pop(0), False
                    if holder.holder in tried or holder.holder in state.banned or holder.holder == self.holder_id:
                        continue
                elif busy_at and not queued:
                    # Every holder asked is sending: wait in one's queue rather than ask again later.
                    holder, wait, queued = self._rng.choice(busy_at), True, True
                else:
                    break
                tried.add(holder.holder)
                async with self._fetch_slots:
                    outcome = await self._try_holder(holder, state, deadline, wait)
                if isinstance(outcome, bytes):
                    return self._fetched(state, outcome)
                if isinstance(outcome, HolderBusy):  # try the peers it named first: they have copies
                    log.debug("round %d: %s's packet: holder %s busy, names %d", state.round, state.publisher,
                              holder.holder[-8:], len(outcome.holders))
                    busy_at.append(holder)
                    named = [self._holder_named(h, state) for h in outcome.holders]
                    for h in named:
                        known.setdefault(h.holder, h)
                    queue[:0] = [h for h in named if h.holder not in tried]
            passes += 1
            if busy_at:  # copies exist but every holder is sending: ask again shortly
                await asyncio.sleep(min(busy_pause_s * (0.5 + self._rng.random()), max(0.0, deadline - loop.time())))
                busy_pause_s = min(busy_pause_s * 2, 8 * self.config.busy_pause_s)
                continue
            if not looked_up:
                continue  # the hinted holders failed: wait for the DHT's
            # Every known holder failed: wait for new ones (other peers finishing their fetches, or
            # the publisher's announcement, which is stored beside the round and may come late).
            await asyncio.sleep(min(self.config.holder_refresh_s, max(0.0, deadline - loop.time())))
            try:
                if ann is None or ann.digest != state.digest:
                    ann = take_announcement((await self.announcements(state.round)).get(state.publisher))
                for h in await self.holders(state.round, state.publisher):
                    known[h.holder] = h
            except Exception as e:  # a DHT hiccup: the next pass reads again
                log.debug("reading holders of %s failed: %r", state.publisher, e)

    def _holder_named(self, holder: str, state: _FetchState) -> Announcement:
        """A holder a busy peer named, reachable at the addresses we know for it (or p2pd's)."""
        return Announcement(state.publisher, state.round, state.digest, state.size_bytes or 0,
                            self._addresses.get(holder, []), holder)

    async def _try_holder(self, holder: Announcement, state: _FetchState, deadline: float,
                          wait: bool = False, child: bool = False) -> bytes | HolderBusy | None:
        """The verified packet; HolderBusy when the holder has no free upload slot (with `wait`: none
        freed within its queue time); None on failure."""
        try:
            return await self._download(holder, state, deadline, wait, child)
        except HolderBusy as busy:
            return busy
        except (DigestMismatch, MalformedPacket, OversizedPacket) as e:
            state.banned.add(holder.holder)
            log.warning("round %d: holder %s of %s's packet banned: %s", state.round, holder.holder,
                        state.publisher, e)
        except HolderRefused as e:
            log.info("round %d: holder %s refused %s's packet: %s", state.round, holder.holder, state.publisher, e)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self._dialed.discard(holder.holder)
            log.info("round %d: holder %s of %s's packet failed: %r", state.round, holder.holder, state.publisher, e)
        except Exception as e:  # p2pd control errors (dial failures) come as several private types
            self._dialed.discard(holder.holder)
            log.info("round %d: holder %s of %s's packet unreachable: %r", state.round, holder.holder,
                     state.publisher, e)
        return None

    async def _download(self, holder: Announcement, state: _FetchState, deadline: float, wait: bool = False,
                        child: bool = False) -> bytes:
        loop = asyncio.get_running_loop()
        cfg = self.config

        def budget(limit_s: float) -> float:
            return max(0.0, min(limit_s, deadline - loop.time()))

        peer = PeerID.from_base58(holder.holder)
        if holder.multiaddrs:
            self._addresses.setdefault(holder.holder, holder.multiaddrs)
        started = loop.time()
        if holder.multiaddrs and holder.holder not in self._dialed:
            # p2pd takes the peer id separately and refuses addresses that still end in /p2p/<id>.
            suffix = f"/p2p/{holder.holder}"
            maddrs = [Multiaddr(m.removesuffix(suffix)) for m in holder.multiaddrs]
            # P2P has no public connect(); the daemon client's tells p2pd where the holder listens.
            await asyncio.wait_for(self._p2p._client.connect(peer, maddrs), budget(cfg.connect_timeout_s))
            self._dialed.add(holder.holder)
        _, reader, writer = await asyncio.wait_for(
            self._p2p.call_binary_stream_handler(peer, HANDLER_NAME), budget(cfg.connect_timeout_s))
        try:
            request = msgpack.packb({"run": cfg.run_id, "round": state.round, "peer": state.publisher,
                                     "digest": state.digest, "wait": wait, "child": child})
            writer.write(REQUEST_PREFIX.pack(len(request)) + request)
            await asyncio.wait_for(writer.drain(), budget(cfg.connect_timeout_s))
            status, length = RESPONSE_HEADER.unpack(
                await asyncio.wait_for(reader.readexactly(RESPONSE_HEADER.size), budget(cfg.connect_timeout_s)))
            if status == STATUS_ERROR:
                message = await asyncio.wait_for(reader.read(min(length, MAX_ERROR_BYTES)), budget(cfg.stall_timeout_s))
                raise HolderRefused(message.decode("utf-8", "replace"))
            if status == STATUS_BUSY:
                if length > MAX_ERROR_BYTES:
                    raise MalformedPacket(f"busy answer of {length} bytes")
                raw = await asyncio.wait_for(reader.readexactly(length), budget(cfg.stall_timeout_s))
                raise HolderBusy(_parse_busy(raw))
            if status != STATUS_OK:
                raise MalformedPacket(f"unknown response status {status}")
            if length > cfg.max_packet_bytes:
                raise OversizedPacket(f"holder offers {length} bytes, the limit is {cfg.max_packet_bytes}")
            if state.size_bytes is not None and length != state.size_bytes:
                raise MalformedPacket(f"holder offers {length} bytes, the announcement says {state.size_bytes}")
            answered = loop.time()
            # Grown as bytes arrive, not allocated from the claimed length: a hostile holder
            # announcing 256 MB costs us only what it actually sends before it is dropped. Peers
            # may be served from it while it grows (see _Partial), unless another download of
            # the same packet already offers that.
            key = (state.round, state.publisher)
            partial = _Partial(state.digest, length)
            if key not in self._partial:
                self._partial[key] = partial
                self._notify_copy()
            hasher, traffic = hashlib.sha256(), self.traffic(state.round)
            alone: tuple[float, int] | None = None  # since when (and from how many bytes) no other download ran
            self._downloads += 1
            try:
                while len(partial.buffer) < length:
                    piece = await asyncio.wait_for(
                        reader.read(min(cfg.chunk_bytes << 1, length - len(partial.buffer))),
                        budget(cfg.stall_timeout_s))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", length)
                    partial.buffer += piece
                    hasher.update(piece)
                    traffic.downloaded_bytes += len(piece)
                    partial.notify()
                    now = loop.time()
                    if self._downloads > 1:
                        alone = None
                    elif alone is None:
                        alone = (now, len(partial.buffer))
                    elif (elapsed := now - alone[0]) > cfg.stall_timeout_s and len(partial.buffer) < length \
                            and len(partial.buffer) - alone[1] < cfg.min_rate_bytes_per_s * elapsed:
                        raise asyncio.TimeoutError(f"{len(partial.buffer) - alone[1]} bytes in {elapsed:.1f} s "
                                                   f"alone: under the floor of {cfg.min_rate_bytes_per_s:.0f} B/s")
                if hasher.hexdigest() != state.digest:
                    raise DigestMismatch(f"bytes from {holder.holder} hash to {hasher.hexdigest()[:16]}..., "
                                         f"wanted {state.digest[:16]}...")
                data = bytes(partial.buffer)
                if (held := self._held.get(key)) is None or held.digest != state.digest:
                    self._held[key] = _Held(state.digest, data, partial.sent_to, partial.receiving)
                partial.verified = True
            except BaseException:
                partial.failed = True
                raise
            finally:
                self._downloads -= 1
                partial.notify()
                if self._partial.get(key) is partial:
                    del self._partial[key]
            writer.write(RECEIPT)  # frees the holder's upload slot; a lost receipt only delays that
            done = loop.time()
            log.debug("round %d: %s's packet from %s: %d bytes, answer after %.3f s, bytes in %.3f s (%.1f Mbps)",
                      state.round, state.publisher, holder.holder[-8:], length, answered - started, done - answered,
                      length * 8 / max(done - answered, 1e-6) / 1e6)
            return data
        finally:
            writer.close()

    def _announce_holder(self, state: _FetchState, size_bytes: int) -> None:
        """Queue a holders record; packets verified together are announced in one DHT store."""
        key = holders_key(self.config.run_id, state.round, state.publisher)
        self._pending_holders.append((key, make_record(state.digest, size_bytes, self._maddrs, self.holder_id)))
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush_holders())

    async def _flush_holders(self) -> None:
        while self._pending_holders:
            # A short pause batches the packets that finish together: one DHT traversal, not one each.
            await asyncio.sleep(self.config.holder_batch_s)
            batch, self._pending_holders = self._pending_holders, []
            keys, records = [k for k, _ in batch], [r for _, r in batch]
            try:
                await self._dht.store_many(keys, records, get_dht_time() + self.config.announce_ttl_s,
                                           subkeys=[self.holder_id] * len(batch))
            except Exception as e:  # swarming is an optimisation: a failed announcement costs only load spread
                log.info("announcing %d held packets failed: %r", len(batch), e)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def wait_background(self) -> None:
        """Wait for pending holder announcements (tests and benchmarks; the round loop need not)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- serving ------------------------------------------------------------------------------

    def _payload_for(self, round: int, publisher: str, data: bytes) -> bytes:
        """The bytes served for a held packet; fault-injection tests override this."""
        return data

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        slot: str | None = None  # "upload" (of max_uploads, or a seed stream) or "child"
        try:
            (length,) = REQUEST_PREFIX.unpack(
                await asyncio.wait_for(reader.readexactly(REQUEST_PREFIX.size), cfg.request_timeout_s))
            if length > MAX_REQUEST_BYTES:
                raise MalformedPacket(f"request of {length} bytes")
            raw = await asyncio.wait_for(reader.readexactly(length), cfg.request_timeout_s)
            round, publisher, digest, wait, child = self._parse_request(raw)
            copy = await self._copy_for(round, publisher, digest, cfg.request_timeout_s)
            if copy is None:
                raise HolderRefused("not held")
            if child and self._child_uploads < MAX_CHILD_STREAMS:
                # The packet's tree bounds these (a few children per packet), so no slot is taken.
                self._child_uploads += 1
                slot = "child"
            else:
                # With every slot taken, name the peers with a copy (whole ones first), or queue the
                # request if it asks to wait or there is nobody to name. A packet only its
                # publisher has yet starts its tree at once, beside the other uploads.
                can_name = bool(copy.sent_to or copy.receiving)  # what a busy answer would list
                seed = isinstance(copy, _Held) and copy.own and not copy.sent_to and len(copy.receiving) < SEED_STREAMS
                wait_s = cfg.request_timeout_s if wait or not can_name else 0.0
                slot = "upload" if await self._take_upload_slot(wait_s, seed) else None
            if slot is None:
                answer = msgpack.packb(self._copy_holders(copy))
                writer.write(RESPONSE_HEADER.pack(STATUS_BUSY, len(answer)) + answer)
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
                return
            requester = stream_info.peer_id.to_base58()
            copy.receiving.append(requester)
            try:
                traffic = self.traffic(round)
                if isinstance(copy, _Held):
                    payload = memoryview(self._payload_for(round, publisher, copy.data))
                    writer.write(RESPONSE_HEADER.pack(STATUS_OK, len(payload)))
                    for offset in range(0, len(payload), cfg.chunk_bytes):
                        piece = payload[offset: offset + cfg.chunk_bytes]
                        writer.write(piece)
                        await asyncio.wait_for(writer.drain(), cfg.stall_timeout_s)
                        traffic.uploaded_bytes += len(piece)
                else:
                    await self._forward(copy, writer, traffic)
                traffic.num_served += 1
                # The slot is held until the fetcher says it has the verified bytes (or gives up).
                receipt = await asyncio.wait_for(reader.read(len(RECEIPT)), cfg.stall_timeout_s)
                if receipt == RECEIPT and requester not in copy.sent_to:
                    copy.sent_to.append(requester)
            finally:
                copy.receiving.remove(requester)
        except ProtocolError as e:
            message = str(e).encode()[:MAX_ERROR_BYTES]
            try:
                writer.write(RESPONSE_HEADER.pack(STATUS_ERROR, len(message)) + message)
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
            except Exception:
                pass  # the caller is gone; nothing to tell
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            log.debug("packet stream dropped: %r", e)
        except Exception:  # a bug here must not take the node down with it
            log.exception("packet stream handler failed")
        finally:
            if slot == "upload":
                self._release_upload_slot()
            elif slot == "child":
                self._child_uploads -= 1
            writer.close()

    def _notify_copy(self) -> None:
        self._copy_added.set()
        self._copy_added = asyncio.Event()

    async def _copy_for(self, round: int, publisher: str, digest: str, wait_s: float) -> _Held | _Partial | None:
        """This node's copy of the packet, whole or arriving. If none yet, a tree child may have
        asked before our own copy started: waits up to `wait_s` for one while this node fetches
        the packet, and up to WANT_GRACE_S for it to start fetching (it learns of packets from
        the coordinator at about the moment its children do)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline, grace = now + wait_s, now + min(wait_s, WANT_GRACE_S)
        while True:
            for copy in (self._held.get((round, publisher)), self._partial.get((round, publisher))):
                if copy is not None and copy.digest == digest:
                    return copy
            wanted = (round, publisher, digest) in self._wanted
            if loop.time() >= (deadline if wanted else grace):
                return None
            try:
                await asyncio.wait_for(self._copy_added.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                pass

    def _copy_holders(self, copy: _Held | _Partial) -> list[str]:
        """Up to MAX_BUSY_NAMES peers with a copy: those that confirmed one first, then those receiving one."""
        confirmed = self._rng.sample(copy.sent_to, min(MAX_BUSY_NAMES, len(copy.sent_to)))
        arriving = [p for p in dict.fromkeys(copy.receiving) if p not in confirmed]
        return confirmed + self._rng.sample(arriving, min(MAX_BUSY_NAMES - len(confirmed), len(arriving)))

    async def _take_upload_slot(self, wait_s: float, seed: bool = False) -> bool:
        """An upload slot, waiting up to `wait_s` in first-come order for one to free; a `seed`
        stream may take one of SEED_STREAMS extra slots instead of waiting."""
        if self._uploads < self.config.max_uploads + (SEED_STREAMS if seed else 0):
            self._uploads += 1
            return True
        if wait_s <= 0:
            return False
        handed = asyncio.get_running_loop().create_future()  # resolved by _release_upload_slot
        self._upload_queue.append(handed)
        try:
            await asyncio.wait_for(asyncio.shield(handed), wait_s)
        except asyncio.TimeoutError:
            if not handed.done():
                handed.cancel()
                return False
        except BaseException:
            if handed.done() and not handed.cancelled():
                self._release_upload_slot()  # handed over as this handler was being cancelled
            handed.cancel()
            raise
        return True

    def _release_upload_slot(self) -> None:
        """Hand the slot to the longest-waiting request, or free it (an extra one always)."""
        while self._uploads <= self.config.max_uploads and self._upload_queue:
            handed = self._upload_queue.popleft()
            if not handed.done():
                handed.set_result(None)
                return
        self._uploads -= 1

    async def _forward(self, partial: _Partial, writer: asyncio.StreamWriter, traffic: Traffic) -> None:
        """Send a packet that is still arriving, each piece as it comes, the last byte once verified."""
        writer.write(RESPONSE_HEADER.pack(STATUS_OK, partial.length))
        sent = 0
        while sent < partial.length:
            if partial.failed:
                raise ConnectionError("the copy being forwarded failed upstream")
            upto = partial.servable()
            if upto > sent:
                piece = bytes(partial.buffer[sent:upto])
                writer.write(piece)
                await asyncio.wait_for(writer.drain(), self.config.stall_timeout_s)
                traffic.uploaded_bytes += len(piece)
                sent = upto
            else:
                await asyncio.wait_for(partial.arrived.wait(), self.config.stall_timeout_s)

    def _parse_request(self, raw: bytes) -> tuple[int, str, str, bool, bool]:
        try:
            request = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=MAX_REQUEST_BYTES,
                                      max_bin_len=0, max_array_len=0, max_map_len=8)
        except Exception as e:  # msgpack raises a zoo of types on bad input
            raise MalformedPacket(f"request does not parse: {type(e).__name__}") from None
        if not isinstance(request, dict) or not REQUEST_KEYS <= set(request) <= REQUEST_KEYS | OPTIONAL_REQUEST_KEYS:
            raise MalformedPacket("request is not a map with run, round, peer, digest (and optionally wait, child)")
        run, round, publisher, digest = (request[k] for k in ("run", "round", "peer", "digest"))
        wait, child = request.get("wait", False), request.get("child", False)
        if not (isinstance(run, str) and isinstance(publisher, str) and isinstance(digest, str)
                and isinstance(round, int) and not isinstance(round, bool) and isinstance(wait, bool)
                and isinstance(child, bool)):
            raise MalformedPacket("request fields have the wrong types")
        if run != self.config.run_id:
            raise WrongRound(f"this node serves run {self.config.run_id!r}, not {run!r}")
        return round, publisher, digest, wait, child

    # -- parameter snapshots ----------------------------------------------------------------------

    async def publish_params(self, round: int, data: bytes) -> Announcement:
        """Hold and serve a snapshot of the parameters that start `round`, for peers catching up.

        Snapshots are held like packets under the reserved publisher id `PARAMS_ID` and announced
        only as holder records (key ".../round/R/holders/params", subkey this node's libp2p id),
        so a round's packet announcements stay packets only; a peer that fetched and verified a
        snapshot re-serves it like any packet (several donors, swarming).
        """
        data = bytes(data)
        digest = packet_digest(data)
        self._held[(round, PARAMS_ID)] = _Held(digest, data)
        record = make_record(digest, len(data), self._maddrs, self.holder_id)
        key = holders_key(self.config.run_id, round, PARAMS_ID)
        if not await self._dht.store(key, record, get_dht_time() + self.config.announce_ttl_s, subkey=self.holder_id):
            raise AnnounceFailed(f"no DHT node stored the parameter snapshot for round {round}")
        return Announcement(PARAMS_ID, round, digest, len(data), list(self._maddrs), self.holder_id)

    async def params_holders(self, round: int) -> list[Announcement]:
        """Every announced snapshot of the parameters that start `round` (digests may differ)."""
        return await self.holders(round, PARAMS_ID)

    async def fetch_params(self, round: int, digest: str, timeout_s: float = 120.0) -> bytes | None:
        """The snapshot for `round` whose sha256 is `digest`, from any holder; None if none served it."""
        return (await self.fetch(round, {PARAMS_ID: digest}, timeout_s=timeout_s)).get(PARAMS_ID)

    # -- lifecycle ----------------------------------------------------------------------------

    async def forget_before(self, round: int) -> None:
        for key in [k for k in self._held if k[0] < round]:
            del self._held[key]
        for r in [r for r in self._traffic if r < round]:
            del self._traffic[r]

    async def reachability_check(self) -> Reachability:
        maddrs = [str(m) for m in await self._p2p.get_visible_maddrs(latest=True)]
        self._maddrs = maddrs
        return assess_reachability(maddrs)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)
        try:
            await self._dht.shutdown()
        finally:
            await self._p2p.shutdown()  # terminates p2pd and waits for it to exit
        self._held.clear()


def assess_reachability(maddrs: list[str]) -> Reachability:
    """Classify announced multiaddrs and say in one sentence what to do if nobody can dial them."""
    public, relayed, loopback = [], False, True
    for text in maddrs:
        maddr = Multiaddr(text)
        if "p2p-circuit" in text:
            relayed = True
        ip = _ip_of(maddr)
        if ip is None:
            loopback = False
            continue
        loopback &= ip.is_loopback
        if ip.is_global:
            public.append(text)
    reachable = bool(public) or relayed
    if public:
        advice = "This node announces a public address; peers on other networks can dial it if the port is open."
    elif relayed:
        advice = "This node is reachable through a libp2p relay; transfers to it go through the relay."
    elif loopback:
        advice = ("This node listens on loopback only: only processes on this machine can reach it. To join peers "
                  "elsewhere, pass --host-maddrs /ip4/0.0.0.0/tcp/PORT and --announce-maddrs "
                  "/ip4/<public IP>/tcp/PORT, or enable --auto-relay / client mode.")
    else:
        advice = ("This node announces private addresses only: peers outside this network cannot dial it. Forward "
                  "a port and pass --announce-maddrs /ip4/<public IP>/tcp/PORT, or enable --auto-relay "
                  "(reachable through a relay) or client mode (fetches only, serves nobody).")
    return Reachability(list(maddrs), public, relayed, loopback and bool(maddrs), reachable, advice)


def _ip_of(maddr: Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(maddr.value_for_protocol(proto))
        except Exception:  # multiaddr raises ProtocolLookupError or similar when absent
            continue
    return None


def _is_loopback(maddr: Multiaddr) -> bool:
    ip = _ip_of(maddr)
    return ip is not None and ip.is_loopback


def _parse_busy(raw: bytes) -> list[str]:
    """The peer ids in a busy answer; anything else in it is a malformed answer."""
    try:
        names = msgpack.unpackb(raw, raw=False, max_str_len=128, max_bin_len=0, max_array_len=MAX_BUSY_NAMES,
                                max_map_len=0)
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise MalformedPacket(f"busy answer does not parse: {type(e).__name__}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MalformedPacket("busy answer is not a list of peer ids")
    valid = []
    for name in names:
        try:
            PeerID.from_base58(name)
        except Exception:
            raise MalformedPacket(f"busy answer names {name[:20]!r}, not a peer id") from None
        valid.append(name)
    return valid


def _addresses_by_holder(maddrs: list[str]) -> dict[str, list[str]]:
    """Multiaddrs ending in /p2p/<libp2p id>, grouped by that id (others are logged and skipped)."""
    by_holder: dict[str, list[str]] = {}
    for text in maddrs:
        try:
            holder = Multiaddr(text).value_for_protocol("p2p")
        except Exception:
            log.warning("ignoring hinted holder %r: not a multiaddr with /p2p/<id>", text)
            continue
        by_holder.setdefault(holder, []).append(text)
    return by_holder


def _hinted_holders(maddrs: list[str], state: _FetchState) -> list[Announcement]:
    """Holders named by the caller, as multiaddrs ending in /p2p/<libp2p id>."""
    return [Announcement(state.publisher, state.round, state.digest, state.size_bytes or 0, addrs, holder)
            for holder, addrs in _addresses_by_holder(maddrs).items()]


def _order_holders(
    candidates: list[Announcement], banned: set[str], self_id: str, publisher_holder: str | None,
    rng: random.Random,
) -> list[Announcement]:
    """Distinct usable holders: others' verified copies in random order first, the publisher last.

    Random order spreads fetchers over the copies; trying the publisher last keeps its upload
    link for the peers that find no other copy yet.
    """
    merged: dict[str, Announcement] = {}
    for c in candidates:
        if c.holder and c.holder != self_id and c.holder not in banned:
            if c.holder in merged:  # the same holder named twice (hint and DHT): union its addresses
                prior = merged[c.holder]
                c = Announcement(c.peer_id, c.round, c.digest, c.size_bytes,
                                 list(dict.fromkeys(prior.multiaddrs + c.multiaddrs)), c.holder)
            merged[c.holder] = c
    others = [c for h, c in merged.items() if h != publisher_holder]
    rng.shuffle(others)
    return others + [c for h, c in merged.items() if h == publisher_holder]
