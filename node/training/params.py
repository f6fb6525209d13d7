"""Naming and fingerprinting the model's parameters.

`flat_named_params` fixes the one order in which everything that walks the model (the codec,
error-feedback buffers, checkpoints, the outer step) visits its tensors: sorted by name.
`param_digest` is the fingerprint peers compare after every outer step to prove they hold
bit-identical parameters, and the coordinator records so that a joining peer can check the
parameters it fetched.

The digest is the hash tree of protocol/digest.py over the canonical layout of the named tensors
(header of names, dtypes and shapes; raw bytes in sorted-name order, cut into 4 MiB chunks that
are hashed on every core). The same values give the same digest on any device and in any
memory layout; a snapshot stream (node/training/snapshot.py) is checked against the same tree
while it arrives. CPU tensors are hashed in place; tensors on an accelerator are copied to the
host in slices of at most `HOST_SLICE_BYTES`, so hashing never holds a second copy of the model.
Callers on an event loop run it in a worker thread (`asyncio.to_thread`): at 1B parameters it
reads 4.4 GB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from protocol.digest import Tree, encode_header, tree_of

HOST_SLICE_BYTES = 64 << 20  # tensors off the CPU are copied to the host this much at a time


def flat_named_params(model: nn.Module) -> OrderedDict[str, nn.Parameter]:
    """Trainable parameters by name, in sorted-name order; a tied parameter appears once."""
    return OrderedDict(sorted((name, p) for name, p in model.named_parameters() if p.requires_grad))


def named_tensors(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's parameters or a name -> tensor mapping, sorted by name, detached."""
    named = dict(model_or_state.named_parameters()) if isinstance(model_or_state, nn.Module) else model_or_state
    return {name: named[name].detach() for name in sorted(named)}


def tensor_header(named: Mapping[str, torch.Tensor]) -> bytes:
    """The canonical header (protocol/digest.py) of these tensors."""
    return encode_header((name, str(t.dtype), tuple(t.shape)) for name, t in named.items())


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order as a 1-D uint8 tensor on its device (no copy when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_bytes(tensor: torch.Tensor, start: int = 0, end: int | None = None) -> memoryview:
    """Bytes [start, end) of the tensor's canonical body: a view of a CPU tensor's own memory, or a
    host copy of that slice from any other device."""
    piece = byte_view(tensor)[start:end]
    if piece.device.type != "cpu":
        piece = piece.cpu()
    return memoryview(piece.numpy())


def tensor_pieces(named: Mapping[str, torch.Tensor], max_bytes: int = HOST_SLICE_BYTES) -> Iterator[memoryview]:
    """The canonical body of `named` (already in sorted order), in pieces of at most `max_bytes`."""
    for tensor in named.values():
        size = tensor_nbytes(tensor)
        if tensor.device.type == "cpu":
            if size:
                yield tensor_bytes(tensor)  # in place, however large
            continue
        for start in range(0, size, max_bytes):
            yield tensor_bytes(tensor, start, min(start + max_bytes, size))


def param_tree(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> Tree:
    """The hash tree over named tensors (a module's parameters, or a name -> tensor mapping)."""
    named = named_tensors(model_or_state)
    return tree_of(tensor_header(named), tensor_pieces(named))


def param_digest(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """The digest (64 hex characters) over named tensors: a module's parameters or a name -> tensor mapping."""
    return param_tree(model_or_state).hex
