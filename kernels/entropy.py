"""Entropy coding for packets in numpy: Rice codes for index gaps, 2-bit code packing.

This is the wire format's definition and the reference the torch coder is tested against
(kernels/entropy_torch.py, byte for byte); `protocol.packet` encodes and decodes with the torch
coder, on the tensors' device.

Rice coding with parameter b writes a gap g as its quotient g >> b in unary and its low b bits
verbatim. Instead of interleaving the two parts per symbol, which forces a sequential decoder,
the quotients go to one stream and the remainders to another, so both directions are a handful
of numpy array operations; the bit count is the same as interleaved Rice coding.

- unary stream: for every gap, q zero bits then a one bit, MSB-first, zero-padded to a byte.
  Decoding finds the ones with `flatnonzero`; their spacing gives the quotients.
- remainder stream: b bits per gap, MSB-first, zero-padded to a byte.

Index gaps come from positions p_0 < p_1 < ... inside a chunk as g_0 = p_0, g_i = p_i - p_{i-1}
- 1; gaps are therefore >= 0, and any decoded gap sequence yields strictly increasing positions
(no duplicates, never unsorted), so the only check decoding needs is the chunk bound.

Decoders here assume their caller bounded the input size; they raise ValueError on streams that
do not hold exactly the expected number of symbols, which `protocol.packet` turns into a typed
error.
"""

from __future__ import annotations

import numpy as np

MAX_RICE_PARAM = 24


def positions_to_gaps(positions: np.ndarray) -> np.ndarray:
    """(num_chunks, k) ascending positions -> flat int64 gaps (first position, then spacing - 1)."""
    positions = positions.astype(np.int64, copy=False)
    gaps = np.empty_like(positions)
    gaps[:, :1] = positions[:, :1]
    gaps[:, 1:] = np.diff(positions, axis=1) - 1
    return gaps.reshape(-1)


def gaps_to_positions(gaps: np.ndarray, num_chunks: int, k: int) -> np.ndarray:
    """Inverse of `positions_to_gaps`: (num_chunks, k) int64 positions, strictly increasing per row."""
    return np.cumsum(gaps.reshape(num_chunks, k) + 1, axis=1) - 1


def best_rice_param(gaps: np.ndarray) -> int:
    """The b that minimises the coded size of `gaps` (exact, over the plausible range)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    centre = max(0, int(np.log2(mean + 1)))
    best_b, best_bits = 0, None
    for b in range(max(0, centre - 2), min(MAX_RICE_PARAM, centre + 2) + 1):
        bits = int((gaps >> b).sum()) + gaps.size * (1 + b)
        if best_bits is None or bits < best_bits:
            best_b, best_bits = b, bits
    return best_b


def rice_encode(gaps: np.ndarray, b: int) -> tuple[bytes, bytes]:
    """(unary stream, remainder stream) for non-negative int64 `gaps`."""
    if not 0 <= b <= MAX_RICE_PARAM:
        raise ValueError(f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
    gaps = gaps.astype(np.int64, copy=False)
    quotients = gaps >> b
    ends = np.cumsum(quotients + 1) - 1  # bit position of each symbol's terminating one
    num_bits = int(ends[-1]) + 1 if gaps.size else 0
    unary = np.zeros(num_bits, dtype=np.uint8)
    unary[ends] = 1
    if b == 0:
        return np.packbits(unary).tobytes(), b""
    shifts = np.arange(b - 1, -1, -1, dtype=np.int64)
    remainder_bits = ((gaps[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(unary).tobytes(), np.packbits(remainder_bits.reshape(-1)).tobytes()


def rice_decode(unary: bytes, remainders: bytes, count: int, b: int) -> np.ndarray:
    """The `count` gaps coded in the two streams; ValueError if they do not hold exactly that."""
    if not 0 <= b <= MAX_RICE_PARAM:
        raise ValueError(f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
    if len(remainders) != (count * b + 7) // 8:
        raise ValueError(f"remainder stream has {len(remainders)} bytes, expected {(count * b + 7) // 8}")
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    ends = np.flatnonzero(bits)
    if ends.size != count:
        raise ValueError(f"unary stream holds {ends.size} symbols, expected {count}")
    if count and len(unary) != int(ends[-1]) // 8 + 1:
        raise ValueError("unary stream has trailing bytes")
    quotients = np.diff(ends, prepend=-1) - 1
    if b == 0:
        return quotients
    remainder_bits = np.unpackbits(np.frombuffer(remainders, dtype=np.uint8))[: count * b]
    weights = 1 << np.arange(b - 1, -1, -1, dtype=np.int64)
    low = remainder_bits.reshape(count, b).astype(np.int64) @ weights
    return (quotients << b) | low


def pack_2bit(codes: np.ndarray) -> bytes:
    """Codes in [0, 4), four to a byte, first code in the high bits."""
    codes = codes.astype(np.uint8, copy=False).reshape(-1)
    padded = np.zeros((codes.size + 3) // 4 * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] << 6 | quads[:, 1] << 4 | quads[:, 2] << 2 | quads[:, 3]).astype(np.uint8).tobytes()


def unpack_2bit(packed: bytes, count: int) -> np.ndarray:
    """Inverse of `pack_2bit`; ValueError unless `packed` is exactly ceil(count / 4) bytes."""
    if len(packed) != (count + 3) // 4:
        raise ValueError(f"code stream has {len(packed)} bytes, expected {(count + 3) // 4}")
    raw = np.frombuffer(packed, dtype=np.uint8)
    quads = np.stack([raw >> 6, (raw >> 4) & 3, (raw >> 2) & 3, raw & 3], axis=1)
    return quads.reshape(-1)[:count]
