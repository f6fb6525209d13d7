"""Checkpoints: parameters and the state a peer needs to resume, as safetensors.

A checkpoint is a directory of three files:

- `params.safetensors`: the model's parameters by name (a tied tensor once), fp32 master copy.
- `state.safetensors`: the inner AdamW moments as `optimizer.<param name>.<state key>`
  (`exp_avg`, `exp_avg_sq`, `step`), error-feedback buffers as `error_buffer.<param name>`, and
  the outer momentum (DiLoCo) as `outer_momentum.<param name>`. Names, not positions, so a
  checkpoint survives a reordering of the optimizer's parameter list.
- `meta.json`: format version, round, the parameter digest (`node.training.params.param_digest`), the
  model config, the optimizer's hyper-parameters per group (by parameter name), and `extra`
  (caller's JSON: run id, inner step, strategy...).

Format 2 is format 1 with the hash-tree digest (protocol/digest.py) in place of one sha256; a
format-1 checkpoint is refused as such, and the node catches up from peers instead.
Peers catching up are served snapshots straight from these files (node/training/snapshot.py,
`Snapshot.from_checkpoint`, which finds each tensor's bytes with `tensor_extents`).

Saving is atomic at the directory level: everything is written and fsynced into a hidden
sibling directory, then renamed into place (the previous checkpoint is renamed aside first and
removed after, and `load_checkpoint` falls back to it if a crash came between the two renames).
Any OSError while saving (unwritable directory, disk full) is raised as `CheckpointError`, and
leaves the previous checkpoint as it was. Loading verifies the parameter digest.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from node.durable import fsync_dir, write_synced
from node.training.params import param_digest

FORMAT_VERSION = 2
PARAMS_FILE = "params.safetensors"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
_OPTIMIZER, _ERROR_BUFFER, _OUTER_MOMENTUM = "optimizer.", "error_buffer.", "outer_momentum."


class CheckpointError(Exception):
    """A checkpoint could not be written or read back intact."""


@dataclass(slots=True)
class Checkpoint:
    """What `load_checkpoint` read (the model and optimizer, if given, are already restored)."""

    round: int
    digest: str
    params: dict[str, torch.Tensor]
    error_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    outer_momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    model_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _optimizer_tensors(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> tuple[dict, list]:
    """The optimizer's per-parameter state and its groups, keyed by parameter name."""
    tensors, groups = {}, []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in group["params"]], **hyper})
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                value = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{_OPTIMIZER}{names[id(param)]}.{key}"] = _cpu(value)
    return tensors, groups


def _reason(error: Exception) -> str:
    disk_full = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(error, OSError):
        return "disk full" if error.errno in disk_full else f"{error.strerror or error} ({error.filename or ''})"
    return "disk full" if any(f"os error {code})" in str(error) for code in disk_full) else str(error)


def save_checkpoint(
    directory: str | os.PathLike,
    round: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    error_buffers: Mapping[str, torch.Tensor] | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    outer_momentum: Mapping[str, torch.Tensor] | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    midway: Callable[[], None] | None = None,
) -> str:
    """Write the checkpoint for `round` into `directory` atomically; returns the parameter digest.

    `params` replaces the model's own tensors as the saved parameters (the node saves the global
    model that starts `round`, which with overlap is not what the model holds). `midway` is called
    at the most fragile moment, the old checkpoint set aside and the new one not in place yet (fault
    injection's crash; `resolve` then finds the old one)."""
    directory = Path(directory)
    params = {name: _cpu(p) for name, p in sorted((params or dict(model.named_parameters())).items())}
    digest = param_digest(params)
    state: dict[str, torch.Tensor] = {}
    groups: list = []
    if optimizer is not None:
        names = {id(p): name for name, p in model.named_parameters()}
        state, groups = _optimizer_tensors(optimizer, names)
    state.update({f"{_ERROR_BUFFER}{k}": _cpu(v) for k, v in (error_buffers or {}).items()})
    state.update({f"{_OUTER_MOMENTUM}{k}": _cpu(v) for k, v in (outer_momentum or {}).items()})
    config = getattr(model, "config", None)
    meta = {
        "format_version": FORMAT_VERSION,
        "round": int(round),
        "digest": digest,
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "optimizer_groups": groups,
        "extra": dict(extra or {}),
    }
    meta_text = json.dumps(meta, indent=2, sort_keys=True)  # fail on bad `extra` before any I/O

    token = uuid.uuid4().hex[:8]
    staging = directory.parent / f".{directory.name}.tmp-{token}"
    aside = directory.parent / f".{directory.name}.old-{token}"
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        write_synced(staging / PARAMS_FILE, lambda p: save_file(params, p))
        write_synced(staging / STATE_FILE, lambda p: save_file(state, p))
        write_synced(staging / META_FILE, lambda p: p.write_text(meta_text))
        fsync_dir(staging)
        if directory.exists():
            os.replace(directory, aside)
        if midway is not None:
            midway()
        os.replace(staging, directory)
        fsync_dir(directory.parent)
    except (OSError, SafetensorError) as error:
        # safetensors reports its own I/O failures as SafetensorError("... (os error N) ...").
        shutil.rmtree(staging, ignore_errors=True)
        if aside.exists() and not directory.exists():
            os.replace(aside, directory)
        raise CheckpointError(f"cannot write checkpoint to {directory}: {_reason(error)}") from error
    shutil.rmtree(aside, ignore_errors=True)
    return digest


