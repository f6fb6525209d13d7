"""Checkpoints: bit-identical round trip with optimizer state, atomic saves, typed errors."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import node.training.checkpoint as checkpoint_module
from node.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from node.training.inner import make_inner_optimizer, run_inner_steps
from node.training.model import build_model
from node.training.params import flat_named_params, param_digest
from protocol.run_config import InnerSection

CFG = InnerSection(warmup_steps=2, total_steps=10, batch_size=2, seq_len=16)


pytestmark = pytest.mark.usefixtures("single_thread")


def random_batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, 256, (CFG.batch_size, CFG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def trained_tiny():
    model = build_model("tiny", seed=0)
    optimizer = make_inner_optimizer(model, CFG)
    run_inner_steps(model, optimizer, random_batches(0), 0, 2, CFG, "cpu")
    return model, optimizer


def test_round_trip_bit_identical(tmp_path):
    model, optimizer = trained_tiny()
    errors = {name: torch.randn(p.shape) for name, p in flat_named_params(model).items()}
    momentum = {name: torch.randn(p.shape) for name, p in flat_named_params(model).items()}
    digest = save_checkpoint(
        tmp_path / "ckpt", 3, model, optimizer, errors, {"run": "abc", "inner_step": 2}, outer_momentum=momentum
    )
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["meta.json", "params.safetensors", "state.safetensors"]
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["digest"] == digest == param_digest(model)

    fresh = build_model("tiny", seed=99)
    fresh_optimizer = make_inner_optimizer(fresh, CFG)
    loaded = load_checkpoint(tmp_path / "ckpt", fresh, fresh_optimizer)
    assert loaded.round == 3 and loaded.extra == {"run": "abc", "inner_step": 2}
    assert loaded.model_config["hidden"] == 128
    assert param_digest(fresh) == digest
    assert fresh.lm_head.weight is fresh.embed.weight
    assert all(torch.equal(loaded.error_buffers[k], v) for k, v in errors.items())
    assert all(torch.equal(loaded.outer_momentum[k], v) for k, v in momentum.items())

    original, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert original["param_groups"] == restored["param_groups"]
    assert original["state"].keys() == restored["state"].keys()
    for index, state in original["state"].items():
        for key, value in state.items():
            assert torch.equal(value, restored["state"][index][key]), (index, key)

    # Resumed training continues bit-identically.
    run_inner_steps(model, optimizer, random_batches(1), 2, 2, CFG, "cpu")
    run_inner_steps(fresh, fresh_optimizer, random_batches(1), 2, 2, CFG, "cpu")
    assert param_digest(fresh) == param_digest(model)


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    model, optimizer = trained_tiny()
    save_checkpoint(tmp_path / "ckpt", 1, model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    digest = save_checkpoint(tmp_path / "ckpt", 2, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert load_checkpoint(tmp_path / "ckpt").digest == digest


def test_unwritable_directory_raises_checkpoint_error(tmp_path):
    model = build_model("tiny", seed=0)
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path / "a_file" / "ckpt", 0, model)
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(CheckpointError):
            save_checkpoint(locked / "ckpt", 0, model)


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = build_model("tiny", seed=0)
    digest = save_checkpoint(tmp_path / "ckpt", 1, model)

    def full_disk(tensors, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_module, "save_file", full_disk)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(tmp_path / "ckpt", 2, model)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert load_checkpoint(tmp_path / "ckpt").digest == digest


def test_corrupted_params_fail_digest(tmp_path):
    model = build_model("tiny", seed=0)
    save_checkpoint(tmp_path / "ckpt", 1, model)
    meta_path = tmp_path / "ckpt" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["digest"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="digest"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "missing")


def test_wrong_model_shape_rejected(tmp_path):
    save_checkpoint(tmp_path / "ckpt", 1, build_model("tiny", seed=0))
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "ckpt", build_model("small", seed=0))


def test_load_falls_back_to_checkpoint_set_aside_by_a_crashed_save(tmp_path):
    model = build_model("tiny", seed=0)
    digest = save_checkpoint(tmp_path / "ckpt", 1, model)
    # A crash between the two renames leaves only the previous checkpoint, set aside.
    os.replace(tmp_path / "ckpt", tmp_path / ".ckpt.old-deadbeef")
    assert load_checkpoint(tmp_path / "ckpt").digest == digest
