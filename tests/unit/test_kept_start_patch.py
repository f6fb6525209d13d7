"""node/training/round_start.py `StartPatch`: a SparseLoCo round start kept as the coordinates its outer step
moved puts back, bit for bit, the start a dense copy would; and it is small.

The amended-manifest recompute that uses it end to end is tests/unit/test_round_loop.py
(`test_withheld_packet_is_amended_out_and_every_round_applied`: the recomputed digest is the agreed one).
"""

from __future__ import annotations

import torch

from node.training.round_start import MAX_PATCH_FRACTION, StartPatch, pack_bits, unpack_bits


def sparse_aggregate(shape: tuple[int, ...], fraction: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator)
    keep = torch.rand(shape, generator=generator) < fraction
    return torch.where(keep, values, torch.zeros(()))


def test_the_patch_restores_the_start_exactly_and_costs_a_fraction_of_a_copy():
    generator = torch.Generator().manual_seed(0)
    shapes = {"w": (257, 129), "b": (1,), "g": (64,), "e": (3, 5, 7)}
    start = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    start["g"][3] = -0.0  # a signed zero survives too
    aggregates = {name: sparse_aggregate(shape, 0.05, i) for i, (name, shape) in enumerate(shapes.items())}
    patch = StartPatch.before(start, aggregates)
    after = {name: start[name] - aggregates[name] for name in start}  # SparseLoCoOuter.commit
    for name in start:
        restored = patch.restored(name, after[name])
        assert restored.dtype == start[name].dtype and restored.shape == start[name].shape
        assert torch.equal(restored.view(torch.int32), start[name].view(torch.int32)), name  # bitwise
        assert not torch.equal(after[name], start[name]) or not aggregates[name].any()
    dense_bytes = sum(t.nbytes for t in start.values())
    assert patch.num_bytes < (0.05 * 1.3 + 1 / 32) * dense_bytes  # 4 B per moved coordinate, a bit per coordinate


def test_a_tensor_mostly_moved_is_kept_dense_and_no_aggregate_keeps_nothing():
    start = {"w": torch.randn(32, 32), "b": torch.randn(32)}
    aggregates = {"w": sparse_aggregate((32, 32), 0.9, 1), "b": torch.zeros(32)}
    patch = StartPatch.before(start, aggregates)
    assert set(patch.dense) == {"w"} and (aggregates["w"] != 0).float().mean() > MAX_PATCH_FRACTION
    assert patch.coordinates["b"][1].numel() == 0
    for name in start:
        assert torch.equal(patch.restored(name, start[name] - aggregates[name]), start[name])
    nothing = StartPatch.before(start, None)  # no usable payload: the step changes nothing
    assert nothing.num_bytes == 0 and torch.equal(nothing.restored("w", start["w"]), start["w"])


def test_aggregates_of_a_ranks_rows_only_keep_a_dense_copy():
    start = {"w": torch.randn(8, 4)}
    patch = StartPatch.before(start, {"w": torch.zeros(4, 4)})  # rank 0's half of the rows
    assert set(patch.dense) == {"w"}


def test_bits_pack_eight_to_a_byte_and_come_back():
    generator = torch.Generator().manual_seed(3)
    for count in (0, 1, 7, 8, 9, 1000):
        mask = torch.rand(count, generator=generator) < 0.3
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == (count + 7) // 8
        assert torch.equal(unpack_bits(packed, count), mask)
    assert pack_bits(torch.tensor([True, False, False, False, False, False, False, True, True])).tolist() == [129, 128]


def test_the_patch_lives_on_the_device_it_is_given():
    start = {"w": torch.randn(16, 16)}
    aggregates = {"w": sparse_aggregate((16, 16), 0.1, 2)}
    patch = StartPatch.before(start, aggregates, device="meta")  # where it is kept, not where the start is
    bits, values = patch.coordinates["w"]
    assert bits.device.type == "meta" and values.device.type == "meta"