def resolve(directory: Path) -> Path:
    """The checkpoint directory, or the previous one set aside by a save that crashed midway."""
    if (directory / META_FILE).exists():
        return directory
    aside = sorted(directory.parent.glob(f".{directory.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if aside and (aside[-1] / META_FILE).exists():
        return aside[-1]
    raise CheckpointError(f"no checkpoint at {directory}")


def checkpoint_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's meta.json (round, digest, extra...), without reading its tensors."""
    directory = resolve(Path(directory))
    try:
        return json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read checkpoint at {directory}: {error}") from error


MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit


def tensor_extents(file) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (torch dtype name, shape, first byte, end byte) of each tensor in an open safetensors
    file, as absolute file offsets (its layout: u64 header length N, N bytes of JSON, then data)."""
    try:
        head = os.pread(file.fileno(), 8, 0)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < length <= MAX_SAFETENSORS_HEADER_BYTES:
            raise ValueError(f"header length {length}")
        header = json.loads(os.pread(file.fileno(), length, 8))
        data_start, size = 8 + length, os.fstat(file.fileno()).st_size
        extents = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
            if not 0 <= begin <= end <= size - data_start:
                raise ValueError(f"{name}: data offsets {begin}..{end} outside the file")
            extents[name] = (_SAFETENSORS_DTYPES[entry["dtype"]], shape, data_start + begin, data_start + end)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read the tensors of {file.name}: {error!r}") from error
    return extents


_SAFETENSORS_DTYPES = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "I64": "torch.int64",
    "I32": "torch.int32",
    "I16": "torch.int16",
    "I8": "torch.int8",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
}


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: torch.device | str = "cpu",
) -> Checkpoint:
    """Read a checkpoint, verify its digest, and restore `model` and `optimizer` if given.

    The optimizer must have been built over `model`'s parameters; its state and group
    hyper-parameters (learning rate included) are replaced by the saved ones.
    """
    directory = resolve(Path(directory))
    try:
        meta = json.loads((directory / META_FILE).read_text())
        params = load_file(directory / PARAMS_FILE, device=str(device))
        state = load_file(directory / STATE_FILE, device=str(device))
    except (OSError, ValueError, SafetensorError) as error:
        raise CheckpointError(f"cannot read checkpoint at {directory}: {error}") from error
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    digest = param_digest(params)
    if digest != meta["digest"]:
        raise CheckpointError(f"{directory}: parameter digest {digest} does not match meta.json {meta['digest']}")

    if model is not None:
        own = dict(model.named_parameters())
        if own.keys() != params.keys():
            missing, unexpected = own.keys() - params.keys(), params.keys() - own.keys()
            raise CheckpointError(
                f"{directory}: parameters differ from the model's: "
                f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        with torch.no_grad():
            for name, param in own.items():
                if param.shape != params[name].shape:
                    raise CheckpointError(
                        f"{directory}: {name} has shape {tuple(params[name].shape)}, model {tuple(param.shape)}"
                    )
                param.copy_(params[name])
    if optimizer is not None:
        if model is None:
            raise ValueError("restoring an optimizer needs the model it was built over")
        _restore_optimizer(optimizer, model, meta["optimizer_groups"], state, directory)

    def section(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    return Checkpoint(
        round=meta["round"],
        digest=digest,
        params=params,
        error_buffers=section(_ERROR_BUFFER),
        outer_momentum=section(_OUTER_MOMENTUM),
        model_config=meta.get("model_config"),
        extra=meta.get("extra", {}),
    )


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, saved_groups: list, state: dict, directory: Path
) -> None:
    names = {id(p): name for name, p in model.named_parameters()}
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if current != [group["params"] for group in saved_groups]:
        raise CheckpointError(f"{directory}: the optimizer's parameter groups differ from the saved ones")
    # torch's state_dict format: parameters numbered across groups in order.
    index = {name: i for i, name in enumerate(n for group in current for n in group)}
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith(_OPTIMIZER):
            name, _, state_key = key[len(_OPTIMIZER) :].rpartition(".")
            if name not in index:
                raise CheckpointError(f"{directory}: optimizer state for unknown parameter {name}")
            per_param.setdefault(index[name], {})[state_key] = value
    groups = []
    for group in saved_groups:
        hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [index[n] for n in group["params"]]})
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
