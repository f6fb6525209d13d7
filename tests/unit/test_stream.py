"""The packet-stream wire format of protocol/stream.py: round trips, and refusal of hostile bytes."""

from __future__ import annotations

import random
import subprocess
import sys

import msgpack
import pytest

from protocol.errors import MalformedPacket, OversizedPacket, ProtocolError, TruncatedPacket
from protocol.stream import (
    MAX_ERROR_BYTES,
    MAX_RATE,
    MAX_REQUEST_BYTES,
    MAX_STRIPES,
    MIN_RATE,
    MIN_STRIPE_BYTES,
    RATE,
    RATE_FRAME,
    REQUEST_PREFIX,
    RESPONSE_HEADER,
    STATUS_BUSY,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_STRIPED,
    UNSTRIPED_OFFER,
    PacketRequest,
    PushOffer,
    decode_busy,
    decode_error,
    decode_offer,
    decode_request,
    decode_response_header,
    encode_busy,
    encode_error,
    encode_offer,
    encode_rate,
    encode_request,
    encode_response_header,
    is_peer_id,
    request_body_length,
    stripe_bounds,
)

DIGEST = "ab" * 32
HOLDERS = ["12D3KooWQsF5p9hSR9p8nwwe5tiBco3CcNSauVbT7jStrMnUpx45", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]
GOOD = {"run": "r1", "round": 3, "peer": "peer-a", "digest": DIGEST}


def split(frame: bytes) -> bytes:
    """The body of a request frame, after checking its prefix."""
    prefix, body = frame[: REQUEST_PREFIX.size], frame[REQUEST_PREFIX.size :]
    assert request_body_length(prefix) == len(body)
    return body


@pytest.mark.parametrize("wait, child", [(False, False), (True, False), (False, True), (True, True)])
def test_request_round_trips(wait, child):
    request = PacketRequest(run="r1", round=12, publisher="peer-a", digest=DIGEST, wait=wait, child=child)
    assert decode_request(split(encode_request(request))) == request


@pytest.mark.parametrize("stripe, stripes", [(0, 2), (1, 2), (0, MAX_STRIPES), (MAX_STRIPES - 1, MAX_STRIPES)])
def test_striped_requests_round_trip(stripe, stripes):
    request = PacketRequest(
        run="r1", round=12, publisher="p", digest=DIGEST, child=True, stripe=stripe, stripes=stripes
    )
    assert decode_request(split(encode_request(request))) == request


@pytest.mark.parametrize("rate", [MIN_RATE, 1_125_000, MAX_RATE])
def test_paced_requests_and_rate_frames_round_trip(rate):
    request = PacketRequest(run="r1", round=12, publisher="p", digest=DIGEST, stripe=1, stripes=4, rate=rate)
    assert decode_request(split(encode_request(request))) == request
    assert RATE_FRAME.unpack(encode_rate(rate)) == (RATE, rate) and len(encode_rate(rate)) == 5


@pytest.mark.parametrize("rate", [-1, MIN_RATE - 1, MAX_RATE + 1])
def test_a_rate_out_of_bounds_is_never_written(rate):
    with pytest.raises(MalformedPacket):
        encode_rate(rate)
    with pytest.raises(MalformedPacket):
        encode_request(PacketRequest(run="r1", round=1, publisher="p", digest=DIGEST, rate=rate))
    with pytest.raises(MalformedPacket):
        encode_rate(0)  # a stream is never told to stop: its fetcher reads it or hangs up


