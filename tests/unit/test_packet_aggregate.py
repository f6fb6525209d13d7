"""The whole-packet aggregation (locoswarm_kernels.sparse.aggregate_packets) against the per-tensor
scatter_mean it replaces on the node: the same bits, tensor by tensor."""

import math

import pytest
import torch

from locoswarm_kernels.chunking import packet_layout
from locoswarm_kernels.quantize import QuantTable
from locoswarm_kernels.sparse import (
    PacketSelections,
    aggregate_packets,
    code_values,
    error_feedback_step,
    median_clip_scales,
    packet_clip_scales,
    scatter_mean,
)
from protocol.packet import ModelSpec, decode_packet, encode_packet
from protocol.signing import PeerKey

# tiled, plain-view, awkward (67 x 130: small tiles), vector, 1-element and 3-D tensors
SHAPES = {
    "embed.weight": (256, 64),
    "layers.0.attn.wq.weight": (64, 64),
    "layers.0.mlp.w1.weight": (67, 130),
    "layers.0.conv": (8, 4, 16),
    "norm.weight": (64,),
    "scalar": (1,),
    "wide.weight": (128, 192),
}


def decoded_packets(num_peers: int, seed: int, top_k: int = 64, dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    spec = ModelSpec(dict(sorted(shapes.items())), top_k)
    layouts = spec.layouts()
    packets = []
    for peer in range(num_peers):
        key = PeerKey.from_seed(bytes([peer % 256, peer // 256]))
        scale = float(torch.rand((), generator=gen)) * 10 ** int(torch.randint(-4, 2, (), generator=gen))
        sparse = {
            n: error_feedback_step(
                torch.zeros(s, dtype=dtype), torch.randn(s, generator=gen).to(dtype) * scale, layouts[n], 0.95, 1.0
            )
            for n, s in spec.shapes.items()
        }
        data = encode_packet("run", 0, f"p{peer:03d}", bytes(32), spec, sparse, key)
        packets.append(decode_packet(data, spec, key.public_bytes).tensors)
    return spec, packets


def reference(packets, peer_scales=None):
    """scatter_mean tensor by tensor; peer_scales[p][t] as aggregate_packets takes them."""
    names = list(packets[0])
    return {
        name: scatter_mean(
            [p[name] for p in packets],
            peer_scales=None if peer_scales is None else [row[t] for row in peer_scales],
        )
        for t, name in enumerate(names)
    }


def assert_same_bits(got, expected):
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].shape == expected[name].shape and got[name].dtype == expected[name].dtype
        assert torch.equal(got[name].view(torch.int32), expected[name].view(torch.int32)), name


@pytest.mark.parametrize("seed", range(4))
def test_aggregate_is_scatter_mean_bit_for_bit(seed):
    _, packets = decoded_packets(num_peers=3 + 2 * seed, seed=seed)
    assert_same_bits(aggregate_packets(packets), reference(packets))


@pytest.mark.parametrize("seed", range(3))
def test_median_clip_norms_scales_and_aggregate_match_the_per_tensor_path(seed):
    _, packets = decoded_packets(num_peers=7, seed=10 + seed)
    for packet in packets:  # the same float64 bits as SparseTensor.squared_norm
        assert packet.squared_norms() == [sparse.squared_norm() for sparse in packet.values()]
    peer_scales = packet_clip_scales(packets)
    for t, name in enumerate(packets[0]):
        assert [row[t] for row in peer_scales] == median_clip_scales(
            [math.sqrt(p[name].squared_norm()) for p in packets]
        )
    assert any(s < 1.0 for scales in peer_scales for s in scales)
    assert_same_bits(aggregate_packets(packets, peer_scales=peer_scales), reference(packets, peer_scales=peer_scales))


@pytest.mark.parametrize("top_k", [256, 64])
def test_code_counts_from_packed_bytes_are_the_counts_of_the_codes(top_k):
    # At top_k 256 every tensor's codes fill whole bytes; at 64 a 1-value scalar and other small
    # tensors share bytes with their neighbours, and the last byte holds padding.
    small = {n: s for n, s in SHAPES.items() if n in ("embed.weight", "layers.0.attn.wq.weight", "wide.weight")}
    small["norm.weight"] = (256,)
    for shapes in (small, SHAPES):
        _, packets = decoded_packets(num_peers=3, seed=5, top_k=top_k, shapes=shapes)
        for packet in packets:
            expected = torch.bincount(packet.code_index(), minlength=packet.code_values.numel()).view(-1, 4)
            assert torch.equal(packet._counts, expected)
            assert packet.squared_norms() == [sparse.squared_norm() for sparse in packet.values()]
    assert packets[0].layout.loose_symbols.numel() > 0


def test_code_counts_ignore_the_padding_bits():
    from locoswarm_kernels.chunking import packet_layout
    from locoswarm_kernels.entropy_torch import pack_2bit, unpack_2bit
    from locoswarm_kernels.sparse import code_counts

    spec = ModelSpec({"a": (3,), "b": (5,)}, top_k=4096)  # 8 values: 3 of a's, 5 of b's, no padding
    layout = packet_layout(tuple(spec.layouts().values()))
    codes = torch.tensor([3, 1, 2, 0, 0, 3, 3, 1], dtype=torch.uint8)
    assert code_counts(pack_2bit(codes), codes, layout).tolist() == [[0, 1, 1, 1], [2, 1, 0, 2]]
    spec = ModelSpec({"a": (3,), "b": (6,)}, top_k=4096)  # 9 values: the last byte holds 3 padding codes
    layout = packet_layout(tuple(spec.layouts().values()))
    packed = pack_2bit(torch.tensor([3, 1, 2, 0, 0, 3, 3, 1, 2], dtype=torch.uint8))
    packed[-1] |= 0b00111111  # hostile padding: codes 3, 3, 3 after the last value
    codes = unpack_2bit(packed, 9)
    assert code_counts(packed, codes, layout).tolist() == [[0, 1, 1, 1], [2, 1, 1, 2]]


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_scales_give_the_same_float32_products(seed):
    gen = torch.Generator().manual_seed(seed)
    _, packets = decoded_packets(num_peers=5, seed=20 + seed)
    peer_scales = torch.rand(5, len(packets[0]), generator=gen, dtype=torch.float64)
    peer_scales[0, 0], peer_scales[1, 1], peer_scales[2] = 0.0, 1.0, 1.0  # the ends of [0, 1]
    peer_scales = peer_scales.tolist()
    assert_same_bits(aggregate_packets(packets, peer_scales=peer_scales), reference(packets, peer_scales=peer_scales))


def test_one_peer_half_precision_tables_and_coordinates_nobody_sent():
    for dtype in (torch.bfloat16, torch.float16):
        _, packets = decoded_packets(num_peers=2, seed=5, dtype=dtype)
        assert_same_bits(aggregate_packets(packets[:1]), reference(packets[:1]))
        assert_same_bits(aggregate_packets(packets), reference(packets))
    _, packets = decoded_packets(num_peers=1, seed=6)
    means = aggregate_packets(packets)
    for name, sparse in packets[0].items():  # what nobody sent is +0.0
        untouched = torch.ones(sparse.layout.numel, dtype=torch.bool)
        untouched[sparse.flat_indices()] = False
        assert torch.equal(
            means[name].reshape(-1)[untouched].view(torch.int32), torch.zeros(int(untouched.sum()), dtype=torch.int32)
        )


def test_counts_past_255_peers_and_blocks_shared_by_tensors(monkeypatch):
    import locoswarm_kernels.chunking as chunking

    monkeypatch.setattr(chunking, "BLOCK_ELEMENTS", 3000)  # several tensors a block, and tensors alone
    chunking.packet_layout.cache_clear()
    try:
        shapes = {"a": (64, 8), "b": (4096,), "c": (64,), "d": (3,)}
        _, packets = decoded_packets(num_peers=260, seed=7, top_k=512, shapes=shapes)
        layout = packets[0].layout
        assert any(end - first > 1 for first, end in layout.blocks) and len(layout.blocks) > 1
        assert_same_bits(aggregate_packets(packets), reference(packets))
        assert_same_bits(aggregate_packets(packets[:255]), reference(packets[:255]))
    finally:
        chunking.packet_layout.cache_clear()


def test_code_values_decode_as_quant_table_does():
    gen = torch.Generator().manual_seed(0)
    tables = [
        QuantTable(
            shift=float(torch.randn((), generator=gen)) * 10.0**e, lookup=torch.randn(4, generator=gen), dtype=dtype
        )
        for e in range(-6, 6)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ]
    expected = torch.stack([t.decode(torch.arange(4, dtype=torch.uint8)).float() for t in tables])
    assert torch.equal(code_values(tables), expected)


def test_mixed_layouts_and_bad_scales_are_refused():
    _, packets = decoded_packets(num_peers=2, seed=8)
    _, others = decoded_packets(num_peers=1, seed=8, top_k=128)
    with pytest.raises(ValueError):
        aggregate_packets(packets + others)
    with pytest.raises(ValueError):
        aggregate_packets(packets, peer_scales=[[1.0] * len(packets[0]), [1.5] * len(packets[0])])


def test_decoded_views_and_layout_are_consistent():
    spec, packets = decoded_packets(num_peers=1, seed=9)
    packet = packets[0]
    assert isinstance(packet, PacketSelections) and list(packet) == list(spec.shapes)
    assert packet.layout is packet_layout(tuple(spec.layouts().values()), torch.device("cpu"))
    for t, (_, sparse) in enumerate(packet.items()):
        first, end = packet.layout.symbol_starts[t], packet.layout.symbol_starts[t + 1]
        assert (
            sparse.positions.dtype == torch.int16 and sparse.codes.dtype == torch.uint8
        )  # 7 bytes a value, with the index
        assert packet.index.dtype == torch.int32
        assert torch.equal(packet.code_index()[first:end], sparse.codes.reshape(-1).int() + 4 * t)
        assert bool((sparse.positions.diff(dim=1) > 0).all()) and int(sparse.positions.max()) < sparse.layout.chunk_len
