"""The packet wire format: round trip, and typed refusals of hostile bytes."""

import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from locoswarm_kernels.sparse import error_feedback_step
from protocol import errors
from protocol.packet import (
    MAGIC,
    PREFIX,
    WIRE_VERSION,
    ModelSpec,
    decode_packet,
    encode_packet,
    read_header,
)
from protocol.signing import PeerKey

SHAPES = {
    "embed.weight": (256, 64),
    "layers.0.attn.wq.weight": (64, 64),
    "layers.0.mlp.w1.weight": (67, 130),
    "norm.weight": (64,),
    "scalar": (1,),
}
KEY = PeerKey.from_seed(b"peer-a")
OTHER = PeerKey.from_seed(b"peer-b")


def make_packet(top_k=64, seed=0, key=KEY, round=3):
    torch.manual_seed(seed)
    spec = ModelSpec(dict(sorted(SHAPES.items())), top_k)
    layouts = spec.layouts()
    tensors = {
        n: error_feedback_step(torch.zeros(s), torch.randn(s), layouts[n], 0.95, 1.0) for n, s in spec.shapes.items()
    }
    return spec, tensors, encode_packet("run-1", round, "p-a", bytes(range(32)), spec, tensors, key)


def resign(body: bytes, key=KEY) -> bytes:
    return body + key.sign(body)


def rebuild(data: bytes, mutate_header) -> bytes:
    """Re-frame the packet with a mutated header map and a valid signature (a malicious member)."""
    header, offset = read_header(data)
    mutate_header(header)
    raw = msgpack.packb(header)
    return resign(PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + data[offset:-64])


def test_round_trip_is_exact():
    spec, tensors, data = make_packet()
    packet = decode_packet(data, spec, KEY.public_bytes, run_id="run-1", round=3)
    assert (packet.run_id, packet.round, packet.peer_id) == ("run-1", 3, "p-a")
    assert packet.base_digest == bytes(range(32)) and packet.num_bytes == len(data)
    for name, sparse in tensors.items():
        got = packet.tensors[name]
        assert torch.equal(got.flat_indices(), sparse.flat_indices())
        assert torch.equal(got.values(), sparse.values())


def test_wrong_run_round_and_key_are_refused():
    spec, _, data = make_packet()
    with pytest.raises(errors.WrongRound):
        decode_packet(data, spec, KEY.public_bytes, round=4)
    with pytest.raises(errors.WrongRound):
        decode_packet(data, spec, KEY.public_bytes, run_id="other")
    with pytest.raises(errors.BadSignature):
        decode_packet(data, spec, OTHER.public_bytes)
    with pytest.raises(errors.BadSignature):  # one flipped payload bit breaks the signature
        decode_packet(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:], spec, KEY.public_bytes)


def test_non_member_lookup_is_refused():
    spec, _, data = make_packet()

    def lookup(peer_id):
        raise errors.BadSignature(f"{peer_id} is not a member")

    with pytest.raises(errors.BadSignature):
        decode_packet(data, spec, lookup)


def test_framing_errors():
    spec, _, data = make_packet()
    with pytest.raises(errors.OversizedPacket):
        decode_packet(data, spec, KEY.public_bytes, max_bytes=len(data) - 1)
    with pytest.raises(errors.TruncatedPacket):
        decode_packet(data[:40], spec, KEY.public_bytes)
    with pytest.raises(errors.BadSignature):  # the last 64 bytes are no longer the signature
        decode_packet(data[:-1], spec, KEY.public_bytes)
    with pytest.raises(errors.TruncatedPacket):  # re-signed, but the streams run past the payload
        decode_packet(resign(data[:-65]), spec, KEY.public_bytes)
    with pytest.raises(errors.BadMagic):
        decode_packet(b"XXXX" + data[4:], spec, KEY.public_bytes)
    with pytest.raises(errors.UnsupportedVersion):
        decode_packet(data[:4] + struct.pack("<H", 99) + data[6:], spec, KEY.public_bytes)
    with pytest.raises(errors.OversizedPacket):
        decode_packet(data[:6] + struct.pack("<I", 1 << 30) + data[10:], spec, KEY.public_bytes)


