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
from dataclasses import dataclass
from functools import lru_cache

import torch


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