@pytest.mark.parametrize(
    "size, stripes",
    [(0, 4), (1, 4), (MIN_STRIPE_BYTES - 1, 4), (MIN_STRIPE_BYTES * 2, 4), (1_570_000, 4), (10**9 + 7, 8), (10**6, 1)],
)
def test_stripe_bounds_cover_the_packet_in_even_parts_of_at_least_the_minimum(size, stripes):
    bounds = stripe_bounds(size, stripes)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # adjacent, in order
    assert len(bounds) == max(1, min(stripes, size // MIN_STRIPE_BYTES))
    if len(bounds) > 1:
        lengths = [end - start for start, end in bounds]
        assert min(lengths) >= MIN_STRIPE_BYTES and max(lengths) - min(lengths) <= 1


def test_request_bytes_are_the_documented_layout():
    frame = encode_request(PacketRequest(run="r", round=1, publisher="p", digest=DIGEST))
    body = msgpack.packb({"run": "r", "round": 1, "peer": "p", "digest": DIGEST, "wait": False, "child": False})
    assert frame == len(body).to_bytes(4, "big") + body


def test_request_without_optional_keys_is_accepted():
    request = decode_request(msgpack.packb(GOOD))
    assert (request.run, request.round, request.publisher, request.digest) == ("r1", 3, "peer-a", DIGEST)
    assert not request.wait and not request.child


@pytest.mark.parametrize(
    "prefix, error",
    [
        (REQUEST_PREFIX.pack(MAX_REQUEST_BYTES + 1), OversizedPacket),
        (REQUEST_PREFIX.pack(1 << 30), OversizedPacket),
        (b"\x00\x00\x01", TruncatedPacket),
        (b"", TruncatedPacket),
    ],
)
def test_request_prefix_refuses_long_and_truncated(prefix, error):
    with pytest.raises(error):
        request_body_length(prefix)


BAD_REQUESTS = [
    b"",
    b"\xc1",
    msgpack.packb(GOOD)[:-3],  # empty, not msgpack, truncated
    msgpack.packb(GOOD) + b"\x00",  # trailing bytes
    msgpack.packb([1, 2]),
    msgpack.packb("r1"),
    msgpack.packb(None),  # not a map
    msgpack.packb({k: v for k, v in GOOD.items() if k != "digest"}),  # a required key missing
    msgpack.packb(GOOD | {"x": 1}),  # an unknown key
    msgpack.packb(GOOD | {"round": True}),
    msgpack.packb(GOOD | {"round": "3"}),
    msgpack.packb(GOOD | {"round": 1.0}),
    msgpack.packb(GOOD | {"run": 1}),
    msgpack.packb(GOOD | {"peer": None}),
    msgpack.packb(GOOD | {"digest": b"ab"}),
    msgpack.packb(GOOD | {"wait": 1}),
    msgpack.packb(GOOD | {"child": "yes"}),
    msgpack.packb({1: "r1", "round": 3, "peer": "p", "digest": DIGEST}),  # a non-string key
    msgpack.packb({**GOOD, **{f"k{i}": 0 for i in range(7)}}),  # more entries than any request has
    msgpack.packb(GOOD | {"stripe": 1}),  # a stripe without the number of stripes
    msgpack.packb(GOOD | {"stripes": 4}),  # ...and the other way round
    msgpack.packb(GOOD | {"stripe": 4, "stripes": 4}),  # past the last stripe
    msgpack.packb(GOOD | {"stripe": -1, "stripes": 4}),
    msgpack.packb(GOOD | {"stripe": 0, "stripes": 1}),  # one stripe is a plain request
    msgpack.packb(GOOD | {"stripe": 0, "stripes": MAX_STRIPES + 1}),
    msgpack.packb(GOOD | {"stripe": 0, "stripes": 1 << 40}),
    msgpack.packb(GOOD | {"stripe": True, "stripes": 4}),
    msgpack.packb(GOOD | {"stripe": 1, "stripes": 4, "offset": 10}),  # an offset and a stripe
    msgpack.packb(GOOD | {"run": ["r1"]}),  # a nested list
    msgpack.packb(GOOD | {"rate": 0}),  # a rate is written only when paced, and is never 0
    msgpack.packb(GOOD | {"rate": MIN_RATE - 1}),  # under the floor: a packet would outlast a stall
    msgpack.packb(GOOD | {"rate": MAX_RATE + 1}),
    msgpack.packb(GOOD | {"rate": -MIN_RATE}),
    msgpack.packb(GOOD | {"rate": True}),
    msgpack.packb(GOOD | {"rate": 1e6}),
]


@pytest.mark.parametrize("body", BAD_REQUESTS)
def test_malformed_requests_are_refused(body):
    with pytest.raises(MalformedPacket):
        decode_request(body)


def test_a_request_body_over_the_limit_is_refused_before_parsing():
    with pytest.raises(OversizedPacket):
        decode_request(msgpack.packb(GOOD | {"run": "r" * MAX_REQUEST_BYTES}))


def test_response_header_round_trips_and_refuses_hostile_values():
    for status, length in [
        (STATUS_OK, 0),
        (STATUS_OK, 1000),
        (STATUS_ERROR, 1 << 40),
        (STATUS_BUSY, 512),
        (STATUS_STRIPED, 1000),
    ]:
        assert decode_response_header(encode_response_header(status, length), 1000) == (status, length)
    for status in (STATUS_OK, STATUS_STRIPED):
        with pytest.raises(OversizedPacket):
            decode_response_header(encode_response_header(status, 1001), 1000)
    with pytest.raises(OversizedPacket):
        decode_response_header(encode_response_header(STATUS_BUSY, 513), 1000)
    with pytest.raises(MalformedPacket):
        decode_response_header(encode_response_header(4, 0), 1000)
    with pytest.raises(TruncatedPacket):
        decode_response_header(encode_response_header(STATUS_OK, 1)[:-1], 1000)


def test_busy_answer_round_trips():
    for names in ([], HOLDERS, HOLDERS * 4):
        frame = encode_busy(names)
        status, length = decode_response_header(frame[: RESPONSE_HEADER.size], 1)
        assert status == STATUS_BUSY and length == len(frame) - RESPONSE_HEADER.size
        assert decode_busy(frame[RESPONSE_HEADER.size :]) == names
    with pytest.raises(ValueError):
        encode_busy(HOLDERS * 5)


@pytest.mark.parametrize(
    "body, error",
    [
        (b"\xc1", MalformedPacket),  # not msgpack
        (msgpack.packb({"a": 1}), MalformedPacket),  # not a list
        (msgpack.packb([1, 2]), MalformedPacket),  # not strings
        (msgpack.packb([b"\x01"]), MalformedPacket),  # bytes, not strings
        (msgpack.packb(["not-a-peer-id"]), MalformedPacket),  # "-" is not base58
        (msgpack.packb(["0OIl"]), MalformedPacket),  # characters base58 leaves out
        (msgpack.packb(["x"] * 9), MalformedPacket),  # more names than an answer carries
        (msgpack.packb(["1" * 129]), MalformedPacket),  # longer than a peer id
        (msgpack.packb(HOLDERS)[:-5], MalformedPacket),  # truncated
        (msgpack.packb(HOLDERS) + b"\x90", MalformedPacket),  # trailing bytes
        (msgpack.packb(["1" * 100] * 6), OversizedPacket),  # over 512 bytes
    ],
)
def test_busy_answers_that_are_not_lists_of_peer_ids_are_refused(body, error):
    with pytest.raises(error):
        decode_busy(body)


def test_peer_id_check_agrees_with_hivemind():
    """`is_peer_id` (no hivemind import) accepts exactly what PeerID.from_base58 accepts."""
    from hivemind.p2p import PeerID

    rng = random.Random(0)
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0OIl-_/ \t\n\u00e9\u00a0"
    samples = HOLDERS + ["", " ", "abc ", " abc", "a\u00a0"]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(2000)]
    for text in samples:
        try:
            PeerID.from_base58(text)
            accepted = True
        except Exception:
            accepted = False
        assert is_peer_id(text) == accepted, repr(text)


def test_error_frame_is_cut_to_the_limit():
    frame = encode_error("not held")
    assert frame == RESPONSE_HEADER.pack(STATUS_ERROR, 8) + b"not held"
    long = encode_error("\u00e9" * MAX_ERROR_BYTES)  # 2 bytes each: cut mid-character
    status, length = decode_response_header(long[: RESPONSE_HEADER.size], 1)
    assert status == STATUS_ERROR and length == MAX_ERROR_BYTES == len(long) - RESPONSE_HEADER.size
    assert decode_error(long[RESPONSE_HEADER.size :]) == "\u00e9" * (MAX_ERROR_BYTES // 2)
    assert decode_error(b"\xff\xfe") == "\ufffd\ufffd"


def test_random_bytes_raise_only_protocol_errors():
    rng = random.Random(0)
    for _ in range(2000):
        raw = rng.randbytes(rng.randint(0, 40))
        for decode in (decode_request, decode_busy, request_body_length, lambda b: decode_response_header(b, 1 << 20)):
            try:
                decode(raw)
            except ProtocolError:
                pass


def test_protocol_stream_imports_neither_node_nor_hivemind():
    code = (
        "import sys, protocol.stream; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('node', 'hivemind', 'coordinator')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_striped_push_offers_round_trip_and_name_a_stripe_the_size_has():
    """A striped offer carries stripe and stripes (both or neither); the stripe must be one of the
    parts `stripe_bounds` cuts the size into, so a 600 kB packet offered in 4 has stripes 0 and 1."""
    size = 600_000
    assert len(stripe_bounds(size, 4)) == 2
    offer = PushOffer(run="r1", round=3, publisher="peer-a", digest=DIGEST, size=size, stripe=1, stripes=4)
    body = split(encode_offer(offer))
    assert msgpack.unpackb(body)["stripe"] == 1 and msgpack.unpackb(body)["stripes"] == 4
    assert decode_offer(body, max_packet_bytes=size) == offer
    whole = PushOffer(run="r1", round=3, publisher="peer-a", digest=DIGEST, size=size)
    assert "stripes" not in msgpack.unpackb(split(encode_offer(whole)))  # an earlier holder reads it
    fields = {"run": "r1", "round": 3, "peer": "peer-a", "digest": DIGEST, "size": size}
    for bad in (
        {**fields, "stripe": 2, "stripes": 4},  # the size has two parts
        {**fields, "stripe": 0, "stripes": 1},
        {**fields, "stripe": 0, "stripes": MAX_STRIPES + 1},
        {**fields, "stripe": -1, "stripes": 4},
        {**fields, "stripe": 1},
        {**fields, "stripes": 4},
        {**fields, "stripe": "1", "stripes": 4},
    ):
        with pytest.raises(MalformedPacket):
            decode_offer(msgpack.packb(bad), max_packet_bytes=1 << 20)


def test_push_offers_round_trip_and_hostile_ones_are_refused_typed():
    offer = PushOffer(run="r1", round=3, publisher="peer-a", digest=DIGEST, size=5000)
    body = split(encode_offer(offer))
    assert msgpack.unpackb(body) == {"run": "r1", "round": 3, "peer": "peer-a", "digest": DIGEST, "size": 5000}
    assert decode_offer(body, max_packet_bytes=5000) == offer
    with pytest.raises(OversizedPacket):
        decode_offer(body, max_packet_bytes=4999)  # over the holder's packet limit: refused before any byte
    fields = {"run": "r1", "round": 3, "peer": "peer-a", "digest": DIGEST, "size": 5000}
    for bad in (
        {**fields, "size": 0},
        {**fields, "size": -1},
        {**fields, "size": True},
        {**fields, "round": -1},
        {**fields, "round": "3"},
        {**fields, "wait": True},
        {k: v for k, v in fields.items() if k != "size"},
        [1, 2],
    ):
        with pytest.raises(ProtocolError):
            decode_offer(msgpack.packb(bad), max_packet_bytes=1 << 20)
    with pytest.raises(MalformedPacket, match=UNSTRIPED_OFFER):
        decode_offer(msgpack.packb({**fields, "wait": True}), max_packet_bytes=1 << 20)
    with pytest.raises(MalformedPacket):
        decode_offer(b"\xc1garbage", max_packet_bytes=1 << 20)
    with pytest.raises(OversizedPacket):
        decode_offer(b"\x00" * (MAX_REQUEST_BYTES + 1), max_packet_bytes=1 << 20)
