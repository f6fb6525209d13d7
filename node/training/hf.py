"""Hugging Face Llama weights in and out: the name map, config.json, export, and `init_from`.

    export_checkpoint("ckpt", "hf-out", tokenizer="data/fineweb")   # config.json, model.safetensors,
                                                                     # tokenizer.json (+ its config)
    load_init_weights(model, "TinyLlama-1.1B/", sha256)             # a run's starting weights

The directory `export_*` writes loads with transformers' `LlamaForCausalLM.from_pretrained` (and
`AutoTokenizer`, when it holds the tokenizer) and gives the project's logits; `init_from` reads
the same layout back (a `model.safetensors`, or a directory holding one and its `config.json`).

Names, ours (node/training/model.py) against Hugging Face's LlamaForCausalLM:

    embed.weight                          model.embed_tokens.weight
    layers.{i}.attn_norm.weight           model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{q,k,v,o}_proj.weight model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.mlp_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                           model.norm.weight
    lm_head.weight                        lm_head.weight (untied only: a tied model's file has none)

Rotary embeddings: model.py rotates each (x_i, x_{i+D/2}) pair, the rotate-half layout that
Hugging Face Llama uses too, so q_proj and k_proj are copied unchanged. (The permutation the
conversion of Meta's original checkpoints applies is between the interleaved layout and this one.)

`init_from` is checked before it is used, since every peer must start from the same bits: the
file's sha256 against the run config's `init_sha256`, a config.json beside it against the model
(sizes, rotary base, norm epsilon), a tokenizer.json beside it against the run's tokenizer, and
every tensor's name and shape. Each failure is an `InitMismatch` (or `WeightsError` for a file
that cannot be read) with a one-line message that says what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from node.training.model import ModelConfig, llama_tensor_shapes

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_DERIVED = re.compile(r"\.rotary_emb\.inv_freq$")  # older HF checkpoints saved the rotary table
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ours -> HF, as (pattern, replacement) over the part after "layers.{i}."
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_FROM_HF_LAYER = {hf: ours for ours, hf in _LAYER_NAMES.items()}
_FROM_HF_TOP = {hf: ours for ours, hf in _TOP_NAMES.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class WeightsError(Exception):
    """Hugging Face weights that cannot be read or do not fit the model."""


class InitMismatch(WeightsError):
    """This peer's init_from is not the run's: another file, model shape or tokenizer."""


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of one of our parameter names."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _OURS_LAYER.match(name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    raise KeyError(f"no Hugging Face name for {name!r}")


def our_name(name: str) -> str:
    """Our parameter name for a Hugging Face Llama name."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    match = _HF_LAYER.match(name)
    if match and match[2] in _FROM_HF_LAYER:
        return f"layers.{match[1]}.{_FROM_HF_LAYER[match[2]]}"
    raise KeyError(f"no parameter of the model is called {name!r} in the Hugging Face layout")


