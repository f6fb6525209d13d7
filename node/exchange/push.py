"""Pushing packets to reachable holders: how a node nobody can dial gets its packet served.

    receiver = PushReceiver(config, store, announcer)     # P2PExchange answers PUSH_PROTOCOL_NAME with it
    receiver.accept = check                               # (round, publisher, digest) -> was it submitted so?
    holder = await push_packet(host, config, traffic, offer, data, targets)   # the first target that took it

A node behind a NAT can open streams but nobody can open one to it, so a fetcher that dials it
waits out its dial time-out and its packet spreads only over connections it happened to open.
Such a node (the coordinator's dial-back at join says so, or its operator: coordinator/
reachability.py) hands its packet to a reachable peer over a stream it opens itself, the first of
`targets` that takes it (node/exchange/topology.py `push_targets`: the first reachable member of
the packet's tree, which all peers compute alike, then the others in tree order). That peer
holds, serves and announces the copy as one it fetched, so every other peer fetches from it.
Snapshots are not pushed: such a node dials the peers loading a snapshot that the coordinator
lists in its heartbeat answers (connection reversal, `P2PExchange.dial_peers`), and they fetch
the snapshot it serves over that connection like any other (node/exchange/fetch.py).

The receiver treats an offer as hostile (protocol/stream.py, "Pushes"): it refuses a packet of
another run or an old round, one over its packet limit, one it holds already, more than
`max_push_streams` at once, more than `max_push_bytes` of pushed packets held, and any packet
whose digest `accept` does not confirm (the node asks the coordinator whether the publisher
submitted that digest: pushed bytes are only ever a submitted packet). It asks while the body
comes, so the coordinator's answer is off the path of the packet every peer waits for; a body it
refuses is dropped, whole or not, and never announced. The body must be exactly
the offered size and hash to the offered digest; reads stall out after `stall_timeout_s`. While
it arrives the copy is a `Partial`, served onward cut-through like a fetched one, so a fetcher that
asks meanwhile waits for it rather than looking elsewhere. The handler never raises.

The body comes in up to `stripes` parts side by side, a stream each, as a fetched copy does: one
stream carries one yamux window per round trip. The other stripes' streams ride on stripe 0's
push from the same peer and are refused without it (`_join_stripe`); a stripe that does not come
within the connect time-out fails the push, and every stream hears the one verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from node.exchange.announce import Announcer
from node.exchange.base import Traffic
from node.exchange.config import ExchangeConfig
from node.exchange.host import Host, dial_addresses
from node.exchange.pace import Uplink, write_pieces
from node.exchange.store import PacketStore, all_or_first_error
from protocol.errors import ProtocolError
from protocol.stream import (
    ALREADY_HELD,
    MAX_ERROR_BYTES,
    PUSH_PROTOCOL_NAME,
    RESPONSE_HEADER,
    STATUS_ERROR,
    STATUS_OK,
    UNSTRIPED_OFFER,
    HolderRefused,
    PushOffer,
    decode_error,
    decode_offer,
    decode_response_header,
    encode_error,
    encode_offer,
    encode_response_header,
    request_body_length,
    stripe_bounds,
)

log = logging.getLogger(__name__)
# Each push made, at DEBUG; the network lab reads it (tools/netlab/timeline.py).
PUSHED_LINE = (
    "round %d: pushed %d bytes to %s in %d stripes: go-ahead after %.3f s, written in %.3f s, verdict after %.3f s"
)

AcceptPush = Callable[[int, str, str], Awaitable[bool]]  # (round, publisher, digest) -> submitted so?
UNANSWERED_S = 60.0  # after a check the coordinator did not answer, offers ask before their body this long


@dataclass(slots=True)
class _Striped:
    """A striped push being received: its offer (stripe 0's), each stripe's stream as it comes,
    and the verdict its other streams get (None: held; else the refusal)."""

    offer: PushOffer
    readers: list[asyncio.Future[asyncio.StreamReader]]
    verdict: asyncio.Future[str | None]


class PushReceiver:
    """Takes packets pushed by nodes nobody can dial, within its limits (see the module docstring)."""

    def __init__(self, config: ExchangeConfig, store: PacketStore, announcer: Announcer):
        self.config = config
        self._store, self._announcer = store, announcer
        self.accept: AcceptPush | None = None  # None: every push is refused
        self.min_round = 0  # offers for older rounds are refused (the exchange's forget_before)
        self._pushed: dict[tuple[int, str], int] = {}  # (round, publisher) -> bytes, of pushes taken
        self._num_streams = 0
        self._striped: dict[tuple[int, str, str], _Striped] = {}  # (round, publisher, pusher) -> its stripes
        self._unanswered_until = -math.inf  # a check went unanswered: ask before the body until then

    def held_bytes(self) -> int:
        """Bytes of pushed packets this node still holds or is receiving."""
        store = self._store
        live = {k: n for k, n in self._pushed.items() if k in store.held or k in store.partial}
        self._pushed = live
        return sum(live.values())

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg, source = self.config, str(stream_info.peer_id)
        counted = False  # a stripe's stream after the first rides on its push: it counts no stream
        striped: _Striped | None = None  # this push's other stripes' streams, while it is received
        verdict: str | None = "the push's first stripe failed"  # what those streams are told
        try:
            length = request_body_length(await asyncio.wait_for(reader.readexactly(4), cfg.request_timeout_s))
            body = await asyncio.wait_for(reader.readexactly(length), cfg.request_timeout_s)
            offer = decode_offer(body, cfg.max_packet_bytes)
            if offer.stripe:
                await self._join_stripe(offer, source, reader, writer)
                return
            self._num_streams, counted = self._num_streams + 1, True
            refusal = self._refusal(offer)
            # The body comes while the coordinator is asked: its answer is off the push's path.
            # While it does not answer, the body would only be dropped: ask first then.
            asked_first = refusal is None and asyncio.get_running_loop().time() < self._unanswered_until
            if asked_first:
                refusal = await self._submission_refusal(offer)
            if refusal is None:
                striped = self._expect_stripes(offer, source, reader)  # before the pusher may open them
                writer.write(encode_response_header(STATUS_OK, 0))
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
                if asked_first:
                    await self._receive(reader, offer, source, striped)
                else:
                    refusal = await self._receive_checked(reader, offer, source, striped)
            if refusal is not None:
                verdict = refusal
                log.info(
                    "round %d: refused a push of %s's packet from %s: %s", offer.round, offer.publisher, source, refusal
                )
                writer.write(encode_error(refusal))
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
                return
            self._announcer.announce_holder(offer.round, offer.publisher, offer.digest, offer.size)
            verdict = None
            writer.write(encode_response_header(STATUS_OK, 0))
            await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
            log.info("round %d: holding %s's packet, pushed by %s", offer.round, offer.publisher, source)
        except (ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            log.info("push from %s failed: %r", source, e)
            try:
                writer.write(encode_error(str(e) or type(e).__name__))
                await asyncio.wait_for(writer.drain(), cfg.request_timeout_s)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                pass
        finally:
            if counted:
                self._num_streams -= 1
            if striped is not None:
                self._end_stripes(striped, source, verdict)
            writer.close()

    def _expect_stripes(self, offer: PushOffer, source: str, reader: asyncio.StreamReader) -> _Striped | None:
        """The other stripes' streams this push will bring (None: it comes whole on this one)."""
        num_stripes = len(stripe_bounds(offer.size, offer.stripes))
        if num_stripes == 1:
            return None
        loop = asyncio.get_running_loop()
        striped = _Striped(offer, [loop.create_future() for _ in range(num_stripes)], loop.create_future())
        striped.readers[0].set_result(reader)
        self._striped[(offer.round, offer.publisher, source)] = striped
        return striped

    async def _join_stripe(
        self, offer: PushOffer, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Stripe `offer.stripe` of a push whose stripe 0 this node takes from the same peer: its
        stream goes to that receipt (`_receive`), and gets the push's verdict once there is one."""
        striped = self._striped.get((offer.round, offer.publisher, source))
        if striped is None or striped.offer != dataclasses.replace(offer, stripe=0):
            verdict = "no push of that packet from you to take a stripe of"
        elif striped.readers[offer.stripe].done():
            verdict = f"stripe {offer.stripe} is taken already"
        else:
            striped.readers[offer.stripe].set_result(reader)  # before any await: the push may end meanwhile
            writer.write(encode_response_header(STATUS_OK, 0))
            await asyncio.wait_for(writer.drain(), self.config.request_timeout_s)
            verdict = await asyncio.shield(striped.verdict)
        writer.write(encode_error(verdict) if verdict is not None else encode_response_header(STATUS_OK, 0))
        await asyncio.wait_for(writer.drain(), self.config.request_timeout_s)

    def _end_stripes(self, striped: _Striped, source: str, verdict: str | None) -> None:
        """Tell the push's other stripes' streams its verdict; a stripe that never came is no longer awaited."""
        key = (striped.offer.round, striped.offer.publisher, source)
        if self._striped.get(key) is striped:
            del self._striped[key]
        striped.verdict.set_result(verdict)
        for stripe in striped.readers:
            stripe.cancel()  # no-op for those that came

    def _refusal(self, offer: PushOffer) -> str | None:
        """Why this offer is refused before its body comes (None: the body may come; the
        submission's check runs beside it, `_receive_checked`)."""
        cfg = self.config
        if offer.run != cfg.run_id:
            return f"not in run {offer.run}"
        if offer.round < self.min_round:
            return f"round {offer.round} is over here"
        if (refusal := self._held_refusal(offer)) is not None:
            return refusal
        if self._num_streams > cfg.max_push_streams:  # this stream counts itself
            return "busy: too many pushes at once"
        if self.held_bytes() + offer.size > cfg.max_push_bytes:
            return "full: pushed packets held reach max_push_bytes"
        if self.accept is None:
            return "this node takes no pushes"
        return None

    async def _submission_refusal(self, offer: PushOffer) -> str | None:
        """Why the publisher's submission refuses this offer (None: it submitted that digest)."""
        assert self.accept is not None
        try:
            submitted = await asyncio.wait_for(self.accept(offer.round, offer.publisher, offer.digest), 10.0)
        except Exception as e:  # the coordinator's answer is advice: no answer refuses the push
            log.debug("checking a push of %s's packet failed: %r", offer.publisher, e)
            self._unanswered_until = asyncio.get_running_loop().time() + UNANSWERED_S
            return "cannot check the submission now"
        self._unanswered_until = -math.inf  # it answers: bodies come beside the check again
        return None if submitted else "not the digest the publisher submitted"

    async def _receive_checked(
        self, reader: asyncio.StreamReader, offer: PushOffer, source: str, striped: _Striped | None
    ) -> str | None:
        """Receive the body while the submission is checked; None once both passed. A refused
        submission ends the body's receipt and drops what arrived, whole or not, never announced:
        a hostile push costs the bytes that arrive within the coordinator's answer. Until then a
        copy arriving may be served onward, but only to fetchers asking for its digest, which they
        had from a submission (protocol/stream.py, "Pushes"). A check the coordinator does not
        answer makes the next UNANSWERED_S of offers ask before their body: through an outage a
        pusher retries, and would send its whole packet each time for nothing."""
        checking = asyncio.ensure_future(self._submission_refusal(offer))
        receiving = asyncio.ensure_future(self._receive(reader, offer, source, striped))
        try:
            if (refusal := await checking) is not None:
                receiving.cancel()
                await asyncio.gather(receiving, return_exceptions=True)
                self._drop(offer)
                return refusal
            await receiving
            return None
        finally:
            for task in (checking, receiving):
                task.cancel()

    def _held_refusal(self, offer: PushOffer) -> str | None:
        """ALREADY_HELD when this node holds (or receives) that packet with that digest; a refusal
        when it holds another packet of that publisher and round; None when it holds none."""
        key = (offer.round, offer.publisher)
        copy = self._store.held.get(key) or self._store.partial.get(key)
        if copy is None:
            return None
        return ALREADY_HELD if copy.digest == offer.digest else "holds another packet of that publisher and round"

    async def _receive(
        self, reader: asyncio.StreamReader, offer: PushOffer, source: str, striped: _Striped | None
    ) -> None:
        """The body, whole on `reader` or in the stripes `striped` expects (each stream within the
        connect time-out of the go-ahead, or the push fails)."""
        cfg, key = self.config, (offer.round, offer.publisher)
        self._pushed[key] = offer.size

        async def open_stripe(i: int) -> asyncio.StreamReader:
            assert striped is not None
            return await asyncio.wait_for(asyncio.shield(striped.readers[i]), cfg.connect_timeout_s)

        try:
            await self._store.receive(
                key,
                offer.digest,
                offer.size,
                reader,
                piece_bytes=cfg.chunk_bytes << 1,
                read_timeout_s=lambda: cfg.stall_timeout_s,
                source=source,
                pushed=True,
                stripes=stripe_bounds(offer.size, offer.stripes) if striped is not None else (),
                open_stripe=open_stripe,
            )
        except BaseException:
            self._pushed.pop(key, None)
            raise
        self._store.traffic(offer.round).num_fetched += 1

    def _drop(self, offer: PushOffer) -> None:
        """Forget a refused push's copy, if it arrived whole before the refusal."""
        key = (offer.round, offer.publisher)
        held = self._store.held.get(key)
        if held is not None and held.pushed and held.digest == offer.digest:
            self._store.drop(key)
        self._pushed.pop(key, None)


async def push_packet(
    host: Host,
    config: ExchangeConfig,
    traffic: Traffic,
    offer: PushOffer,
    data: bytes,
    targets: list[tuple[str, list[str]]],
    timeout_s: float,
    uplink: Uplink | None = None,
    stripes: int = 1,
) -> str | None:
    """Push `data` to the first of `targets` ((libp2p id, multiaddrs), in order) that takes it and
    verifies it; returns that holder's id, or None when every target refused or failed. With
    `uplink`, the body's pieces take their turn on this node's stated uplink (pace.py). The body
    goes in up to `stripes` parts side by side, one stream each (protocol/stream.py, "Pushes"), or
    whole to a holder of an earlier version."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for holder, maddrs in targets:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(_push_one(host, config, traffic, offer, data, holder, maddrs, uplink, stripes), left)
            log.info("round %d: pushed this node's packet to %s", offer.round, holder)
            return holder
        except HolderRefused as e:
            if str(e) == ALREADY_HELD:  # a verified copy is there already (fetched over our own connection)
                log.info("round %d: %s holds this node's packet already", offer.round, holder)
                return holder
            log.info("round %d: %s refused this node's packet: %s", offer.round, holder, e)
        except (ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            log.info("round %d: pushing this node's packet to %s failed: %r", offer.round, holder, e)
        except Exception as e:  # p2pd control errors (dial failures) come as several private types
            log.info("round %d: %s unreachable for a push: %r", offer.round, holder, e)
    return None


async def _push_one(
    host: Host,
    config: ExchangeConfig,
    traffic: Traffic,
    offer: PushOffer,
    data: bytes,
    holder: str,
    maddrs: list[str],
    uplink: Uplink | None = None,
    stripes: int = 1,
) -> None:
    peer = PeerID.from_base58(holder)
    if maddrs:
        await asyncio.wait_for(host.connect(peer, dial_addresses(holder, maddrs)), config.connect_timeout_s)
    bounds = stripe_bounds(len(data), stripes)
    if len(bounds) > 1:
        try:
            return await _push_stripes(host, config, traffic, offer, data, peer, bounds, uplink)
        except HolderRefused as e:
            if str(e) != UNSTRIPED_OFFER:
                raise
            log.info("round %d: %s takes pushes whole (an earlier version)", offer.round, holder)
    await _push_stripes(host, config, traffic, offer, data, peer, [(0, len(data))], uplink)


async def _push_stripes(
    host: Host,
    config: ExchangeConfig,
    traffic: Traffic,
    offer: PushOffer,
    data: bytes,
    peer: PeerID,
    bounds: list[tuple[int, int]],
    uplink: Uplink | None,
) -> None:
    """Offer stripe 0, then open a stream for each other stripe once the holder said "send it";
    write every stripe's bytes side by side and wait for the verdict on each stream."""
    clock = asyncio.get_running_loop().time
    started = clock()
    if len(bounds) > 1:
        offer = dataclasses.replace(offer, stripe=0, stripes=len(bounds))
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def offered(stripe: int, answer_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.wait_for(host.open_stream(peer, PUSH_PROTOCOL_NAME), config.connect_timeout_s)
        streams.append((reader, writer))
        writer.write(encode_offer(dataclasses.replace(offer, stripe=stripe)))
        await writer.drain()
        await _answer(reader, answer_s)
        return reader, writer

    try:
        first = await offered(0, config.request_timeout_s + 10.0)  # the holder may ask the coordinator first
        answered = clock()
        # A failed offer ends the others before the streams are closed: none is opened after.
        others = await all_or_first_error([offered(i, config.request_timeout_s) for i in range(1, len(bounds))])
        ordered, view = [first, *others], memoryview(data)

        async def write(writer: asyncio.StreamWriter, start: int, end: int) -> None:
            await write_pieces(
                writer,
                view[start:end],
                traffic,
                chunk_bytes=config.chunk_bytes,
                stall_timeout_s=config.stall_timeout_s,
                uplink=uplink,
            )

        await all_or_first_error([write(w, *b) for (_, w), b in zip(ordered, bounds)])
        written = clock()
        await all_or_first_error([_answer(r, config.stall_timeout_s) for r, _ in ordered])
        log.debug(
            PUSHED_LINE,
            offer.round,
            len(data),
            str(peer)[-8:],
            len(bounds),
            answered - started,
            written - answered,
            clock() - written,
        )
    finally:
        for _, writer in streams:
            writer.close()


async def _answer(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """The holder's go-ahead or verdict: returns on status 0; a refusal raises HolderRefused."""
    status, length = decode_response_header(
        await asyncio.wait_for(reader.readexactly(RESPONSE_HEADER.size), timeout_s), max_packet_bytes=0
    )
    if status == STATUS_ERROR:
        message = await asyncio.wait_for(reader.read(min(length, MAX_ERROR_BYTES)), timeout_s)
        raise HolderRefused(decode_error(message))
    if status != STATUS_OK or length:
        raise HolderRefused(f"unexpected answer: status {status}, {length} bytes")
