"""A Triton kernel for the round's scatter-mean: dequantize and add every peer's values in one launch,
in peer order, bit-identical to `locoswarm_kernels.reference.reference_scatter_mean`.

Why Triton: torch can add all peers' values in one `index_add_`, but the order in which duplicates
are summed is then up to the backend (atomics on CUDA), and float32 addition is not associative;
keeping peer order in torch takes one launch per peer. Here one program owns one chunk (its
`chunk_len` elements of the chunk-ordered total) and walks the peers in order: inside a chunk a
peer's positions are distinct, so each element gets at most one add per peer, the adds happen in
peer order, and no two programs touch the same element. A barrier between peers makes one peer's
stores visible to the next peer's loads in the block.

    ordered_scatter_add(positions (P, C, k), codes (P, C, k) uint8, values_by_code (P, 4) float32,
                        total (C * chunk_len,) float32, count (C * chunk_len,) int32)

`values_by_code[p, c]` is what code c of peer p decodes to, with the peer's scale already applied
(computed in torch exactly as the per-peer path computes it), so the kernel does one float32 add
per element and nothing else. The mean (total / max(count, 1)) stays in torch.

On CPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is
imported), which is how the tests check it; `available()` says whether it can run on a device.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: the torch path in locoswarm_kernels.sparse is the default everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """True when the kernel can run on `device`: compiled on CUDA, interpreted on CPU."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return (kind == "cuda" and not INTERPRET) or (kind == "cpu" and INTERPRET)


if triton is not None:

    @triton.jit
    def _ordered_scatter_add_kernel(
        positions_ptr,
        codes_ptr,
        values_ptr,
        total_ptr,
        count_ptr,
        num_peers,
        num_chunks,
        k,
        chunk_len,
        BLOCK_K: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK_K)
        mask = lanes < k
        for peer in range(num_peers):
            row = (peer * num_chunks + chunk) * k
            position = tl.load(positions_ptr + row + lanes, mask=mask, other=0).to(tl.int64)
            code = tl.load(codes_ptr + row + lanes, mask=mask, other=0).to(tl.int32)
            value = tl.load(values_ptr + peer * 4 + code, mask=mask, other=0.0)
            where = chunk * chunk_len + position
            tl.store(total_ptr + where, tl.load(total_ptr + where, mask=mask, other=0.0) + value, mask=mask)
            tl.store(count_ptr + where, tl.load(count_ptr + where, mask=mask, other=0) + 1, mask=mask)
            tl.debug_barrier()  # this peer's stores are seen by the next peer's loads


def ordered_scatter_add(
    positions: torch.Tensor, codes: torch.Tensor, values_by_code: torch.Tensor, total: torch.Tensor, count: torch.Tensor
) -> None:
    """Add every peer's decoded values into `total` (float32) and 1 into `count` (int32), in peer order."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    num_peers, num_chunks, k = positions.shape
    if codes.shape != positions.shape or values_by_code.shape != (num_peers, 4):
        raise ValueError("positions, codes and values_by_code disagree in shape")
    if total.dtype != torch.float32 or count.dtype != torch.int32 or values_by_code.dtype != torch.float32:
        raise ValueError("total and values_by_code must be float32, count int32")
    chunk_len = total.numel() // max(1, num_chunks)
    if num_peers == 0 or num_chunks == 0:
        return
    _ordered_scatter_add_kernel[(num_chunks,)](
        positions.contiguous(),
        codes.contiguous(),
        values_by_code.contiguous(),
        total,
        count,
        num_peers,
        num_chunks,
        k,
        chunk_len,
        BLOCK_K=triton.next_power_of_2(k),
    )
