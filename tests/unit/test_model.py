"""The LLaMA-style model: shapes, causality, seeded initialisation, preset sizes, digests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from node.training.model import PRESETS, ModelConfig, build_model, llama_tensor_shapes, lm_loss, num_parameters
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
        ModelConfig(vocab_size=256, hidden=100, num_layers=1, num_heads=3, num_kv_heads=3, intermediate=8,
                    max_seq_len=8)
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
