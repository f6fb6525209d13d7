"""The torch entropy coder and the batched scatter-mean against their references: the same bytes as
the numpy coder in kernels/entropy.py, the same refusals on broken streams, and the same float32
bits as kernels/reference.py's peer-by-peer sum."""

import msgpack
import numpy as np
import pytest
import torch

from locoswarm_kernels import entropy as ref
from locoswarm_kernels import entropy_torch as fast
from locoswarm_kernels.chunking import chunk_layout
from locoswarm_kernels.quantize import QuantTable
from locoswarm_kernels.reference import reference_scatter_mean
from locoswarm_kernels.sparse import SparseTensor, compress, scatter_mean
from protocol.packet import (
    DTYPE_NAMES,
    MAGIC,
    PREFIX,
    TABLE,
    WIRE_VERSION,
    ModelSpec,
    decode_packet,
    encode_packet,
)
from protocol.signing import PeerKey

KEY = PeerKey.from_seed(b"torch-codec")
SHAPES = [(1,), (7,), (65,), (3, 5), (67, 130), (13, 64), (4, 6, 10), ()]


def random_gaps(rng, n, mean):
    return (rng.geometric(1 / mean, size=n) - 1).astype(np.int64)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 333, 4096])
@pytest.mark.parametrize("b", [0, 1, 3, 5, 9, 17, 24])
def test_rice_streams_are_the_reference_bytes(n, b):
    rng = np.random.default_rng(n * 31 + b)
    gaps = random_gaps(rng, n, mean=float(rng.uniform(1, 2 ** min(b + 2, 20))))
    unary, remainders = fast.rice_encode(torch.from_numpy(gaps), b)
    ref_unary, ref_remainders = ref.rice_encode(gaps, b)
    assert unary.dtype == remainders.dtype == torch.uint8
    assert bytes(unary.numpy()) == ref_unary and bytes(remainders.numpy()) == ref_remainders
    assert fast.rice_decode(unary, remainders, n, b).tolist() == gaps.tolist()


@pytest.mark.parametrize("seed", range(12))
def test_best_rice_param_and_gaps_match_reference(seed):
    rng = np.random.default_rng(seed)
    chunks, chunk_len = int(rng.integers(1, 40)), int(rng.choice([1, 15, 64, 4096]))
    k = int(rng.integers(1, chunk_len + 1))
    positions = np.sort(np.stack([rng.choice(chunk_len, k, replace=False) for _ in range(chunks)]), axis=1)
    gaps = fast.positions_to_gaps(torch.from_numpy(positions).to(torch.int16))
    assert gaps.tolist() == ref.positions_to_gaps(positions).tolist()
    assert fast.best_rice_param(gaps) == ref.best_rice_param(gaps.numpy())
    assert torch.equal(fast.gaps_to_positions(gaps, chunks, k), torch.from_numpy(positions))
    assert fast.best_rice_param(torch.zeros(0, dtype=torch.int64)) == ref.best_rice_param(np.zeros(0, np.int64))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1001])
def test_two_bit_packing_is_the_reference_bytes(n):
    codes = np.random.default_rng(n).integers(0, 4, size=n).astype(np.uint8)
    packed = fast.pack_2bit(torch.from_numpy(codes))
    assert bytes(packed.numpy()) == ref.pack_2bit(codes)
    assert fast.unpack_2bit(packed, n).tolist() == codes.tolist()
    with pytest.raises(ValueError):
        fast.unpack_2bit(torch.cat([packed, packed[:1]]) if n else torch.zeros(1, dtype=torch.uint8), n)


