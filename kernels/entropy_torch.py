"""The packet's entropy coder as whole-tensor torch ops, on whatever device the tensors live on.

Same streams, bit for bit, as the numpy reference in `locoswarm_kernels.entropy` (its docstring has the
format): Rice-coded index gaps split into a unary stream (q zero bits then a one, MSB-first) and a
remainder stream (b bits per gap, MSB-first), and 2-bit codes four to a byte. Nothing here loops
over elements or chunks in Python, and nothing goes through numpy, so a node encodes on its
training device and moves only the finished bytes to the host.

How the bit streams are built without a sequential coder:

- unary, encode: the terminating one of gap i sits at bit `ends[i] = cumsum(q + 1)[i] - 1`; each
  one is added into its byte as `128 >> (bit % 8)` with an integer `index_add_` (the bits are
  distinct, so the sum is their OR, and integer sums do not depend on order).
- remainders, encode: gap i's b bits start at bit i*b; shifted into a 32-bit big-endian window
  (offset <= 7, b <= 24, so they fit), its four bytes are added into place the same way.
- decode (`rice_decode_rows`): positions rather than gaps. With Z_i the zeros before the i-th
  terminating one in the unary bytes and D_i the running sum of remainder + 1, position i is
  (Z_i << b) + D_i minus a constant per row, so neither the quotients nor a segmented sum are ever
  formed. Z_i is the zeros before its byte plus a (256 * 8) table entry for its rank in the byte;
  values per byte, per section and per row reach the symbols through `_spread` (one integer
  index_add_ of the steps and a cumsum, several times cheaper than repeat_interleave on the CPU).
  A remainder is read from a 31-bit big-endian window of the four bytes from its first one.
  Small values (bit offsets, Z, remainders) run in int32, positions in int64.

Decoders assume their caller bounded the stream sizes (`protocol.packet` does, before any
allocation); they raise ValueError, like the reference, for streams that do not hold exactly the
expected symbols. A few host syncs remain where a size must be known (the Rice parameter, the
stream lengths, the symbol count check): a handful per tensor when encoding, one per packet when
decoding, none per element.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from locoswarm_kernels.chunking import scratch
from locoswarm_kernels.entropy import MAX_RICE_PARAM

_BYTE_SHIFTS = (24, 16, 8, 0)


@lru_cache(maxsize=16)
def _byte_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(popcount (256,), bit offset of the r-th set bit MSB-first (256 * 8,)) in `dtype` on `device`."""
    values = torch.arange(256, dtype=torch.int64)
    bits = (values.unsqueeze(1) >> torch.arange(7, -1, -1)) & 1  # (256, 8) MSB-first
    popcount = bits.sum(1)
    # For each byte, the offsets of its set bits in order, then 8s as padding (never read).
    order = torch.where(bits.bool(), torch.arange(8), torch.full_like(bits, 8)).sort(dim=1).values
    return popcount.to(device, dtype), order.reshape(-1).to(device, dtype)


def positions_to_gaps(positions: torch.Tensor) -> torch.Tensor:
    """(num_chunks, k) ascending positions -> flat int64 gaps (first position, then spacing - 1)."""
    positions = positions.to(torch.int64)
    before = torch.full_like(positions[:, :1], -1)
    return (torch.diff(positions, dim=1, prepend=before) - 1).reshape(-1)


def gaps_to_positions(gaps: torch.Tensor, num_chunks: int, k: int) -> torch.Tensor:
    """Inverse of `positions_to_gaps`: (num_chunks, k) int64 positions, strictly increasing per row."""
    return torch.cumsum(gaps.reshape(num_chunks, k) + 1, dim=1) - 1


