"""Fetching packets: which holders to ask, in what order, and the download with its checks.

    fetcher = PacketFetcher(config, host, store, announcer, rng)
    packets = await fetcher.fetch(round, {publisher: digest}, holders_hint, timeout_s, parents, mirrors)

Per packet, the search asks this node's parent in the packet's tree first (`parents`, from
node.exchange.topology.tree_parent), as a "child" that waits in its queue and for its copy to
start arriving; then the hinted holders (a manifest's addresses); then those the DHT knows (one
batched lookup per fetch, made only when some packet needs it). Others' verified copies are tried
in random order before the publisher, which keeps the publisher's uplink for the peers that find
no other copy yet. A busy holder names peers with a copy: they are tried at once (they hold
verified copies, or will in a moment), so a packet spreads as a tree, each copy feeding the next,
instead of every peer pulling it through the publisher's uplink at 1/(N-1) of its rate. When
every holder asked is busy, the fetcher asks one of them again with "wait" and waits in that
holder's queue for its next free slot; only a queue that times out sends it into a short pause
(`busy_pause_s`, doubling): a pause after every busy answer would leave the download link idle
between transfers. A parent that fails sends the fetch on to this search. With every known
holder failed, it re-reads the DHT for new ones every `holder_refresh_s`, until one serves or the
caller's time-out. While this node sends its own packet's first copy (the one every peer waits
for), downloads pause between pieces (`PacketStore.after_first_copies`, at most half the stall
time-out per download): a download link kept full delays the acknowledgements the upload needs
(the lab's queues, as a home router's), and the lab's slow publishers sent that copy at a quarter
of their uplink while they fetched. A packet's own first copy (from a holder its submission
names: the publisher, or the peer it pushes to) never pauses: two publishers sending each other
their first copies would each wait for the other's reads (both stalled for the bound: 6.4 s where
one alone took 1.4 s, tools/netlab/README.md). Copies forwarded by the peer this node's copy goes
to pause like any other: they kept its download queue full while its upload went. With the link's
download rate stated (`downlink_mbps`),
packet downloads together take at most nine tenths of it: each request asks its holder to send
at its share of that, and every stream receiving is told its new share whenever a download
starts or ends, or a holder's measured rate leaves part of its share to the others
(node/exchange/pace.py `Shares`, max-min fair; the reads keep to the total as well, `Pacer`);
while this node's own first copy goes, such downloads are held by their shares rather than their
reads (half the rate, less what first copies take: `Shares`): their holders slow down within a
round trip, where paused reads stop the bytes only once a stream's window is full.
The link's download queue then stays empty: the first request for this node's own packet, and
the acknowledgements of the copy it then sends, cross that queue. The root of the tree
of a publisher nobody can dial waits for its push (`pushed_here`, `push_grace_s` to start)
before it searches.

A packet of a few MB comes in stripes (`stripes`, protocol/stream.py): stripe 0 is the request
above, and once its answer came the other stripes are asked of the same holder, each on a stream
of its own, and read side by side into one copy; a holder on a slow uplink answers stripe 0 with
the whole packet instead (node/exchange/serve.py). A stream carries one yamux window (256 KiB) per
round trip until its window grows, so one stream took a 1.57 MB packet at 44 Mbps over a 100 Mbps
link with a 40 ms round trip, and four at 70 Mbps (the lab, two hosts). A holder that fails any
stripe fails the whole download; the next holder is asked for all of it.

Bytes from holders are hostile. The download refuses a length that differs from the announced size
(or exceeds `max_packet_bytes`) before buffering, hashes while reading, drops a holder that stalls
for `stall_timeout_s` or trickles (under `min_rate_bytes_per_s` for `stall_timeout_s` while no
other download runs), leaves a holder whose bytes, at their pace so far (the time this node held
its own reads back not counted), would need longer than the fetch has left once `stall_timeout_s`
passed (`TooSlow`, banned for this packet: a forwarder trickling above the floor beside other
downloads otherwise kept every packet it was asked for until the round's time-out, and every peer
reported them missing; a packet's first copy, from its publisher, is exempt, nobody else has it
yet, unless that publisher is a suspect, below), and on a digest mismatch or a malformed answer
bans that holder for this fetch and tries the next one. A copy forwarded cut-through that fails
upstream ends short: the fetcher, which never counts a short stream as a whole packet, tries
another holder without banning that one. A verified copy is kept, served, and announced under the
holders key, so later fetchers spread their load over it.

The packet mirror (`mirrors`: a presigned GET URL and the manifest's size per packet, from the
coordinator) is one more holder, raced against the peer search once that has not delivered
within `mirror_after_s`, or sooner once a pass asked holders and every one failed (a publisher
nobody can dial). Its bytes are as hostile as a peer's: a Content-Length other than the
manifest's size (or the announcement's, or over `max_packet_bytes`) is refused before any body
is read, the body is hashed as it arrives and never buffered past that size, and a short body,
an HTTP error or a lost connection (the publisher's upload may not be there yet) is tried again
every `holder_refresh_s`, while a wrong length or digest bans the mirror for that packet. A
verified copy from the mirror is kept, served and announced like one from a peer; whichever of
the two verifies first wins, and the other is cancelled.

A suspect's packet (`suspects`: publishers the coordinator flagged for a packet dropped as
unfetchable, `withheld_packet`) is given up once, `stall_timeout_s` or more after the fetch's
start, no copy of it is arriving here (checked every SUSPECT_CHECK_S), and its first copy is left
like any other once its pace would miss the deadline (`TooSlow`): a publisher that withholds its
packet, or trickles it, then costs each peer about a stall time-out a round rather than the whole
fetch's, while one that serves again is fetched as any other (docs/DESIGN.md, "A publisher dropped
once is not waited for again").

A parameter snapshot (`fetch_snapshot`) goes through the same search among the holders that
announced it, but its bytes go into a `SnapshotSink` (node/training/snapshot.py) rather than a
buffer: the request carries the sink's offset, the answer must be exactly the rest of the
snapshot as the sink's own layout sizes it, and each unit (the prologue, then 4 MiB chunks) is
checked and written as it completes. A holder that fails mid-stream costs only the unit in
progress: the next holder is asked from the first byte not yet verified. A holder keeps only its
newest snapshot, so once every holder known refuses it ("not held") on two passes with a DHT
re-read between them, the snapshot is gone from the swarm: the fetch gives up at once rather than
ask until its time-out, and the caller looks for a newer one. A holder nobody can dial is reached
all the same once it dialled this node (connection reversal: the coordinator asks it to while this
node's heartbeats say `loading_snapshot`, node/round/catchup.py): p2pd answers `connect` for a
peer it has a connection to at once, and opens the request stream over that connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import random
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from hivemind.p2p import PeerID

from node.exchange.announce import Announcer
from node.exchange.base import MirrorCopy
from node.exchange.config import ExchangeConfig
from node.exchange.host import Host, dial_addresses
from node.exchange.pace import PACED_PIECE_BYTES, Pacer, Shares, paced_rate
from node.exchange.reachability import addresses_by_holder
from node.exchange.store import Held, PacketStore
from protocol.dht_records import PARAMS_ID, Announcement, holders_key, packets_key
from protocol.errors import MalformedPacket, OversizedPacket, ShapeMismatch, TruncatedPacket
from protocol.stream import (
    MAX_ERROR_BYTES,
    RECEIPT,
    RESPONSE_HEADER,
    STATUS_BUSY,
    STATUS_ERROR,
    STATUS_STRIPED,
    DigestMismatch,
    HolderBusy,
    HolderRefused,
    PacketRequest,
    decode_busy,
    decode_error,
    decode_response_header,
    encode_request,
    stripe_bounds,
)

if TYPE_CHECKING:
    from node.training.snapshot import SnapshotSink

log = logging.getLogger(__name__)
# Each packet fetched, at DEBUG; the network lab reads it (tools/netlab/timeline.py).
FETCHED_LINE = "round %d: %s's packet from %s: %d bytes, answer after %.3f s, bytes in %.3f s (%.1f Mbps, %d streams)"

MIRROR = "mirror"  # the packet mirror's name among a fetch's holders (its bans, its logs)
# A suspect's packet: how often, from stall_timeout_s on, a copy of it arriving is checked for. Between
# holders (one left, the next asked) no copy arrives for a moment: a suspect may lose its round there.
SUSPECT_CHECK_S = 1.0


@dataclass(slots=True)
class FetchState:
    round: int
    publisher: str
    digest: str
    size_bytes: int | None  # from an announcement; None: unknown, bounded by max_packet_bytes
    banned: set[str] = field(default_factory=set)  # holders that sent bad bytes
    sink: SnapshotSink | None = None  # a snapshot's receiver (its layout sizes the stream)
    refused: set[str] = field(default_factory=set)  # holders that answered they do not hold it
    # with a mirror copy: set once a pass asked holders and every one failed (the mirror need not wait)
    peers_failed: asyncio.Event | None = None
    # the holders the submission names (the publisher, or the peer it pushes to): their copy is
    # the packet's first, which never holds back for this node's own (`PacketStore.after_first_copies`)
    first_hand: frozenset[str] = frozenset()
    suspect: bool = False  # its publisher's packet was dropped before: no exemption, given up sooner
    from_mirror: bool = False  # the mirror's body is arriving now (a copy in progress, as a `Partial` is)


class TooSlow(asyncio.TimeoutError):
    """A holder whose bytes, at the pace they came so far, would arrive after the fetch's deadline."""


