"""The parameter snapshot stream: the bytes a peer catching up fetches, checked as they arrive.

A snapshot of the global model that starts round R is served over the packet stream
(protocol/stream.py) under the reserved publisher id "params", announced in the DHT under
".../round/R/holders/params" (protocol/dht_records.py). It has two sections, each a tensor group
in the canonical layout of protocol/digest.py: 0 = the parameters (the root of its tree is the
parameter digest the coordinator records), 1 = the outer state every peer shares (DiLoCo's
"outer_momentum.<name>" tensors; no tensors for SparseLoCo). All integers little-endian:

    prologue  b"LSNP", u16 version (1), u16 number of sections (2), then per section:
              u64 header length, the header, u64 body length, u64 number of leaves n,
              n leaves of 32 bytes
    bodies    section 0's body, then section 1's

    snapshot digest = BLAKE3(0x02 || b"locoswarm.snapshot.v1" || root_0 || root_1)

The snapshot digest names the snapshot in DHT records and requests. A receiver builds the
`SnapshotLayout` it expects from its own model (names, dtypes, shapes: nothing from the wire), so
it knows the stream's exact length and its units before the first byte: the prologue, then each
section's chunks. It refuses a stream whose prologue differs from that layout, or whose roots are
not the agreed parameter digest and the requested snapshot digest, before any body byte; then it
checks every chunk against its leaf as the chunk completes. So bad bytes cost at most one chunk,
nothing unverified is ever kept, and a transfer that breaks off resumes from another holder of
the same snapshot digest at the first chunk not yet verified (the request's "offset").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from blake3 import blake3

from protocol.digest import CHUNK_BYTES, LEAF_BYTES, Tree, num_chunks
from protocol.errors import MalformedPacket, ShapeMismatch, TruncatedPacket
from protocol.stream import DigestMismatch

MAGIC = b"LSNP"
VERSION = 1
NUM_SECTIONS = 2
PARAMS_SECTION, STATE_SECTION = 0, 1
_START = struct.Struct("<4sHH")
_U64 = struct.Struct("<Q")
_SNAPSHOT_TAG = b"\x02locoswarm.snapshot.v1"


@dataclass(frozen=True, slots=True)
class SectionLayout:
    header: bytes  # protocol/digest.py's canonical header of the section's tensors
    body_bytes: int


@dataclass(frozen=True, slots=True)
class Unit:
    """A piece of the stream that is verified whole: the prologue, or one chunk of a section's body."""

    start: int  # stream offset
    end: int
    section: int  # -1 for the prologue
    body_start: int = 0  # offset of the unit in its section's body


class SnapshotLayout:
    """Where everything lies in a snapshot stream of given sections (the prologue's size follows
    from the headers and body lengths alone)."""

    def __init__(self, sections: Sequence[SectionLayout]):
        if len(sections) != NUM_SECTIONS:
            raise ValueError(f"a snapshot has {NUM_SECTIONS} sections, not {len(sections)}")
        self.sections = tuple(sections)
        self.prologue_bytes = _START.size + sum(
            3 * _U64.size + len(s.header) + LEAF_BYTES * num_chunks(s.body_bytes) for s in self.sections
        )
        self.body_starts: list[int] = []  # stream offset of each section's body
        offset = self.prologue_bytes
        for section in self.sections:
            self.body_starts.append(offset)
            offset += section.body_bytes
        self.total_bytes = offset

    def unit_at(self, offset: int) -> Unit:
        """The unit holding stream byte `offset` (0 <= offset < total_bytes)."""
        if not 0 <= offset < self.total_bytes:
            raise ValueError(f"offset {offset} outside a snapshot of {self.total_bytes} bytes")
        if offset < self.prologue_bytes:
            return Unit(0, self.prologue_bytes, -1)
        for index in reversed(range(NUM_SECTIONS)):
            base = self.body_starts[index]
            if offset >= base and self.sections[index].body_bytes:
                body_start = (offset - base) - (offset - base) % CHUNK_BYTES
                body_end = min(body_start + CHUNK_BYTES, self.sections[index].body_bytes)
                return Unit(base + body_start, base + body_end, index, body_start)
        raise AssertionError("unreachable: every offset past the prologue lies in a non-empty body")


