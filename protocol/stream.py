"""The packet stream, protocol "locoswarm.packet.v1": the bytes a fetcher and a holder exchange.

A fetcher opens a libp2p stream to a holder under PROTOCOL_NAME and asks for one packet, named
by run, round, publisher and digest (the DHT records of protocol/dht_records.py say who holds
what); the holder answers with the packet, an error, or "busy". Any client that speaks to this
project's nodes follows this layout:

    request   u32 big-endian length L (at most 1024), then L bytes of msgpack map
              {"run": str, "round": int, "peer": str (publisher peer id), "digest": hex str,
               "wait": bool (optional; true: queue for an upload slot rather than be answered busy),
               "child": bool (optional; true: the fetcher is the holder's child in the packet's
                              tree, served on a stream of its own beside the upload slots),
               "offset": int (optional, written only when not 0; serve the bytes from this
                              offset on: a snapshot transfer resuming at another holder),
               "stripe": int, "stripes": int (optional, both or neither, never with offset; a
                              packet in `stripes` parts, 2 to MAX_STRIPES: serve part `stripe`),
               "rate": int (optional, MIN_RATE to MAX_RATE bytes/s: send this stream's bytes no
                              faster; the fetcher's rate frames change it later)}
    response  u8 status, u64 big-endian length N, then N bytes:
              status 0: the packet bytes from the offset on (written in pieces as they are
                        available), N = size - offset
              status 3: striped: N is the packet's size, and the bytes that follow are only
                        part `stripe` of it, `stripe_bounds(N, stripes)` long
              status 1: a UTF-8 error message (N at most 512), e.g. "not held"
              status 2: busy: every upload slot is taken; N bytes (at most 512) of msgpack list
                        of up to 8 libp2p peer ids (base58) with a copy: those that confirmed a
                        verified one first, then those it is being sent to now
    receipt   after status 0 or 3, the fetcher sends one byte 0x01 once the bytes hash to the digest; the
              holder keeps the upload slot until it reads it (or EOF, or its stall time-out)
    rate      after a request with "rate", and before its receipt, the fetcher may send rate frames:
              u8 0x02, u32 big-endian bytes/s (MIN_RATE to MAX_RATE), the stream's new rate; a
              holder that reads anything else there, a rate out of bounds, or more than
              MAX_RATE_FRAMES frames, ends the stream

A holder answers only for a packet it holds (whole, or still arriving) with exactly the requested
digest; a request that is malformed, for another run, or for a packet not held gets an error
frame, and one that does not arrive in time just closes the stream. A holder forwarding a packet
it is still receiving holds back the last byte until its own copy hashed to the digest, so a copy
that fails upstream ends the stream short rather than with bad bytes. A fetcher refuses a length
that differs from the announced size (or exceeds its packet limit) before reading the body, and
the sha256 of the bytes must equal the digest asked for (`DigestMismatch` otherwise).

Stripes: one libp2p stream carries at most one yamux window (256 KiB, fixed by the yamux spec) per
round trip until its window grows, 52 Mbps over a 40 ms round trip, so a packet of a few megabytes
is asked for in parts, each on a stream of its own, side by side. Part 0 is the request that queues
and takes the upload slot (or the child stream) as a whole request would; the fetcher asks for the
other parts once part 0's answer came, and a holder serves those only while it serves part 0 to the
same peer, on no slot of their own. A holder may answer part 0's request with status 0 and the
whole packet, and the fetcher then asks for no other part: a node whose uplink binds before a
stream's window does (a slow one, which paces its uploads) answers so. `stripe_bounds` cuts a
packet into at most `stripes` parts of at least MIN_STRIPE_BYTES, so a small packet has one part,
and both sides compute the same cut from the size. A holder forwarding a copy still arriving holds
back the last byte of every part until the copy verified. The receipt goes on every part's stream
once the whole packet hashed to its digest.

Rates: a fetcher on a slow link that states its download rate asks each holder to send at its
share of nine tenths of it (node/exchange/pace.py), and tells every stream its new share whenever
a download starts or ends. The holder writes the stream in small pieces at that rate. Pacing the
reads instead cannot work: p2pd and the kernel take hundreds of kB of every stream before flow
control reaches the sender, so a few downloads keep the link's download queue full, and the
requests for the node's own packet and the acknowledgements of its uploads wait behind them (in
the lab, where the queue drops at its tail, a 10 Mbps publisher answered after up to 1.6 s).

Pushes, protocol "locoswarm.push.v1": a node nobody can dial hands its packet to a reachable peer
over a stream it opens itself (node/exchange/push.py), which then holds and serves it as any holder:

    offer     the request layout above with the map {"run", "round", "peer" (publisher peer id),
              "digest", "size": int (the packet's length)}, and for a striped push "stripe" and
              "stripes" (both or neither, as in requests)
    answer    a response header: status 0 with N = 0 ("send it"), or an error frame (refused: the
              reason, e.g. "full" or "not submitted"; exactly ALREADY_HELD: the holder has a
              verified copy with that digest already, which is as good as a push)
    body      after status 0, the pusher sends exactly `size` bytes; the holder asks the
              coordinator whether the publisher submitted that digest while they come
    verdict   a response header: status 0 with N = 0 once the bytes hashed to the digest, the
              submission was confirmed and the copy is held, or an error frame (a refused
              submission may end the stream before the body does)

A striped push crosses the same round trips a striped fetch does, with the same cut
(`stripe_bounds(size, stripes)`): the pusher offers stripe 0 with the number of stripes, and once
the holder said "send it" opens a stream for every other stripe, whose offer repeats stripe 0's but
for "stripe". The holder takes a stripe's stream only while it takes stripe 0's from the same peer
(an error frame otherwise); every stream then carries its stripe's bytes, and every stream gets
the one verdict on the whole packet. A holder of an earlier version refuses a striped offer with
UNSTRIPED_OFFER's message; the pusher then offers it the packet whole on one stream.

Parameter snapshots (publisher "params") use the same stream; their bytes are laid out and
checked as protocol/snapshot.py says: the fetcher knows their exact length from its own model
(no packet limit applies), checks them chunk by chunk against a hash tree, and resumes a broken
transfer elsewhere with "offset".

One encoder and one decoder per message: `encode_request` / `request_body_length` then
`decode_request` (two steps, because a stream reader learns the body's length from the prefix),
`encode_response_header` / `decode_response_header`, `encode_busy` / `decode_busy`, `encode_error`
/ `decode_error`. Decoders treat their input as hostile: lengths are bounded before anything sized
by them is read, msgpack is parsed with limits, and every refusal is a `protocol.errors` type.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import msgpack

from protocol.errors import MalformedPacket, OversizedPacket, ProtocolError, TruncatedPacket

PROTOCOL_NAME = "locoswarm.packet.v1"
PUSH_PROTOCOL_NAME = "locoswarm.push.v1"
ALREADY_HELD = "already held"  # a push answer: the holder has that packet, with that digest, already
REQUEST_PREFIX = struct.Struct(">I")
RESPONSE_HEADER = struct.Struct(">BQ")
STATUS_OK, STATUS_ERROR, STATUS_BUSY, STATUS_STRIPED = 0, 1, 2, 3
RECEIPT = b"\x01"  # the fetcher's "verified" after a packet
RATE = b"\x02"  # a rate frame's tag: the stream's new rate follows
RATE_FRAME = struct.Struct(">cI")
MIN_RATE = 32 << 10  # bytes/s: under this a packet of a few MB would outlast the holder's patience
MAX_RATE = (1 << 32) - 1
MAX_RATE_FRAMES = 1024  # per stream: an honest fetcher sends one each time one of its downloads starts or ends
MAX_REQUEST_BYTES = 1024
MAX_ERROR_BYTES = 512
MAX_BUSY_BYTES = 512
MAX_BUSY_NAMES = 8  # peers named in a busy answer
MAX_STRIPES = 8  # parts a packet may be asked for in
MIN_STRIPE_BYTES = 256 << 10  # a part smaller than one yamux window gains nothing
MAX_PEER_ID_CHARS = 128  # a base58 libp2p id is about 52 characters
REQUEST_KEYS = frozenset({"run", "round", "peer", "digest"})
OPTIONAL_REQUEST_KEYS = frozenset({"wait", "child", "offset", "stripe", "stripes", "rate"})
OFFER_KEYS = frozenset({"run", "round", "peer", "digest", "size"})
UNSTRIPED_OFFER = "offer is not a map with run, round, peer, digest, size"  # how earlier holders refuse stripes
# What hivemind 1.1.12's PeerID.from_base58 (base58.b58decode) accepts: the bitcoin alphabet,
# after trailing whitespace is stripped. The same test here keeps this module free of hivemind.
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]*")


class DigestMismatch(ProtocolError):
    """A holder sent bytes that do not hash to the digest asked for (a packet's sha256, or a
    snapshot's hash tree)."""


class HolderRefused(ProtocolError):
    """A holder answered with an error frame (it does not hold the packet, or refused the request)."""


class HolderBusy(Exception):
    """Every upload slot of the holder is taken; `holders` are peers it already sent the packet to."""

    def __init__(self, holders: list[str]):
        super().__init__(f"busy; try {len(holders)} other holders")
        self.holders = holders


@dataclass(frozen=True, slots=True, kw_only=True)
class PacketRequest:
    """A fetcher's request for one packet."""

    run: str
    round: int
    publisher: str  # the publisher's peer id (wire key "peer")
    digest: str  # sha256 hex of the packet asked for
    wait: bool = False  # queue for an upload slot instead of a busy answer
    child: bool = False  # the fetcher is the holder's child in the packet's tree
    offset: int = 0  # serve the bytes from here on (a snapshot transfer resuming)
    stripe: int = 0  # with stripes > 1: the part of the packet asked for
    stripes: int = 1  # the parts the packet is cut in (stripe_bounds); 1: the whole packet
    rate: int = 0  # bytes/s the holder sends this stream at, at most (rate frames change it); 0: unpaced


def stripe_bounds(size: int, stripes: int) -> list[tuple[int, int]]:
    """[start, end) of each part of a `size`-byte packet asked for in `stripes` parts: at most
    that many, each at least MIN_STRIPE_BYTES (one part for a small packet), even in size."""
    n = max(1, min(stripes, size // MIN_STRIPE_BYTES))
    return [(size * i // n, size * (i + 1) // n) for i in range(n)]


def encode_request(request: PacketRequest) -> bytes:
    """The request frame: length prefix, then the msgpack map (wait and child always written,
    offset only when not 0, stripe and stripes only when more than one, rate only when paced)."""
    fields = {
        "run": request.run,
        "round": request.round,
        "peer": request.publisher,
        "digest": request.digest,
        "wait": request.wait,
        "child": request.child,
    }
    if request.offset:
        fields["offset"] = request.offset
    if request.stripes > 1:
        fields["stripe"], fields["stripes"] = request.stripe, request.stripes
    if request.rate:
        fields["rate"] = check_rate(request.rate)
    body = msgpack.packb(fields)
    return REQUEST_PREFIX.pack(len(body)) + body


def request_body_length(prefix: bytes) -> int:
    """The length of the request body that follows this 4-byte prefix; at most MAX_REQUEST_BYTES."""
    if len(prefix) != REQUEST_PREFIX.size:
        raise TruncatedPacket(f"request prefix of {len(prefix)} bytes, not {REQUEST_PREFIX.size}")
    (length,) = REQUEST_PREFIX.unpack(prefix)
    if length > MAX_REQUEST_BYTES:
        raise OversizedPacket(f"request of {length} bytes")
    return length


def _unpack_frame(body: bytes, what: str):
    """The msgpack value of a request or offer body, parsed with limits (a map of short strings and ints)."""
    if len(body) > MAX_REQUEST_BYTES:
        raise OversizedPacket(f"{what} of {len(body)} bytes")
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_REQUEST_BYTES,
            max_bin_len=0,
            max_array_len=0,
            max_map_len=10,
        )
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise MalformedPacket(f"{what} does not parse: {type(e).__name__}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_request(body: bytes) -> PacketRequest:
    """The request in a body read after its prefix; which run it names is for the caller to check."""
    request = _unpack_frame(body, "request")
    if not isinstance(request, dict) or not REQUEST_KEYS <= set(request) <= REQUEST_KEYS | OPTIONAL_REQUEST_KEYS:
        raise MalformedPacket(
            "request is not a map with run, round, peer, digest"
            " (and optionally wait, child, offset, stripe, stripes, rate)"
        )
    run, round, publisher, digest = (request[k] for k in ("run", "round", "peer", "digest"))
    wait, child, offset = request.get("wait", False), request.get("child", False), request.get("offset", 0)
    stripe, stripes, rate = request.get("stripe", 0), request.get("stripes", 1), request.get("rate", 0)
    if not (
        isinstance(run, str)
        and isinstance(publisher, str)
        and isinstance(digest, str)
        and isinstance(round, int)
        and not isinstance(round, bool)
        and isinstance(wait, bool)
        and isinstance(child, bool)
        and _is_int(offset)
        and _is_int(stripe)
        and _is_int(stripes)
        and _is_int(rate)
    ):
        raise MalformedPacket("request fields have the wrong types")
    if offset < 0:
        raise MalformedPacket(f"request offset {offset} is negative")
    if ("stripe" in request) != ("stripes" in request):
        raise MalformedPacket("a striped request names both its stripe and the number of stripes")
    if "stripes" in request and not (2 <= stripes <= MAX_STRIPES and 0 <= stripe < stripes and not offset):
        raise MalformedPacket(f"stripe {stripe} of {stripes}: 2 to {MAX_STRIPES} stripes, and no offset beside them")
    if "rate" in request:
        check_rate(rate)
    return PacketRequest(
        run=run,
        round=round,
        publisher=publisher,
        digest=digest,
        wait=wait,
        child=child,
        offset=offset,
        stripe=stripe,
        stripes=stripes,
        rate=rate,
    )


def check_rate(rate: int) -> int:
    """A stream's rate (bytes/s) as a request or rate frame names it, refused out of bounds."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise MalformedPacket(f"rate {rate} bytes/s is not within {MIN_RATE} to {MAX_RATE}")
    return rate


def encode_rate(rate: int) -> bytes:
    """A rate frame: the stream's new rate, in bytes/s."""
    return RATE_FRAME.pack(RATE, check_rate(rate))


@dataclass(frozen=True, slots=True, kw_only=True)
class PushOffer:
    """A pusher's offer of one packet to a holder (PUSH_PROTOCOL_NAME)."""

    run: str
    round: int
    publisher: str  # the publisher's peer id (wire key "peer")
    digest: str  # sha256 hex of the packet
    size: int  # its length in bytes
    stripe: int = 0  # which part this stream carries, of `stripes` (`stripe_bounds`)
    stripes: int = 1


def encode_offer(offer: PushOffer) -> bytes:
    """The offer frame (stripe and stripes only when more than one)."""
    fields = {
        "run": offer.run,
        "round": offer.round,
        "peer": offer.publisher,
        "digest": offer.digest,
        "size": offer.size,
    }
    if offer.stripes > 1:
        fields["stripe"], fields["stripes"] = offer.stripe, offer.stripes
    body = msgpack.packb(fields)
    return REQUEST_PREFIX.pack(len(body)) + body


def decode_offer(body: bytes, max_packet_bytes: int) -> PushOffer:
    """The offer in a body read after its prefix (`request_body_length`); a size over the
    holder's packet limit, or not positive, is refused here."""
    offer = _unpack_frame(body, "offer")
    if not isinstance(offer, dict) or set(offer) not in (OFFER_KEYS, OFFER_KEYS | {"stripe", "stripes"}):
        raise MalformedPacket(f"{UNSTRIPED_OFFER}, and optionally stripe and stripes")
    run, round, publisher, digest, size = (offer[k] for k in ("run", "round", "peer", "digest", "size"))
    stripe, stripes = offer.get("stripe", 0), offer.get("stripes", 1)
    if not (isinstance(run, str) and isinstance(publisher, str) and isinstance(digest, str)):
        raise MalformedPacket("offer fields have the wrong types")
    if not (_is_int(round) and _is_int(size) and _is_int(stripe) and _is_int(stripes)) or round < 0:
        raise MalformedPacket("offer round, size and stripes must be integers, the round not negative")
    if not 0 < size <= max_packet_bytes:
        raise OversizedPacket(f"offer of {size} bytes; the limit is {max_packet_bytes}")
    if "stripes" in offer and not (2 <= stripes <= MAX_STRIPES and 0 <= stripe < len(stripe_bounds(size, stripes))):
        raise MalformedPacket(f"stripe {stripe} of {stripes}: 2 to {MAX_STRIPES} stripes, one the size has")
    return PushOffer(
        run=run, round=round, publisher=publisher, digest=digest, size=size, stripe=stripe, stripes=stripes
    )


def encode_response_header(status: int, length: int) -> bytes:
    return RESPONSE_HEADER.pack(status, length)


def decode_response_header(raw: bytes, max_packet_bytes: int) -> tuple[int, int]:
    """(status, length) of a response; a busy answer or a packet longer than its limit is refused."""
    if len(raw) != RESPONSE_HEADER.size:
        raise TruncatedPacket(f"response header of {len(raw)} bytes, not {RESPONSE_HEADER.size}")
    status, length = RESPONSE_HEADER.unpack(raw)
    if status not in (STATUS_OK, STATUS_ERROR, STATUS_BUSY, STATUS_STRIPED):
        raise MalformedPacket(f"unknown response status {status}")
    if status == STATUS_BUSY and length > MAX_BUSY_BYTES:
        raise OversizedPacket(f"busy answer of {length} bytes")
    if status in (STATUS_OK, STATUS_STRIPED) and length > max_packet_bytes:
        raise OversizedPacket(f"holder offers {length} bytes, the limit is {max_packet_bytes}")
    return status, length


def encode_error(message: str) -> bytes:
    """A whole error response: header, then the message cut to MAX_ERROR_BYTES."""
    text = message.encode()[:MAX_ERROR_BYTES]
    return encode_response_header(STATUS_ERROR, len(text)) + text


def decode_error(raw: bytes) -> str:
    """The message of an error response (for logs only: undecodable bytes are replaced)."""
    return raw[:MAX_ERROR_BYTES].decode("utf-8", "replace")


def is_peer_id(text: str) -> bool:
    """Whether `text` reads as a base58 libp2p peer id, as hivemind's PeerID.from_base58 reads it."""
    return isinstance(text, str) and _BASE58.fullmatch(text.rstrip()) is not None


def encode_busy(holders: list[str]) -> bytes:
    """A whole busy response: header, then the msgpack list of peers with a copy."""
    if len(holders) > MAX_BUSY_NAMES:
        raise ValueError(f"a busy answer names at most {MAX_BUSY_NAMES} peers, not {len(holders)}")
    body = msgpack.packb(holders)
    return encode_response_header(STATUS_BUSY, len(body)) + body


def decode_busy(body: bytes) -> list[str]:
    """The peer ids in a busy answer; anything else in it is a malformed answer."""
    if len(body) > MAX_BUSY_BYTES:
        raise OversizedPacket(f"busy answer of {len(body)} bytes")
    try:
        names = msgpack.unpackb(
            body, raw=False, max_str_len=MAX_PEER_ID_CHARS, max_bin_len=0, max_array_len=MAX_BUSY_NAMES, max_map_len=0
        )
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise MalformedPacket(f"busy answer does not parse: {type(e).__name__}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MalformedPacket("busy answer is not a list of peer ids")
    for name in names:
        if not is_peer_id(name):
            raise MalformedPacket(f"busy answer names {name[:20]!r}, not a peer id")
    return names
