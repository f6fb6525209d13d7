"""The pseudo-gradient packet: one peer's compressed contribution to one round, on the wire.

Layout (all integers little-endian):

    offset   size  field
    0        4     magic b"LSWP"
    4        2     wire version, u16 (this build writes and reads WIRE_VERSION)
    6        4     header length H, u32, at most MAX_HEADER_BYTES
    10       H     header, a msgpack map (below)
    10+H     P     payload: per tensor, in header order, its unary stream then its remainder
                   stream; after the last tensor, the code stream of all tensors
    10+H+P   64    Ed25519 signature by the peer over bytes [0, 10+H+P)

Header map (short keys; every field required, no others allowed):

    "run"     str    run id                     "round"  int    round number
    "peer"    str    peer id                    "base"   bytes  32-byte digest (protocol/digest.py)
    "top_k"   int    density numerator                          of the parameters the delta was taken from
    "chunk"   int    chunk side (64)            "codes"  [coder, length]: coder 0 = 2-bit codes
                                                         packed four to a byte, 1 = the same
                                                         bytes zstandard-compressed
    "tensors" list of [name, shape, dtype, rice_b, table, unary_len, remainder_len] where
              table = 20 bytes: float32 shift then the 4 float32 bin means

Per tensor, chunking and k follow from its shape, top_k and chunk (locoswarm_kernels.chunking), so a
receiver checks them against its own model instead of trusting counts from the wire. Indices are
Rice-coded gaps between ascending positions inside each chunk (locoswarm_kernels.entropy has the format and
the numpy reference; locoswarm_kernels.entropy_torch the whole-tensor torch coder this module uses, on the
tensors' device), which cannot express a duplicate or an unsorted index; only the chunk bound is
checked, and a unary stream longer than any in-range selection needs is refused unread.

`decode_packet` treats its input as hostile: the total size is bounded first, the header is parsed
with msgpack limits, every count and length is checked against what the model implies before any
allocation sized by the input, the zstandard stream is bounded by the expected size, and every
failure is a `ProtocolError` subclass.

Values are bounded too, per tensor and before anything is decompressed: the shift, the four table
entries and the four values a code can decode to (shift + entry, computed exactly as
`QuantTable.decode` computes them: in float32, then in the tensor's declared dtype) must be finite
(`NonFiniteValue`) and at most `max_abs_value` in magnitude (`ValueOutOfRange`; the run's
`outer.max_abs_value`). A signed packet of finite fields that decodes to 1e30, or overflows
float16 or float32 once summed, is thereby refused by every peer alike, and the aggregation never
sees a value it cannot add.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import msgpack
import torch
import zstandard

from locoswarm_kernels.chunking import ChunkLayout, chunk_layout, packet_layout, scratch
from locoswarm_kernels.entropy import MAX_RICE_PARAM
from locoswarm_kernels.entropy_torch import (
    StreamError,
    best_rice_param,
    max_unary_bytes,
    pack_2bit,
    positions_to_gaps,
    rice_decode_positions,
    rice_encode,
    unpack_2bit,
)
from locoswarm_kernels.quantize import QuantTable
from locoswarm_kernels.sparse import PacketSelections, SparseTensor, code_counts
from protocol.errors import (
    BadMagic,
    BadSignature,
    IndexOutOfRange,
    MalformedPacket,
    NonFiniteValue,
    OversizedPacket,
    ProtocolError,
    ShapeMismatch,
    TruncatedPacket,
    UnsupportedVersion,
    ValueOutOfRange,
    WrongRound,
)
from protocol.run_config import DEFAULT_MAX_ABS_VALUE
from protocol.signing import SIGNATURE_BYTES, PeerKey, verify

MAGIC = b"LSWP"
WIRE_VERSION = 1
PREFIX = struct.Struct("<4sHI")
MAX_HEADER_BYTES = 4 << 20
DEFAULT_MAX_PACKET_BYTES = 256 << 20
CODER_RAW, CODER_ZSTD = 0, 1
TABLE = struct.Struct("<5f")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HEADER_KEYS = frozenset({"run", "round", "peer", "base", "top_k", "chunk", "codes", "tensors"})


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The tensors a packet must carry, in order, and the density they are sent at."""

    shapes: dict[str, tuple[int, ...]]  # name -> shape, in packet order (sorted names)
    top_k: int
    chunk_size: int = 64

    @classmethod
    def from_named_tensors(cls, tensors: Mapping[str, torch.Tensor], top_k: int, chunk_size: int = 64) -> "ModelSpec":
        return cls({name: tuple(t.shape) for name, t in sorted(tensors.items())}, top_k, chunk_size)

    def layouts(self) -> dict[str, ChunkLayout]:
        return dict(_layouts(tuple(self.shapes.items()), self.top_k, self.chunk_size))