def to_hf_state(
    params: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Our named parameters (a tied model's lm_head absent or shared) in the HF layout, as
    contiguous CPU tensors of `dtype`; a tied model's file has no lm_head, as HF saves one."""
    state = {}
    for name, tensor in params.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        state[hf_name(name)] = tensor.detach().to("cpu", dtype).contiguous()
    return state


def from_hf_state(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str = "the file"
) -> dict[str, torch.Tensor]:
    """HF Llama tensors as our named fp32 parameters for `cfg` (a tied model's lm_head left out),
    every name and shape checked: WeightsError (InitMismatch for a shape) names what differs."""
    expected = llama_tensor_shapes(cfg)
    ours: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in hf_state.items():
        if _DERIVED.search(name):
            continue
        try:
            ours[our_name(name)] = tensor
        except KeyError:
            unknown.append(name)
    if unknown:
        raise WeightsError(f"{source}: tensors a Llama model does not have: {sorted(unknown)[:8]}")
    if cfg.tie_embeddings:
        head = ours.pop("lm_head.weight", None)
        if head is not None and "embed.weight" in ours and not torch.equal(head, ours["embed.weight"]):
            raise InitMismatch(
                f"{source}: lm_head differs from embed_tokens, but the model ties them: "
                "use a preset with untied embeddings (512m, 1b)"
            )
    elif "lm_head.weight" not in ours and "embed.weight" in ours:
        ours["lm_head.weight"] = ours["embed.weight"]  # a tied file into an untied model: both start equal
    missing = sorted(expected.keys() - ours.keys())
    if missing:
        raise WeightsError(
            f"{source}: missing {[hf_name(n) for n in missing][:8]}{' and more' if len(missing) > 8 else ''}"
        )
    for name, shape in expected.items():
        if tuple(ours[name].shape) != shape:
            hint = ""
            if name in ("embed.weight", "lm_head.weight") and ours[name].shape[1:] == shape[1:]:
                hint = (
                    f": its vocabulary is {ours[name].shape[0]}; set model.vocab_size = {ours[name].shape[0]}"
                    " (and model.tokenizer_id to its tokenizer.json's)"
                )
            raise InitMismatch(
                f"{source}: {hf_name(name)} has shape {tuple(ours[name].shape)}, the run's model "
                f"{shape}{hint or ': choose the preset of the same size'}"
            )
    return {name: ours[name].to(torch.float32).clone() for name in expected}


# -- config.json --------------------------------------------------------------------------------


def hf_config(
    cfg: ModelConfig, *, dtype: str = "float32", bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict:
    """config.json for LlamaForCausalLM with `cfg`'s shapes (rotary base under both the key
    transformers 4 reads and the one 5 reads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def config_differences(hf: Mapping, cfg: ModelConfig) -> list[str]:
    """What a Hugging Face config.json says that the model `cfg` does not do ("rope_theta: file
    500000.0, model 10000.0"); empty when the weights mean the same computation."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    heads = hf.get("num_attention_heads")
    pairs = {
        "hidden_size": (hf.get("hidden_size"), cfg.hidden),
        "intermediate_size": (hf.get("intermediate_size"), cfg.intermediate),
        "num_hidden_layers": (hf.get("num_hidden_layers"), cfg.num_layers),
        "num_attention_heads": (heads, cfg.num_heads),
        "num_key_value_heads": (hf.get("num_key_value_heads", heads), cfg.num_kv_heads),
        "vocab_size": (hf.get("vocab_size"), cfg.vocab_size),
        "rms_norm_eps": (hf.get("rms_norm_eps"), cfg.norm_eps),
        "rope_theta": (theta, cfg.rope_theta),
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    if "head_dim" in hf and hf["head_dim"] is not None:
        pairs["head_dim"] = (hf["head_dim"], cfg.head_dim)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        pairs["rope_type"] = (rope.get("rope_type", rope.get("type")), "default")
    return [f"{key}: file {got}, model {want}" for key, (got, want) in pairs.items() if got is not None and got != want]


# -- export ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exported:
    out_dir: Path
    files: list[str]
    num_parameters: int


def export_model(
    params: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "float32",
) -> Exported:
    """Write `params` (our names) as a Hugging Face Llama directory: config.json,
    model.safetensors, and the tokenizer when given (a tokenizer.json or a prepared data
    directory holding one; it must be `cfg.tokenizer_id` when that is set)."""
    from safetensors.torch import save_file

    from node.training.shards import special_tokens, tokenizer_file, tokenizer_id

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {sorted(_DTYPES)}")
    special = {"bos": None, "eos": None}
    source = None
    if tokenizer is not None:
        source = tokenizer_file(tokenizer)
        identity = tokenizer_id(source)
        if cfg.tokenizer_id is not None and identity != cfg.tokenizer_id:
            raise InitMismatch(
                f"{source} is tokenizer {identity[:12]}, the model was trained on "
                f"{cfg.tokenizer_id[:12]}: pass the tokenizer.json of the run's data"
            )
        special = special_tokens(source)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    state = to_hf_state(params, cfg, _DTYPES[dtype])
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = hf_config(
        cfg,
        dtype=dtype,
        bos_token_id=special["bos"] and special["bos"][0],
        eos_token_id=special["eos"] and special["eos"][0],
    )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    files = [CONFIG_FILE, WEIGHTS_FILE]
    if source is not None:
        if source.resolve() != (out / TOKENIZER_FILE).resolve():
            shutil.copyfile(source, out / TOKENIZER_FILE)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
        tokenizer_config |= {f"{role}_token": token[1] for role, token in special.items() if token}
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        files += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
    return Exported(out, files, sum(t.numel() for t in state.values()))


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "float32",
    require_tokenizer: bool = True,
) -> Exported:
    """A node's checkpoint (node/training/checkpoint.py: its parameters, digest-checked, and the
    model config in its meta.json) as a Hugging Face Llama directory (`export_model`). A model
    trained on a tokenizer needs it (`tokenizer`), unless `require_tokenizer` is False."""
    from node.training.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(checkpoint_dir)
    if not checkpoint.model_config:
        raise WeightsError(f"{checkpoint_dir}: the checkpoint does not record its model config")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in checkpoint.model_config.items() if k in known})
    if cfg.tokenizer_id is not None and tokenizer is None and require_tokenizer:
        raise WeightsError(
            f"the run trained on tokenizer {cfg.tokenizer_id[:12]}: pass --tokenizer with its"
            " tokenizer.json (or the prepared data directory), or --no-tokenizer for weights only"
        )
    return export_model(checkpoint.params, cfg, out_dir, tokenizer=tokenizer, dtype=dtype)


# -- init_from ---------------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            hasher.update(block)
    return hasher.hexdigest()


def init_weights_file(init_from: str | os.PathLike) -> Path:
    """The safetensors file `init_from` names: the file, or a directory's model.safetensors."""
    path = Path(init_from).expanduser()
    if path.is_dir():
        if not (path / WEIGHTS_FILE).is_file() and any(path.glob("*.safetensors.index.json")):
            raise WeightsError(
                f"{path} holds sharded weights: merge them into one {WEIGHTS_FILE} "
                "(e.g. save_pretrained(..., max_shard_size='100GB'))"
            )
        path = path / WEIGHTS_FILE
    if not path.is_file():
        raise InitMismatch(
            f"the run starts from {init_from}, which this machine does not have: copy the operator's file there"
        )
    return path


def read_init_weights(init_from: str | os.PathLike, sha256: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The run's starting weights (our names, fp32), after every check in the module docstring."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from node.training.shards import tokenizer_id

    path = init_weights_file(init_from)
    digest = file_sha256(path)
    if digest != sha256:
        raise InitMismatch(
            f"{path} has sha256 {digest[:16]}..., the run's init_sha256 is {sha256[:16]}...: "
            "this is another file; copy the operator's"
        )
    directory = path.parent
    if (directory / CONFIG_FILE).is_file():
        try:
            hf = json.loads((directory / CONFIG_FILE).read_text())
        except (OSError, ValueError) as error:
            raise WeightsError(f"cannot read {directory / CONFIG_FILE}: {error}") from error
        differences = config_differences(hf, cfg)
        if differences:
            raise InitMismatch(
                f"{directory / CONFIG_FILE} describes another model than the run's "
                f"({'; '.join(differences)}): choose the matching preset and model.vocab_size"
            )
    if cfg.tokenizer_id is not None and (directory / TOKENIZER_FILE).is_file():
        beside = tokenizer_id(directory / TOKENIZER_FILE)
        if beside != cfg.tokenizer_id:
            raise InitMismatch(
                f"{directory / TOKENIZER_FILE} is tokenizer {beside[:12]}, the run's data "
                f"{cfg.tokenizer_id[:12]}: prepare the data with this tokenizer.json"
            )
    try:
        hf_state = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise WeightsError(f"cannot read {path}: {error}") from error
    return from_hf_state(hf_state, cfg, str(path))


@torch.no_grad()
def load_init_weights(model: nn.Module, init_from: str | os.PathLike, sha256: str) -> None:
    """Replace `model`'s parameters (node.training.model.Transformer) by the run's init_from."""
    params = read_init_weights(init_from, sha256, model.config)
    for name, param in model.named_parameters():
        param.copy_(params[name])
