"""Naming and fingerprinting the model's parameters.

`flat_named_params` fixes the one order in which everything that walks the model (the codec,
error-feedback buffers, checkpoints, the outer step) visits its tensors: sorted by name.
`param_digest` is the fingerprint peers compare after every outer step to prove they hold
bit-identical parameters, and the coordinator records so that a joining peer can check the
parameters it fetched.

Digest layout, per tensor in sorted-name order: the name (UTF-8), the dtype string, the shape,
each as a length-prefixed field, then the tensor's raw bytes in C order as a CPU tensor
(little-endian, as on every platform torch ships for). The same values give the same digest on
any device.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn


def flat_named_params(model: nn.Module) -> OrderedDict[str, nn.Parameter]:
    """Trainable parameters by name, in sorted-name order; a tied parameter appears once."""
    return OrderedDict(sorted((name, p) for name, p in model.named_parameters() if p.requires_grad))


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def param_digest(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 hex digest over named tensors: a module's parameters or a name -> tensor mapping."""
    if isinstance(model_or_state, nn.Module):
        named = dict(model_or_state.named_parameters())
    else:
        named = dict(model_or_state)
    hasher = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name].detach()
        hasher.update(_field(name.encode("utf-8")))
        hasher.update(_field(str(tensor.dtype).encode("ascii")))
        hasher.update(_field(struct.pack(f"<{tensor.ndim}Q", *tensor.shape)))
        flat = tensor.to("cpu").contiguous().reshape(-1)
        # A byte view works for every dtype, bf16 included, which numpy cannot represent.
        hasher.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return hasher.hexdigest()
