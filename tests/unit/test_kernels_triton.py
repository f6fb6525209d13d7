"""The Triton scatter-mean kernel (kernels/triton_aggregate.py) under Triton's interpreter on CPU:
the same float32 bits as the peer-order reference and as the torch path, through locoswarm_kernels.sparse's
own dispatch. Skips when triton is not installed."""

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is in the test extras on Linux x86_64)")

from locoswarm_kernels.reference import reference_scatter_mean
from locoswarm_kernels.sparse import scatter_mean
from tests.unit.test_kernels_torch_codec import order_sensitive_selections, reference_of

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def interpreted(monkeypatch):
    """locoswarm_kernels.triton_aggregate re-imported with TRITON_INTERPRET=1 (triton.jit reads it when a
    kernel is defined), and locoswarm_kernels.sparse told to use it on CPU; re-imported plainly afterwards."""
    import locoswarm_kernels.triton_aggregate as module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LOCOSWARM_TRITON", "1")
    yield importlib.reload(module)
    monkeypatch.undo()
    importlib.reload(module)


@pytest.mark.parametrize("num_peers", [1, 3, 8])
def test_triton_scatter_mean_is_the_peer_order_sum(interpreted, num_peers, monkeypatch):
    assert interpreted.available("cpu")
    layout, selections = order_sensitive_selections(num_peers, shape=(6, 130), top_k=2048)
    scales = [1.0 if i % 2 else 0.5 + i / 64 for i in range(num_peers)]
    for peer_scales in (None, scales):
        expected = reference_of(selections, layout, peer_scales)
        got = scatter_mean(selections, peer_scales=peer_scales).reshape(-1)
        assert torch.equal(got, expected)
        monkeypatch.setenv("LOCOSWARM_TRITON", "0")  # the torch path agrees
        assert torch.equal(scatter_mean(selections, peer_scales=peer_scales).reshape(-1), expected)
        monkeypatch.setenv("LOCOSWARM_TRITON", "1")


def test_triton_kernel_counts_and_tiles(interpreted):
    """Square tiles (a non-view layout, positions transposed back by from_chunks) and k >= chunk."""
    for shape, top_k in (((128, 192), 128), ((8, 8), 8192)):
        layout, selections = order_sensitive_selections(4, shape=shape, top_k=top_k)
        total = torch.zeros(layout.num_chunks * layout.chunk_len)
        count = torch.zeros_like(total, dtype=torch.int32)
        values_by_code = torch.stack([s.table.decode(torch.arange(4, dtype=torch.uint8)).float() for s in selections])
        interpreted.ordered_scatter_add(
            torch.stack([s.positions for s in selections]),
            torch.stack([s.codes for s in selections]),
            values_by_code,
            total,
            count,
        )
        expected_count = torch.zeros(layout.numel, dtype=torch.int32)
        for s in selections:
            expected_count[s.flat_indices()] += 1
        from locoswarm_kernels.chunking import from_chunks

        assert torch.equal(from_chunks(count.view(layout.num_chunks, -1), layout).reshape(-1), expected_count)
        contributions = [(s.flat_indices().tolist(), s.values().reshape(-1).float()) for s in selections]
        assert torch.equal(scatter_mean(selections).reshape(-1), reference_scatter_mean(contributions, layout.numel))
