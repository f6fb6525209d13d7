"""Chunk geometry of SparseLoCo: how each tensor is cut into the chunks Top-k selects within.

Following the SparseLoCo reference (arXiv 2508.15706), a 2-D tensor of shape (m, n) is cut into
tiles of (tile_rows, tile_cols), each the largest divisor of its dimension that is <= 64, so a
4096-element tile for LLaMA shapes and smaller tiles for awkward ones; a 1-D tensor of length L
into chunks of the largest divisor of L that is <= 64. Tensors of more than two dimensions are
treated as (shape[0], prod(rest)) and a 0-D tensor as a 1-element vector.

Chunks are numbered tile-row-major over the tile grid, and positions inside a chunk row-major
inside the tile: chunk c = ty * (n / tile_cols) + tx, position p = h * tile_cols + w.

The number kept per chunk is `k = max(1, round(chunk_len * top_k / chunk_size**2))` (Python's
round, as the reference), clamped to the chunk length.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import torch

from locoswarm_kernels.quantize import NUM_BINS

T = TypeVar("T")
R = TypeVar("R")


@lru_cache(maxsize=4096)
def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is <= `limit` (n itself when n <= limit)."""
    if n <= limit:
        return n
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            if d <= limit:
                best = max(best, d)
            if n // d <= limit:
                best = max(best, n // d)
    return best


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How one tensor is chunked and how many values each chunk keeps."""

    shape: tuple[int, ...]  # the tensor's own shape
    rows: int  # the 2-D view's rows (1 for a vector)
    cols: int  # the 2-D view's columns
    tile_rows: int  # rows of one tile (1 for a vector)
    tile_cols: int  # columns of one tile (the chunk length for a vector)
    k: int  # values kept per chunk

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def chunk_len(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def num_chunks(self) -> int:
        return self.numel // self.chunk_len

    @property
    def num_selected(self) -> int:
        return self.num_chunks * self.k

    @property
    def is_view(self) -> bool:
        """True when chunks are a plain reshape of the flat tensor (no tile transpose)."""
        return self.tile_rows == 1 or self.tile_cols == self.cols


def chunk_layout(shape: tuple[int, ...] | torch.Size, top_k: int, chunk_size: int = 64) -> ChunkLayout:
    """The layout of a tensor of `shape` at density `top_k / chunk_size**2`."""
    shape = tuple(int(s) for s in shape)
    if top_k < 1 or chunk_size < 1:
        raise ValueError(f"top_k and chunk_size must be positive, got {top_k}, {chunk_size}")
    if any(s < 1 for s in shape):
        raise ValueError(f"cannot chunk an empty tensor of shape {shape}")
    if len(shape) <= 1:
        rows, cols = 1, (shape[0] if shape else 1)
        tile_rows, tile_cols = 1, largest_divisor_at_most(cols, chunk_size)
    else:
        rows, cols = shape[0], math.prod(shape[1:])
        tile_rows = largest_divisor_at_most(rows, chunk_size)
        tile_cols = largest_divisor_at_most(cols, chunk_size)
    chunk_len = tile_rows * tile_cols
    k = min(chunk_len, max(1, round(chunk_len * top_k / (chunk_size * chunk_size))))
    return ChunkLayout(shape, rows, cols, tile_rows, tile_cols, k)


def to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """(num_chunks, chunk_len): a view when the layout allows, else a tiled copy."""
    flat = x.reshape(layout.rows, layout.cols)
    if layout.is_view:
        return flat.reshape(layout.num_chunks, layout.chunk_len)
    tiles = flat.view(
        layout.rows // layout.tile_rows, layout.tile_rows, layout.cols // layout.tile_cols, layout.tile_cols
    )  # (ty, h, tx, w)
    return tiles.permute(0, 2, 1, 3).reshape(layout.num_chunks, layout.chunk_len)


def from_chunks(chunks: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The inverse of `to_chunks`, shaped like the original tensor."""
    if layout.is_view:
        return chunks.reshape(layout.shape)
    grid_rows, grid_cols = layout.rows // layout.tile_rows, layout.cols // layout.tile_cols
    tiles = chunks.reshape(grid_rows, grid_cols, layout.tile_rows, layout.tile_cols)  # (ty, tx, h, w)
    return tiles.permute(0, 2, 1, 3).reshape(layout.shape)


def tile_view(x: torch.Tensor, layout: ChunkLayout, chunk_space: bool = False) -> torch.Tensor:
    """A 4-D view, (tile row, tile column, row in tile, column in tile), of `x`: a tensor of the
    layout's shape, or with `chunk_space` its chunks one after another (what `to_chunks` makes,
    flattened). Copying one such view into the other is `to_chunks` or `from_chunks`."""
    grid_rows, grid_cols = layout.rows // layout.tile_rows, layout.cols // layout.tile_cols
    if chunk_space:
        return x.view(grid_rows, grid_cols, layout.tile_rows, layout.tile_cols)
    return x.view(grid_rows, layout.tile_rows, grid_cols, layout.tile_cols).permute(0, 2, 1, 3)


def flat_indices(chunk_positions: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Row-major indices into the flat tensor of (num_chunks, k) positions inside chunks."""
    chunk = torch.arange(layout.num_chunks, device=chunk_positions.device, dtype=torch.int64).unsqueeze(1)
    pos = chunk_positions.to(torch.int64)
    if layout.is_view:
        return chunk * layout.chunk_len + pos
    grid_cols = layout.cols // layout.tile_cols
    row = (chunk // grid_cols) * layout.tile_rows + pos // layout.tile_cols
    col = (chunk % grid_cols) * layout.tile_cols + pos % layout.tile_cols
    return row * layout.cols + col


# Aggregation buffers hold whole tensors, consecutive small ones together up to this many elements
# (16 MiB of float32 sums: a block and its counts stay in cache while every peer adds into it).
BLOCK_ELEMENTS = 1 << 22


class PacketLayout:
    """Constants of a model's tensors taken together, selections concatenated in order (a packet's
    order: tensor by tensor, chunk by chunk, k positions a chunk). Built once per layouts and device
    (`packet_layout`), so that decoding and aggregating a packet rebuild none of them.

    Chunk space: a tensor's chunks one after another (`to_chunks(x).reshape(-1)`). Tensors are
    grouped into blocks of consecutive tensors (`BLOCK_ELEMENTS`); a selected value's *index* is its
    place in its block's chunk space, the tensors of a block lying one after another there.
    """

    def __init__(self, layouts: tuple[ChunkLayout, ...], device: torch.device):
        self.layouts, self.device = layouts, device
        counts = [layout.num_selected for layout in layouts]
        self.symbol_starts = [sum(counts[:t]) for t in range(len(counts) + 1)]  # per tensor, then the total
        self.num_symbols = self.symbol_starts[-1]
        # Blocks: [first tensor, end tensor), and each tensor's offset in its block's chunk space.
        self.blocks: list[tuple[int, int]] = []
        self.block_offsets: list[int] = []
        size = BLOCK_ELEMENTS
        for t, layout in enumerate(layouts):
            numel = layout.num_chunks * layout.chunk_len
            if size + numel > BLOCK_ELEMENTS or not self.blocks:
                self.blocks.append((t, t))
                size = 0
            self.blocks[-1] = (self.blocks[-1][0], t + 1)
            self.block_offsets.append(size)
            size += numel
        self.block_sizes = [
            sum(layouts[t].num_chunks * layouts[t].chunk_len for t in range(a, b)) for a, b in self.blocks
        ]

        long = dict(dtype=torch.int64, device=device)
        num_chunks = torch.tensor([layout.num_chunks for layout in layouts], **long)
        per_row = lambda values: torch.repeat_interleave(torch.tensor(values, **long), num_chunks)
        self.row_lengths = per_row([layout.k for layout in layouts])  # a row is a chunk: k symbols
        self.row_chunk_len = per_row([layout.chunk_len for layout in layouts])
        self.rows_per_tensor = [layout.num_chunks for layout in layouts]
        first_row = torch.cumsum(num_chunks, 0) - num_chunks
        row_in_tensor = torch.arange(int(num_chunks.sum()), **long) - torch.repeat_interleave(first_row, num_chunks)
        # Where each row starts in its block's chunk space, and in its tensor's.
        self.row_offsets = per_row(self.block_offsets) + row_in_tensor * self.row_chunk_len
        # index - position, per symbol: int32 where every block is (PacketSelections.index's dtype)
        offset_dtype = torch.int32 if max(self.block_sizes, default=0) < 2**31 else torch.int64
        self.symbol_row_offsets = torch.repeat_interleave(self.row_offsets, self.row_lengths).to(offset_dtype)
        self.row_ends = torch.cumsum(self.row_lengths, 0) - 1  # each row's last symbol
        self.row_counts_through = torch.cumsum(num_chunks, 0)  # rows up to each tensor's end
        symbols_per_tensor = torch.tensor(counts, **long)
        # NUM_BINS * tensor of each symbol: where its code's entries start in a (tensors * NUM_BINS) table.
        self.code_offsets = torch.repeat_interleave(
            torch.arange(0, NUM_BINS * len(layouts), NUM_BINS, dtype=torch.int32, device=device), symbols_per_tensor
        )
        # For locoswarm_kernels.sparse.code_counts, which counts codes by byte of the packed codes (four a byte):
        # 256 * the tensor of each byte whose four codes are all one tensor's, 256 * len(layouts) (a
        # row of counts thrown away) for the others; and the codes of those others, counted one by
        # one: their symbols and NUM_BINS * their tensors.
        byte_tensor = torch.full(((self.num_symbols + 3) // 4,), len(layouts), dtype=torch.int64)
        loose: list[int] = []
        for t, (start, end) in enumerate(zip(self.symbol_starts, self.symbol_starts[1:])):
            first_whole, end_whole = (start + 3) // 4, end // 4
            if first_whole < end_whole:
                byte_tensor[first_whole:end_whole] = t
                loose += list(range(start, 4 * first_whole)) + list(range(4 * end_whole, end))
            else:
                loose += list(range(start, end))
        self.byte_code_offsets = (byte_tensor * 256).to(device=device, dtype=torch.int32)
        self.loose_symbols = torch.tensor(loose, dtype=torch.int64, device=device)
        self.loose_code_offsets = self.code_offsets.index_select(0, self.loose_symbols)


@lru_cache(maxsize=16)
def packet_layout(layouts: tuple[ChunkLayout, ...], device: torch.device | str = "cpu") -> PacketLayout:
    """The cached `PacketLayout` of these layouts, its tensors on `device`."""
    return PacketLayout(layouts, torch.device(device))


class _Scratch(threading.local):
    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


_scratch = _Scratch()


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A (numel,) work buffer of undefined contents, reused from call to call by the calling thread.

    On the CPU a fresh tensor of a few MiB costs more in page faults than the ops that fill it
    (each decode or aggregation would map and fault in tens of MiB of temporaries), so the packet
    kernels take their temporaries from here; elsewhere the device's caching allocator does this,
    and this returns a fresh tensor. A buffer is valid until the same thread asks for `name` again:
    nothing returned to a caller may be one."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    key = (name, dtype, device)
    buffer = _scratch.buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


@lru_cache(maxsize=4)
def worker_pool(workers: int) -> ThreadPoolExecutor:
    """A lasting pool of `workers` threads for the packet kernels' independent pieces of work (the
    aggregation's runs of chunks; torch ops release the GIL): lasting, so that its threads keep
    their `scratch` buffers.

    Each worker runs its ops on one intra-op thread: the pool is the parallelism, and ops of a few
    hundred thousand elements split further across busy cores ran slower than on one (a packet's
    Rice decode took 11 ms with two intra-op threads, 8.5 ms with one, on two loaded cores). The
    setting is the calling thread's own, but torch also keeps it as the default for threads that
    start using torch later: once every worker has set it, the creating thread sets its own count
    again, which restores that default and leaves its own unchanged."""
    own = torch.get_num_threads()
    started = threading.Barrier(workers + 1)

    def start() -> None:
        torch.get_num_threads()  # torch's per-thread start-up, which would otherwise reset what follows
        torch.set_num_threads(1)
        started.wait()

    pool = ThreadPoolExecutor(workers, thread_name_prefix="packet-kernels")
    for _ in range(workers):  # one blocking task each, so that every thread starts now
        pool.submit(start)
    started.wait()
    torch.set_num_threads(own)
    return pool


def pool_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """`fn` of every item, in order: on `worker_pool(workers)` when `workers` > 1, else in this thread."""
    return list(worker_pool(workers).map(fn, items) if workers > 1 else map(fn, items))


def num_workers(num_threads: int | None, device: torch.device | str) -> int:
    """How many pool workers a packet kernel uses: `num_threads`, by default torch's intra-op thread
    count, on the CPU only (a device runs its own kernels in parallel)."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, num_threads if num_threads is not None else torch.get_num_threads())