def mutations(unary: bytes, remainders: bytes):
    yield unary, remainders
    yield unary + b"\x00", remainders  # trailing byte
    yield unary + b"\x80", remainders  # one symbol too many
    yield unary[:-1], remainders  # symbols missing
    yield unary, remainders + b"\x00"  # remainder stream too long
    yield unary, remainders[:-1]
    flipped = bytearray(unary)
    flipped[len(flipped) // 2] ^= 0x10
    yield bytes(flipped), remainders


@pytest.mark.parametrize("b", [0, 2, 5])
def test_broken_streams_are_refused_exactly_where_the_reference_refuses(b):
    gaps = random_gaps(np.random.default_rng(b), 200, mean=40)
    unary, remainders = ref.rice_encode(gaps, b)
    for u, r in mutations(unary, remainders):
        try:
            expected = ref.rice_decode(u, r, gaps.size, b).tolist()
        except ValueError:
            expected = ValueError
        as_tensor = lambda raw: torch.tensor(list(raw), dtype=torch.uint8)
        try:
            got = fast.rice_decode(as_tensor(u), as_tensor(r), gaps.size, b).tolist()
        except ValueError:
            got = ValueError
        assert got == expected


def reference_packet_body(spec: ModelSpec, tensors: dict[str, SparseTensor]) -> bytes:
    """The body the numpy coder wrote before the torch coder (wire version 1, raw codes)."""
    sections, streams, all_codes = [], [], []
    for name, sparse in tensors.items():
        gaps = ref.positions_to_gaps(sparse.positions.numpy())
        b = ref.best_rice_param(gaps)
        unary, remainders = ref.rice_encode(gaps, b)
        table = TABLE.pack(sparse.table.shift, *sparse.table.lookup.tolist())
        sections.append(
            [name, list(sparse.layout.shape), DTYPE_NAMES[sparse.table.dtype], b, table, len(unary), len(remainders)]
        )
        streams += [unary, remainders]
        all_codes.append(sparse.codes.numpy().reshape(-1))
    codes = ref.pack_2bit(np.concatenate(all_codes))
    header = msgpack.packb(
        {
            "run": "r",
            "round": 3,
            "peer": "p",
            "base": bytes(32),
            "top_k": spec.top_k,
            "chunk": spec.chunk_size,
            "codes": [0, len(codes)],
            "tensors": sections,
        }
    )
    return b"".join([PREFIX.pack(MAGIC, WIRE_VERSION, len(header)), header, *streams, codes])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k", [64, 128, 8192])
def test_packets_are_the_reference_bytes_and_decode_back(dtype, top_k):
    """Awkward shapes (1 element, odd dimensions, k >= chunk at top_k 8192), every float dtype;
    zstandard is off (level -131072 never wins on random codes) so the raw codes compare too."""
    gen = torch.Generator().manual_seed(top_k)
    shapes = {f"t{i}": s for i, s in enumerate(SHAPES)}
    spec = ModelSpec(shapes, top_k)
    tensors = {
        name: compress(torch.randn(shape, generator=gen).to(dtype), layout)
        for (name, shape), layout in zip(shapes.items(), spec.layouts().values())
    }
    data = encode_packet("r", 3, "p", bytes(32), spec, tensors, KEY, zstd_level=-131072)
    header = msgpack.unpackb(data[PREFIX.size : PREFIX.size + PREFIX.unpack_from(data)[2]])
    assert header["codes"][0] == 0  # raw codes: the whole body compares
    assert data[:-64] == reference_packet_body(spec, tensors)
    decoded = decode_packet(data, spec, KEY.public_bytes)
    for name, sparse in tensors.items():
        assert torch.equal(decoded.tensors[name].positions, sparse.positions.long())
        assert torch.equal(decoded.tensors[name].codes, sparse.codes)


def order_sensitive_selections(num_peers: int, shape=(67, 130), top_k=2048, dtype=torch.float32):
    """Peers whose values differ by orders of magnitude (so the float32 sum depends on its order),
    overlapping heavily (top_k 2048: half of each chunk)."""
    layout = chunk_layout(shape, top_k)
    gen = torch.Generator().manual_seed(num_peers)
    selections = []
    for peer in range(num_peers):
        positions = torch.rand(layout.num_chunks, layout.chunk_len, generator=gen).argsort(1)[:, : layout.k]
        codes = torch.randint(0, 4, (layout.num_chunks, layout.k), generator=gen, dtype=torch.uint8)
        lookup = torch.randn(4, generator=gen) * 10.0 ** (peer % 5 * 3 - 6)
        table = QuantTable(shift=float(torch.randn((), generator=gen)) * 1e-3, lookup=lookup, dtype=dtype)
        selections.append(SparseTensor(layout, positions.sort(1).values.to(torch.int16), codes, table))
    return layout, selections


def reference_of(selections, layout, peer_scales=None) -> torch.Tensor:
    """locoswarm_kernels.reference's element-by-element, peer-order scatter-mean of `selections`."""
    contributions = []
    for i, s in enumerate(selections):
        values = s.values().reshape(-1).float()
        contributions.append((s.flat_indices().tolist(), values * peer_scales[i] if peer_scales else values))
    return reference_scatter_mean(contributions, layout.numel)


@pytest.mark.parametrize("num_peers", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_scatter_mean_is_the_peer_order_sum(num_peers, dtype):
    layout, selections = order_sensitive_selections(num_peers, dtype=dtype)
    scales = [1.0 if i % 3 else 0.37 + i / 100 for i in range(num_peers)]
    for peer_scales in (None, scales):
        expected = reference_of(selections, layout, peer_scales)
        got = scatter_mean(selections, peer_scales=peer_scales).reshape(-1)
        assert torch.equal(got, expected)
    # the order matters for these values: the reversed peer order gives other bits somewhere
    if num_peers >= 7:
        assert not torch.equal(scatter_mean(selections[::-1]).reshape(-1), scatter_mean(selections).reshape(-1))


def test_scatter_mean_refuses_mixed_layouts_and_bad_scales():
    _, a = order_sensitive_selections(2)
    _, b = order_sensitive_selections(1, shape=(64, 64))
    with pytest.raises(ValueError):
        scatter_mean(a + b)
    with pytest.raises(ValueError):
        scatter_mean(a, peer_scales=[1.0, 1.5])


@pytest.mark.parametrize("seed", range(25))
def test_batched_rice_decode_matches_per_section_reference(seed):
    """A packet's sections decoded in one batch: the gaps of each, and on a bit flipped in one
    section's unary stream, a refusal naming that section exactly when the reference refuses it."""
    rng = np.random.default_rng(seed)
    buffer, sections, all_gaps = b"", [], []
    for _ in range(int(rng.integers(1, 8))):
        n, b = int(rng.integers(1, 300)), int(rng.integers(0, 25))
        gaps = random_gaps(rng, n, mean=float(rng.uniform(1, 3000)))
        unary, remainders = ref.rice_encode(gaps, b)
        sections.append((len(buffer), len(unary), len(buffer) + len(unary), len(remainders), n, b))
        buffer += unary + remainders
        all_gaps += gaps.tolist()
    as_tensor = lambda raw: torch.tensor(list(raw), dtype=torch.uint8)
    assert fast.rice_decode_batch(as_tensor(buffer), sections).tolist() == all_gaps

    broken = bytearray(buffer)
    victim = int(rng.integers(0, len(sections)))
    u0, u_len, r0, r_len, n, b = sections[victim]
    broken[u0 + int(rng.integers(0, u_len))] ^= 1 << int(rng.integers(0, 8))
    try:
        expected = ref.rice_decode(bytes(broken[u0 : u0 + u_len]), bytes(broken[r0 : r0 + r_len]), n, b).tolist()
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(fast.StreamError) as refused:
            fast.rice_decode_batch(as_tensor(broken), sections)
        assert refused.value.index == victim
    else:
        first = sum(s[4] for s in sections[:victim])
        assert fast.rice_decode_batch(as_tensor(broken), sections)[first : first + n].tolist() == expected


def test_rows_to_positions_restarts_every_row():
    rng = np.random.default_rng(3)
    row_lengths = torch.tensor([3, 3, 5, 1, 20])
    rows = [np.sort(rng.choice(40, int(k), replace=False)) for k in row_lengths]
    gaps = torch.cat([fast.positions_to_gaps(torch.from_numpy(r).unsqueeze(0)) for r in rows])
    assert fast.rows_to_positions(gaps, row_lengths).tolist() == np.concatenate(rows).tolist()


def test_unary_stream_longer_than_any_selection_is_refused_unread():
    from protocol.errors import IndexOutOfRange
    from protocol.packet import read_header

    spec = ModelSpec({"w": (64, 64)}, 64)
    tensors = {"w": compress(torch.randn(64, 64), spec.layouts()["w"])}
    data = encode_packet("r", 3, "p", bytes(32), spec, tensors, KEY)
    header, offset = read_header(data)
    layout = spec.layouts()["w"]
    longest = fast.max_unary_bytes(layout.num_chunks, layout.k, layout.chunk_len, header["tensors"][0][3])
    padding = longest + 1 - header["tensors"][0][5]
    header["tensors"][0][5] = longest + 1  # one byte more than 64 in-range positions can need
    raw = msgpack.packb(header)
    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + b"\x01" * padding + data[offset:-64]
    with pytest.raises(IndexOutOfRange, match="longer than any"):
        decode_packet(body + KEY.sign(body), spec, KEY.public_bytes)
