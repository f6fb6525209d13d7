"""Hugging Face Llama weights out (`locoswarm export`) and in (`init_from`): the name map, equal
logits against transformers' LlamaForCausalLM (fp32, CPU), and the refusals of init_from."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from locoswarm.cli import main as locoswarm
from node.training.checkpoint import save_checkpoint
from node.training.data import TokenDataset
from node.training.hf import (
    InitMismatch,
    WeightsError,
    export_checkpoint,
    export_model,
    file_sha256,
    from_hf_state,
    hf_name,
    our_name,
    read_init_weights,
    to_hf_state,
)
from node.training.model import PRESETS, build_model, llama_tensor_shapes
from node.training.params import flat_named_params
from node.training.peer import PeerTraining
from protocol.run_config import RunConfig

# The tiny preset (tied, multi-head), and a shape that exercises everything else the map must get
# right: grouped-query attention, untied head, another rotary base and norm epsilon, odd vocabulary.
TIED = PRESETS["tiny"]
UNTIED_GQA = dataclasses.replace(
    PRESETS["tiny"],
    num_layers=2,
    num_kv_heads=2,
    tie_embeddings=False,
    rope_theta=500_000.0,
    norm_eps=1e-6,
    vocab_size=301,
)
CONFIGS = [pytest.param(TIED, id="tied"), pytest.param(UNTIED_GQA, id="untied-gqa")]


def _model(cfg, seed=0):
    """A model whose norm gains are not all ones, so a swapped norm would show in the logits."""
    model = build_model(cfg, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in flat_named_params(model).items():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _tokens(cfg, seed=0):
    return torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_name_map_is_a_bijection():
    for cfg in (TIED, UNTIED_GQA):
        names = list(llama_tensor_shapes(cfg))
        assert [our_name(hf_name(n)) for n in names] == names
        assert len({hf_name(n) for n in names}) == len(names)
    assert hf_name("layers.3.attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("layers.0.mlp_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("embed.weight") == "model.embed_tokens.weight"
    with pytest.raises(KeyError):
        our_name("model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize("cfg", CONFIGS)
def test_round_trip_through_the_project_model(cfg, tmp_path):
    """Without transformers: export, read back as init_from, the same bits and logits."""
    model = _model(cfg)
    export_model(flat_named_params(model), cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["tie_word_embeddings"], saved["rope_theta"], saved["num_key_value_heads"]) == (
        cfg.tie_embeddings,
        cfg.rope_theta,
        cfg.num_kv_heads,
    )
    back = build_model(cfg, seed=7)
    params = read_init_weights(tmp_path, file_sha256(tmp_path / "model.safetensors"), cfg)
    with torch.no_grad():
        for name, param in back.named_parameters():
            param.copy_(params[name])
    assert all(torch.equal(a, b) for a, b in zip(flat_named_params(model).values(), flat_named_params(back).values()))
    x = _tokens(cfg)
    assert torch.equal(model(x), back.eval()(x))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_export_loads_in_transformers_with_equal_logits(cfg, tmp_path, transformers, single_thread):
    model = _model(cfg)
    save_checkpoint(tmp_path / "ckpt", 3, model)
    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert exported.files == ["config.json", "model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert set(hf.state_dict()) >= set(to_hf_state(flat_named_params(model), cfg))
    x = _tokens(cfg)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_import_from_transformers_with_equal_logits(cfg, tmp_path, transformers, single_thread):
    """A model transformers initialised and saved starts a run: the same logits in our model."""
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    hf.save_pretrained(tmp_path)
    model = build_model(cfg, seed=0)
    params = read_init_weights(tmp_path, file_sha256(tmp_path / "model.safetensors"), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name])
    x = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf(x).logits, atol=1e-4, rtol=0)


def _run(init_from, sha256, **model) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "t",
            "model": {"preset": "tiny", "init_from": str(init_from), "init_sha256": sha256, **model},
            "inner": {"steps": 1, "batch_size": 2, "seq_len": 16},
        }
    )


def test_init_from_starts_every_peer_identical_and_refuses_another_file(tmp_path, single_thread):
    source = _model(TIED, seed=5)
    export_model(flat_named_params(source), TIED, tmp_path / "start")
    sha256 = file_sha256(tmp_path / "start" / "model.safetensors")
    shard = TokenDataset([torch.arange(256, dtype=torch.uint8).numpy()], vocab_size=256, name="bytes")
    peers = [PeerTraining.build(_run(tmp_path / "start", sha256), "cpu", shard) for _ in range(2)]
    for peer in peers:
        assert all(
            torch.equal(a, b)
            for a, b in zip(flat_named_params(peer.model).values(), flat_named_params(source).values())
        )
    # The file given directly works as well as its directory.
    PeerTraining.build(_run(tmp_path / "start" / "model.safetensors", sha256), "cpu", shard)

    with pytest.raises(InitMismatch, match="has sha256 .*copy the operator's"):
        PeerTraining.build(_run(tmp_path / "start", "0" * 64), "cpu", shard)
    with pytest.raises(InitMismatch, match="does not have: copy the operator's file there"):
        PeerTraining.build(_run(tmp_path / "elsewhere", sha256), "cpu", shard)
    # A config.json that describes another model (here: another rotary base) is refused by name.
    shutil.copytree(tmp_path / "start", tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps(config | {"rope_theta": 500000.0}))
    with pytest.raises(InitMismatch, match="rope_theta: file 500000.0, model 10000.0"):
        PeerTraining.build(_run(tmp_path / "other", sha256), "cpu", shard)
    # Weights of another vocabulary say which vocab_size to set.
    wide = dataclasses.replace(TIED, vocab_size=300)
    export_model(flat_named_params(build_model(wide, 0)), wide, tmp_path / "wide")
    (tmp_path / "wide" / "config.json").unlink()
    with pytest.raises(InitMismatch, match="set model.vocab_size = 300"):
        read_init_weights(tmp_path / "wide", file_sha256(tmp_path / "wide" / "model.safetensors"), TIED)
    with pytest.raises(WeightsError, match="tensors a Llama model does not have"):
        from_hf_state({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, TIED)


def test_export_ships_the_runs_tokenizer(tmp_path, transformers, capsys):
    from node.training.shards import tokenizer_id, train_bpe

    tokenizer = train_bpe(["def f(x):\n    return x + 1\n"] * 50 + ["hello world, " * 20], 300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    identity = tokenizer_id(tmp_path / "tokenizer.json")
    vocab = max(tokenizer.get_vocab().values()) + 1
    cfg = dataclasses.replace(TIED, vocab_size=vocab, tokenizer_id=identity)
    save_checkpoint(tmp_path / "ckpt", 1, _model(cfg))

    # The checkpoint records its tokenizer: exporting without one is refused, with what to pass.
    assert locoswarm(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    other = train_bpe(["something else entirely"] * 10, 280)
    other.save(str(tmp_path / "other.json"))
    assert (
        locoswarm(
            [
                "export",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "b"),
                "--tokenizer",
                str(tmp_path / "other.json"),
            ]
        )
        == 2
    )
    assert "pass the tokenizer.json of the run's data" in capsys.readouterr().err

    assert (
        locoswarm(
            [
                "export",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "hf"),
                "--tokenizer",
                str(tmp_path / "tokenizer.json"),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert "LlamaForCausalLM.from_pretrained" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    end = tokenizer.token_to_id("<|endoftext|>")
    assert (config["vocab_size"], config["eos_token_id"], config["torch_dtype"]) == (vocab, end, "bfloat16")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return x + 1\n"
    assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16 and hf.config.vocab_size == vocab
