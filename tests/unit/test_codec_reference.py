"""The fast codec kernels agree exactly with the slow reference on awkward inputs."""

import numpy as np
import pytest
import torch

from locoswarm_kernels.chunking import chunk_layout, from_chunks, largest_divisor_at_most, to_chunks
from locoswarm_kernels.entropy import (
    best_rice_param,
    gaps_to_positions,
    pack_2bit,
    positions_to_gaps,
    rice_decode,
    rice_encode,
    unpack_2bit,
)
from locoswarm_kernels.reference import (
    reference_chunks,
    reference_compress,
    reference_decode_values,
    reference_rice_bits,
    reference_scatter_mean,
)
from locoswarm_kernels.sparse import compress, decompress, error_feedback_step, scatter_mean

SHAPES = [
    (1,),
    (7,),
    (64,),
    (65,),
    (127,),
    (4096,),
    (1, 1),
    (3, 5),
    (67, 130),
    (128, 192),
    (13, 64),
    (256, 33),
    (4, 6, 10),
    (),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tie_free(shape, dtype, seed, top_k=64):
    """Random signed values whose magnitudes are distinct inside every chunk (Top-k has no ties)."""
    gen = torch.Generator().manual_seed(seed)
    layout = chunk_layout(shape, top_k)
    # Every representable magnitude in a range, then a random distinct subset of them per chunk.
    octaves = 10 if dtype == torch.float16 else 20  # float16 tops out at 65504
    candidates = torch.logspace(-octaves, octaves, steps=20_000, base=2.0).to(dtype).unique()
    picks = torch.rand(layout.num_chunks, candidates.numel(), generator=gen).argsort(dim=1)[:, : layout.chunk_len]
    signs = torch.randint(0, 2, picks.shape, generator=gen).to(dtype) * 2 - 1
    return from_chunks(candidates[picks] * signs, layout).reshape(shape)


def test_largest_divisor():
    assert largest_divisor_at_most(4096, 64) == 64
    assert largest_divisor_at_most(5440, 64) == 64  # the 512M model's intermediate size
    assert largest_divisor_at_most(1000, 64) == 50
    assert largest_divisor_at_most(127, 64) == 1
    assert largest_divisor_at_most(33, 64) == 33
    assert largest_divisor_at_most(96, 64) == 48


def test_layout_matches_paper_density():
    layout = chunk_layout((1536, 1536), 64)
    assert (layout.chunk_len, layout.k) == (4096, 64)
    assert chunk_layout((1536, 1536), 128).k == 128
    assert chunk_layout((1536,), 64).k == 1  # 64-element chunks keep round(64 * 64 / 4096) = 1
    assert chunk_layout((5, 3), 64).k == 1
    assert chunk_layout((8, 8), 8192).k == 64  # k >= chunk length keeps the whole chunk


@pytest.mark.parametrize("shape", SHAPES)
def test_chunks_round_trip_and_match_reference(shape):
    x = torch.randn(shape)
    layout = chunk_layout(x.shape, 64)
    chunks = to_chunks(x, layout)
    assert torch.equal(from_chunks(chunks, layout), x)
    reference = reference_chunks(x, layout)
    assert torch.equal(chunks, torch.tensor([[v for _, v in c] for c in reference]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("top_k", [64, 128, 8192])
def test_compress_matches_reference(shape, dtype, top_k):
    x = tie_free(shape, dtype, seed=top_k + len(shape))
    layout = chunk_layout(x.shape, top_k)
    sparse = compress(x, layout)
    positions, indices, values, codes, shift, lookup = reference_compress(x, layout)

    assert sparse.positions.tolist() == positions
    assert sparse.flat_indices().tolist() == indices
    assert sparse.codes.reshape(-1).tolist() == codes
    assert sparse.table.shift == shift
    assert sparse.table.lookup.tolist() == lookup
    decoded = reference_decode_values(codes, shift, lookup, dtype)
    assert torch.equal(sparse.values().reshape(-1), decoded)

    dense = decompress(sparse)
    assert dense.dtype == dtype and dense.shape == x.shape
    assert torch.equal(dense.reshape(-1)[indices], decoded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(67, 130), (128, 192), (127,), (1,)])
def test_error_feedback_step_matches_definition(shape, dtype):
    """e <- beta e + lr delta; then e -= decode(encode(e)), checked against the plain formula."""
    buffer = tie_free(shape, dtype, seed=1)
    delta = tie_free(shape, dtype, seed=2)
    layout = chunk_layout(buffer.shape, 64)
    expected = buffer * 0.95 + delta * 1.0
    sparse_expected = compress(expected, layout)
    expected = expected - decompress(sparse_expected)

    sparse = error_feedback_step(buffer, delta, layout, beta=0.95, outer_lr=1.0)
    assert torch.equal(buffer, expected)
    assert torch.equal(sparse.codes, sparse_expected.codes)
    # the selected elements were replaced by their quantization error
    assert torch.equal(sparse.positions, sparse_expected.positions)


def test_error_feedback_keeps_quantization_error():
    torch.manual_seed(0)
    buffer = torch.zeros(256, 256)
    delta = torch.randn(256, 256)
    layout = chunk_layout(buffer.shape, 64)
    sparse = error_feedback_step(buffer, delta, layout, beta=0.95, outer_lr=1.0)
    assert torch.allclose(buffer + decompress(sparse), delta)
    kept = buffer.reshape(-1)[sparse.flat_indices()]
    assert kept.abs().max() > 0  # 2-bit codes are lossy: the residual stays in the buffer


@pytest.mark.parametrize("num_peers", [1, 2, 5])
def test_scatter_mean_matches_reference_and_ignores_arrival_order(num_peers):
    shape = (67, 130)
    layout = chunk_layout(shape, 128)
    selections = [compress(tie_free(shape, torch.float32, seed=10 + i), layout) for i in range(num_peers)]
    got = scatter_mean(selections).reshape(-1)
    expected = reference_scatter_mean(
        [(s.flat_indices().tolist(), s.values().reshape(-1)) for s in selections], layout.numel
    )
    assert torch.equal(got, expected)
    # bit-identical in any arrival order once sorted by peer (here: by list position)
    shuffled = list(reversed(list(enumerate(selections))))
    assert torch.equal(scatter_mean([s for _, s in sorted(shuffled, key=lambda t: t[0])]).reshape(-1), got)


@pytest.mark.parametrize("b", [0, 1, 4, 5, 9])
def test_rice_streams_match_reference(b):
    rng = np.random.default_rng(b)
    gaps = rng.geometric(1 / 50, size=333) - 1
    unary, remainders = rice_encode(gaps, b)
    ref_unary, ref_rem = reference_rice_bits(gaps.tolist(), b)
    assert np.unpackbits(np.frombuffer(unary, np.uint8))[: len(ref_unary)].tolist() == [int(c) for c in ref_unary]
    assert np.unpackbits(np.frombuffer(remainders, np.uint8))[: len(ref_rem)].tolist() == [int(c) for c in ref_rem]
    assert len(unary) == (len(ref_unary) + 7) // 8 and len(remainders) == (len(ref_rem) + 7) // 8
    assert rice_decode(unary, remainders, gaps.size, b).tolist() == gaps.tolist()


def test_gap_coding_round_trip_and_best_param():
    rng = np.random.default_rng(0)
    positions = np.sort(np.stack([rng.choice(4096, 64, replace=False) for _ in range(50)]), axis=1)
    gaps = positions_to_gaps(positions)
    assert gaps.min() >= 0
    assert np.array_equal(gaps_to_positions(gaps, 50, 64), positions)
    b = best_rice_param(gaps)
    assert b == 5  # mean gap about 63
    cost = lambda p: int((gaps >> p).sum()) + gaps.size * (1 + p)
    assert all(cost(b) <= cost(p) for p in range(0, 12))


def test_two_bit_packing_round_trip():
    codes = np.random.default_rng(1).integers(0, 4, size=1001).astype(np.uint8)
    packed = pack_2bit(codes)
    assert len(packed) == 251
    assert np.array_equal(unpack_2bit(packed, 1001), codes)
    with pytest.raises(ValueError):
        unpack_2bit(packed[:-1], 1001)


def test_compress_refuses_nan():
    x = torch.randn(64, 64)
    x[3, 3] = float("nan")
    with pytest.raises(ValueError):
        compress(x, chunk_layout(x.shape, 64))
