"""Parameter snapshots for peers catching up: served from tensors or a checkpoint file, loaded
straight into the model, a chunk at a time, never held whole in memory.

    snapshot = Snapshot.from_checkpoint(directory)        # the checkpoint this node wrote anyway
    snapshot = Snapshot.from_tensors(params, state)       # the round-start tensors, not copied
    start, unit = snapshot.read_unit(offset)              # a verified unit (prologue or chunk)
    sink = SnapshotSink(model_params, outer_state, params_digest=agreed)
    sink.expect(snapshot_digest)
    while not sink.done: sink.accept(bytes_of(sink.next_unit()))   # verified, then written

The stream layout and its checks are protocol/snapshot.py's; the exchange moves the units
(node/exchange/serve.py, fetch.py). A served unit is read into a fresh buffer and checked against
its leaf before it goes out, so a source whose bytes moved on (the round-start tensors after the
next outer step; a damaged file) raises `StaleSnapshot` instead of sending bytes that would get
this honest peer banned: the receiver resumes from another holder. Host memory is one unit per
stream on either side (4 MiB), whatever the model's size.

A sink writes each verified chunk into the live tensors it was given (the model's parameters and
the outer state `OuterStep.snapshot_state` returns). Only verified bytes are written, but a fetch
that fails halfway leaves the parameters part old and part new: the caller treats them as
unknown until a snapshot completes (`written_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from node.training.params import named_tensors, tensor_bytes, tensor_header, tensor_nbytes
from protocol.digest import CHUNK_BYTES, Tree, encode_header, leaf, tree_of
from protocol.snapshot import (
    PARAMS_SECTION,
    SectionLayout,
    SnapshotLayout,
    check_roots,
    decode_prologue,
    encode_prologue,
    snapshot_digest,
)
from protocol.stream import DigestMismatch

STATE_PREFIX = "outer_momentum."  # the checkpoint's and the snapshot's name for shared outer state


class StaleSnapshot(Exception):
    """The bytes a snapshot would serve no longer match its tree: it must not be served any more."""


@dataclass(frozen=True, slots=True)
class _Segment:
    """One tensor's bytes in a section body."""

    nbytes: int
    read: Callable[[int, int], bytes | memoryview]  # bytes [start, end) of the tensor
    fill: Callable[[memoryview, int], None]  # (out, start): bytes [start, start + len(out)) into out


class _Section:
    def __init__(self, header: bytes, segments: list[_Segment]):
        self.header, self.segments = header, segments
        self.starts: list[int] = []  # body offset of each segment
        offset = 0
        for segment in segments:
            self.starts.append(offset)
            offset += segment.nbytes
        self.body_bytes = offset

    def layout(self) -> SectionLayout:
        return SectionLayout(self.header, self.body_bytes)

    def read_into(self, out: memoryview, start: int) -> None:
        """Fill `out` with body bytes from `start` on."""
        end = start + len(out)
        for segment, base in zip(self.segments, self.starts):
            lo, hi = max(start, base), min(end, base + segment.nbytes)
            if lo < hi:
                segment.fill(out[lo - start : hi - start], lo - base)


def _tensor_section(named: Mapping[str, torch.Tensor]) -> _Section:
    named = named_tensors(named)

    def segment(t: torch.Tensor) -> _Segment:
        def fill(out: memoryview, lo: int) -> None:
            out[:] = tensor_bytes(t, lo, lo + len(out))

        return _Segment(tensor_nbytes(t), lambda lo, hi: tensor_bytes(t, lo, hi), fill)

    return _Section(tensor_header(named), [segment(t) for t in named.values()])