@dataclass(frozen=True, slots=True)
class _SectionPlan:
    """What decoding checks a packet's sections against, made once per model and density."""

    names: tuple[str, ...]
    shapes: tuple[list[int], ...]  # as the header carries them
    layouts: tuple[ChunkLayout, ...]
    unary_caps: tuple[tuple[int, ...], ...]  # per section, per Rice parameter: `max_unary_bytes`
    num_codes: int
    narrow_positions: bool  # every position fits int16


@lru_cache(maxsize=64)
def _section_plan(shapes: tuple[tuple[str, tuple[int, ...]], ...], top_k: int, chunk_size: int) -> _SectionPlan:
    layouts = tuple(layout for _, layout in _layouts(shapes, top_k, chunk_size))
    caps = tuple(
        tuple(max_unary_bytes(c.num_chunks, c.k, c.chunk_len, b) for b in range(MAX_RICE_PARAM + 1)) for c in layouts
    )
    return _SectionPlan(
        tuple(name for name, _ in shapes),
        tuple(list(shape) for _, shape in shapes),
        layouts,
        caps,
        sum(layout.num_selected for layout in layouts),
        all(c.chunk_len <= 2**15 for c in layouts),
    )


@lru_cache(maxsize=64)
def _layouts(
    shapes: tuple[tuple[str, tuple[int, ...]], ...], top_k: int, chunk_size: int
) -> tuple[tuple[str, ChunkLayout], ...]:
    """`ModelSpec.layouts`, made once per model and density (every packet decode asks for them)."""
    return tuple((name, chunk_layout(shape, top_k, chunk_size)) for name, shape in shapes)


@dataclass(frozen=True, slots=True)
class Packet:
    """A decoded, verified packet."""

    run_id: str
    round: int
    peer_id: str
    base_digest: bytes
    tensors: PacketSelections  # name -> SparseTensor (positions int64, codes uint8) on the device decoded to
    num_bytes: int
    # Its digest (`packet_digest`, as round manifests list it) is not computed here: whoever fetched
    # the bytes checked them against it already.


def packet_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_packet(
    run_id: str,
    round: int,
    peer_id: str,
    base_digest: bytes,
    spec: ModelSpec,
    tensors: Mapping[str, SparseTensor],
    key: PeerKey,
    zstd_level: int = 3,
) -> bytes:
    """Serialize and sign one peer's selections (one SparseTensor per name in `spec`).

    The streams are coded on the selections' device; only the finished bytes cross to the host,
    in one copy."""
    if list(tensors) != list(spec.shapes):
        raise ValueError("tensors must be given for exactly the spec's names, in its order")
    sections, streams, all_codes = [], [], []
    for name, sparse in tensors.items():
        gaps = positions_to_gaps(sparse.positions)
        rice_b = best_rice_param(gaps)
        unary, remainders = rice_encode(gaps, rice_b)
        table = TABLE.pack(sparse.table.shift, *sparse.table.lookup.tolist())
        sections.append(
            [
                name,
                list(sparse.layout.shape),
                DTYPE_NAMES[sparse.table.dtype],
                rice_b,
                table,
                unary.numel(),
                remainders.numel(),
            ]
        )
        streams += [unary, remainders.to(unary.device)]
        all_codes.append(sparse.codes.reshape(-1).to(unary.device))
    if streams:
        packed = pack_2bit(torch.cat(all_codes))
        host = torch.cat([*streams, packed]).cpu().numpy().tobytes()
        split = len(host) - packed.numel()
        stream_bytes, codes = host[:split], host[split:]
    else:
        stream_bytes, codes = b"", b""
    coder = CODER_RAW
    compressed = zstandard.ZstdCompressor(level=zstd_level).compress(codes)
    if len(compressed) < len(codes):
        codes, coder = compressed, CODER_ZSTD
    header = msgpack.packb(
        {
            "run": run_id,
            "round": round,
            "peer": peer_id,
            "base": bytes(base_digest),
            "top_k": spec.top_k,
            "chunk": spec.chunk_size,
            "codes": [coder, len(codes)],
            "tensors": sections,
        }
    )
    body = b"".join([PREFIX.pack(MAGIC, WIRE_VERSION, len(header)), header, stream_bytes, codes])
    return body + key.sign(body)


