"""The LLaMA-style model: shapes, causality, seeded initialisation, preset sizes, digests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from node.training.model import (
    PRESETS,
    SDPA_HAS_GQA,
    ModelConfig,
    apply_rope,
    build_model,
    llama_tensor_shapes,
    lm_loss,
    num_parameters,
    rope_tables,
)
from node.training.params import flat_named_params, param_digest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", seed=0)


def test_forward_shapes_tiny(tiny):
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    logits = tiny(tokens)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    targets = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(2))
    loss = lm_loss(tiny, tokens, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_causal_masking(tiny):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 256
    with torch.no_grad():
        before, after = tiny(tokens), tiny(changed)
    assert torch.equal(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_same_seed_same_digest_different_seed_different():
    a, b, c = build_model("tiny", seed=7), build_model("tiny", seed=7), build_model("tiny", seed=8)
    assert param_digest(a) == param_digest(b)
    assert param_digest(a) != param_digest(c)


def test_init_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model("tiny", seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_tied_embeddings_and_names():
    model = build_model("tiny", seed=0)
    assert model.lm_head.weight is model.embed.weight
    names = list(flat_named_params(model))
    assert names == sorted(names)
    assert "lm_head.weight" not in names and "embed.weight" in names
    assert set(names) == set(llama_tensor_shapes("tiny"))
    assert num_parameters(model) == num_parameters("tiny")


def test_gqa_forward():
    cfg = dataclasses.replace(PRESETS["tiny"], num_heads=4, num_kv_heads=2, tie_embeddings=False)
    model = build_model(cfg, seed=0)
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)
    shapes = llama_tensor_shapes(cfg)
    assert shapes["layers.0.attn.k_proj.weight"] == (64, 128)
    assert "lm_head.weight" in shapes


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 0.7e6, 1.3e6), ("small", 10e6, 30e6), ("512m", 490e6, 530e6), ("1b", 1.0e9, 1.2e9)],
)
def test_preset_parameter_counts(preset, low, high):
    assert low <= num_parameters(preset) <= high


def test_512m_shape_matches_paper():
    cfg = PRESETS["512m"]
    assert (cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.intermediate) == (1536, 12, 12, 5440)
    shapes = llama_tensor_shapes("512m")
    assert shapes["layers.11.mlp.gate_proj.weight"] == (5440, 1536)


def test_config_validation():
    with pytest.raises(ValueError):
        ModelConfig(
            vocab_size=256, hidden=100, num_layers=1, num_heads=3, num_kv_heads=3, intermediate=8, max_seq_len=8
        )
    with pytest.raises(ValueError):
        build_model("no-such-preset", seed=0)


def test_digest_covers_dtype_and_device_independent():
    state = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(2)}
    assert param_digest(state) != param_digest({**state, "a": torch.ones(2, dtype=torch.float64)})
    assert param_digest(state) != param_digest({**state, "b": state["b"].reshape(3, 2)})
    # Non-contiguous layout does not matter, only the values in C order.
    assert param_digest({"b": state["b"].t().contiguous().t(), "a": state["a"]}) == param_digest(state)
    bf16 = {"x": torch.ones(3, dtype=torch.bfloat16)}
    assert param_digest(bf16) == param_digest({"x": bf16["x"].clone()}) != param_digest({"x": torch.ones(3)})
    if torch.cuda.is_available():
        assert param_digest({k: v.cuda() for k, v in state.items()}) == param_digest(state)


def _gqa_model(**overrides):
    cfg = dataclasses.replace(PRESETS["tiny"], num_heads=4, num_kv_heads=2, **overrides)
    return build_model(cfg, seed=1)


def test_sdpa_gqa_equals_repeated_kv():
    """SDPA's own grouped-query attention against the plain reference that copies K/V to every head."""
    attn = _gqa_model().layers[0].attn
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(attn.head_dim, 9, 10000.0)
    B, T, _ = x.shape
    q = apply_rope(attn.q_proj(x).view(B, T, 4, 32).transpose(1, 2), cos, sin)  # (B, H, T, D)
    k = apply_rope(attn.k_proj(x).view(B, T, 2, 32).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
    v = attn.v_proj(x).view(B, T, 2, 32).transpose(1, 2)  # (B, Hkv, T, D)
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
    reference = attn.o_proj(y.transpose(1, 2).reshape(B, T, 128))
    assert SDPA_HAS_GQA
    torch.testing.assert_close(attn(x, cos, sin), reference, rtol=0, atol=1e-6)


def _loss_and_grads(model, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, x, y, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in flat_named_params(model).items()}


def test_activation_checkpointing_gives_the_same_gradients():
    model = _gqa_model()
    x, y = torch.randint(0, 256, (2, 2, 24), generator=torch.Generator().manual_seed(3))
    plain_loss, plain = _loss_and_grads(model, x, y)
    model.activation_checkpointing = True
    ckpt_loss, ckpt = _loss_and_grads(model, x, y)
    assert torch.equal(plain_loss, ckpt_loss)
    assert all(torch.equal(plain[n], ckpt[n]) for n in plain)


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_cross_entropy_equals_the_plain_one(tie):
    model = _gqa_model(tie_embeddings=tie)
    x, y = torch.randint(0, 256, (2, 3, 20), generator=torch.Generator().manual_seed(4))  # 60 tokens
    plain_loss, plain = _loss_and_grads(model, x, y, chunk_tokens=60)  # one chunk: the plain path
    chunked_loss, chunked = _loss_and_grads(model, x, y, chunk_tokens=16)  # 16, 16, 16, 12
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name in plain:
        torch.testing.assert_close(chunked[name], plain[name], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(model, x, y, chunk_tokens=7), plain_loss, rtol=1e-6, atol=1e-6)


def test_llama3_presets():
    assert 3.1e9 < num_parameters("3b") < 3.3e9 and 8.0e9 < num_parameters("8b") < 8.1e9
    cfg = PRESETS["8b"]
    assert (cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate, cfg.vocab_size) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
    )
