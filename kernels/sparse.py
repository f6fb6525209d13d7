"""The SparseLoCo compressor on whole tensors: error feedback, per-chunk Top-k, 2-bit codes,
and the scatter-mean aggregation of many peers' selections.

One peer, one round (arXiv 2508.15706; README.md, "The algorithm"):

    e  = beta * e + outer_lr * delta          # error feedback, never sent
    S  = top-k of |e| inside every chunk      # locoswarm_kernels.chunking
    c  = quantize(e[S])                        # locoswarm_kernels.quantize, per tensor
    e[S] -= decode(c)                          # what was sent leaves the buffer
    e[S] += decode(c)                          # restore_sent: only if the swarm did not apply it

Everything here is whole-tensor torch, device-agnostic, with no Python loop over chunks or
elements; `locoswarm_kernels.reference` is the slow, obvious version the tests compare against. Selected
positions are sorted ascending inside each chunk, which the wire's delta coding relies on.

Many peers, one round: each peer's tensor may first be scaled down to the round's median norm of
that tensor (`squared_norm`, `median_clip_scales`), then `scatter_mean` averages per coordinate.
A node aggregates whole decoded packets instead (`PacketSelections`, `packet_clip_scales`,
`aggregate_packets`): every tensor at once from the packets' flat arrays, with the same bits as
`squared_norm` and `scatter_mean` tensor by tensor (tests/unit/test_packet_aggregate.py).
Neither can make a non-finite value from finite inputs bounded by B (protocol.packet checks every
decodable value against the run's bound): a scale lies in [0, 1], and the float32 sum of n peers
is at most n * B (B <= 1e30 keeps it finite up to 3e8 peers).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from locoswarm_kernels.chunking import (
    BLOCK_ELEMENTS,
    ChunkLayout,
    PacketLayout,
    flat_indices,
    from_chunks,
    num_workers,
    pool_map,
    scratch,
    tile_view,
    to_chunks,
)
from locoswarm_kernels.entropy_torch import code_quads
from locoswarm_kernels.quantize import NUM_BINS, QuantTable, quantize


@dataclass(frozen=True, slots=True)
class SparseTensor:
    """One tensor's compressed selection: what a packet carries for it."""

    layout: ChunkLayout
    positions: torch.Tensor  # (num_chunks, k) int16/int64, ascending in each row, < chunk_len
    codes: torch.Tensor  # (num_chunks, k) uint8 in [0, 4)
    table: QuantTable

    def values(self) -> torch.Tensor:
        """(num_chunks, k) decoded values in the table's dtype."""
        return self.table.decode(self.codes)

    def flat_indices(self) -> torch.Tensor:
        """(num_chunks * k,) int64 row-major indices into the flat tensor."""
        return flat_indices(self.positions, self.layout).reshape(-1)

    def squared_norm(self) -> float:
        """Sum of the squared decoded values, in float64: the count of each code times its value
        squared, added in code order. Counts are exact and the order fixed, so every peer gets the
        same bits whatever its device or thread count (a torch reduction's order depends on both)."""
        counts = torch.bincount(self.codes.reshape(-1).long(), minlength=len(self.table.lookup)).tolist()
        values = self.table.decode(torch.arange(len(counts), dtype=torch.uint8)).double().tolist()
        return math.fsum(count * value * value for count, value in zip(counts, values))