class SnapshotGone(Exception):
    """Every holder known refused the snapshot: they moved on to a newer one."""


class PacketFetcher:
    """Finds holders of wanted packets and downloads verified copies into the store."""

    def __init__(
        self, config: ExchangeConfig, host: Host, store: PacketStore, announcer: Announcer, rng: random.Random
    ):
        self.config = config
        self._host, self._store, self._announcer = host, store, announcer
        self.holder_id = host.holder_id
        self.rng = rng  # packet and holder order; tests replace it to force an order
        self._fetch_slots = asyncio.Semaphore(config.max_parallel_fetches)  # shared by every fetch() call
        self._dialed: set[str] = set()  # holders p2pd has addresses for (dialing costs a daemon round trip)
        self._num_downloads = 0  # packet bodies being read now
        self._addresses: dict[str, list[str]] = {}  # libp2p id -> multiaddrs, from hints and announcements
        # packet downloads together, at most PACED_SHARE of the stated downlink: the holders send at
        # the shares they are told (`Shares`), and the reads keep to it too (`Pacer`)
        paced = paced_rate(config.downlink_mbps) if config.downlink_mbps else None
        self._pacer = Pacer(paced) if paced else None
        self._shares = Shares(paced) if paced else None
        if self._shares is not None:
            # While this node's first copy goes, downloads but packets' first copies share part of
            # the rate (`Shares`, HELD_FRACTION), for at most half the stall time-out.
            hold_s = config.stall_timeout_s / 2
            self._shares.held = lambda: store.first_copy_pending(hold_s)
            store.on_first_copies_changed = lambda: self._first_copies_changed(hold_s)

    def _first_copies_changed(self, hold_s: float) -> None:
        """Tell the downloads their shares now, and again once a hold now in force ran out."""
        self._shares.refresh()
        if self._shares.held():
            asyncio.get_running_loop().call_later(hold_s, self._shares.refresh)

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
        """The wanted packets ({publisher: digest}) that some holder served and that verified."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        held = self._store.held
        result = {p: h.data for p, d in wanted.items() if isinstance(h := held.get((round, p)), Held) and h.digest == d}
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
                lookup_task = asyncio.ensure_future(self._announcer.lookup(keys, round, deadline))
            return lookup_task

        for maddrs in [*(holders_hint or {}).values(), *(parents or {}).values()]:  # to reach peers named later
            self._addresses.update(addresses_by_holder(maddrs))

        async def one(publisher: str, digest: str) -> bytes | None:
            started = loop.time()
            if publisher in pushed_here:
                # Its publisher, which nobody can dial, pushes it here: a copy pulled from it
                # meanwhile would halve the rate of both through its uplink.
                data = await self._store.awaited_push(round, publisher, digest, self.config.push_grace_s)
                if data is not None:
                    self._store.traffic(round).fetch_spans.append((started, loop.time()))
                    return data
            state = FetchState(round, publisher, digest, None, suspect=publisher in suspects)
            hints = hinted_holders((holders_hint or {}).get(publisher, []), state)
            state.first_hand = frozenset(h.holder for h in hints)
            parent = next(iter(hinted_holders((parents or {}).get(publisher, []), state)), None)
            log.debug(
                "round %d: fetching %s's packet, parent %s", round, publisher, parent.holder[-8:] if parent else None
            )
            search = self._fetch_one(state, hints, lookup, deadline, parent)
            if (mirror := (mirrors or {}).get(publisher)) is not None:
                state.peers_failed = asyncio.Event()
                search = self._with_mirror(state, search, mirror, deadline)
            # A packet its publisher pushes here (node/exchange/push.py) ends the search too.
            searching = asyncio.ensure_future(search)
            pushed = asyncio.ensure_future(self._store.pushed_copy(round, publisher, digest))
            try:
                done = await self._until_done_or_given_up({searching, pushed}, state, deadline)
            finally:
                searching.cancel()
                pushed.cancel()
            if not done:
                log.warning(
                    "round %d: no holder served %s's packet within %.1f s%s",
                    round,
                    publisher,
                    loop.time() - started,
                    " (a suspect: no copy arriving, given up)" if state.suspect and loop.time() < deadline else "",
                )
                return None
            data = (searching if searching in done else pushed).result()
            self._store.traffic(round).fetch_spans.append((started, loop.time()))
            return data

        # Each fetcher takes the packets in its own random order, so that the first wave of
        # max_parallel_fetches transfers does not hit the same few publishers from every peer.
        order = self.rng.sample(list(todo.items()), len(todo))
        try:
            fetched = await asyncio.gather(*(one(p, d) for p, d in order))
        finally:
            if lookup_task is not None:
                lookup_task.cancel()
        result |= {p: data for (p, _), data in zip(order, fetched) if data is not None}
        return result

    async def _until_done_or_given_up(
        self, tasks: set[asyncio.Future], state: FetchState, deadline: float
    ) -> set[asyncio.Future]:
        """The first of `tasks` done by `deadline` (an empty set: none). A suspect's packet is
        given up sooner: at the first check, from `stall_timeout_s` on, with no copy of it arriving
        (from a peer or a push, a `Partial` in the store; or from the mirror)."""
        loop = asyncio.get_running_loop()
        check = loop.time() + self.config.stall_timeout_s if state.suspect else math.inf
        key = (state.round, state.publisher)
        while True:
            until = min(deadline, check)
            done, _ = await asyncio.wait(
                tasks, timeout=max(0.0, until - loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
            arriving = key in self._store.partial or state.from_mirror
            if done or loop.time() >= deadline or not arriving:
                return done
            check = loop.time() + SUSPECT_CHECK_S

    async def fetch_snapshot(self, round: int, digest: str, sink: SnapshotSink, timeout_s: float) -> bool:
        """Receive the snapshot named `digest` into `sink` from the holders that announced it;
        True once all of it verified. A later call with the same sink resumes where this one stopped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sink.expect(digest)
        if sink.done:
            return True
        run_id = self.config.run_id
        keys = {None: packets_key(run_id, round), PARAMS_ID: holders_key(run_id, round, PARAMS_ID)}
        lookup_task: asyncio.Future | None = None

        def lookup() -> asyncio.Future:
            nonlocal lookup_task
            if lookup_task is None:
                lookup_task = asyncio.ensure_future(self._announcer.lookup(keys, round, deadline))
            return lookup_task

        state = FetchState(round, PARAMS_ID, digest, sink.total_bytes, sink=sink)
        started = loop.time()
        try:
            await asyncio.wait_for(self._fetch_one(state, [], lookup, deadline), max(0.0, deadline - loop.time()))
        except SnapshotGone:
            log.info(
                "round %d: snapshot %s: no holder still has it (%d refused)", round, digest[:12], len(state.refused)
            )
            return False
        except asyncio.TimeoutError:
            log.warning(
                "round %d: snapshot %s: %d of %d bytes verified within %.1f s",
                round,
                digest[:12],
                sink.offset,
                sink.total_bytes,
                timeout_s,
            )
            return False
        finally:
            if lookup_task is not None:
                lookup_task.cancel()
        self._store.traffic(round).fetch_spans.append((started, loop.time()))
        return sink.done

    async def _fetch_one(
        self,
        state: FetchState,
        hints: list[Announcement],
        lookup: Callable[[], asyncio.Future],
        deadline: float,
        parent: Announcement | None = None,
    ) -> bytes:
        """Try the parent, the hinted holders, then those the DHT knows and those busy holders name,
        re-reading the DHT for new ones, until one serves or the caller times out."""
        known = {h.holder: h for h in hints}
        with self._store.wanting(state.round, state.publisher, state.digest):  # a tree child asking waits for us
            if parent is not None and parent.holder != self.holder_id:
                # No fetch slot: the tree gives each packet one stream into this node.
                outcome = await self._try_holder(parent, state, deadline, wait=True, child=True)
                if outcome is not None and not isinstance(outcome, HolderBusy):
                    return self._fetched(state, outcome)
                if isinstance(outcome, HolderBusy):
                    for name in outcome.holders:
                        known.setdefault(name, self._holder_named(name, state))
            return await self._search(state, known, lookup, deadline)

    async def _with_mirror(self, state: FetchState, search, mirror: MirrorCopy, deadline: float) -> bytes:
        """The peer `search`'s packet, or the mirror's if the peers have not delivered within
        `mirror_after_s` (or every holder asked failed) and the mirror's copy verifies first (see
        the module docstring)."""
        loop = asyncio.get_running_loop()
        peers = asyncio.ensure_future(search)
        failed = asyncio.ensure_future(state.peers_failed.wait()) if state.peers_failed is not None else None
        fallback: asyncio.Future | None = None
        try:
            await asyncio.wait(
                {peers} | ({failed} if failed is not None else set()),
                timeout=max(0.0, min(self.config.mirror_after_s, deadline - loop.time())),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if peers.done():
                return peers.result()
            fallback = asyncio.ensure_future(self._from_mirror(state, mirror, deadline))
            pending: set[asyncio.Future] = {peers, fallback}
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if peers in done:
                    return peers.result()
                if fallback in done and (data := fallback.result()) is not None:
                    return data
        finally:
            for task in (peers, failed, fallback):
                if task is not None and not task.done():
                    task.cancel()

    async def _from_mirror(self, state: FetchState, mirror: MirrorCopy, deadline: float) -> bytes | None:
        """The mirror's verified copy, asked again every `holder_refresh_s` after a failure; None
        once it sent bad bytes (banned for this packet)."""
        loop = asyncio.get_running_loop()
        failures = 0
        while MIRROR not in state.banned:
            started = loop.time()
            try:
                async with self._fetch_slots:
                    data = await self._download_mirror(state, mirror, deadline)
            except (DigestMismatch, MalformedPacket, OversizedPacket) as e:
                state.banned.add(MIRROR)
                log.warning("round %d: the mirror's copy of %s's packet banned: %s", state.round, state.publisher, e)
                return None
            except (httpx.HTTPError, asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as e:
                failures += 1  # logged once: it is asked again every holder_refresh_s
                log.log(
                    logging.INFO if failures == 1 else logging.DEBUG,
                    "round %d: the mirror's copy of %s's packet failed (asked again): %r",
                    state.round,
                    state.publisher,
                    e,
                )
                await asyncio.sleep(max(0.0, min(self.config.holder_refresh_s, deadline - loop.time())))
                continue
            self._store.traffic(state.round).num_fetched += 1
            self._announcer.announce_holder(state.round, state.publisher, state.digest, len(data))
            log.debug(
                "round %d: %s's packet from the mirror: %d bytes in %.3f s",
                state.round,
                state.publisher,
                len(data),
                loop.time() - started,
            )
            return data
        return None

    async def _download_mirror(self, state: FetchState, mirror: MirrorCopy, deadline: float) -> bytes:
        """One GET of the mirror's copy: its length checked before the body is read, the body
        hashed as it arrives and never buffered past the expected size; held once verified. From
        the body's first byte until then, `state.from_mirror` says a copy is arriving."""
        try:
            return await self._mirror_copy(state, mirror, deadline)
        finally:
            state.from_mirror = False

    async def _mirror_copy(self, state: FetchState, mirror: MirrorCopy, deadline: float) -> bytes:
        loop = asyncio.get_running_loop()
        cfg = self.config
        expected = mirror.size_bytes
        if state.size_bytes is not None and state.size_bytes != expected:
            raise MalformedPacket(f"the manifest says {expected} bytes, the announcement {state.size_bytes}")
        if expected > cfg.max_packet_bytes:
            raise OversizedPacket(f"the manifest's {expected} bytes exceed max_packet_bytes {cfg.max_packet_bytes}")
        remaining = max(0.001, deadline - loop.time())
        timeout = httpx.Timeout(min(cfg.stall_timeout_s, remaining), connect=min(cfg.connect_timeout_s, remaining))
        hasher, buffer = hashlib.sha256(), bytearray()
        traffic = self._store.traffic(state.round)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            async with client.stream("GET", mirror.url) as response:
                if response.status_code != 200:
                    raise httpx.HTTPStatusError(
                        f"the mirror answered {response.status_code}", request=response.request, response=response
                    )
                length = response.headers.get("content-length")
                if length is None or not length.isdigit() or int(length) != expected:
                    raise MalformedPacket(f"the mirror offers {length} bytes, the manifest says {expected}")
                state.from_mirror = True
                async for piece in response.aiter_raw(cfg.chunk_bytes):
                    if len(buffer) + len(piece) > expected:
                        raise MalformedPacket(f"the mirror sent more than the {expected} bytes it offered")
                    buffer += piece
                    hasher.update(piece)
                    traffic.downloaded_bytes += len(piece)
        if len(buffer) != expected:
            raise asyncio.IncompleteReadError(bytes(buffer[:0]), expected)
        if hasher.hexdigest() != state.digest:
            raise DigestMismatch(
                f"bytes from the mirror hash to {hasher.hexdigest()[:16]}..., wanted {state.digest[:16]}..."
            )
        data = await asyncio.to_thread(self._store.spool.keep, buffer)
        key = (state.round, state.publisher)
        if (held := self._store.held.get(key)) is None or held.digest != state.digest:
            self._store.held[key] = Held(state.digest, data)
            self._store.notify_copy()  # tree children waiting for our copy
        else:
            data = held.data  # a peer's copy verified meanwhile: serve one
        return data

    def _fetched(self, state: FetchState, data: bytes | SnapshotSink) -> bytes | SnapshotSink:
        """A verified packet, held and served from now on (_download); its copy announced. (A
        snapshot is served once its caller loaded it: it lives in the model, not in the store.)"""
        self._store.traffic(state.round).num_fetched += 1
        if state.sink is None:
            self._announcer.announce_holder(state.round, state.publisher, state.digest, len(data))
        return data

    async def _search(
        self, state: FetchState, known: dict[str, Announcement], lookup: Callable[[], asyncio.Future], deadline: float
    ) -> bytes:
        loop = asyncio.get_running_loop()
        hints = list(known.values())
        ann, looked_up, passes, busy_pause_s = None, False, 0, self.config.busy_pause_s

        def take_announcement(found: Announcement | None) -> Announcement | None:
            """The publisher's own record: its size bounds the download, and it is a holder."""
            if found is not None and found.digest == state.digest:
                if state.sink is None:  # a snapshot's size is its layout's, never a record's
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
            queue = order_holders(
                candidates, state.banned, self.holder_id, ann.holder if ann is not None else None, self.rng
            )
            tried, busy_at, queued = set(), [], False
            while True:
                if queue:
                    holder, wait = queue.pop(0), False
                    if holder.holder in tried or holder.holder in state.banned or holder.holder == self.holder_id:
                        continue
                elif busy_at and not queued:
                    # Every holder asked is sending: wait in one's queue rather than ask again later.
                    holder, wait, queued = self.rng.choice(busy_at), True, True
                else:
                    break
                tried.add(holder.holder)
                async with self._fetch_slots:
                    outcome = await self._try_holder(holder, state, deadline, wait)
                if outcome is not None and not isinstance(outcome, HolderBusy):
                    return self._fetched(state, outcome)
                if isinstance(outcome, HolderBusy):  # try the peers it named first: they have copies
                    log.debug(
                        "round %d: %s's packet: holder %s busy, names %d",
                        state.round,
                        state.publisher,
                        holder.holder[-8:],
                        len(outcome.holders),
                    )
                    busy_at.append(holder)
                    named = [self._holder_named(h, state) for h in outcome.holders]
                    for h in named:
                        known.setdefault(h.holder, h)
                    queue[:0] = [h for h in named if h.holder not in tried]
            passes += 1
            if busy_at:  # copies exist but every holder is sending: ask again shortly
                await asyncio.sleep(min(busy_pause_s * (0.5 + self.rng.random()), max(0.0, deadline - loop.time())))
                busy_pause_s = min(busy_pause_s * 2, 8 * self.config.busy_pause_s)
                continue
            if tried and state.peers_failed is not None:
                state.peers_failed.set()  # the mirror, if any, is asked beside the further search
            if not looked_up:
                continue  # the hinted holders failed: wait for the DHT's
            if state.sink is not None and passes >= 2 and tried and tried <= state.refused:
                raise SnapshotGone()  # refused by all, before and after a DHT re-read
            # Every known holder failed: wait for new ones (other peers finishing their fetches, or
            # the publisher's announcement, which is stored beside the round and may come late).
            await asyncio.sleep(min(self.config.holder_refresh_s, max(0.0, deadline - loop.time())))
            try:
                if ann is None or ann.digest != state.digest:
                    ann = take_announcement((await self._announcer.announcements(state.round)).get(state.publisher))
                for h in await self._announcer.holders(state.round, state.publisher):
                    known[h.holder] = h
            except Exception as e:  # a DHT hiccup: the next pass reads again
                log.debug("reading holders of %s failed: %r", state.publisher, e)

    def _holder_named(self, holder: str, state: FetchState) -> Announcement:
        """A holder a busy peer named, reachable at the addresses we know for it (or p2pd's)."""
        return Announcement(
            state.publisher, state.round, state.digest, state.size_bytes or 0, self._addresses.get(holder, []), holder
        )

    async def _try_holder(
        self, holder: Announcement, state: FetchState, deadline: float, wait: bool = False, child: bool = False
    ) -> bytes | SnapshotSink | HolderBusy | None:
        """The verified packet; HolderBusy when the holder has no free upload slot (with `wait`: none
        freed within its queue time); None on failure."""
        try:
            return await self._download(holder, state, deadline, wait, child)
        except HolderBusy as busy:
            return busy
        except (DigestMismatch, MalformedPacket, OversizedPacket, ShapeMismatch, TruncatedPacket) as e:
            state.banned.add(holder.holder)
            log.warning("round %d: holder %s of %s's packet banned: %s", state.round, holder.holder, state.publisher, e)
        except HolderRefused as e:
            state.refused.add(holder.holder)
            log.info("round %d: holder %s refused %s's packet: %s", state.round, holder.holder, state.publisher, e)
        except TooSlow as e:
            state.banned.add(holder.holder)  # for this packet: the others are asked instead
            log.info("round %d: holder %s of %s's packet left: %s", state.round, holder.holder, state.publisher, e)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self._dialed.discard(holder.holder)
            log.info("round %d: holder %s of %s's packet failed: %r", state.round, holder.holder, state.publisher, e)
        except Exception as e:  # p2pd control errors (dial failures) come as several private types
            self._dialed.discard(holder.holder)
            log.info(
                "round %d: holder %s of %s's packet unreachable: %r", state.round, holder.holder, state.publisher, e
            )
        return None

    async def _download(
        self, holder: Announcement, state: FetchState, deadline: float, wait: bool = False, child: bool = False
    ) -> bytes | SnapshotSink:
        loop = asyncio.get_running_loop()
        cfg = self.config

        def budget(limit_s: float) -> float:
            return max(0.0, min(limit_s, deadline - loop.time()))

        peer = PeerID.from_base58(holder.holder)
        if holder.multiaddrs:
            self._addresses.setdefault(holder.holder, holder.multiaddrs)
        started = loop.time()
        if holder.multiaddrs and holder.holder not in self._dialed:
            maddrs = dial_addresses(holder.holder, holder.multiaddrs)
            await asyncio.wait_for(self._host.connect(peer, maddrs), budget(cfg.connect_timeout_s))
            self._dialed.add(holder.holder)
        reader, writer = await asyncio.wait_for(self._host.open_stream(peer), budget(cfg.connect_timeout_s))
        writers = [writer]  # the streams of this download: stripe 0's first
        download = object()  # its key in the shares of the downlink
        holdable = holder.holder not in state.first_hand  # not the packet's first copy (`Shares`)
        stripes = cfg.fetch_stripes if state.sink is None else 1
        request = PacketRequest(
            run=cfg.run_id,
            round=state.round,
            publisher=state.publisher,
            digest=state.digest,
            wait=wait,
            child=child,
            offset=state.sink.offset if state.sink is not None else 0,
            stripes=stripes,
            rate=self._shares.next_share(download, holdable) if self._shares is not None and state.sink is None else 0,
        )
        try:
            answered, status, length = await self._ask(reader, writer, request, state, budget, download, holdable)
            if state.sink is not None:
                data = await self._receive_snapshot(reader, state, length, budget)
            else:
                bounds = stripe_bounds(length, stripes) if status == STATUS_STRIPED else [(0, length)]

                async def open_stripe(i: int) -> asyncio.StreamReader:
                    """Stripe i's stream, answered; it rides on stripe 0's slot at the holder."""
                    stripe_reader, stripe_writer = await asyncio.wait_for(
                        self._host.open_stream(peer), budget(cfg.connect_timeout_s)
                    )
                    writers.append(stripe_writer)
                    rate = self._shares.next_share(download, holdable) if request.rate and self._shares else 0
                    stripe_request = dataclasses.replace(request, stripe=i, rate=rate)
                    _, stripe_status, size = await self._ask(
                        stripe_reader, stripe_writer, stripe_request, state, budget, download, holdable
                    )
                    if stripe_status != STATUS_STRIPED or size != length:
                        raise MalformedPacket(f"stripe {i} answered as a {size}-byte packet, stripe 0 as {length}")
                    return stripe_reader

                data = await self._receive(
                    reader, holder, state, length, budget, bounds, open_stripe, download, holdable
                )
            for stream in writers:
                stream.write(RECEIPT)  # frees the holder's upload slot; a lost receipt only delays that
            done = loop.time()
            log.debug(
                FETCHED_LINE,
                state.round,
                state.publisher,
                holder.holder[-8:],
                length,
                answered - started,
                done - answered,
                length * 8 / max(done - answered, 1e-6) / 1e6,
                len(writers),
            )
            return data
        finally:
            if self._shares is not None:
                self._shares.leave(download)
            for stream in writers:
                stream.close()

    async def _ask(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: PacketRequest,
        state: FetchState,
        budget: Callable[[float], float],
        download: object,
        holdable: bool,
    ) -> tuple[float, int, int]:
        """Send `request` and read the answer's header: (when it came, its status, its length) for
        the bytes that follow; an error or a busy answer is raised (HolderRefused, HolderBusy), and
        a length other than the announced size before any of the bytes is read (MalformedPacket).
        `holdable`: the download is no packet's first copy (`Shares`)."""
        cfg = self.config
        writer.write(encode_request(request))
        await asyncio.wait_for(writer.drain(), budget(cfg.connect_timeout_s))
        expected = state.size_bytes - request.offset if state.sink is not None else state.size_bytes
        status, length = decode_response_header(
            await asyncio.wait_for(reader.readexactly(RESPONSE_HEADER.size), budget(cfg.connect_timeout_s)),
            expected if state.sink is not None else cfg.max_packet_bytes,
        )
        if status == STATUS_ERROR:
            message = await asyncio.wait_for(reader.read(min(length, MAX_ERROR_BYTES)), budget(cfg.stall_timeout_s))
            raise HolderRefused(decode_error(message))
        if status == STATUS_BUSY:
            raw = await asyncio.wait_for(reader.readexactly(length), budget(cfg.stall_timeout_s))
            raise HolderBusy(decode_busy(raw))
        if status == STATUS_STRIPED and request.stripes == 1:
            raise MalformedPacket("a striped answer to a request for the whole packet")
        if expected is not None and length != expected:
            raise MalformedPacket(f"holder offers {length} bytes, the announcement says {expected}")
        if request.rate and self._shares is not None:
            self._shares.join(download, writer, request.rate, holdable)  # its bytes come now: the shares change
        return asyncio.get_running_loop().time(), status, length

    async def _receive(
        self,
        reader: asyncio.StreamReader,
        holder: Announcement,
        state: FetchState,
        length: int,
        budget: Callable[[float], float],
        bounds: list[tuple[int, int]],
        open_stripe: Callable[[int], Awaitable[asyncio.StreamReader]],
        download: object,
        holdable: bool,
    ) -> bytes:
        """The `length` bytes of a packet body, in stripes `bounds` (the first from `reader`, the
        others from `open_stripe(i)`), verified and held from then on (`PacketStore.receive`);
        `budget(limit_s)` caps each read's time-out by what is left of the fetch, and a holder that
        trickles while no other download runs is dropped (`_rate_floor`). `holdable`: no packet's
        first copy, so it holds back while this node's own goes."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        alone: tuple[float, int] | None = None  # since when (and from how many bytes) no other download ran
        started, own_waits_s = loop.time(), 0.0  # own_waits_s: this node held its reads back that long

        counted = 0  # bytes of this download the pacer was told of

        def after_piece(received: int) -> None:
            """Charge the pacer for the new bytes; drop a holder under the rate floor, or (but a
            first copy's, unless its publisher is a suspect) one that at its pace would finish
            after the deadline."""
            nonlocal alone, counted
            if self._pacer is not None:
                self._pacer.spent(received - counted)
                counted = received
            if self._shares is not None:
                self._shares.received(download, received)
            now = loop.time()
            alone = self._rate_floor(alone, now, received, length)
            pace_checked = holdable or state.suspect
            if pace_checked and received < length and (elapsed := now - started - own_waits_s) >= cfg.stall_timeout_s:
                needs_s = elapsed * (length - received) / max(received, 1)
                if needs_s > budget(math.inf):
                    raise TooSlow(
                        f"{received} of {length} bytes in {elapsed:.1f} s: {needs_s:.0f} s more at that pace, "
                        f"{budget(math.inf):.0f} s left"
                    )

        held_s = 0.0  # this download's reads held back while this node sent its first copy
        hold_reads = holdable and self._shares is None  # a paced download is held by its share (`Shares`)

        async def before_piece() -> None:
            """Hold while this node sends its first copy (`hold_reads`), then wait for the pacer."""
            nonlocal held_s, alone, own_waits_s
            # At most half the holder's stall time-out in all, so the holder never drops this stream.
            waited = await self._store.after_first_copies(cfg.stall_timeout_s / 2 - held_s) if hold_reads else 0.0
            held_s += waited
            if self._pacer is not None:
                waited += await self._pacer.wait()
            own_waits_s += waited
            if waited and alone is not None:
                alone = (alone[0] + waited, alone[1])  # not the holder's trickle

        self._num_downloads += 1
        try:
            return await self._store.receive(
                (state.round, state.publisher),
                state.digest,
                length,
                reader,
                piece_bytes=PACED_PIECE_BYTES if self._pacer is not None else cfg.chunk_bytes << 1,
                read_timeout_s=lambda: budget(cfg.stall_timeout_s),
                source=holder.holder,
                on_piece=after_piece,
                before_piece=before_piece,
                stripes=bounds,
                open_stripe=open_stripe,
            )
        finally:
            self._num_downloads -= 1

    def _rate_floor(
        self, alone: tuple[float, int] | None, now: float, got: int, length: int
    ) -> tuple[float, int] | None:
        """Since when (and from how many bytes) this download ran alone; raises TimeoutError for a
        holder that sent under `min_rate_bytes_per_s` for `stall_timeout_s` meanwhile."""
        cfg = self.config
        if self._num_downloads > 1:
            return None
        if alone is None:
            return now, got
        if (
            (elapsed := now - alone[0]) > cfg.stall_timeout_s
            and got < length
            and got - alone[1] < cfg.min_rate_bytes_per_s * elapsed
        ):
            raise asyncio.TimeoutError(
                f"{got - alone[1]} bytes in {elapsed:.1f} s alone: under the floor of "
                f"{cfg.min_rate_bytes_per_s:.0f} B/s"
            )
        return alone

    async def _receive_snapshot(
        self, reader: asyncio.StreamReader, state: FetchState, length: int, budget: Callable[[float], float]
    ) -> SnapshotSink:
        """The rest of a snapshot (`length` bytes from the sink's offset), a unit at a time: read into
        a buffer the sink's layout sizes (never the holder's claim), then checked and written into
        the model in a worker thread. What verified stays verified if the stream breaks."""
        loop = asyncio.get_running_loop()
        cfg, sink = self.config, state.sink
        traffic = self._store.traffic(state.round)
        end, received = sink.offset + length, 0
        alone: tuple[float, int] | None = None
        self._num_downloads += 1
        try:
            while sink.offset < end:
                unit = sink.next_unit()
                buffer = bytearray(unit.end - unit.start)
                view, filled = memoryview(buffer), 0
                while filled < len(buffer):
                    piece = await asyncio.wait_for(
                        reader.read(min(cfg.chunk_bytes << 1, len(buffer) - filled)), budget(cfg.stall_timeout_s)
                    )
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", length)
                    view[filled : filled + len(piece)] = piece
                    filled += len(piece)
                    received += len(piece)
                    traffic.downloaded_bytes += len(piece)
                    alone = self._rate_floor(alone, loop.time(), received, length)
                await asyncio.to_thread(sink.accept, buffer)
        finally:
            self._num_downloads -= 1
        return sink


def hinted_holders(maddrs: list[str], state: FetchState) -> list[Announcement]:
    """Holders named by the caller, as multiaddrs ending in /p2p/<libp2p id>."""
    return [
        Announcement(state.publisher, state.round, state.digest, state.size_bytes or 0, addrs, holder)
        for holder, addrs in addresses_by_holder(maddrs).items()
    ]


def order_holders(
    candidates: list[Announcement],
    banned: set[str],
    self_id: str,
    publisher_holder: str | None,
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
                c = Announcement(
                    c.peer_id,
                    c.round,
                    c.digest,
                    c.size_bytes,
                    list(dict.fromkeys(prior.multiaddrs + c.multiaddrs)),
                    c.holder,
                )
            merged[c.holder] = c
    others = [c for h, c in merged.items() if h != publisher_holder]
    rng.shuffle(others)
    return others + [c for h, c in merged.items() if h == publisher_holder]
