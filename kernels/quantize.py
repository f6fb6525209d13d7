"""SparseLoCo's 2-bit statistical quantizer, per tensor over its selected values.

Following the authors' compressor (QErywan/RobustDiLoCo `src/tplr/sparseloco.py` at 276fa59;
README.md, "The algorithm"): shift = mean of the values, sigma = unbiased std of the
centred values, scale = range_in_sigmas * sigma / num_bins (6 sigma over 4 bins), and
code = clamp(round(centred / scale + num_bins // 2), 0, num_bins - 1) with round-half-to-even.
A zero, NaN or infinite scale falls back to 1.0 (a single value, or all values equal). Decoding
uses a table of num_bins entries: each code decodes to the mean of the centred values that fell
in its bin (0 for an empty bin), plus shift. The table and shift travel with the tensor.

The arithmetic runs in the values' dtype where the authors' code does (mean, centring, sigma) and in
float32 where theirs does (division by the scale, the table). The order of the sums differs:
`locoswarm_kernels.sparse.select_topk` sorts the selected positions ascending inside each chunk (the
wire's delta coding needs that order) and hands the values over in that order, while the
authors sum in torch.topk's unsorted order. Float32 addition is not associative, so the results
are not bit for bit theirs: side by side on the same tensors (fp32, 4 peers, 5 rounds) the
selected positions and the codes were identical, and the shift and the table differed in the
last bit (about 1 ulp) in about half of the tensor-rounds. That does not affect agreement: every
peer decodes a tensor with the shift and table its packet carries, so all peers reconstruct the
same values, bit for bit, whichever order the sender summed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NUM_BINS = 4
RANGE_IN_SIGMAS = 6.0


@dataclass(frozen=True, slots=True)
class QuantTable:
    """What a receiver needs to turn codes back into values."""

    shift: float  # the mean of the selected values, exactly representable in `dtype`
    lookup: torch.Tensor  # (NUM_BINS,) float32: mean centred value per bin
    dtype: torch.dtype  # the dtype the values are decoded to

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Values for `codes` (any shape, uint8), in `self.dtype` on the codes' device."""
        lookup = self.lookup.to(codes.device)
        shift = torch.tensor(self.shift, dtype=self.dtype, device=codes.device)
        flat = lookup.index_select(0, codes.reshape(-1).long())  # faster than advanced indexing on CPU
        return (flat + shift).to(self.dtype).view(codes.shape)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, QuantTable]:
    """(codes uint8 shaped like `values`, table). `values` must be finite."""
    offset = NUM_BINS // 2
    shift = values.mean()
    centred = values - shift
    n = centred.numel()
    if n <= 1:
        sigma = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        sigma = centred.norm() / math.sqrt(n - 1)
    scale = RANGE_IN_SIGMAS * sigma / NUM_BINS
    # torch.where rather than a Python test: no device sync per tensor on CUDA.
    scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    centred_f = centred.float().reshape(-1)
    codes = (centred_f / scale + offset).round().clamp(0, NUM_BINS - 1).to(torch.uint8)
    codes_long = codes.long()
    sums = torch.zeros(NUM_BINS, dtype=torch.float32, device=values.device).scatter_add_(0, codes_long, centred_f)
    counts = torch.zeros(NUM_BINS, dtype=torch.float32, device=values.device).scatter_add_(
        0, codes_long, torch.ones_like(centred_f)
    )
    lookup = torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.zeros_like(sums))
    table = QuantTable(shift=float(shift), lookup=lookup.cpu(), dtype=values.dtype)
    return codes.reshape(values.shape), table