def test_shape_and_density_mismatch():
    spec, _, data = make_packet()
    wrong = ModelSpec({**spec.shapes, "norm.weight": (65,)}, spec.top_k)
    with pytest.raises(errors.ShapeMismatch):
        decode_packet(data, wrong, KEY.public_bytes)
    with pytest.raises(errors.ShapeMismatch):
        decode_packet(data, ModelSpec(spec.shapes, 128), KEY.public_bytes)
    fewer = dict(list(spec.shapes.items())[:-1])
    with pytest.raises(errors.ShapeMismatch):
        decode_packet(data, ModelSpec(fewer, 64), KEY.public_bytes)


def test_signed_but_malformed_sections():
    spec, _, data = make_packet()

    def nan_table(h):
        h["tensors"][0][4] = struct.pack("<5f", float("nan"), 0, 0, 0, 0)

    def big_rice(h):
        h["tensors"][0][3] = 99

    def extra_key(h):
        h["evil"] = 1

    def bad_codes(h):
        h["codes"] = [7, h["codes"][1]]

    def lying_length(h):
        h["tensors"][0][5] += 1

    for mutate, error in [
        (nan_table, errors.NonFiniteValue),
        (big_rice, errors.MalformedPacket),
        (extra_key, errors.MalformedPacket),
        (bad_codes, errors.MalformedPacket),
        (lying_length, errors.ProtocolError),
    ]:
        with pytest.raises(error):
            decode_packet(rebuild(data, mutate), spec, KEY.public_bytes)


def test_index_out_of_range_is_refused():
    """A signed packet whose Rice stream puts an index past the chunk end."""
    spec = ModelSpec({"v": (64,)}, 4096)  # one chunk of 64 keeping all 64: gaps all zero, b = 0
    layouts = spec.layouts()
    tensors = {"v": error_feedback_step(torch.zeros(64), torch.randn(64), layouts["v"], 0.95, 1.0)}
    data = encode_packet("r", 0, "p-a", bytes(32), spec, tensors, KEY)
    header, offset = read_header(data)
    assert header["tensors"][0][3] == 0 and header["tensors"][0][5] == 8  # 64 terminating ones
    # replace the unary stream: first symbol q=1 (gap 1), the rest as before -> last index = 64
    unary = np.packbits(np.array([0] + [1] * 64 + [0] * 7, dtype=np.uint8)).tobytes()
    header["tensors"][0][5] = len(unary)
    raw = msgpack.packb(header)
    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + unary + data[offset + 8 : -64]
    with pytest.raises(errors.IndexOutOfRange):
        decode_packet(resign(body), spec, KEY.public_bytes)


def test_zstd_bomb_is_bounded():
    import zstandard

    spec, _, data = make_packet()

    def bomb(h):
        h["codes"] = [1, len(bomb_bytes)]

    bomb_bytes = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    header, offset = read_header(data)
    sections_len = sum(t[5] + t[6] for t in header["tensors"])
    bomb(header)
    raw = msgpack.packb(header)
    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + data[offset : offset + sections_len] + bomb_bytes
    with pytest.raises(errors.MalformedPacket):
        decode_packet(resign(body), spec, KEY.public_bytes)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutations_raise_only_protocol_errors(data):
    """Random byte flips, truncations and splices, signed by the attacker (the worst case)."""
    spec, _, packet = _FUZZ_BASE
    body = bytearray(packet[:-64])
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "set"] if body else ["insert"]))
        pos = data.draw(st.integers(0, max(0, len(body) - 1)))
        if op == "flip":
            body[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "truncate":
            del body[pos:]
        elif op == "insert":
            body[pos:pos] = data.draw(st.binary(max_size=16))
        else:
            body[pos : pos + 1] = bytes([data.draw(st.integers(0, 255))])
    signed = data.draw(st.booleans())
    mutated = resign(bytes(body)) if signed else bytes(body) + packet[-64:]
    try:
        decoded = decode_packet(mutated, spec, KEY.public_bytes)
    except errors.ProtocolError:
        return
    for sparse in decoded.tensors.values():  # anything accepted is well-formed
        assert int(sparse.positions.max()) < sparse.layout.chunk_len
        assert bool(torch.isfinite(sparse.values()).all())


_FUZZ_BASE = make_packet(seed=7)