def encode_prologue(layout: SnapshotLayout, trees: Sequence[Tree]) -> bytes:
    """The prologue of a snapshot with these section trees (which must fit the layout)."""
    parts = [_START.pack(MAGIC, VERSION, NUM_SECTIONS)]
    for section, tree in zip(layout.sections, trees, strict=True):
        if (tree.header, tree.body_bytes) != (section.header, section.body_bytes):
            raise ValueError("a tree does not describe its section of the layout")
        parts += [
            _U64.pack(len(tree.header)),
            tree.header,
            _U64.pack(tree.body_bytes),
            _U64.pack(len(tree.leaves)),
            *tree.leaves,
        ]
    prologue = b"".join(parts)
    assert len(prologue) == layout.prologue_bytes
    return prologue


def decode_prologue(layout: SnapshotLayout, raw: bytes) -> list[Tree]:
    """The section trees a holder sent; refused unless every field equals what `layout` expects
    (`raw` must be exactly `layout.prologue_bytes` long, which the receiver reads and no more)."""
    if len(raw) != layout.prologue_bytes:
        raise TruncatedPacket(f"snapshot prologue of {len(raw)} bytes, expected {layout.prologue_bytes}")
    magic, version, count = _START.unpack_from(raw, 0)
    if (magic, version, count) != (MAGIC, VERSION, NUM_SECTIONS):
        raise MalformedPacket(f"not a snapshot of version {VERSION} with {NUM_SECTIONS} sections")
    offset, trees = _START.size, []
    for index, section in enumerate(layout.sections):
        (header_len,) = _U64.unpack_from(raw, offset)
        offset += _U64.size
        if header_len != len(section.header) or raw[offset : offset + header_len] != section.header:
            raise ShapeMismatch(f"snapshot section {index}: its tensors' names, dtypes or shapes are not the model's")
        offset += header_len
        body_bytes, count = _U64.unpack_from(raw, offset)[0], _U64.unpack_from(raw, offset + _U64.size)[0]
        offset += 2 * _U64.size
        if body_bytes != section.body_bytes or count != num_chunks(body_bytes):
            raise MalformedPacket(
                f"snapshot section {index}: {body_bytes} bytes in {count} chunks, expected "
                f"{section.body_bytes} in {num_chunks(section.body_bytes)}"
            )
        leaves = tuple(raw[offset + i * LEAF_BYTES : offset + (i + 1) * LEAF_BYTES] for i in range(count))
        offset += count * LEAF_BYTES
        trees.append(Tree(section.header, body_bytes, leaves))
    return trees


def snapshot_digest(trees: Sequence[Tree]) -> str:
    """The digest that names a snapshot: over its sections' roots."""
    if len(trees) != NUM_SECTIONS:
        raise ValueError(f"a snapshot has {NUM_SECTIONS} sections, not {len(trees)}")
    return blake3(_SNAPSHOT_TAG + b"".join(t.root for t in trees)).hexdigest()


def check_roots(trees: Sequence[Tree], params_digest: str, digest: str) -> None:
    """Refuse trees whose parameter root is not the agreed digest or whose snapshot digest is not
    the one asked for."""
    if trees[PARAMS_SECTION].hex != params_digest:
        raise DigestMismatch(
            f"snapshot parameters hash to {trees[PARAMS_SECTION].hex[:16]}..., "
            f"the agreed digest is {params_digest[:16]}..."
        )
    if (got := snapshot_digest(trees)) != digest:
        raise DigestMismatch(f"snapshot hashes to {got[:16]}..., asked for {digest[:16]}...")
