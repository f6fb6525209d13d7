"""Slow, obvious reference of the SparseLoCo compressor, for tests of the fast kernels.

Written for reading, not speed: Python loops over tiles and chunks, an explicit stable sort for
Top-k, bins looked up one value at a time, Rice codes as bit strings. The fast path in
`locoswarm_kernels.sparse` / `locoswarm_kernels.entropy` must agree with it exactly (values in selection order:
chunk by chunk, ascending position inside a chunk).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from locoswarm_kernels.chunking import ChunkLayout


def reference_chunks(x: torch.Tensor, layout: ChunkLayout) -> list[list[tuple[int, float]]]:
    """Each chunk as a list of (flat index into x, value), chunk numbering as in locoswarm_kernels.chunking."""
    flat = x.reshape(-1).tolist()
    chunks = []
    for tile_row in range(layout.rows // layout.tile_rows):
        for tile_col in range(layout.cols // layout.tile_cols):
            chunk = []
            for h in range(layout.tile_rows):
                for w in range(layout.tile_cols):
                    index = (tile_row * layout.tile_rows + h) * layout.cols + tile_col * layout.tile_cols + w
                    chunk.append((index, flat[index]))
            chunks.append(chunk)
    return chunks


def reference_compress(x: torch.Tensor, layout: ChunkLayout):
    """(positions per chunk, flat indices, selected values in x's dtype, codes, shift, lookup)."""
    positions, indices, selected = [], [], []
    for chunk in reference_chunks(x, layout):
        by_magnitude = sorted(range(len(chunk)), key=lambda p: (-abs(chunk[p][1]), p))
        kept = sorted(by_magnitude[: layout.k])
        positions.append(kept)
        indices += [chunk[p][0] for p in kept]
        selected += [chunk[p][1] for p in kept]
    values = torch.tensor(selected, dtype=x.dtype)

    shift = values.mean()
    centred = values - shift
    n = len(selected)
    sigma = centred.norm() / math.sqrt(n - 1) if n > 1 else torch.zeros((), dtype=x.dtype)
    scale = 6.0 * sigma / 4
    if float(scale) == 0.0 or not math.isfinite(float(scale)):
        scale = torch.ones((), dtype=x.dtype)
    scaled = (centred.float() / scale).tolist()
    codes = [min(3, max(0, round(v + 2))) for v in scaled]  # Python's round is half-to-even too
    centred_f = centred.float().tolist()
    lookup = []
    for b in range(4):
        members = [v for v, c in zip(centred_f, codes) if c == b]
        # float32 accumulation in the same order as the fast path's scatter_add
        total = np.float32(0.0)
        for v in members:
            total = np.float32(total + np.float32(v))
        lookup.append(float(total / np.float32(len(members))) if members else 0.0)
    return positions, indices, values, codes, float(shift), lookup


def reference_decode_values(codes: list[int], shift: float, lookup: list[float], dtype: torch.dtype) -> torch.Tensor:
    table = torch.tensor(lookup, dtype=torch.float32)
    return torch.stack([table[c] + torch.tensor(shift, dtype=dtype) for c in codes]).to(dtype)


def reference_scatter_mean(contributions: list[tuple[list[int], torch.Tensor]], numel: int) -> torch.Tensor:
    """Per coordinate, the float32 mean over the peers (in list order) that sent it."""
    total = [np.float32(0.0)] * numel  # numpy float32 scalars: IEEE single-precision arithmetic
    count = [0] * numel
    for indices, values in contributions:
        for i, v in zip(indices, values.float().tolist()):
            total[i] = np.float32(total[i] + np.float32(v))
            count[i] += 1
    return torch.tensor([t / np.float32(c) if c else t for t, c in zip(total, count)], dtype=torch.float32)


def reference_rice_bits(gaps: list[int], b: int) -> tuple[str, str]:
    """The unary and remainder streams as strings of '0' and '1', before padding."""
    unary = "".join("0" * (g >> b) + "1" for g in gaps)
    remainders = "".join(format(g & ((1 << b) - 1), f"0{b}b") if b else "" for g in gaps)
    return unary, remainders