def select_topk(chunks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions sorted ascending per chunk, values at them) of the k largest |x| per chunk."""
    if k >= chunks.shape[1]:
        positions = torch.arange(chunks.shape[1], device=chunks.device).expand(chunks.shape[0], -1)
        return positions.contiguous(), chunks.clone()
    positions = torch.topk(chunks.abs(), k, dim=1, sorted=False).indices
    positions = positions.sort(dim=1).values
    return positions, chunks.gather(1, positions)


def compress(x: torch.Tensor, layout: ChunkLayout) -> SparseTensor:
    """Select and quantize `x` (any float dtype) without modifying it."""
    sparse, _ = _compress_chunks(to_chunks(x, layout), layout)
    return sparse


def _compress_chunks(chunks: torch.Tensor, layout: ChunkLayout) -> tuple[SparseTensor, torch.Tensor]:
    positions, selected = select_topk(chunks, layout.k)
    # Top-k ranks NaN and Inf above every finite magnitude, so a non-finite tensor always has
    # a non-finite selected value: checking the k values is checking the whole tensor.
    if not bool(torch.isfinite(selected).all()):
        raise ValueError("cannot compress a tensor holding NaN or Inf")
    codes, table = quantize(selected)
    narrow = torch.int16 if layout.chunk_len <= 2**15 else torch.int64
    return SparseTensor(layout, positions.to(narrow), codes, table), selected


def error_feedback_step(
    error_buffer: torch.Tensor, delta: torch.Tensor | None, layout: ChunkLayout, beta: float, outer_lr: float
) -> SparseTensor:
    """Fold `delta` into `error_buffer` in place, compress it, and remove what was sent.

    `delta` may be None to compress the buffer as it stands (no decay, no accumulation).
    """
    if delta is not None:
        if beta != 1.0:
            error_buffer.mul_(beta)
        error_buffer.add_(delta, alpha=outer_lr)
    chunks = to_chunks(error_buffer, layout)
    sparse, selected = _compress_chunks(chunks, layout)
    residual = selected - sparse.values().to(selected.dtype)
    # Positions are unique, so each selected element is written once: deterministic on any device.
    if layout.is_view:  # chunks is a view of the buffer: write through it
        chunks.scatter_(1, sparse.positions.long(), residual)
    else:
        error_buffer.view(-1).index_put_((sparse.flat_indices(),), residual.reshape(-1))
    return sparse


def restore_sent(error_buffer: torch.Tensor, sparse: SparseTensor) -> None:
    """Add back into `error_buffer` (contiguous, shaped like `sparse.layout`) what `sparse` sent: the
    inverse of `error_feedback_step`'s removal, for a packet the swarm did not apply.

    Only the selected elements are touched, each by one addition in the buffer's dtype (residual plus
    decoded value, which is the folded value up to that rounding); no dense tensor is made. The
    selection may live on another device than the buffer: its few values and indices move, not the
    buffer."""
    index = sparse.flat_indices().to(error_buffer.device)
    values = sparse.values().reshape(-1).to(error_buffer.device, error_buffer.dtype)
    # Positions are unique, so each element is added to once: deterministic on any device.
    error_buffer.view(-1).index_add_(0, index, values)


def decompress(sparse: SparseTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense tensor the selection stands for (zeros where nothing was sent)."""
    layout = sparse.layout
    out = torch.zeros(layout.numel, dtype=dtype or sparse.table.dtype, device=sparse.codes.device)
    out[sparse.flat_indices()] = sparse.values().reshape(-1).to(out.dtype)
    return out.view(layout.shape)


def median_clip_scales(norms: list[float]) -> list[float]:
    """Per peer, min(1, median / norm): the factor that brings a norm above the round's median
    down to it (1.0 for a zero norm; 0.0 for a non-finite one, which bounded packets never have,
    so that no scale is ever infinite or NaN)."""
    finite = [n for n in norms if math.isfinite(n)]
    median = statistics.median(finite) if finite else 0.0
    return [0.0 if not math.isfinite(n) else 1.0 if n <= median else median / n for n in norms]


