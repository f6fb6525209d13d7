"""The fast CPU paths of the packet kernels against the plain ones they stand for: the grouped Rice
decoder (locoswarm_kernels.entropy_torch.rice_decode_positions) against `rice_decode_rows`, refusals
included, and the chunk-by-chunk aggregation against the block-by-block one and `scatter_mean`,
for any number of workers."""

import numpy as np
import pytest
import torch

from locoswarm_kernels import entropy as ref
from locoswarm_kernels import entropy_torch as fast
from locoswarm_kernels import sparse
from locoswarm_kernels.chunking import scratch
from locoswarm_kernels.sparse import aggregate_packets, packet_clip_scales
from tests.unit.test_packet_aggregate import (
    assert_same_bits,
    decoded_packets,
    reference,
)


def random_sections(rng, num_sections: int, grouped: bool):
    """(stream bytes, sections, row lengths): sections of random sizes, Rice parameters and gaps."""
    buffer, sections, row_lengths = b"", [], []
    for _ in range(num_sections):
        row_len = int(rng.choice([1, 2, 8, 16, 64]))
        rows = int(rng.integers(1, 20))
        if grouped:
            rows = rows - rows % 8 + 8  # a multiple of 8 symbols: the grouped path
        b = int(rng.choice([0, 1, 4, 5, 7, 8, 9, 13, 20, 24]))
        gaps = (rng.geometric(1 / float(rng.uniform(1, 3000)), size=row_len * rows) - 1).astype(np.int64)
        unary, remainders = ref.rice_encode(gaps, b)
        sections.append((len(buffer), len(unary), len(buffer) + len(unary), len(remainders), gaps.size, b))
        row_lengths.append(row_len)
        buffer += unary + remainders
    return buffer, sections, row_lengths


def plain(streams, sections, row_lengths):
    rows = [s[4] // r for s, r in zip(sections, row_lengths)]
    lengths = torch.repeat_interleave(torch.tensor(row_lengths), torch.tensor(rows))
    return fast.rice_decode_rows(streams, sections, lengths, rows).clamp_max(2**31 - 1).to(torch.int32)


def outcome(fn):
    try:
        return fn()
    except fast.StreamError as e:
        return (e.index, str(e))


@pytest.mark.parametrize("seed", range(40))
def test_grouped_rice_decode_is_the_plain_one_and_refuses_alike(seed):
    rng = np.random.default_rng(seed)
    buffer, sections, row_lengths = random_sections(rng, int(rng.integers(1, 9)), grouped=seed % 2 == 0)
    streams = torch.tensor(list(buffer), dtype=torch.uint8)
    assert torch.equal(
        fast.rice_decode_positions(streams, sections, row_lengths), plain(streams, sections, row_lengths)
    )
    out = torch.full((sum(s[4] for s in sections),), -7, dtype=torch.int32)
    assert fast.rice_decode_positions(streams, sections, row_lengths, out=out) is out
    assert torch.equal(out, plain(streams, sections, row_lengths))

    for _ in range(3):  # a flipped unary bit: the same refusal (first bad section) or the same positions
        broken = bytearray(buffer)
        u0, u_len = sections[int(rng.integers(0, len(sections)))][:2]
        broken[u0 + int(rng.integers(0, u_len))] ^= 1 << int(rng.integers(0, 8))
        streams = torch.tensor(list(broken), dtype=torch.uint8)
        expected = outcome(lambda streams=streams: plain(streams, sections, row_lengths))
        got = outcome(lambda streams=streams: fast.rice_decode_positions(streams, sections, row_lengths))
        if isinstance(expected, tuple) or isinstance(got, tuple):
            assert got == expected
        else:
            assert torch.equal(got, expected)


def test_groups_split_where_int32_would_not_hold_them(monkeypatch):
    """b = 20 and gaps below 2^20 (no quotients): each section's values fit in int32 but not all
    together, so the group is cut into runs; a section that does not fit alone takes the plain path."""
    rng = np.random.default_rng(0)
    buffer, sections = b"", []
    for count in (8, 512, 512, 256, 64, 2048):
        gaps = rng.integers(0, 2**20, size=count).astype(np.int64)
        unary, remainders = ref.rice_encode(gaps, 20)
        sections.append((len(buffer), len(unary), len(buffer) + len(unary), len(remainders), count, 20))
        buffer += unary + remainders
    streams = torch.tensor(list(buffer), dtype=torch.uint8)
    runs = []
    decode_group = fast._decode_group
    monkeypatch.setattr(fast, "_decode_group", lambda *args: runs.append(len(args[1])) or decode_group(*args))
    row_lengths = [8] * len(sections)
    assert torch.equal(
        fast.rice_decode_positions(streams, sections, row_lengths), plain(streams, sections, row_lengths)
    )
    assert runs == [2, 3]  # (8, 512), (512, 256, 64); 2048 alone is too large


def test_rows_that_do_not_divide_a_section_are_refused():
    with pytest.raises(ValueError):
        fast.rice_decode_positions(torch.zeros(4, dtype=torch.uint8), [(0, 1, 1, 0, 3, 0)], [2])


@pytest.mark.parametrize("seed", range(3))
def test_aggregation_bits_do_not_depend_on_workers_or_path(seed):
    _, packets = decoded_packets(num_peers=5 + seed, seed=30 + seed)
    scales = packet_clip_scales(packets)
    expected = reference(packets, peer_scales=scales)
    for workers in (1, 2, 3):
        assert_same_bits(aggregate_packets(packets, peer_scales=scales, num_threads=workers), expected)
    layout = packets[0].layout
    tables = [(p.code_values * torch.tensor(s).unsqueeze(1)).view(-1) for p, s in zip(packets, scales)]
    assert_same_bits(
        sparse._aggregate_blocks(packets, tables, torch.float32, torch.device("cpu"), torch.float32), expected
    )
    assert layout.num_symbols == packets[0].index.numel()


def test_runs_of_tile_rows_split_large_tensors(monkeypatch):
    """Tensors larger than a run: whole tile rows at a time, on views and on tiled layouts."""
    monkeypatch.setattr(sparse, "BLOCK_ELEMENTS", 3 * 4096)
    shapes = {"tiled": (256, 192), "view": (64, 64 * 9), "vector": (64 * 50,)}
    _, packets = decoded_packets(num_peers=4, seed=40, shapes=shapes)
    assert_same_bits(aggregate_packets(packets, num_threads=2), reference(packets))


def test_scratch_buffers_are_reused_per_thread_and_name():
    a = scratch("test.a", 10, torch.int32, "cpu")
    assert scratch("test.a", 5, torch.int32, "cpu").data_ptr() == a.data_ptr()
    assert scratch("test.b", 5, torch.int32, "cpu").data_ptr() != a.data_ptr()
    assert scratch("test.a", 20, torch.int32, "cpu").numel() == 20
