"""The packet's entropy coder as whole-tensor torch ops, on whatever device the tensors live on.

Same streams, bit for bit, as the numpy reference in `kernels.entropy` (its docstring has the
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
- unary, decode: a popcount table per byte gives how many ones each byte holds; the ones are laid
  out with `repeat_interleave`, and a (256, 8) table gives the bit offset of the r-th one of a byte.
  The work is proportional to the stream's bytes plus the count, not to its bits.
- remainders, decode: the two to four bytes that hold gap i's bits, from byte (i*b) // 8, are
  gathered into one window and shifted down.

Decoding indexes in int32 when the streams are short enough for every bit position to fit (any
packet under 256 MiB), which halves the memory traffic on the CPU; the gaps come back as int64.

Decoders assume their caller bounded the stream sizes (`protocol.packet` does, before any
allocation); they raise ValueError, like the reference, for streams that do not hold exactly the
expected symbols. A few host syncs remain where a size must be known (the Rice parameter, the
stream lengths, the symbol count check): a handful per tensor, none per element.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels.entropy import MAX_RICE_PARAM

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
    """The reference's choice (`kernels.entropy.best_rice_param`), from two host syncs.

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
    byte_of_one = torch.repeat_interleave(torch.arange(raw.numel(), device=device, dtype=index_dtype),
                                          ones_per_byte, output_size=count)
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


def rice_decode_batch(streams: torch.Tensor, sections: list[tuple[int, int, int, int, int, int]]) -> torch.Tensor:
    """The gaps of many tensors at once, concatenated in section order (int64).

    `streams` holds the packet's coded bytes; each section is (unary_start, unary_len,
    remainder_start, remainder_len, count, b), byte offsets into `streams`. Accepts and refuses
    exactly what `rice_decode` does section by section (StreamError names the first bad section),
    with a fixed number of whole-tensor ops and two host syncs for the whole packet."""
    device = streams.device
    for i, (_, _, _, rem_len, count, b) in enumerate(sections):
        if not 0 <= b <= MAX_RICE_PARAM:
            raise StreamError(i, f"rice parameter {b} outside [0, {MAX_RICE_PARAM}]")
        if rem_len != (count * b + 7) // 8:
            raise StreamError(i, f"remainder stream has {rem_len} bytes, expected {(count * b + 7) // 8}")
    if not sections:
        return torch.zeros(0, dtype=torch.int64, device=device)
    # int32 throughout when every bit position in the streams fits (any packet under 256 MiB).
    index_dtype = torch.int32 if streams.numel() * 8 + 64 < 2**31 else torch.int64
    as_tensor = lambda column: torch.tensor([s[column] for s in sections], dtype=index_dtype, device=device)
    unary_start, unary_len, rem_start, counts, rice_b = (as_tensor(c) for c in (0, 1, 2, 4, 5))
    num_sections, num_unary, num_symbols = len(sections), sum(s[1] for s in sections), sum(s[4] for s in sections)
    popcount, bit_order = _byte_tables(device, index_dtype)
    spread = lambda per_section, lengths, total: torch.repeat_interleave(per_section, lengths, output_size=total)

    # Every unary byte, gathered in section order, and the section each belongs to.
    unary_at = torch.arange(num_unary, device=device, dtype=index_dtype)
    raw = streams.index_select(0, unary_at + spread(unary_start - _segment_starts(unary_len), unary_len, num_unary))
    raw = raw.to(index_dtype)
    ones_per_byte = popcount.index_select(0, raw)
    section_of_byte = spread(torch.arange(num_sections, device=device), unary_len, num_unary)
    found = torch.zeros(num_sections, dtype=index_dtype, device=device).index_add_(0, section_of_byte, ones_per_byte)
    last_byte = (torch.cumsum(unary_len, dim=0, dtype=index_dtype) - 1).clamp_min(0)
    last_is_zero = (unary_len > 0) & (raw[last_byte] == 0) if num_unary else unary_len < 0
    for i, (got, zero_tail, section) in enumerate(zip(found.tolist(), last_is_zero.tolist(), sections)):
        if got != section[4]:
            raise StreamError(i, f"unary stream holds {got} symbols, expected {section[4]}")
        if section[4] and zero_tail:
            raise StreamError(i, "unary stream has trailing bytes")

    # The terminating ones in order, as bit positions in the gathered unary bytes; a section's
    # first symbol counts from just before its own first byte.
    byte_of_one = torch.repeat_interleave(unary_at, ones_per_byte, output_size=num_symbols)
    rank = torch.arange(num_symbols, device=device, dtype=index_dtype)
    rank -= (torch.cumsum(ones_per_byte, dim=0, dtype=index_dtype) - ones_per_byte).index_select(0, byte_of_one)
    ends = byte_of_one * 8 + bit_order.index_select(0, raw.index_select(0, byte_of_one) * 8 + rank)
    previous = torch.roll(ends, 1)
    first_symbols = _segment_starts(counts)[counts > 0].long()
    previous[first_symbols] = (_segment_starts(unary_len)[counts > 0] * 8 - 1).to(index_dtype)
    quotients = (ends - previous - 1).to(torch.int64)

    # Remainders: b bits per symbol from bit (remainder_start * 8 + j * b), through a window of the
    # two to four bytes they can touch.
    b = spread(rice_b, counts, num_symbols)
    start = spread(rem_start * 8 - _segment_starts(counts) * rice_b, counts, num_symbols)
    start += torch.arange(num_symbols, device=device, dtype=index_dtype) * b
    window_bytes = (max(s[5] for s in sections) + 14) // 8
    window_dtype = torch.int32 if window_bytes <= 3 else torch.int64
    padded = torch.cat([streams, torch.zeros(4, dtype=torch.uint8, device=device)]).to(window_dtype)
    first = start >> 3
    window = padded.index_select(0, first)
    for j in range(1, window_bytes):  # at most three more gathers, not a loop over elements
        window = (window << 8) | padded.index_select(0, first + j)
    low = (window >> (8 * window_bytes - (start & 7) - b)) & ((1 << b) - 1)
    return (quotients << b.to(torch.int64)) | low.to(torch.int64)


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
    """Inverse of `pack_2bit`; ValueError unless `packed` is exactly ceil(count / 4) bytes."""
    if packed.numel() != (count + 3) // 4:
        raise ValueError(f"code stream has {packed.numel()} bytes, expected {(count + 3) // 4}")
    shifts = torch.tensor([6, 4, 2, 0], dtype=torch.uint8, device=packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 3).reshape(-1)[:count]


def max_unary_bytes(num_chunks: int, k: int, chunk_len: int, b: int) -> int:
    """The longest unary stream any in-range selection can need: per chunk the gaps plus one sum to
    at most chunk_len, so the quotients sum to at most (chunk_len - k) >> b. A longer stream cannot
    decode to positions inside their chunks, so a decoder may refuse it before reading it."""
    return (num_chunks * (k + ((chunk_len - k) >> b)) + 7) // 8
