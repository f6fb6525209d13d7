"""The inner loop: the learning-rate schedule's exact endpoints, and that tiny learns."""

from __future__ import annotations

import math

import pytest
import torch

from node.training.data import load_corpus
from node.training.inner import InnerConfig, lr_at, make_inner_optimizer, run_inner_steps
from node.training.model import build_model


pytestmark = pytest.mark.usefixtures("single_thread")


def test_lr_schedule_endpoints_exact():
    cfg = InnerConfig(warmup_steps=10, total_steps=110, batch_size=1, seq_len=8)
    assert lr_at(0, cfg) == 0.1 * 1e-3
    assert lr_at(5, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(10, cfg) == 1e-3
    assert lr_at(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, cfg) == 0.1 * 1e-3
    assert lr_at(10_000, cfg) == 0.1 * 1e-3
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))  # rising warm-up
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # falling cosine
    assert max(lrs) == 1e-3 and min(lrs) == 0.1 * 1e-3


def test_lr_schedule_without_warmup():
    cfg = InnerConfig(warmup_steps=0, total_steps=4, batch_size=1, seq_len=8, lr=2.0, min_lr_ratio=0.25)
    cosine = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([0.5 + 1.5 * c for c in cosine])
    assert lr_at(0, cfg) == 2.0 and lr_at(4, cfg) == 0.5


def test_config_validation():
    with pytest.raises(ValueError):
        InnerConfig(warmup_steps=20, total_steps=10, batch_size=1, seq_len=8)


def test_optimizer_groups_and_decay_choice():
    model = build_model("tiny", seed=0)
    cfg = InnerConfig(warmup_steps=1, total_steps=2, batch_size=1, seq_len=8)
    optimizer = make_inner_optimizer(model, cfg)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["weight_decay"] == 0.1
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    customary = make_inner_optimizer(model, InnerConfig(warmup_steps=1, total_steps=2, batch_size=1, seq_len=8,
                                                        decay_1d_params=False))
    decayed, undecayed = customary.param_groups
    assert all(p.ndim == 2 for p in decayed["params"]) and all(p.ndim == 1 for p in undecayed["params"])
    assert undecayed["weight_decay"] == 0.0
    assert len(decayed["params"]) + len(undecayed["params"]) == len(list(model.parameters()))


def test_tiny_loss_decreases_on_stdlib(tmp_path):
    corpus = load_corpus(None, cache_dir=tmp_path)
    cfg = InnerConfig(warmup_steps=5, total_steps=30, batch_size=8, seq_len=64)
    model = build_model("tiny", seed=0)
    optimizer = make_inner_optimizer(model, cfg)
    batches = corpus.train.shard(0, 4).batches(cfg.batch_size, cfg.seq_len, seed=0)
    seen = []
    first = run_inner_steps(model, optimizer, batches, 0, 5, cfg, "cpu", on_step=lambda *a: seen.append(a))
    rest = run_inner_steps(model, optimizer, batches, 5, 25, cfg, "cpu")
    assert [s for s, _, _ in seen] == [0, 1, 2, 3, 4]
    assert all(tps > 0 for _, _, tps in seen)
    assert first.num_tokens == 5 * 8 * 64 and rest.num_tokens == 25 * 8 * 64
    assert first.compute_s > 0
    assert optimizer.param_groups[0]["lr"] == lr_at(29, cfg)
    assert first.mean_loss == pytest.approx(sum(loss for _, loss, _ in seen) / 5)
    assert seen[0][1] > 5.0  # ~ln 256 at initialisation
    assert rest.mean_loss < seen[0][1] - 1.0, (seen, rest)


def test_inner_loop_is_deterministic():
    cfg = InnerConfig(warmup_steps=1, total_steps=4, batch_size=2, seq_len=16)
    digests = []
    for _ in range(2):
        model = build_model("tiny", seed=3)
        optimizer = make_inner_optimizer(model, cfg)
        generator = torch.Generator().manual_seed(0)
        windows = iter(lambda: torch.randint(0, 256, (2, 17), generator=generator), None)
        batches = ((t[:, :-1], t[:, 1:]) for t in windows)
        result = run_inner_steps(model, optimizer, batches, 0, 3, cfg, "cpu")
        digests.append((result.mean_loss, [p.detach().clone() for p in model.parameters()]))
    assert digests[0][0] == digests[1][0]
    assert all(torch.equal(a, b) for a, b in zip(digests[0][1], digests[1][1]))