def scatter_mean(
    selections: list[SparseTensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    peer_scales: list[float] | None = None,
) -> torch.Tensor:
    """Per coordinate, the mean over the peers that sent it.

    All selections must share one layout and come in a fixed order (sorted by peer id): the sum
    runs peer by peer in that order and each peer touches each element once, so the result is
    bit-identical whatever order the packets arrived in and on whatever device it runs.
    `peer_scales` multiplies each peer's values first (norm clipping), each in [0, 1] so that a
    scaled value is never larger than the value. Returns the dense tensor in the layout's shape.

    Batched: every peer's positions and codes are stacked once, the values come from one gather in
    a (peers, 4) table of what each code decodes to (computed per peer exactly as
    `QuantTable.decode` and the scale would compute it element by element), and the counts from one
    integer `index_add_` (integer sums do not depend on order). The float32 sums keep peer order:
    one `index_add_` per peer (its indices are distinct), or, asked for, one Triton launch that walks
    the peers in order inside each chunk (locoswarm_kernels.triton_aggregate; `_use_triton`).
    """
    if peer_scales is not None and not all(0.0 <= s <= 1.0 for s in peer_scales):
        raise ValueError("peer scales must lie in [0, 1]")
    layout = selections[0].layout
    if any(sparse.layout != layout for sparse in selections):
        raise ValueError("selections have different layouts")
    device = torch.device(device)
    numel = layout.num_chunks * layout.chunk_len
    values_by_code = _values_by_code(selections, dtype, peer_scales).to(device)  # (P, NUM_BINS)
    positions = torch.stack([s.positions.to(device) for s in selections])  # (P, C, k)
    codes = torch.stack([s.codes.to(device) for s in selections])  # (P, C, k) uint8
    if _use_triton(device, dtype):
        from locoswarm_kernels.triton_aggregate import ordered_scatter_add

        total = torch.zeros(numel, dtype=dtype, device=device)
        count = torch.zeros(numel, dtype=torch.int32, device=device)
        ordered_scatter_add(positions, codes, values_by_code, total, count)
    else:
        num_peers = len(selections)
        row_offsets = torch.arange(0, numel, layout.chunk_len, device=device).unsqueeze(1)  # (C, 1)
        index = (positions.to(torch.int64) + row_offsets).reshape(num_peers, -1)  # (P, C * k)
        code_index = codes.reshape(num_peers, -1).to(torch.int64)
        code_index += torch.arange(0, num_peers * NUM_BINS, NUM_BINS, device=device).unsqueeze(1)
        values = values_by_code.reshape(-1).index_select(0, code_index.reshape(-1)).view(num_peers, -1)
        total = torch.zeros(numel, dtype=dtype, device=device)
        for peer in range(num_peers):  # peer order; distinct indices inside a peer
            total.index_add_(0, index[peer], values[peer])
        count = torch.zeros(numel, dtype=torch.int32, device=device).index_add_(
            0, index.reshape(-1), torch.ones(1, dtype=torch.int32, device=device).expand(index.numel())
        )
    # counts are integers (exact on any device); where nobody sent a coordinate, 0 / 1 = 0
    mean = total.div_(count.clamp_min_(1).to(dtype))
    return from_chunks(mean.view(layout.num_chunks, layout.chunk_len), layout)


def _values_by_code(
    selections: list[SparseTensor], dtype: torch.dtype, peer_scales: list[float] | None
) -> torch.Tensor:
    """(P, NUM_BINS): what each code of each peer adds to the sum, by the same IEEE operations the
    element-wise path performs (decode in the table's dtype, cast to `dtype`, times the scale; the
    float32 step of `code_values` between them is exact)."""
    values = code_values([sparse.table for sparse in selections]).to(dtype)
    if peer_scales is None:
        return values
    return torch.stack([row * scale for row, scale in zip(values, peer_scales)])


def _use_triton(device: torch.device, dtype: torch.dtype) -> bool:
    """The Triton kernel for float32 sums when LOCOSWARM_TRITON=1 and triton is there (on CPU under
    TRITON_INTERPRET=1, for tests). Off by default, on CUDA too: it has run only under the interpreter,
    and every peer must sum bit for bit alike (deploy/gpu_check.sh compares it on a GPU); the torch
    path (one index_add_ per peer, distinct indices) is deterministic on any device."""
    if dtype != torch.float32 or os.environ.get("LOCOSWARM_TRITON") != "1":
        return False
    from locoswarm_kernels.triton_aggregate import available

    return available(device)


def code_values(tables: Sequence[QuantTable]) -> torch.Tensor:
    """(tables, NUM_BINS) float32: what each code of each table decodes to, by `QuantTable.decode`'s
    operations (float32 entry plus the shift in the table's dtype, cast to that dtype), then cast to
    float32 (exact), for all tables of one dtype in one op."""
    out = torch.empty(len(tables), NUM_BINS, dtype=torch.float32)
    lookups = torch.stack([table.lookup.float() for table in tables]) if tables else out
    for dtype in {table.dtype for table in tables}:
        rows = [i for i, table in enumerate(tables) if table.dtype == dtype]
        shifts = torch.tensor([tables[i].shift for i in rows], dtype=dtype).unsqueeze(1)  # (n, 1)
        out[rows] = (lookups[rows] + shifts).to(dtype).float()
    return out


class PacketSelections(dict):
    """One packet's selections, name -> SparseTensor, and the flat arrays those are views of, which
    `aggregate_packets` reads whole: `positions` (n,) each selected value's place in its chunk,
    int16 where every chunk is at most 2^15 long; `codes` (n,) uint8; `code_values` (tensors,
    NUM_BINS) float32 (`code_values`); and `index` (n,) int32 (int64 for a block of 2^31 elements or
    more), each selected value's place in its block's chunk space (locoswarm_kernels.chunking.PacketLayout),
    made from the positions when first read unless given (the CPU aggregation never reads it). A
    node holds every packet of a round decoded at once: 3 bytes a selected value, 7 once `index`
    has been read."""

    def __init__(
        self,
        names: Sequence[str],
        layout: PacketLayout,
        index: torch.Tensor | None,
        positions: torch.Tensor,
        codes: torch.Tensor,
        tables: Sequence[QuantTable],
        values: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ):
        """`values`: `code_values(tables)` when the caller has it already (protocol.packet checks them);
        `counts`: `code_counts`, when the caller has them (else counted when needed)."""
        super().__init__()
        self._counts = counts
        self.layout, self.codes = layout, codes
        self.code_values = code_values(tables) if values is None else values
        self._index = None if index is None else index.to(self._index_dtype())
        if all(chunks.chunk_len <= 2**15 for chunks in layout.layouts):
            positions = positions.to(torch.int16)
        self.positions = positions  # (n,) each selected value's place in its chunk
        starts = layout.symbol_starts
        for t, (name, chunks, table) in enumerate(zip(names, layout.layouts, tables)):
            shape = (chunks.num_chunks, chunks.k)
            self[name] = SparseTensor(
                chunks,
                positions[starts[t] : starts[t + 1]].view(shape),
                codes[starts[t] : starts[t + 1]].view(shape),
                table,
            )
        self._norms: list[float] | None = None

    @property
    def index(self) -> torch.Tensor:
        """(n,) each selected value's place in its block's chunk space: given, or made from the
        positions when first asked for (the CPU aggregation reads positions only)."""
        if self._index is None:
            offsets = self.layout.symbol_row_offsets.to(self.positions.device)
            self._index = torch.add(self.positions, offsets).to(self._index_dtype())
        return self._index

    def _index_dtype(self) -> torch.dtype:
        return torch.int32 if max(self.layout.block_sizes, default=0) < 2**31 else torch.int64

    def code_index(self) -> torch.Tensor:
        """(n,) int32: each selected value's code plus NUM_BINS times its tensor's number, its entry in
        the flattened `code_values`."""
        return self.codes.to(torch.int32).add_(self.layout.code_offsets.to(self.codes.device))

    def squared_norms(self) -> list[float]:
        """`SparseTensor.squared_norm` of every tensor, in order, the same bits: the counts of every
        tensor's codes (given, or one bincount of `code_index`), and the same float64 operations."""
        if self._norms is None:
            counts = self._counts
            if counts is None:
                # Widened by a copy, then added: uint8 + int32 into int32 in one op took 7x as long on the CPU.
                code_index = scratch("norms.code_index", self.codes.numel(), torch.int32, self.codes.device)
                code_index.copy_(self.codes).add_(self.layout.code_offsets.to(self.codes.device))
                counts = torch.bincount(code_index, minlength=self.code_values.numel()).view(self.code_values.shape)
            values = self.code_values.double()
            products = (counts.cpu().double() * values * values).tolist()
            self._norms = [math.fsum(row) for row in products]
        return self._norms


def code_counts(packed: torch.Tensor, codes: torch.Tensor, layout: PacketLayout) -> torch.Tensor:
    """(tensors, NUM_BINS) int64: how many of each tensor's values have each code, the bincount of
    `PacketSelections.code_index`, from a packet's packed codes (`pack_2bit`'s bytes) and the same
    codes unpacked (`codes`): one bincount over the bytes whose four codes are one tensor's (a
    quarter of the values), and the few codes in bytes that two tensors share (or the padding
    ends), one by one (`PacketLayout.byte_code_offsets`, `loose_symbols`). Padding is never counted."""
    num_tensors = len(layout.layouts)
    index = scratch("counts.byte_index", packed.numel(), torch.int32, packed.device)
    index.copy_(packed).add_(layout.byte_code_offsets.to(packed.device))
    per_byte = torch.bincount(index, minlength=256 * (num_tensors + 1))[: 256 * num_tensors].view(-1, 256, 1)
    counts = (per_byte * _codes_per_byte(packed.device)).sum(1)
    if layout.loose_symbols.numel():
        loose = codes.index_select(0, layout.loose_symbols.to(codes.device)).to(torch.int32)
        loose += layout.loose_code_offsets.to(codes.device)
        counts += torch.bincount(loose, minlength=NUM_BINS * num_tensors).view(num_tensors, NUM_BINS)
    return counts


@lru_cache(maxsize=8)
def _codes_per_byte(device: torch.device) -> torch.Tensor:
    """(256, NUM_BINS) int64: how many of each code a packed byte holds (its four codes: the
    unpacking table of locoswarm_kernels.entropy_torch)."""
    codes = code_quads(device).view(torch.uint8).view(256, 4).long()
    return torch.nn.functional.one_hot(codes, NUM_BINS).sum(1)


def packet_clip_scales(packets: Sequence[PacketSelections]) -> list[list[float]]:
    """scales[p][t], as `aggregate_packets` takes them: tensor t's `median_clip_scales` over the
    packets' norms of it (the square roots of `PacketSelections.squared_norms`)."""
    norms = [packet.squared_norms() for packet in packets]
    per_tensor = [
        median_clip_scales([math.sqrt(peer_norms[t]) for peer_norms in norms])
        for t in range(len(packets[0].layout.layouts))
    ]
    return [list(row) for row in zip(*per_tensor)]


def aggregate_packets(
    packets: Sequence[PacketSelections],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    peer_scales: Sequence[Sequence[float]] | None = None,
    num_threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor's `scatter_mean` over the packets (sorted by peer id), the same bits, all at once:
    `peer_scales[p][t]` scales packet p's tensor t.

    Each value is a gather in its packet's (tensors * NUM_BINS) table of values times the scales
    (the same float32 product as `scatter_mean`'s); each element's sum runs in packet order, and its
    count is exact, so the bits are the same on any device and any thread count. On the CPU, chunk
    by chunk (`_aggregate_rows`), with `num_threads` workers taking whole tensors (by default
    torch's thread count; locoswarm_kernels.chunking.num_workers); elsewhere, block by block
    (`_aggregate_blocks`). Each division writes its tensor straight into its own shape (no
    separate `from_chunks` copy). Work buffers are reused (locoswarm_kernels.chunking.scratch)."""
    layout = packets[0].layout
    if any(p.layout.layouts != layout.layouts for p in packets):
        raise ValueError("packets have different layouts")
    if peer_scales is not None and not all(0.0 <= s <= 1.0 for row in peer_scales for s in row):
        raise ValueError("peer scales must lie in [0, 1]")
    device = torch.device(device)
    tables = []
    for i, packet in enumerate(packets):
        table = packet.code_values.to(device, dtype)
        if peer_scales is not None:
            table = table * torch.tensor(peer_scales[i], dtype=dtype, device=device).unsqueeze(1)
        tables.append(table.view(-1))
    # Counts are whole numbers: exact in float32 up to 2^24 peers, and then the division is the
    # float one; for narrower dtypes they are counted in int32 and cast, as scatter_mean does.
    count_dtype = dtype if dtype in (torch.float32, torch.float64) and len(packets) < 2**24 else torch.int32
    if device.type == "cpu":
        return _aggregate_rows(packets, tables, dtype, count_dtype, num_workers(num_threads, device))
    return _aggregate_blocks(packets, tables, dtype, device, count_dtype)


def _aggregate_blocks(
    packets: Sequence[PacketSelections],
    tables: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    count_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """`aggregate_packets` block by block (locoswarm_kernels.chunking.PacketLayout): one buffer in a block's
    chunk space takes one `scatter_add_` of each packet's values there, in packet order, and the
    counts one of ones. Indices are distinct inside a packet, so each element is added to once a
    call: in packet order on any device, atomics or not. A value's place in chunk space is made
    here, a block at a time, from its position and its row's offset: the decoded packets stay at 3
    bytes a value (reading `PacketSelections.index` would keep 4 more each)."""
    layout, names, out = packets[0].layout, list(packets[0]), {}
    codes = [packet.codes.to(device) for packet in packets]
    positions = [packet.positions.to(device) for packet in packets]
    code_offsets, row_offsets = layout.code_offsets.to(device), layout.symbol_row_offsets.to(device)
    for (first, end), size in zip(layout.blocks, layout.block_sizes):
        span = slice(layout.symbol_starts[first], layout.symbol_starts[end])
        n = span.stop - span.start
        total = scratch("aggregate.total", size, dtype, device).zero_()
        count = scratch("aggregate.count", size, count_dtype, device).zero_()
        at = scratch("aggregate.index", n, torch.int64, device)
        code_index = scratch("aggregate.code_index", n, torch.int32, device)
        values = scratch("aggregate.values", n, dtype, device)
        ones = torch.ones(1, dtype=count_dtype, device=device).expand(n)
        for peer_positions, peer_codes, table in zip(positions, codes, tables):  # peer order
            torch.add(row_offsets[span], peer_positions[span], out=at)
            torch.add(code_offsets[span], peer_codes[span], out=code_index)
            torch.index_select(table, 0, code_index, out=values)
            total.scatter_add_(0, at, values)
            count.scatter_add_(0, at, ones)
        divisor = count.clamp_min_(1)  # where nobody sent a coordinate, 0 / 1 = 0
        if count_dtype != dtype:
            divisor = scratch("aggregate.divisor", size, dtype, device).copy_(divisor)
        for t in range(first, end):
            chunks, offset = layout.layouts[t], layout.block_offsets[t]
            numel = chunks.num_chunks * chunks.chunk_len
            dense = torch.empty(chunks.shape, dtype=dtype, device=device)
            part = lambda x: tile_view(x[offset : offset + numel], chunks, chunk_space=True)  # noqa: B023 (this iteration's)
            torch.div(part(total), part(divisor), out=tile_view(dense, chunks))
            out[names[t]] = dense
    return out


def _aggregate_rows(
    packets: Sequence[PacketSelections],
    tables: list[torch.Tensor],
    dtype: torch.dtype,
    count_dtype: torch.dtype,
    workers: int,
) -> dict[str, torch.Tensor]:
    """`aggregate_packets` on the CPU, chunk by chunk: a run of one tensor's chunks at a time (whole
    tile rows, at most about BLOCK_ELEMENTS elements), every packet's values of a chunk side by side
    in packet order, (chunks, packets * k), and one `scatter_add_` along the chunks, which on the CPU
    walks each chunk's entries in order, so that each element's sum runs in packet order. A chunk's
    sums (16 KiB for 4096 float32) stay in cache while every packet adds to them; adding packet by
    packet into a whole block instead missed the cache on nearly every value. Runs are independent:
    `workers` threads take whole runs, and write disjoint parts of the outputs."""
    layout, num_peers = packets[0].layout, len(packets)
    names = list(packets[0])
    table = torch.stack(tables).view(-1)  # (packets * tensors * NUM_BINS,)
    num_entries = len(layout.layouts) * NUM_BINS
    peer_base = torch.arange(0, num_peers * num_entries, num_entries, dtype=torch.int32).view(1, num_peers, 1)
    out = {name: torch.empty(chunks.shape, dtype=dtype) for name, chunks in zip(names, layout.layouts)}

    def run(t: int, first: int, end: int) -> None:
        """Tensor t's chunks [first, end)."""
        chunks = layout.layouts[t]
        rows, k, chunk_len = end - first, chunks.k, chunks.chunk_len
        at = slice(layout.symbol_starts[t] + first * k, layout.symbol_starts[t] + end * k)
        stacked = lambda name, dtype, parts: torch.stack(  # (chunks, packets, k)
            [part[at].view(rows, k) for part in parts],
            dim=1,
            out=scratch(name, rows * num_peers * k, dtype, "cpu").view(rows, num_peers, k),
        )
        code_index = scratch("rows.code_index", rows * num_peers * k, torch.int32, "cpu").view(rows, num_peers, k)
        torch.add(
            stacked("rows.codes", torch.uint8, [p.codes.cpu() for p in packets]),
            peer_base + NUM_BINS * t,
            out=code_index,
        )
        values = torch.index_select(
            table, 0, code_index.view(-1), out=scratch("rows.values", code_index.numel(), dtype, "cpu")
        ).view(rows, -1)
        index = stacked("rows.index", torch.int64, [p.positions.cpu() for p in packets]).view(rows, -1)
        total = scratch("rows.total", rows * chunk_len, dtype, "cpu").view(rows, chunk_len).zero_()
        total.scatter_add_(1, index, values)
        # integer counts (exact in any order); where nobody sent a coordinate, 0 / 1 = 0
        count = scratch("rows.count", rows * chunk_len, count_dtype, "cpu").view(rows, chunk_len).zero_()
        divisor = count.scatter_add_(1, index, torch.ones(1, dtype=count_dtype).expand_as(index)).clamp_min_(1)
        if count_dtype != dtype:
            divisor = scratch("rows.divisor", divisor.numel(), dtype, "cpu").view_as(divisor).copy_(divisor)
        dense = out[names[t]].view(-1)[first * chunk_len : end * chunk_len]
        if chunks.is_view:  # chunk space is the tensor's own layout
            torch.div(total, divisor, out=dense.view(rows, chunk_len))
        else:  # whole tile rows: (tile rows, tiles, rows in tile, columns in tile) both ways
            grid_cols = chunks.cols // chunks.tile_cols
            tiles = lambda x: x.view(rows // grid_cols, grid_cols, chunks.tile_rows, chunks.tile_cols)
            torch.div(
                tiles(total),
                tiles(divisor),
                out=dense.view(rows // grid_cols, chunks.tile_rows, grid_cols, chunks.tile_cols).permute(0, 2, 1, 3),
            )

    jobs = []
    for t, chunks in enumerate(layout.layouts):
        step = max(1, BLOCK_ELEMENTS // chunks.chunk_len)
        if not chunks.is_view:  # whole tile rows
            grid_cols = chunks.cols // chunks.tile_cols
            step = max(1, step // grid_cols) * grid_cols
        jobs += [(t, first, min(first + step, chunks.num_chunks)) for first in range(0, chunks.num_chunks, step)]
    pool_map(lambda job: run(*job), jobs, workers)
    return out
