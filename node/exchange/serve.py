"""Serving packet streams (protocol/stream.py): upload slots, seed and child streams, cut-through.

    server = PacketServer(config, store, rng, payload_for)
    await host.serve(server.handle)        # P2PExchange registers its `_serve`, which calls this

Swarming: a holder serves at most `max_uploads` packet streams at once, so each gets a fair share
of its uplink, and answers further requests "busy" with the peers that confirmed a verified copy. One
exception: a publisher whose packet nobody has confirmed yet serves it on up to SEED_STREAMS
extra streams, so that a fresh packet (the last one submitted is on every peer's critical path)
starts its tree at once instead of queueing behind copies of older packets this node forwards. A
slot is held until the fetcher's receipt, not until the bytes left the process: p2pd and the
kernel buffer hundreds of kilobytes, so "written" says little about "received". A request that
asks to "wait", or one the holder has nobody to name for, queues for the next free slot (first
come, first served, up to `request_timeout_s`) instead of being answered busy. A held packet is
written in `chunk_bytes` pieces (512 KiB by default).

Trees: a fetcher that is this node's child in a packet's distribution tree says so ("child") and
is served on one of MAX_CHILD_STREAMS streams beside the upload slots: the tree already bounds
them (a few children per packet, but every packet of a round at once, and where few members can
forward each has many: in the network lab one or both of the two forwarders of eight peers
reached the old bound of 16 in every run, and they held 19-20 at once without it, slow leaves'
streams among them for 5 s each). A child turned away there falls back to the upload slots'
queue, where a fast backbone child once waited 3.7 s, and its whole subtree with it. A request
for a packet this node does not have yet waits for its copy to start arriving
(`PacketStore.copy_for`). The tree is cut-through: a copy still arriving is sent on as each
piece arrives, holding back the last byte until the whole packet hashed to its digest; if the
copy fails, the onward stream ends short. So a hop costs a piece's latency, not a whole packet's
transfer time.

Snapshots: a `HeldSnapshot` is served unit by unit from its source (a checkpoint file or the
round-start tensors), each unit read in a worker thread and checked against the snapshot's hash
tree before it goes out, from the request's offset on. Snapshot streams take slots of their own
(`max_snapshot_uploads`, queued and answered busy as packets are): a download the model's size
lasts minutes and must never hold a slot that the round's packets wait for. A source whose
bytes moved on (the tensors after the next outer step) ends the stream short and is no longer
served: the fetcher resumes elsewhere without blaming this node. A held packet is also served from an offset; a copy
still arriving only from 0.

Stripes (protocol/stream.py): a request for stripe 0 of a packet takes a slot (or a child stream)
as a whole request would; the fetcher's requests for its other stripes ride on it, no slot of their
own, and are refused unless that peer is being sent the packet here now (at most `stripes` streams
each). A node whose uplink is paced (a slow one, node/exchange/pace.py `Uplink`) answers stripe 0
with the whole packet instead: there the link binds, not a stream's window. A copy still arriving
is forwarded stripe by stripe as each one's bytes arrive, the last byte of every stripe held back
until the copy verified.

Rates (protocol/stream.py, node/exchange/pace.py): a request with a "rate" is written in pieces
of PACED_WRITE_BYTES at that rate, its own and its cut-through bytes alike, and the fetcher's
rate frames, read beside the bytes going out, change it; its receipt comes after them. A rate out
of bounds ends the stream.

Per peer (its libp2p id), a holder sends one copy of a packet at a time (its stripes ride on that
stream) and serves at most MAX_CHILD_STREAMS_PER_PEER of its child streams at once; a further
request is answered busy, naming the peers with a copy, as when every slot is taken. A child's
claim is not checked (the holder does not know the trees), so without these bounds one modified
node asking for a fresh packet again and again as a "child" at the protocol's floor rate (32
KiB/s: 48 s for 1.5 MB) would take every child stream and slot its publisher has and be named as
its only other holders, keeping the packet from its real tree until the round's fetch time-out.
Distinct libp2p ids are cheap, so the child streams go only to the libp2p ids of the run's live
members as the node last read them (`members`, each round); anyone else asking as a child is
served from the slots like any fetcher, so a member that joined since waits in their queue.

The handler never raises: a malformed request, one for another run, or for a packet not held gets
an error frame, and one that does not arrive within `request_timeout_s` just closes the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter, deque
from collections.abc import Callable

from node.exchange.base import Traffic
from node.exchange.config import ExchangeConfig
from node.exchange.pace import Pacer, Uplink, write_pieces
from node.exchange.store import Held, HeldSnapshot, PacketStore, Partial
from protocol.dht_records import PARAMS_ID
from protocol.errors import MalformedPacket, ProtocolError, WrongRound
from protocol.stream import (
    MAX_BUSY_NAMES,
    MAX_RATE_FRAMES,
    RATE,
    RATE_FRAME,
    RECEIPT,
    REQUEST_PREFIX,
    STATUS_OK,
    STATUS_STRIPED,
    HolderRefused,
    PacketRequest,
    check_rate,
    decode_request,
    encode_busy,
    encode_error,
    encode_response_header,
    request_body_length,
    stripe_bounds,
)

log = logging.getLogger(__name__)

MAX_CHILD_STREAMS = 64  # streams to tree children served at once, beside the upload slots
MAX_CHILD_STREAMS_PER_PEER = 16  # of those, to one peer (one packet each); it asks the slots for more
SEED_STREAMS = 2  # streams a publisher may add beyond max_uploads for its packet's first copies

# (round, publisher, held bytes) -> bytes served; for a snapshot, called on each unit it serves
PayloadFor = Callable[[int, str, bytes], bytes]


class UploadSlots:
    """At most `limit` streams at once (a seed stream may take an extra one); further requests
    wait for a free slot in first-come order, or are turned away."""

    def __init__(self, limit: int):
        self.limit = limit
        self.num_taken = 0  # streams being served now (at most limit, plus extra ones)
        self.queue: deque[asyncio.Future] = deque()  # requests waiting for a slot, oldest first

    async def take(self, wait_s: float, extra: int = 0) -> bool:
        """A slot, waiting up to `wait_s` in first-come order for one to free; `extra` slots
        beyond the limit may be taken instead of waiting."""
        if self.num_taken < self.limit + extra:
            self.num_taken += 1
            return True
        if wait_s <= 0:
            return False
        handed = asyncio.get_running_loop().create_future()  # resolved by release
        self.queue.append(handed)
        try:
            await asyncio.wait_for(asyncio.shield(handed), wait_s)
        except asyncio.TimeoutError:
            if not handed.done():
                handed.cancel()
                return False
        except BaseException:
            if handed.done() and not handed.cancelled():
                self.release()  # handed over as this handler was being cancelled
            handed.cancel()
            raise
        return True

    def release(self) -> None:
        """Hand the slot to the longest-waiting request, or free it (an extra one always)."""
        while self.num_taken <= self.limit and self.queue:
            handed = self.queue.popleft()
            if not handed.done():
                handed.set_result(None)
                return
        self.num_taken -= 1


class PacketServer:
    """Answers packet streams from the store, within the upload, seed, snapshot and child stream limits."""

    def __init__(
        self,
        config: ExchangeConfig,
        store: PacketStore,
        rng: random.Random,
        payload_for: PayloadFor,
        uplink: Uplink | None = None,
    ):
        self.config = config
        self.uplink = uplink  # every stream's pieces take their turn on the stated uplink (pace.py)
        self._store, self._rng = store, rng  # rng: which peers a busy answer names
        self._payload_for = payload_for
        self.uploads = UploadSlots(config.max_uploads)  # packet streams (plus seed streams)
        self.snapshot_uploads = UploadSlots(config.max_snapshot_uploads)  # snapshot streams, apart
        self._children_of: Counter[str] = Counter()  # streams to tree children now, by peer
        # libp2p ids of the run's live members (`P2PExchange.set_members`): only they are served
        # as children; None: not known, everyone is
        self.members: frozenset[str] | None = None

    @property
    def num_child_uploads(self) -> int:
        """Streams to tree children being served now (at most MAX_CHILD_STREAMS)."""
        return self._children_of.total()

    @property
    def num_uploads(self) -> int:
        """Packet streams being served now (not children's, not snapshots')."""
        return self.uploads.num_taken

    @property
    def upload_queue(self) -> deque[asyncio.Future]:
        """Packet requests waiting for an upload slot, oldest first."""
        return self.uploads.queue

    def parse_request(self, raw: bytes) -> PacketRequest:
        """A request body from a peer, refused unless it is well formed and for this run."""
        request = decode_request(raw)
        if request.run != self.config.run_id:
            raise WrongRound(f"this node serves run {self.config.run_id!r}, not {request.run!r}")
        return request

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        slot: UploadSlots | None = None  # the slots this stream holds one of (none: a child stream)
        child = False  # served as a tree child, beside the slots
        loop = asyncio.get_running_loop()
        opened = loop.time()
        try:
            length = request_body_length(
                await asyncio.wait_for(reader.readexactly(REQUEST_PREFIX.size), cfg.request_timeout_s)
            )
            request = self.parse_request(await asyncio.wait_for(reader.readexactly(length), cfg.request_timeout_s))
            round, publisher = request.round, request.publisher
            # A snapshot is never on its way here: only a packet's copy is worth waiting for.
            wait_s = 0.0 if publisher == PARAMS_ID else cfg.request_timeout_s
            copy = await self._store.copy_for(round, publisher, request.digest, wait_s)
            found = loop.time()
            if copy is None:
                raise HolderRefused("not held")
            if request.offset and isinstance(copy, Partial):
                raise HolderRefused("a copy still arriving is served from its start only")
            striped = request.stripes > 1
            if striped and isinstance(copy, HeldSnapshot):
                raise MalformedPacket("a snapshot is served whole, from an offset, not in stripes")
            requester = stream_info.peer_id.to_base58()
            if striped and request.stripe:
                # A further stripe rides on the stream serving stripe 0 to the same peer: no slot.
                if not 0 < copy.receiving.count(requester) < request.stripes:
                    raise HolderRefused("a stripe is served beside its packet's stripe 0 only")
            elif requester in copy.receiving and not isinstance(copy, HeldSnapshot):
                # One copy of a packet at a time to a peer: another is only a stream held open.
                await self._answer_busy(writer, copy, besides=requester)
                return
            elif (
                request.child
                and self.num_child_uploads < MAX_CHILD_STREAMS
                and self._children_of[requester] < MAX_CHILD_STREAMS_PER_PEER
                and (self.members is None or requester in self.members)
                and not isinstance(copy, HeldSnapshot)
            ):
                # The packet's tree bounds these (a few children per packet), so no slot is taken.
                self._children_of[requester] += 1
                child = True
            else:
                # With every slot taken, name the peers with a copy (whole ones first), or queue the
                # request if it asks to wait or there is nobody to name. A packet only its
                # publisher has yet starts its tree at once, beside the other uploads.
                can_name = bool(copy.sent_to or copy.receiving)  # what a busy answer would list
                seed = (
                    isinstance(copy, Held) and copy.own and not copy.sent_to and len(set(copy.receiving)) < SEED_STREAMS
                )
                wait_s = cfg.request_timeout_s if request.wait or not can_name else 0.0
                slots = self.snapshot_uploads if isinstance(copy, HeldSnapshot) else self.uploads
                slot = slots if await slots.take(wait_s, SEED_STREAMS if seed else 0) else None
                if slot is None:
                    await self._answer_busy(writer, copy)
                    return
            copy.receiving.append(requester)
            # A paced stream (the fetcher's "rate"): its bytes go at that rate, which the fetcher's
            # rate frames change while they come; its receipt follows them.
            pacer = Pacer(request.rate) if request.rate else None
            frames = asyncio.create_task(self._fetcher_frames(reader, writer, pacer)) if pacer is not None else None
            try:
                traffic = self._store.traffic(round)
                started = loop.time()
                if isinstance(copy, HeldSnapshot):
                    await self._send_snapshot(round, copy, request.offset, writer, traffic, pacer)
                else:
                    await self._send_packet(round, publisher, copy, request, requester, writer, traffic, pacer)
                if not request.stripe:
                    traffic.num_served += 1
                written = loop.time()
                # The slot is held until the fetcher says it has the verified bytes (or gives up).
                receipt = await asyncio.wait_for(frames or reader.read(len(RECEIPT)), cfg.stall_timeout_s)
                log.debug(
                    "round %d: served %s's packet to %s%s%s: a copy after %.3f s, started after %.3f s, written in "
                    "%.3f s, receipt after %.3f s",
                    round,
                    publisher,
                    requester[-8:],
                    f" (stripe {request.stripe} of {request.stripes})" if request.stripes > 1 else "",
                    " as a child" if child else "",
                    found - opened,
                    started - found,
                    written - started,
                    loop.time() - written,
                )
                if receipt == RECEIPT and requester not in copy.sent_to:
                    copy.sent_to.append(requester)
            finally:
                copy.receiving.remove(requester)
                if frames is not None:
                    frames.cancel()
        except ProtocolError as e:
            try:
                writer.write(encode_error(str(e)))
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
            except OSError:  # ConnectionError, or the drain timed out (asyncio.TimeoutError is an OSError)
                pass  # the caller is gone; nothing to tell
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            log.debug("packet stream dropped: %r", e)
        except Exception:  # a bug here must not take the node down with it
            log.exception("packet stream handler failed")
        finally:
            if slot is not None:
                slot.release()
            elif child:
                self._children_of[requester] -= 1
                if not self._children_of[requester]:
                    del self._children_of[requester]
            writer.close()

    async def _answer_busy(self, writer: asyncio.StreamWriter, copy: Held | Partial, besides: str = "") -> None:
        """A busy answer, naming peers with a copy (`_copy_holders`)."""
        writer.write(encode_busy(self._copy_holders(copy, besides)))
        await asyncio.wait_for(writer.drain(), self.config.request_timeout_s)

    def _copy_holders(self, copy: Held | Partial, besides: str = "") -> list[str]:
        """Up to MAX_BUSY_NAMES peers with a copy, never `besides` (the asker): those that confirmed
        one first, then those receiving one."""
        sent_to = [p for p in copy.sent_to if p != besides]
        confirmed = self._rng.sample(sent_to, min(MAX_BUSY_NAMES, len(sent_to)))
        arriving = [p for p in dict.fromkeys(copy.receiving) if p not in confirmed and p != besides]
        return confirmed + self._rng.sample(arriving, min(MAX_BUSY_NAMES - len(confirmed), len(arriving)))

    async def _write(
        self, payload: memoryview, writer: asyncio.StreamWriter, traffic: Traffic, pacer: Pacer | None = None
    ) -> None:
        """`payload` to the stream (`write_pieces`), paced at the fetcher's rate and on this node's uplink."""
        await write_pieces(
            writer,
            payload,
            traffic,
            chunk_bytes=self.config.chunk_bytes,
            stall_timeout_s=self.config.stall_timeout_s,
            pacer=pacer,
            uplink=self.uplink,
        )

    async def _fetcher_frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pacer: Pacer) -> bytes:
        """What the fetcher of a paced stream sends while its bytes go: rate frames, each setting
        the pacer's rate, then its receipt (returned; b"" at EOF). Anything else, a rate out of
        bounds, or more than MAX_RATE_FRAMES frames, ends the stream (b"": no receipt)."""
        for _ in range(MAX_RATE_FRAMES + 1):
            tag = await reader.read(1)
            if tag in (RECEIPT, b""):
                return tag
            if tag != RATE:
                log.debug("paced stream ended: %r where a rate frame or the receipt goes", tag)
                break
            _, rate = RATE_FRAME.unpack(RATE + await reader.readexactly(RATE_FRAME.size - 1))
            try:
                pacer.set_rate(check_rate(rate))
            except ProtocolError as e:
                log.debug("paced stream ended: %s", e)
                break
        else:
            log.debug("paced stream ended: more than %d rate frames", MAX_RATE_FRAMES)
        writer.close()
        return b""

    async def _send_snapshot(
        self,
        round: int,
        copy: HeldSnapshot,
        offset: int,
        writer: asyncio.StreamWriter,
        traffic: Traffic,
        pacer: Pacer | None = None,
    ) -> None:
        """The snapshot's bytes from `offset` on, a verified unit at a time (one unit in memory)."""
        from node.training.snapshot import StaleSnapshot

        source = copy.source
        if offset > source.size_bytes:
            raise MalformedPacket(f"offset {offset} past the snapshot's {source.size_bytes} bytes")
        writer.write(encode_response_header(STATUS_OK, source.size_bytes - offset))
        while offset < source.size_bytes:
            try:
                start, unit = await asyncio.to_thread(source.read_unit, offset)
            except StaleSnapshot as e:
                # Stop serving it (its announcement stays, and gets "not held"); end the stream short.
                if self._store.held.get((round, PARAMS_ID)) is copy:
                    self._store.drop((round, PARAMS_ID))
                log.info("round %d: stopped serving snapshot %s: %s", round, copy.digest[:12], e)
                raise ConnectionError("snapshot no longer held") from e
            end = start + len(unit)
            payload = memoryview(self._payload_for(round, PARAMS_ID, unit))
            del unit
            await self._write(payload[offset - start :], writer, traffic, pacer)
            del payload  # one unit in memory per stream: gone before the next is read
            offset = end

    async def _send_packet(
        self,
        round: int,
        publisher: str,
        copy: Held | Partial,
        request: PacketRequest,
        requester: str,
        writer: asyncio.StreamWriter,
        traffic: Traffic,
        pacer: Pacer | None = None,
    ) -> None:
        """The packet from the request's offset on, or its stripe, to `requester`; a copy still
        arriving as it arrives."""
        key = (round, publisher)
        if isinstance(copy, Held):
            payload = memoryview(self._payload_for(round, publisher, copy.data))
            size = len(payload)
        else:
            size = copy.length
        # A paced uplink binds before a stream's window does: its stripes would add nothing, and
        # the fetcher asks for the others only once part 0's answer came, a round trip or more
        # (0.06-0.55 s in the lab) during which part 0 alone left at the link's rate and then the
        # link idled. Part 0's request gets the whole packet then, on its one stream.
        if request.stripes > 1 and (request.stripe or self.uplink is None):
            bounds = stripe_bounds(size, request.stripes)
            if request.stripe >= len(bounds):
                raise MalformedPacket(f"stripe {request.stripe} of a packet cut in {len(bounds)}")
            start, end = bounds[request.stripe]
            writer.write(encode_response_header(STATUS_STRIPED, size))
        else:
            if request.offset > size:
                raise MalformedPacket(f"offset {request.offset} past the packet's {size} bytes")
            start, end = request.offset, size
            writer.write(encode_response_header(STATUS_OK, size - start))
        if isinstance(copy, Partial):
            await self._forward(copy, start, end, writer, traffic, pacer)
            return
        # Every peer waits for the first copy of this node's own packet: downloads hold back
        # meanwhile, until every byte of it was written to one peer (all of its stripes: they may
        # start a round trip apart, so stripe 0's end is not the copy's).
        first = copy.own and not copy.first_out
        with self._store.sending_first_copy(key) if first else contextlib.nullcontext():
            await self._write(payload[start:end], writer, traffic, pacer)
            if first:
                copy.written_to[requester] = written = copy.written_to.get(requester, 0) + end - start
                if written >= size:
                    self._store.first_copy_out(key)

    async def _forward(
        self,
        partial: Partial,
        start: int,
        end: int,
        writer: asyncio.StreamWriter,
        traffic: Traffic,
        pacer: Pacer | None = None,
    ) -> None:
        """Send bytes [start, end) of a packet that is still arriving, each piece as it comes, the
        last one once the packet verified."""
        sent = start
        while sent < end:
            if partial.failed:
                raise ConnectionError("the copy being forwarded failed upstream")
            upto = partial.servable(sent, end)
            if upto > sent:
                await self._write(memoryview(partial.read(sent, upto)), writer, traffic, pacer)
                sent = upto
            else:
                await asyncio.wait_for(partial.arrived.wait(), self.config.stall_timeout_s)
