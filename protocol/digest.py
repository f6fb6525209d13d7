"""The parameter digest: a hash tree over fixed-size chunks of a canonical tensor layout.

Every peer computes it after every outer step, the coordinator records the digests its peers
agree on, and a peer catching up checks a parameter snapshot against it while the snapshot
arrives (protocol/snapshot.py). It is defined over bytes, so a 1-rank node, a sharded node (each
rank hashing the chunks of its own byte range) and a stream receiver all compute the same value,
each in parallel.

Canonical layout of a group of named tensors (the model's parameters, or a snapshot's outer
state), all integers little-endian:

    header  b"locoswarm.tensors.v2", u32 number of tensors, then per tensor in sorted-name order
            (Python's `sorted` on str: code point order, the same as UTF-8 byte order):
            u64 length + name (UTF-8), u64 length + dtype (torch's name, e.g. "torch.float32"),
            u64 length + shape (one u64 per dimension)
    body    the tensors' raw bytes in C order (little-endian, as on every platform torch ships
            for), concatenated in the same order, with nothing between them

    leaf_i  = BLAKE3(0x00 || body[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])   i = 0 .. n-1
    digest  = BLAKE3(0x01 || u64 len(header) || header || u64 len(body) || leaf_0 || ... || leaf_n-1)

with CHUNK_BYTES = 4 MiB, n = ceil(len(body) / CHUNK_BYTES) (0 for an empty body), 32-byte
BLAKE3 outputs, and the digest written as 64 lowercase hex characters. The 0x00/0x01 prefixes keep
a leaf from ever being read as a root. Chunks are cut from the concatenated body, so one may span
the end of a tensor and the start of the next.

    hasher = ChunkHasher()                      # leaves of a byte stream that starts at a chunk boundary
    hasher.update(piece); ...                   # pieces of any size, hashed in worker threads
    tree = Tree(header, body_bytes, hasher.finish())
    tree.hex                                    # the digest

BLAKE3 and hashlib both release the GIL on large inputs, so the chunks of one digest are hashed
on every core at once (`HASH_THREADS`). A shard that owns a chunk-aligned byte range of the body
hashes its own chunks with a `ChunkHasher`; the ordered concatenation of every shard's leaves
gives the same `Tree`. Benchmark: `locoswarm bench digest` (tools/bench/digest.py).
"""

from __future__ import annotations

import os
import struct
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

from blake3 import blake3

CHUNK_BYTES = 4 << 20  # part of the definition: every peer must use the same
LEAF_BYTES = 32
HEADER_MAGIC = b"locoswarm.tensors.v2"
_LEAF, _ROOT = b"\x00", b"\x01"
HASH_THREADS = max(1, min(16, os.cpu_count() or 1))
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="digest")
        return _pool


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def encode_header(entries: Iterable[tuple[str, str, Sequence[int]]]) -> bytes:
    """The header for tensors given as (name, dtype name, shape); sorted by name here."""
    entries = sorted(entries, key=lambda e: e[0])
    parts = [HEADER_MAGIC, _U32.pack(len(entries))]
    for name, dtype, shape in entries:
        parts += [
            _field(name.encode("utf-8")),
            _field(dtype.encode("ascii")),
            _field(struct.pack(f"<{len(shape)}Q", *shape)),
        ]
    return b"".join(parts)


def num_chunks(body_bytes: int) -> int:
    return -(-body_bytes // CHUNK_BYTES)


def leaf(parts: Iterable[bytes | memoryview]) -> bytes:
    """The leaf hash of one chunk given as consecutive parts (bytes-like)."""
    hasher = blake3(_LEAF)
    for part in parts:
        hasher.update(part)
    return hasher.digest()


@dataclass(frozen=True)  # no slots: `root` is cached in the instance's __dict__
class Tree:
    """A tensor group's hash tree: its header, body length and chunk leaves; `hex` is the digest."""

    header: bytes
    body_bytes: int
    leaves: tuple[bytes, ...]

    def __post_init__(self):
        if len(self.leaves) != num_chunks(self.body_bytes) or any(len(x) != LEAF_BYTES for x in self.leaves):
            raise ValueError(f"{len(self.leaves)} leaves for a body of {self.body_bytes} bytes")

    @cached_property
    def root(self) -> bytes:
        hasher = blake3(_ROOT)
        hasher.update(_field(self.header))
        hasher.update(_U64.pack(self.body_bytes))
        hasher.update(b"".join(self.leaves))
        return hasher.digest()

    @property
    def hex(self) -> str:
        return self.root.hex()


class ChunkHasher:
    """Leaf hashes of a byte stream that starts at a chunk boundary, hashed in worker threads.

    `update` keeps a reference to each piece until its chunks are hashed: the caller must not
    change a piece's bytes before `finish` (or pass a copy). At most a few chunks per thread are
    in flight, so a long stream of fresh pieces (a GPU tensor copied slice by slice) holds a
    bounded amount of memory.
    """

    def __init__(self, max_in_flight: int | None = None):
        self._parts: list[memoryview] = []  # the chunk being filled
        self._filled = 0
        self._futures: deque[Future] = deque()
        self._leaves: list[bytes] = []
        self._max_in_flight = max_in_flight or 2 * HASH_THREADS
        self.num_bytes = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        view = memoryview(piece).cast("B")
        self.num_bytes += len(view)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._filled)
            self._parts.append(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK_BYTES:
                self._submit()

    def _submit(self) -> None:
        parts, self._parts, self._filled = self._parts, [], 0
        if HASH_THREADS == 1:
            self._leaves.append(leaf(parts))
            return
        self._futures.append(_executor().submit(leaf, parts))
        while len(self._futures) > self._max_in_flight:
            self._leaves.append(self._futures.popleft().result())

    def finish(self) -> tuple[bytes, ...]:
        """The leaves of every chunk, the last one possibly short."""
        if self._filled:
            self._submit()
        while self._futures:
            self._leaves.append(self._futures.popleft().result())
        return tuple(self._leaves)


def tree_of(header: bytes, pieces: Iterable[bytes | bytearray | memoryview]) -> Tree:
    """The tree of a body given as consecutive pieces."""
    hasher = ChunkHasher()
    for piece in pieces:
        hasher.update(piece)
    return Tree(header, hasher.num_bytes, hasher.finish())