def _file_section(file, extents: Mapping[str, tuple[str, tuple[int, ...], int, int]]) -> _Section:
    names = sorted(extents)
    header = encode_header((name, extents[name][0], extents[name][1]) for name in names)
    fd = file.fileno()

    def segment(begin: int, end: int) -> _Segment:
        def read(lo: int, hi: int) -> bytes:
            data = os.pread(fd, hi - lo, begin + lo)
            if len(data) != hi - lo:
                raise StaleSnapshot(f"{file.name} ends early")
            return data

        def fill(out: memoryview, lo: int) -> None:  # straight into the unit's buffer: no copy between
            while len(out):
                count = os.preadv(fd, [out], begin + lo)
                if count <= 0:
                    raise StaleSnapshot(f"{file.name} ends early")
                out, lo = out[count:], lo + count

        return _Segment(end - begin, read, fill)

    return _Section(header, [segment(extents[n][2], extents[n][3]) for n in names])


def _pieces(section: _Section, piece_bytes: int = CHUNK_BYTES) -> Iterator[bytes | memoryview]:
    for segment in section.segments:
        for lo in range(0, segment.nbytes, piece_bytes):
            yield segment.read(lo, min(lo + piece_bytes, segment.nbytes))


class Snapshot:
    """A snapshot this node serves: its layout, trees and digest, and its bytes unit by unit."""

    def __init__(
        self,
        sections: list[_Section],
        trees: list[Tree | None],
        *,
        durable: bool,
        round: int | None = None,
        files: tuple = (),
    ):
        self._sections = sections
        self.trees = [tree if tree is not None else tree_of(s.header, _pieces(s)) for s, tree in zip(sections, trees)]
        self.layout = SnapshotLayout([s.layout() for s in sections])
        self.prologue = encode_prologue(self.layout, self.trees)
        self.digest = snapshot_digest(self.trees)  # announced, and asked for by fetchers
        self.params_digest = self.trees[PARAMS_SECTION].hex
        self.size_bytes = self.layout.total_bytes
        self.durable = durable  # read from a checkpoint file, not from tensors that change every round
        self.round = round
        self._files = files

    @classmethod
    def from_tensors(
        cls,
        params: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None = None,
        params_tree: Tree | None = None,
        state_tree: Tree | None = None,
    ) -> Snapshot:
        """Served from these tensors, read as each unit is served (no copy is kept): valid while
        they hold the same values. `params_tree`/`state_tree`: their trees, if already computed."""
        return cls([_tensor_section(params), _tensor_section(state or {})], [params_tree, state_tree], durable=False)

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, params_tree: Tree | None = None) -> Snapshot:
        """Served from a checkpoint's files (node/training/checkpoint.py): its parameters and its
        outer momentum. The files stay open, so a newer checkpoint replacing them does not change
        what this one serves. Without `params_tree` the files are read once to hash them; either
        way the parameter root must be the digest the checkpoint recorded."""
        from node.training.checkpoint import (
            PARAMS_FILE,
            STATE_FILE,
            CheckpointError,
            checkpoint_meta,
            resolve,
            tensor_extents,
        )

        directory = resolve(Path(directory))
        meta = checkpoint_meta(directory)
        files = []
        try:
            for name in (PARAMS_FILE, STATE_FILE):
                files.append(open(directory / name, "rb"))
            params = _file_section(files[0], tensor_extents(files[0]))
            state = _file_section(
                files[1], {n: e for n, e in tensor_extents(files[1]).items() if n.startswith(STATE_PREFIX)}
            )
            snapshot = cls(
                [params, state], [params_tree, None], durable=True, round=meta.get("round"), files=tuple(files)
            )
        except BaseException:
            for f in files:
                f.close()
            raise
        if snapshot.params_digest != meta.get("digest"):
            snapshot.close()
            raise CheckpointError(
                f"{directory}: parameters hash to {snapshot.params_digest[:12]}, "
                f"meta.json says {str(meta.get('digest'))[:12]}"
            )
        return snapshot

    def read_unit(self, offset: int) -> tuple[int, bytes | bytearray]:
        """(start, bytes) of the unit holding stream byte `offset`, checked against its leaf;
        StaleSnapshot if the source no longer holds those bytes. Blocking: call it in a thread."""
        unit = self.layout.unit_at(offset)
        if unit.section < 0:
            return unit.start, self.prologue
        out = bytearray(unit.end - unit.start)
        try:
            self._sections[unit.section].read_into(memoryview(out), unit.body_start)
        except (OSError, ValueError) as e:  # a closed file (forgotten while serving)
            raise StaleSnapshot(f"cannot read the snapshot: {e}") from e
        if leaf([out]) != self.trees[unit.section].leaves[unit.body_start // CHUNK_BYTES]:
            raise StaleSnapshot(f"chunk at {unit.start} no longer matches the snapshot {self.digest[:12]}")
        return unit.start, out

    def close(self) -> None:
        for f in self._files:
            f.close()


class SnapshotSink:
    """Receives one snapshot into live tensors: the parameters and the outer state, each verified
    chunk written in place (see the module docstring)."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None, params_digest: str
    ):
        groups = [named_tensors(params), named_tensors(state or {})]
        self._targets = [_byte_views(named) for named in groups]
        self.layout = _layout(groups)
        self.params_digest = params_digest  # the agreed digest the parameters must hash to
        self.digest: str | None = None  # the snapshot asked for
        self.trees: list[Tree] | None = None  # from the prologue, once it verified
        self.offset = 0  # stream bytes received and verified; a fetch resumes here
        self.written_bytes = 0  # body bytes written into the targets (they are no longer what they were)

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes

    @property
    def done(self) -> bool:
        return self.digest is not None and self.offset == self.total_bytes

    def expect(self, digest: str) -> None:
        """Receive the snapshot with this digest (from the start, if another one was under way)."""
        if digest != self.digest:
            self.digest, self.trees, self.offset = digest, None, 0

    def next_unit(self):
        return self.layout.unit_at(self.offset)

    def accept(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next unit: the prologue (checked against the layout, the agreed digest and the
        snapshot digest) or a chunk (checked against its leaf, then written). Raises
        `protocol.errors.ProtocolError` (`DigestMismatch` for bytes that are not the snapshot's)
        and keeps nothing of a refused unit. Blocking: call it in a thread."""
        if self.digest is None:
            raise RuntimeError("expect(digest) first")
        unit = self.next_unit()
        if len(data) != unit.end - unit.start:
            raise ValueError(f"unit of {unit.end - unit.start} bytes, got {len(data)}")
        if unit.section < 0:
            trees = decode_prologue(self.layout, bytes(data))
            check_roots(trees, self.params_digest, self.digest)
            self.trees = trees
        else:
            index = unit.body_start // CHUNK_BYTES
            if leaf([data]) != self.trees[unit.section].leaves[index]:
                raise DigestMismatch(f"snapshot section {unit.section} chunk {index} does not match its leaf")
            self._write(unit.section, unit.body_start, data)
        self.offset = unit.end

    def _write(self, section: int, start: int, data) -> None:
        if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
            data = bytearray(data)  # torch.frombuffer wants a writable buffer
        source = torch.frombuffer(data, dtype=torch.uint8)
        end = start + len(source)
        base = 0
        with torch.no_grad():
            for view in self._targets[section]:
                lo, hi = max(start, base), min(end, base + len(view))
                if lo < hi:
                    view[lo - base : hi - base].copy_(source[lo - start : hi - start])
                    self.written_bytes += hi - lo
                base += len(view)


def snapshot_size(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None) -> int:
    """The length of a snapshot of these tensors (its layout's: names, dtypes and shapes only)."""
    return _layout([named_tensors(params), named_tensors(state or {})]).total_bytes


def _layout(groups: list[Mapping[str, torch.Tensor]]) -> SnapshotLayout:
    return SnapshotLayout(
        [SectionLayout(tensor_header(named), sum(map(tensor_nbytes, named.values()))) for named in groups]
    )


def _byte_views(named: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """A byte view of each target's own memory, in order (writes through them reach the tensors)."""
    out = []
    for name, tensor in named.items():
        if not tensor.is_contiguous():
            raise ValueError(f"snapshot target {name} is not contiguous: writes would not reach it")
        out.append(tensor.reshape(-1).view(torch.uint8))
    return out