def _field(header: dict, key: str, kind: type | tuple[type, ...]):
    value = header[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MalformedPacket(f"header field {key!r} has type {type(value).__name__}")
    return value


def read_header(data: bytes, max_bytes: int = DEFAULT_MAX_PACKET_BYTES) -> tuple[dict, int]:
    """(header map, payload offset) after the framing checks; no signature check."""
    if len(data) > max_bytes:
        raise OversizedPacket(f"packet of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < PREFIX.size + SIGNATURE_BYTES:
        raise TruncatedPacket(f"packet of {len(data)} bytes is shorter than the fixed framing")
    magic, version, header_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {magic!r}")
    if version != WIRE_VERSION:
        raise UnsupportedVersion(f"wire version {version}, this build reads {WIRE_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise OversizedPacket(f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if PREFIX.size + header_len + SIGNATURE_BYTES > len(data):
        raise TruncatedPacket("packet ends inside its header")
    raw = data[PREFIX.size : PREFIX.size + header_len]
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=1 << 16,
            max_map_len=64,
        )
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise MalformedPacket(f"header does not parse: {type(e).__name__}") from None
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        raise MalformedPacket("header is not a map with exactly the expected keys")
    return header, PREFIX.size + header_len


def decode_packet(
    data: bytes,
    spec: ModelSpec,
    public_key: bytes | Callable[[str], bytes],
    *,
    run_id: str | None = None,
    round: int | None = None,
    max_bytes: int = DEFAULT_MAX_PACKET_BYTES,
    max_abs_value: float = DEFAULT_MAX_ABS_VALUE,
    device: torch.device | str = "cpu",
) -> Packet:
    """Verify and decode hostile `data` against the model `spec`; raise a ProtocolError subclass.

    `public_key` is the sender's key, or a function from peer id to key (raising ProtocolError
    for peers that are not members). `run_id` and `round`, when given, must match the header.
    `max_abs_value` bounds every value the packet can decode to (inf: finite is enough).
    The streams are decoded on `device` (the payload crosses to it in one copy, after every size
    check), and the tensors are returned there.
    """
    if not max_abs_value > 0:
        raise ValueError(f"max_abs_value must be positive, got {max_abs_value}")
    data = bytes(data)
    header, offset = read_header(data, max_bytes)
    peer_id = _field(header, "peer", str)
    packet_run, packet_round = _field(header, "run", str), _field(header, "round", int)
    if run_id is not None and packet_run != run_id:
        raise WrongRound(f"packet is for run {packet_run!r}, expected {run_id!r}")
    if round is not None and packet_round != round:
        raise WrongRound(f"packet is for round {packet_round}, expected {round}")
    key = public_key(peer_id) if callable(public_key) else public_key
    signed_len = len(data) - SIGNATURE_BYTES
    verify(key, data[:signed_len], data[signed_len:])

    base = _field(header, "base", bytes)
    if len(base) != 32:
        raise MalformedPacket("base digest is not 32 bytes")
    if _field(header, "top_k", int) != spec.top_k or _field(header, "chunk", int) != spec.chunk_size:
        raise ShapeMismatch(f"packet density top_k={header['top_k']}/chunk={header['chunk']} is not the run's")
    codes_field, sections = _field(header, "codes", list), _field(header, "tensors", list)
    if len(sections) != len(spec.shapes):
        raise ShapeMismatch(f"packet has {len(sections)} tensors, the model {len(spec.shapes)}")
    if len(codes_field) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in codes_field):
        raise MalformedPacket("codes field is not [coder, length]")
    coder, codes_len = codes_field

    expected = _section_plan(tuple(spec.shapes.items()), spec.top_k, spec.chunk_size)
    parsed, cursor = [], offset
    for section, name, shape, layout, unary_caps in zip(
        sections, expected.names, expected.shapes, expected.layouts, expected.unary_caps
    ):
        if type(section) is not list or len(section) != 7:
            raise MalformedPacket(f"tensor section for {name!r} is not a 7-field list")
        s_name, s_shape, s_dtype, rice_b, table, unary_len, rem_len = section
        if s_name != name or s_shape != shape:
            raise ShapeMismatch(f"section {s_name!r} {s_shape} where the model has {name!r} {shape}")
        if s_dtype not in DTYPES or type(table) is not bytes or len(table) != TABLE.size:
            raise MalformedPacket(f"tensor {name!r}: bad dtype or table")
        if not type(rice_b) is type(unary_len) is type(rem_len) is int:  # (bool is not int here)
            raise MalformedPacket(f"tensor {name!r}: non-integer coder field")
        if not 0 <= rice_b <= MAX_RICE_PARAM or unary_len < 0 or rem_len < 0:
            raise MalformedPacket(f"tensor {name!r}: coder fields out of range")
        if cursor + unary_len + rem_len > signed_len:
            raise TruncatedPacket(f"tensor {name!r}: streams run past the payload")
        if unary_len > unary_caps[rice_b]:
            # Such a stream holds an index past its chunk, or is malformed: either way out of range.
            raise IndexOutOfRange(f"tensor {name!r}: unary stream is longer than any in-range selection needs")
        # (unary start, unary length, remainder start, remainder length, symbols, b), from the streams' start
        streams_at = cursor - offset
        parsed.append((streams_at, unary_len, streams_at + unary_len, rem_len, layout.num_selected, rice_b))
        cursor += unary_len + rem_len
    quant_tables, values = _bounded_tables(
        expected.names, [s[4] for s in sections], [DTYPES[s[2]] for s in sections], max_abs_value
    )
    if codes_len < 0 or cursor + codes_len < signed_len:
        raise MalformedPacket("payload holds bytes the header does not account for")
    if cursor + codes_len > signed_len:
        raise TruncatedPacket("code stream runs past the payload")
    num_codes = expected.num_codes
    plan = packet_layout(expected.layouts, torch.device(device))
    packed = _code_bytes(coder, data[cursor:signed_len], num_codes, device)
    codes = unpack_2bit(packed, num_codes)
    counts = code_counts(packed, codes, plan)  # for the norms: cheaper on the packed bytes

    # Every tensor's positions inside its chunks in one batch (locoswarm_kernels.entropy_torch), a row being a
    # chunk (locoswarm_kernels.chunking.PacketLayout has the per-row constants).
    streams = _to_device(data[offset:cursor], device)
    try:
        positions = rice_decode_positions(
            streams,
            parsed,
            [layout.k for layout in expected.layouts],
            out=scratch("packet.positions", num_codes, torch.int32, device),
        )
    except StreamError as e:
        raise MalformedPacket(f"tensor {expected.names[e.index]!r}: {e}") from None
    # Positions rise inside a row, so each row's last one bounds all of its positions (and gaps).
    outside = positions.index_select(0, plan.row_ends) >= plan.row_chunk_len
    if bool(outside.any()):
        first_row = int(outside.nonzero()[0, 0])
        bad = int(torch.searchsorted(plan.row_counts_through, first_row, right=True))
        raise IndexOutOfRange(f"tensor {expected.names[bad]!r}: an index falls outside its chunk")

    # `positions` is a work buffer: what the packet keeps is a copy (int16 where chunks allow), and
    # each value's place in chunk space is made from it when asked for (PacketSelections.index).
    positions = positions.to(torch.int16) if expected.narrow_positions else positions.clone()
    tensors = PacketSelections(expected.names, plan, None, positions, codes, quant_tables, values, counts)
    return Packet(packet_run, packet_round, peer_id, base, tensors, len(data))


def _bounded_tables(
    names: list[str], tables: list[bytes], dtypes: list[torch.dtype], max_abs_value: float
) -> tuple[list[QuantTable], torch.Tensor]:
    """Each tensor's quantization table, once its fields and every value a code can decode to are
    finite and within `max_abs_value`, in float32 and in its dtype; a ProtocolError naming the
    first tensor that fails otherwise. The four decodable values are computed as
    `QuantTable.decode` computes them (the float32 entry plus the shift in the tensor's dtype, then
    the cast to that dtype), for all tensors of one dtype in one op, and returned beside the tables
    in float32 (exact), (tensors, NUM_BINS): locoswarm_kernels.sparse.code_values of the tables."""
    # Every table's five float32 fields at once, in float64 (exact), checked as one.
    fields = torch.tensor(
        struct.unpack(f"<{TABLE.size // 4 * len(tables)}f", b"".join(tables)), dtype=torch.float64
    ).view(len(tables), 5)
    finite = torch.isfinite(fields).all(1)
    within = fields.abs().amax(1) <= max_abs_value
    if not bool((finite & within).all()):
        for name, is_finite, is_within in zip(names, finite.tolist(), within.tolist()):
            if not is_finite:
                raise NonFiniteValue(f"tensor {name!r}: quantization table holds NaN or Inf")
            if not is_within:
                raise ValueOutOfRange(
                    f"tensor {name!r}: a shift or table entry exceeds max_abs_value {max_abs_value:g}"
                )
    shifts, lookups = fields[:, 0].tolist(), fields[:, 1:].float()
    verdicts: list[str | None] = [None] * len(tables)
    values = torch.empty(len(tables), 4, dtype=torch.float32)
    for dtype in set(dtypes):
        rows = [i for i, d in enumerate(dtypes) if d == dtype]
        narrow_shift = torch.tensor([shifts[i] for i in rows], dtype=dtype).unsqueeze(1)  # (n, 1)
        wide = lookups[rows] + narrow_shift  # float32, as the 0-dim shift in QuantTable.decode
        narrow = wide.to(dtype)
        values[rows] = narrow.float()
        checks = torch.stack(
            [
                ~torch.isfinite(narrow_shift[:, 0]),
                ~torch.isfinite(wide).all(1),
                wide.abs().amax(1) > max_abs_value,
                ~torch.isfinite(narrow).all(1),
                narrow.float().abs().amax(1) > max_abs_value,
            ],
            dim=1,
        ).tolist()
        for i, failed in zip(rows, checks):
            if any(failed):
                verdicts[i] = (
                    "shift overflows {d}",
                    "a decoded value overflows float32",
                    "a decoded value exceeds max_abs_value {m:g} in float32",
                    "a decoded value overflows {d}",
                    "a decoded value exceeds max_abs_value {m:g} in {d}",
                )[failed.index(True)]
    for name, verdict, dtype in zip(names, verdicts, dtypes):
        if verdict is not None:
            kind = ValueOutOfRange if "exceeds" in verdict else NonFiniteValue
            raise kind(f"tensor {name!r}: " + verdict.format(d=DTYPE_NAMES[dtype], m=max_abs_value))
    return [
        QuantTable(shift=shift, lookup=lookup, dtype=dtype)
        for shift, lookup, dtype in zip(shifts, lookups.unbind(0), dtypes)
    ], values


def _to_device(data: bytes, device: torch.device | str) -> torch.Tensor:
    """A uint8 tensor of `data` on `device` (copied: the packet's bytes stay immutable)."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _code_bytes(coder: int, stream: bytes, num_codes: int, device: torch.device | str) -> torch.Tensor:
    """The packed 2-bit codes on `device`, exactly ceil(num_codes / 4) bytes, or MalformedPacket."""
    expected = (num_codes + 3) // 4
    if coder == CODER_ZSTD:
        try:
            # python-zstandard allocates the content size a frame declares, whatever max_output_size
            # says (a frame claiming 4e18 bytes raised MemoryError in the fuzz run): check it first.
            content_size = zstandard.get_frame_parameters(stream).content_size
            if content_size != zstandard.CONTENTSIZE_UNKNOWN and content_size > expected:
                raise MalformedPacket(f"code stream claims {content_size} bytes, at most {expected} expected")
            stream = zstandard.ZstdDecompressor().decompress(stream, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise MalformedPacket(f"code stream does not decompress: {e}") from None
    elif coder != CODER_RAW:
        raise MalformedPacket(f"unknown code coder {coder}")
    if len(stream) != expected:
        raise MalformedPacket(f"code stream has {len(stream)} bytes, expected {expected}")
    return _to_device(stream, device)


__all__ = [
    "MAGIC",
    "WIRE_VERSION",
    "ModelSpec",
    "Packet",
    "ProtocolError",
    "BadSignature",
    "encode_packet",
    "decode_packet",
    "read_header",
    "packet_digest",
]