def best_rice_param(gaps: torch.Tensor) -> int:
    """The reference's choice (`locoswarm_kernels.entropy.best_rice_param`), from two host syncs.

    The reference searches b in [centre - 2, centre + 2] around centre = int(log2(mean + 1)); the
    centre is computed here in exact integer arithmetic, floor(log2((total + n) / n)), which is the
    same number for any packet that fits in memory (the float form could only differ when n
    exceeds 2^40)."""
    n = gaps.numel()
    if n == 0:
        return 0
    total = int(gaps.sum())
    centre = ((total + n) // n).bit_length() - 1
    candidates = range(max(0, centre - 2), min(MAX_RICE_PARAM, centre + 2) + 1)
    sums = torch.stack([(gaps >> b).sum() for b in candidates]).tolist()
    costs = [s + n * (1 + b) for s, b in zip(sums, candidates)]
    return candidates[costs.index(min(costs))]  # the first minimum, as the reference's strict <


def _or_bytes(num_bytes: int, byte_index: torch.Tensor, byte_values: torch.Tensor) -> torch.Tensor:
    """A uint8 stream of `num_bytes` whose byte j is the sum (= OR, the bits being disjoint) of the
    `byte_values` whose `byte_index` is j."""
    out = torch.zeros(num_bytes, dtype=torch.int32, device=byte_index.device)
    out.index_add_(0, byte_index, byte_values.to(torch.int32))
    return out.to(torch.uint8)


def rice_encode(gaps: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unary stream, remainder stream) as uint8 tensors on the gaps' device."""
    if not 0 <= b <= MAX_RICE_PARAM:
        raise ValueError(f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
    gaps = gaps.to(torch.int64).reshape(-1)
    n = gaps.numel()
    ends = torch.cumsum((gaps >> b) + 1, dim=0) - 1  # bit position of each symbol's terminating one
    num_bits = int(ends[-1]) + 1 if n else 0
    unary = _or_bytes((num_bits + 7) // 8, ends >> 3, 128 >> (ends & 7))
    if b == 0:
        return unary, torch.zeros(0, dtype=torch.uint8, device=gaps.device)
    start = torch.arange(n, device=gaps.device, dtype=torch.int64) * b
    window = (gaps & ((1 << b) - 1)) << (32 - (start & 7) - b)  # the b bits, placed in a 32-bit window
    shifts = torch.tensor(_BYTE_SHIFTS, device=gaps.device)
    parts = (window.unsqueeze(1) >> shifts) & 255  # (n, 4) big-endian bytes of the window
    where = (start >> 3).unsqueeze(1) + torch.arange(4, device=gaps.device)
    num_bytes = (n * b + 7) // 8
    remainders = _or_bytes(num_bytes + 3, where.reshape(-1), parts.reshape(-1))[:num_bytes]
    return unary, remainders


def rice_decode(unary: torch.Tensor, remainders: torch.Tensor, count: int, b: int) -> torch.Tensor:
    """The `count` int64 gaps coded in the two uint8 streams; ValueError if they do not hold exactly that."""
    if not 0 <= b <= MAX_RICE_PARAM:
        raise ValueError(f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
    if remainders.numel() != (count * b + 7) // 8:
        raise ValueError(f"remainder stream has {remainders.numel()} bytes, expected {(count * b + 7) // 8}")
    device = unary.device
    # int32 positions when every bit position and remainder offset fits, else int64.
    small = unary.numel() * 8 + 8 < 2**31 and count * max(b, 1) + 32 < 2**31
    index_dtype = torch.int32 if small else torch.int64
    popcount, bit_order = _byte_tables(device, index_dtype)
    raw = unary.to(index_dtype)
    ones_per_byte = popcount.index_select(0, raw)
    found = int(ones_per_byte.sum())
    if found != count:
        raise ValueError(f"unary stream holds {found} symbols, expected {count}")
    if count and int(raw[-1]) == 0:
        raise ValueError("unary stream has trailing bytes")
    byte_of_one = torch.repeat_interleave(
        torch.arange(raw.numel(), device=device, dtype=index_dtype), ones_per_byte, output_size=count
    )
    first_one = torch.cumsum(ones_per_byte, dim=0, dtype=index_dtype) - ones_per_byte  # each byte's first one
    rank = torch.arange(count, device=device, dtype=index_dtype) - first_one.index_select(0, byte_of_one)
    bit = bit_order.index_select(0, raw.index_select(0, byte_of_one) * 8 + rank)
    ends = byte_of_one * 8 + bit
    quotients = torch.diff(ends, prepend=torch.full((1,), -1, dtype=index_dtype, device=device)).to(torch.int64) - 1
    if b == 0:
        return quotients
    window_bytes = (b + 7 + 7) // 8  # bytes that b bits starting at a bit offset <= 7 can touch
    window_dtype = torch.int32 if window_bytes <= 3 else torch.int64
    padded = torch.cat([remainders.to(window_dtype), torch.zeros(3, dtype=window_dtype, device=device)])
    start = torch.arange(count, device=device, dtype=index_dtype) * b
    first = start >> 3
    window = padded.index_select(0, first)
    for j in range(1, window_bytes):  # at most three more gathers, not a loop over elements
        window = (window << 8) | padded.index_select(0, first + j)
    low = (window >> (8 * window_bytes - (start & 7) - b)) & ((1 << b) - 1)
    return (quotients << b) | low.to(torch.int64)


class StreamError(ValueError):
    """A broken stream in `rice_decode_batch`; `index` is the section it belongs to."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _segment_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums: where each of the concatenated segments starts."""
    return torch.cumsum(lengths, dim=0) - lengths


@lru_cache(maxsize=16)
def _unary_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(popcount (256,), zeros before the r-th set bit MSB-first at byte * 8 + r (256 * 8,)) in `dtype`."""
    popcount, bit_order = _byte_tables(device, torch.int64)
    zeros_before = bit_order.view(256, 8) - torch.arange(8, device=device)  # bit offset minus the ones before
    return popcount.to(dtype), zeros_before.reshape(-1).to(dtype)


def _spread(starts: torch.Tensor, values: torch.Tensor, count: int) -> torch.Tensor:
    """(count,) int64: values[j] at every place from starts[j] on (starts ascending, < count + 1).

    The repeat_interleave of a segmented array, built as one integer index_add_ of the steps between
    consecutive values and a cumsum: equal starts (empty segments) add their steps into one place."""
    steps = torch.diff(values.to(torch.int64), prepend=values.new_zeros(1, dtype=torch.int64))
    out = torch.zeros(count + 1, dtype=torch.int64, device=values.device).index_add_(0, starts, steps)
    return torch.cumsum(out[:count], dim=0)


def _spread_pair(
    starts: torch.Tensor, low: torch.Tensor, high: torch.Tensor, count: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_spread` of two arrays. In int32 (every value in [-2^31, 2^31)) both ride one int64 spread,
    high * 2^32 + (low + 2^31) (the offset keeps the low word from borrowing), read back as the two
    int32 halves of each int64 (little-endian: low first); in int64, two spreads."""
    if dtype == torch.int64:
        return _spread(starts, low, count), _spread(starts, high, count)
    packed = _spread(starts, (high.to(torch.int64) << 32) + (low.to(torch.int64) + 2**31), count)
    halves = packed.view(torch.int32).view(count, 2)
    return halves[:, 0] ^ -(2**31), halves[:, 1]  # the xor takes the offset back off, without overflow


@lru_cache(maxsize=8)
def _symbol_params(
    counts_and_b: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per symbol, its section's b and c = 8 * (the section's remainder start) - (its first symbol) * b,
    so that symbol i's remainder starts at bit i * b + c. Cached: packets of one model mostly share
    their Rice parameters (they follow from the density), so this is the same from packet to packet."""
    long = dict(dtype=torch.int64, device=device)
    counts, rice_b = (torch.tensor(column, **long) for column in zip(*counts_and_b))
    symbol_start = _segment_starts(counts)
    c = 8 * _segment_starts((counts * rice_b + 7) // 8) - symbol_start * rice_b
    return _spread_pair(symbol_start, rice_b, c, int(counts.sum()), dtype)


def _check_sections(sections: list[tuple[int, int, int, int, int, int]]) -> None:
    for i, (_, _, _, rem_len, count, b) in enumerate(sections):
        if not 0 <= b <= MAX_RICE_PARAM:
            raise StreamError(i, f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
        if rem_len != (count * b + 7) // 8:
            raise StreamError(i, f"remainder stream has {rem_len} bytes, expected {(count * b + 7) // 8}")


def rice_decode_rows(
    streams: torch.Tensor,
    sections: list[tuple[int, int, int, int, int, int]],
    row_lengths: torch.Tensor,
    rows_per_section: list[int],
    row_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions, not gaps: each row's running sum of gap + 1, minus 1, plus its `row_offsets` entry
    (0 if None), for all sections' symbols in order (int64).

    `streams` holds the packet's coded bytes; each section is (unary_start, unary_len,
    remainder_start, remainder_len, count, b), byte offsets into `streams`. Rows split the symbols:
    `row_lengths` (int64 on the streams' device), `rows_per_section[s]` rows for section s, summing to
    its count. Accepts and refuses exactly what `rice_decode` does section by section (StreamError
    names the first bad section), with a fixed number of whole-tensor ops and one host sync.

    Gap i is (q_i << b) | r_i, q_i the zeros before the i-th terminating one since the previous one.
    With Z_i the zeros before the i-th one in all the unary bytes and D_i = sum_{j<=i} (r_j + 1),
    position i = (Z_i << b) + D_i minus a constant per row (Z and D where the row starts): no
    per-symbol quotient, no segmented sum. Z_i is the zeros before its byte plus a table entry for
    its rank in the byte; the per-byte and per-section values reach the symbols through `_spread`
    (an index_add_ and a cumsum, much cheaper than repeat_interleave). Small values run in int32.
    """
    device = streams.device
    _check_sections(sections)
    num_symbols = sum(s[4] for s in sections)
    if not sections:
        return torch.zeros(0, dtype=torch.int64, device=device)
    # int32 when every bit offset and Z fits (any packet under 256 MiB), else int64.
    small = streams.numel() * 8 + 64 < 2**31 and num_symbols * (MAX_RICE_PARAM + 1) < 2**31
    index_dtype = torch.int32 if small else torch.int64
    long = dict(dtype=torch.int64, device=device)
    unary_len, counts, rice_b = (torch.tensor([s[c] for s in sections], **long) for c in (1, 4, 5))
    symbol_start = _segment_starts(counts)
    unary = torch.cat([streams[s[0] : s[0] + s[1]] for s in sections])
    remainders = torch.cat([streams[s[2] : s[2] + s[3]] for s in sections] + [streams.new_zeros(4)])

    # Unary: ones per byte, each section's count and last byte (the one host sync).
    popcount, zeros_before_rank = _unary_tables(device, index_dtype)
    raw = unary.to(index_dtype)
    ones = popcount.index_select(0, raw)
    ones_through = torch.cumsum(ones, dim=0)  # int64
    unary_end = torch.cumsum(unary_len, dim=0)
    through_end = (
        torch.where(unary_len > 0, ones_through[(unary_end - 1).clamp_min(0)], 0) if unary.numel() else unary_len
    )
    through_start = (
        torch.where(unary_end - unary_len > 0, ones_through[(unary_end - unary_len - 1).clamp_min(0)], 0)
        if unary.numel()
        else unary_len
    )
    last_is_zero = (unary_len > 0) & (raw[(unary_end - 1).clamp_min(0)] == 0) if unary.numel() else unary_len < 0
    for i, (got, zero_tail, section) in enumerate(
        zip((through_end - through_start).tolist(), last_is_zero.tolist(), sections)
    ):
        if got != section[4]:
            raise StreamError(i, f"unary stream holds {got} symbols, expected {section[4]}")
        if section[4] and zero_tail:
            raise StreamError(i, "unary stream has trailing bytes")
    if num_symbols == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)

    # Z_i: per byte, the zeros before it (8 * byte - ones before it) and the key 8 * byte value - ones
    # before it; key + i is the byte value * 8 + the symbol's rank in its byte.
    first_one = ones_through - ones
    byte_bits = torch.arange(0, 8 * raw.numel(), 8, **long)
    key, zeros = _spread_pair(first_one, raw * 8 - first_one, byte_bits - first_one, num_symbols, index_dtype)
    at = torch.arange(num_symbols, dtype=index_dtype, device=device)
    z = zeros_before_rank.index_select(0, key + at).add_(zeros)

    # Remainders: symbol i's b bits start at bit i * b + c of the concatenated remainder streams
    # (c per section); a 31-bit big-endian window from their byte holds them (offset <= 7, b <= 24).
    b, c = _symbol_params(tuple((s[4], s[5]) for s in sections), device, index_dtype)
    w = remainders.to(index_dtype)
    window = (w[:-3] << 23) | (w[1:-2] << 15) | (w[2:-1] << 7) | (w[3:] >> 1)
    start = at * b
    start += c
    low = window.index_select(0, start >> 3)
    low <<= start & 7
    low &= 2**31 - 1
    low >>= 31 - b
    low += 1
    d = torch.cumsum(low, dim=0, dtype=torch.int64)

    # Per row: Z before its first symbol (its section's zeros before it, for a section's first row)
    # and D before it, folded with the offset into one constant.
    row_start = _segment_starts(row_lengths)
    row_section = torch.repeat_interleave(
        torch.arange(len(sections), device=device), torch.tensor(rows_per_section, **long)
    )
    first_row = row_start == symbol_start.index_select(0, row_section)
    before = (row_start - 1).clamp_min(0)
    section_zeros = 8 * (unary_end - unary_len) - symbol_start
    z_before = torch.where(first_row, section_zeros.index_select(0, row_section), z.index_select(0, before).long())
    d_before = torch.where(row_start > 0, d.index_select(0, before), 0)
    constant = -1 - d_before - (z_before << rice_b.index_select(0, row_section))
    if row_offsets is not None:
        constant += row_offsets
    positions = z.to(torch.int64)
    positions <<= b
    positions += d
    positions += _spread(row_start, constant, num_symbols)
    return positions


def rice_decode_batch(streams: torch.Tensor, sections: list[tuple[int, int, int, int, int, int]]) -> torch.Tensor:
    """The gaps of many tensors at once, concatenated in section order (int64): `rice_decode_rows`
    with one row a section, then the differences."""
    counts = torch.tensor([s[4] for s in sections], dtype=torch.int64, device=streams.device)
    positions = rice_decode_rows(streams, sections, counts, [1] * len(sections))
    if not positions.numel():
        return positions
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    firsts = _segment_starts(counts)[counts > 0]
    gaps[firsts] = positions[firsts]
    return gaps


def rows_to_positions(gaps: torch.Tensor, row_lengths: torch.Tensor) -> torch.Tensor:
    """Positions from the concatenated gaps of rows of varying length (each row restarts at -1):
    the batched `gaps_to_positions`."""
    totals = torch.cumsum(gaps + 1, dim=0)
    row_starts = _segment_starts(row_lengths)
    before_row = torch.where(row_starts > 0, totals[(row_starts - 1).clamp_min(0)], 0)
    return totals - torch.repeat_interleave(before_row, row_lengths, output_size=gaps.numel()) - 1


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 4), four to a byte, first code in the high bits: a uint8 tensor."""
    codes = codes.reshape(-1).to(torch.uint8)
    padded = torch.zeros((codes.numel() + 3) // 4 * 4, dtype=torch.uint8, device=codes.device)
    padded[: codes.numel()] = codes
    quads = padded.view(-1, 4)
    return (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]


def unpack_2bit(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_2bit`; ValueError unless `packed` is exactly ceil(count / 4) bytes.

    One gather in a table of the four codes of every byte value, each entry four uint8 read as one
    int32 (2.6x faster on the CPU than shifting every byte four ways)."""
    if packed.numel() != (count + 3) // 4:
        raise ValueError(f"code stream has {packed.numel()} bytes, expected {(count + 3) // 4}")
    quads = code_quads(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    return quads.view(torch.uint8)[:count]


@lru_cache(maxsize=8)
def code_quads(device: torch.device) -> torch.Tensor:
    """(256,) int32: byte value -> its four 2-bit codes, first in the high bits, as four uint8."""
    shifts = torch.tensor([6, 4, 2, 0], device=device)
    return ((torch.arange(256, device=device).view(-1, 1) >> shifts) & 3).to(torch.uint8).view(torch.int32).view(-1)


def max_unary_bytes(num_chunks: int, k: int, chunk_len: int, b: int) -> int:
    """The longest unary stream any in-range selection can need: per chunk the gaps plus one sum to
    at most chunk_len, so the quotients sum to at most (chunk_len - k) >> b. A longer stream cannot
    decode to positions inside their chunks, so a decoder may refuse it before reading it."""
    return (num_chunks * (k + ((chunk_len - k) >> b)) + 7) // 8


def rice_decode_positions(
    streams: torch.Tensor,
    sections: list[tuple[int, int, int, int, int, int]],
    row_lengths: list[int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions inside rows (int32), for all sections' symbols in order: what `rice_decode_rows`
    gives without offsets, section s cut into rows of `row_lengths[s]` symbols (which divides its
    count). Values that would reach 2^31 - 1 saturate there (a caller bounding positions by a chunk
    length refuses them alike). Accepts and refuses exactly what `rice_decode_rows` does. Written
    into `out` when given (int32, one entry a symbol).

    The fast path works on groups: sections of one Rice parameter b and row length whose counts are
    multiples of 8 (so that their remainder streams concatenate into one stream of b bits a symbol)
    and whose values fit in int32, their streams concatenated. A group is a (rows, row length) grid:
    positions are (Z << b) + D minus a constant per row (Z and D where the row starts, and 1), D the
    running sum of remainder + 1 over the group, with every shift by a scalar. Eight
    symbols take exactly b remainder bytes, so the eight remainders are read with eight scalar
    shifts, no gather (`_remainders`). Other sections (short ones, in practice) go through
    `rice_decode_rows`. Temporaries come from reused buffers (locoswarm_kernels.chunking.scratch). (Decoding
    halves of a group on two worker threads was slower, 8 ms against 6 ms a packet on two cores:
    each half pays the per-op overhead, and the ops are short.)"""
    device = streams.device
    _check_sections(sections)
    for i, (section, row_len) in enumerate(zip(sections, row_lengths)):
        if row_len < 1 or section[4] % row_len:
            raise ValueError(f"section {i}: {section[4]} symbols do not split into rows of {row_len}")
    num_symbols = sum(s[4] for s in sections)
    if out is None:
        out = torch.empty(num_symbols, dtype=torch.int32, device=device)
    if not sections:
        return out
    # A group's int32 values stay below (8 * its unary bytes + its symbols) << b: (Z << b) + D.
    groups: dict[tuple[int, int], list[list[int]]] = {}
    general, bound = [], {}
    for i, ((_, unary_len, _, _, count, b), row_len) in enumerate(zip(sections, row_lengths)):
        if not (count and count % 8 == 0 and (8 * unary_len + count) << b < 2**31):
            general.append(i)
            continue
        runs = groups.setdefault((b, row_len), [[]])
        if runs[-1] and (bound[id(runs[-1])] + 8 * unary_len + count) << b >= 2**31:
            runs.append([])
        bound[id(runs[-1])] = bound.get(id(runs[-1]), 0) + 8 * unary_len + count
        runs[-1].append(i)
    groups_in_order = [(b, row_len, members) for (b, row_len), runs in groups.items() for members in runs]
    order = [i for _, _, members in groups_in_order for i in members] + general

    # Unary: ones per byte and each section's count and last byte (the one host sync), in `order`.
    unary_len = torch.tensor([sections[i][1] for i in order], dtype=torch.int64)
    total_bytes = int(unary_len.sum())
    unary = torch.cat(
        [streams[sections[i][0] : sections[i][0] + sections[i][1]] for i in order],
        out=scratch("rice.unary", total_bytes, torch.uint8, device),
    )
    popcount, zeros_before_rank = _unary_tables(device, torch.int32)
    raw = scratch("rice.raw", total_bytes, torch.int32, device).copy_(unary)
    ones = torch.index_select(popcount, 0, raw, out=scratch("rice.ones", total_bytes, torch.int32, device))
    ones_through = torch.cumsum(ones, dim=0, out=scratch("rice.ones_through", total_bytes, torch.int32, device))
    unary_end = torch.cumsum(unary_len, dim=0)
    if total_bytes:
        last = (unary_end - 1).clamp_min(0).to(device)
        before = (unary_end - unary_len - 1).clamp_min(0).to(device)
        got = torch.where(unary_len.to(device) > 0, ones_through.index_select(0, last), 0) - torch.where(
            (unary_end - unary_len).to(device) > 0, ones_through.index_select(0, before), 0
        )
        zero_tail = (unary_len.to(device) > 0) & (raw.index_select(0, last) == 0)
        checks = torch.stack([got, zero_tail.to(torch.int32)]).tolist()
    else:
        checks = [[0] * len(order), [0] * len(order)]
    found = {i: (got, tail) for i, got, tail in zip(order, *checks)}
    for i, section in enumerate(sections):
        got, zero_tail = found[i]
        if got != section[4]:
            raise StreamError(i, f"unary stream holds {got} symbols, expected {section[4]}")
        if section[4] and zero_tail:
            raise StreamError(i, "unary stream has trailing bytes")

    symbol_starts = [0]
    for section in sections:
        symbol_starts.append(symbol_starts[-1] + section[4])

    def place(members: list[int], decoded: torch.Tensor) -> None:
        at = 0
        for i in members:
            out[symbol_starts[i] : symbol_starts[i + 1]].copy_(decoded[at : at + sections[i][4]])
            at += sections[i][4]

    first_one = ones_through.sub_(ones)  # symbols before each byte, counted over `order`
    byte_at = symbol_at = 0
    for b, row_len, members in groups_in_order:
        group_bytes = sum(sections[i][1] for i in members)
        span = slice(byte_at, byte_at + group_bytes)
        place(
            members,
            _decode_group(
                streams,
                [sections[i] for i in members],
                b,
                row_len,
                raw[span],
                first_one[span].sub_(symbol_at),
                zeros_before_rank,
            ),
        )
        byte_at, symbol_at = byte_at + group_bytes, symbol_at + sum(sections[i][4] for i in members)
    if general:
        lengths = torch.tensor([row_lengths[i] for i in general], dtype=torch.int64)
        rows = [sections[i][4] // row_lengths[i] for i in general]
        row_lengths_all = torch.repeat_interleave(lengths, torch.tensor(rows, dtype=torch.int64)).to(device)
        rest = rice_decode_rows(streams, [sections[i] for i in general], row_lengths_all, rows)
        place(general, rest.clamp_max_(2**31 - 1))
    return out


def _decode_group(
    streams: torch.Tensor,
    members: list[tuple[int, int, int, int, int, int]],
    b: int,
    row_len: int,
    raw: torch.Tensor,
    first_one: torch.Tensor,
    zeros_before_rank: torch.Tensor,
) -> torch.Tensor:
    """One group of `rice_decode_positions`: (symbols,) int32 positions inside rows, in a work buffer.
    `raw` holds the group's unary bytes (int32) and `first_one` the group's symbols before each."""
    device = streams.device
    count = sum(s[4] for s in members)
    rows, num_bytes = count // row_len, raw.numel()
    # Z, the zeros before each terminating one over the group's unary bytes. Per byte, in one int64:
    # the zeros before it (high word) and its value * 8 - the symbols before it + count (low word,
    # >= 0: no borrow between the words), spread to its symbols (`_spread`, with work buffers) over
    # a start of ones, so that each symbol's low word gains its number + 1 and becomes value * 8 +
    # its rank in the byte + count + 1: its entry in the table of zeros before a rank, placed at
    # count + 1 in a work buffer (whose other entries are never read).
    words = scratch("rice.per_byte", num_bytes, torch.int64, device).view(torch.int32).view(num_bytes, 2)
    low, high = (scratch(name, num_bytes, torch.int32, device) for name in ("rice.low", "rice.high"))
    torch.mul(raw, 8, out=low).sub_(first_one).add_(count)
    torch.arange(0, 8 * num_bytes, 8, out=high).sub_(first_one)
    words[:, 0], words[:, 1] = low, high  # little-endian: (low, high) words
    per_byte = words.view(torch.int64).view(num_bytes)
    steps = scratch("rice.byte_steps", num_bytes, torch.int64, device)
    steps[:1] = per_byte[:1]
    torch.sub(per_byte[1:], per_byte[:-1], out=steps[1:])
    packed = scratch("rice.packed", count + 1, torch.int64, device).fill_(1).index_add_(0, first_one, steps)[:count]
    halves = packed.cumsum_(0).view(torch.int32).view(count, 2)
    table = scratch("rice.table", count + 1 + zeros_before_rank.numel(), torch.int32, device)
    table[count + 1 :] = zeros_before_rank
    key = scratch("rice.key", count, torch.int32, device).copy_(halves[:, 0])
    z = torch.index_select(table, 0, key, out=scratch("rice.z", count, torch.int32, device))
    # The high words copied out first: adding them strided took longer than the copy and a contiguous add.
    z = z.add_(key.copy_(halves[:, 1])).view(rows, row_len)
    # Remainder + 1 per symbol, and D, their running sum over the group.
    remainders = torch.cat(
        [streams[s[2] : s[2] + s[3]] for s in members],
        out=scratch("rice.remainders", count * b // 8, torch.uint8, device),
    )
    d = _remainders(remainders, count, b).add_(1).view(-1).cumsum_(0).view(rows, row_len)
    # Per row, (Z << b) + D before its first symbol, + 1: Z and D of the previous row's last symbol,
    # except that a section's first row takes the zeros before the section's bytes (its first symbol
    # has counted the padding of the section before) and D before the section.
    row_before = torch.zeros(rows, dtype=torch.int32, device=device)
    row_before[1:] = z[:-1, -1]
    first_rows, section_zeros, row_at, byte_at, symbol_at = [], [], 0, 0, 0
    for _, unary_len, _, _, section_count, _ in members:
        first_rows.append(row_at)
        section_zeros.append(8 * byte_at - symbol_at)
        row_at, byte_at, symbol_at = row_at + section_count // row_len, byte_at + unary_len, symbol_at + section_count
    row_before[torch.tensor(first_rows, device=device)] = torch.tensor(section_zeros, dtype=torch.int32, device=device)
    row_before <<= b
    row_before[1:] += d[:-1, -1]
    row_before += 1
    positions = z.bitwise_left_shift_(b).add_(d).sub_(row_before.unsqueeze(1))
    return positions.view(-1)


@lru_cache(maxsize=64)
def _remainder_shifts(b: int, device: torch.device) -> torch.Tensor:
    """(8,) int64: the right shift that brings symbol j's b-bit remainder to the bottom of its word."""
    return torch.tensor([b * (7 - j) for j in range(8)], dtype=torch.int64, device=device)


def _remainders(remainders: torch.Tensor, count: int, b: int) -> torch.Tensor:
    """(count // 8, 8) int32 in a work buffer: the b-bit remainders of `count` symbols (a multiple
    of 8) from their stream, which eight symbols fill exactly b bytes of. For b <= 8 those bytes,
    reversed into the low bytes of a little-endian int64, are one big-endian number holding the
    eight remainders (symbol j's at bit b * (7 - j)); for larger b, a 31-bit big-endian window from
    every byte, read at a fixed byte and bit per j. No gather either way."""
    device = remainders.device
    out = scratch("rice.remainder_values", count, torch.int32, device).view(count // 8, 8)
    if b == 0:
        return out.zero_()
    if b <= 8 and sys.byteorder == "little":
        words = scratch("rice.words", count, torch.uint8, device).view(count // 8, 8).zero_()
        grouped = remainders.view(count // 8, b)
        for j in range(b):
            words[:, b - 1 - j] = grouped[:, j]
        # All eight shifts in one broadcast op into int64, then one narrowing copy: shifting into
        # int32 columns took 1.8x as long (a mixed-dtype, strided output per shift). The int64 work
        # buffer is `_decode_group`'s per-symbol words, spent by the time remainders are read.
        shifted = torch.bitwise_right_shift(
            words.view(torch.int64),
            _remainder_shifts(b, device),
            out=scratch("rice.packed", count, torch.int64, device).view(count // 8, 8),
        )
        return out.copy_(shifted).bitwise_and_((1 << b) - 1)
    padded = torch.cat([remainders, remainders.new_zeros(3)]).to(torch.int32)
    window = (padded[:-3] << 23) | (padded[1:-2] << 15) | (padded[2:-1] << 7) | (padded[3:] >> 1)
    window = window.view(count // 8, b)
    for j in range(8):
        torch.bitwise_left_shift(window[:, (j * b) >> 3], (j * b) & 7, out=out[:, j])
    out &= 2**31 - 1
    return out.bitwise_right_shift_(31 - b)
