"""Sampling text from a model: the tokenizers a run uses, loading a model to sample from, and the
sampling loop. `locoswarm generate` (node/cli/generate.py) is its command line, whose docstring
states the contract (greedy at temperature 0, seeded otherwise, context the last max_seq_len
tokens); a node sends a short sample with its validation loss (node/round/steps.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is imported where it is used
    from node.training.model import ModelConfig, Transformer

MAX_NEW_TOKENS = 1024
MAX_TEMPERATURE = 10.0
BYTE_VOCAB_SIZE = 256  # node.training.data.BYTE_VOCAB_SIZE, without importing torch here


class GenerateError(Exception):
    """The model or tokenizer asked for cannot be used to sample."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleConfig:
    max_new_tokens: int = 200  # tokens generated at most; fewer when the tokenizer's end of text is drawn
    temperature: float = 0.8  # softmax temperature; 0 is greedy (argmax), the seed then unused
    seed: int = 0  # the sampling generator's seed: same model, prompt and seed, same text

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in 0..{MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")


# -- tokenizers ----------------------------------------------------------------------------------


class TextTokenizer(Protocol):
    name: str
    bos_id: int | None  # put before the prompt, as `data prepare` starts a document
    eos_id: int | None  # ends the sample when drawn

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level text: a token is a byte of UTF-8; bytes that do not decode read as U+FFFD."""

    name, bos_id, eos_id = "bytes", None, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A tokenizer.json, through the `tokenizers` package (the `data` extra)."""

    def __init__(self, path: Path) -> None:
        from node.training.shards import special_tokens

        self.name = str(path)
        try:
            import tokenizers
        except ImportError:
            raise GenerateError(
                "reading a tokenizer.json needs the tokenizers package: pip install 'locoswarm[data]'"
            ) from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot load
            raise GenerateError(f"{path} is not a tokenizer.json the tokenizers package can load: {error}") from None
        special = {role: token and token[0] for role, token in special_tokens(path).items()}
        self.eos_id = special["eos"]
        self.bos_id = special["bos"] if special["bos"] != special["eos"] else None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def run_tokenizer(cfg: ModelConfig, tokenizer: str | None, beside: Path | None = None) -> TextTokenizer:
    """The tokenizer `cfg` was trained with: `tokenizer` (a tokenizer.json or its directory), else a
    tokenizer.json in `beside`, else bytes where the model is byte-level (see the module docstring)."""
    from node.training.shards import tokenizer_file, tokenizer_id

    path = tokenizer_file(tokenizer) if tokenizer is not None else None
    if path is None and beside is not None and (beside / "tokenizer.json").is_file():
        path = beside / "tokenizer.json"
    if path is None:
        if cfg.tokenizer_id is None and cfg.vocab_size == BYTE_VOCAB_SIZE:
            return ByteTokenizer()
        named = f"tokenizer {cfg.tokenizer_id[:12]}" if cfg.tokenizer_id else "a tokenizer it does not name"
        raise GenerateError(
            f"the model was trained on {named} ({cfg.vocab_size} token ids): pass --tokenizer with "
            "the run's tokenizer.json or the `locoswarm data prepare` directory holding it"
        )
    if cfg.tokenizer_id is not None and (identity := tokenizer_id(path)) != cfg.tokenizer_id:
        raise GenerateError(
            f"{path} is tokenizer {identity[:12]}, the model was trained on {cfg.tokenizer_id[:12]}: "
            "pass the tokenizer.json of the run's data"
        )
    return JsonTokenizer(path)


# -- models --------------------------------------------------------------------------------------


def _model_config(fields: dict, source: str) -> ModelConfig:
    from node.training.model import ModelConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in fields.items() if k in known})
    except (TypeError, ValueError) as error:
        raise GenerateError(f"{source}: not a model config this version builds: {error}") from None


def _built(cfg: ModelConfig) -> Transformer:
    from node.training.model import build_model

    # Seeded parameters that the loaded ones replace at once; build_model is the one place that
    # builds and ties a model.
    return build_model(cfg, seed=0).eval()


def load_checkpoint_model(directory: str | Path) -> tuple[Transformer, str]:
    """The model of a node's checkpoint, and a line that says what it is."""
    from node.training.checkpoint import checkpoint_meta, load_checkpoint
    from node.training.model import num_parameters

    meta = checkpoint_meta(directory)
    if not meta.get("model_config"):
        raise GenerateError(f"{directory}: the checkpoint does not record its model config")
    model = _built(_model_config(meta["model_config"], f"{directory}/meta.json"))
    checkpoint = load_checkpoint(directory, model)
    return model, (f"checkpoint {directory}, round {checkpoint.round}, {num_parameters(model) / 1e6:.2f}M parameters")


def load_exported_model(directory: str | Path) -> tuple[Transformer, str]:
    """The model of a Hugging Face Llama directory as `locoswarm export` writes it, and a line that
    says what it is. Its config.json must describe a model this project computes the same way."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from node.training.hf import CONFIG_FILE, WEIGHTS_FILE, config_differences, from_hf_state
    from node.training.model import num_parameters

    directory = Path(directory).expanduser()
    try:
        hf = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise GenerateError(f"no {CONFIG_FILE} in {directory}: give a directory `locoswarm export` wrote") from None
    except (OSError, ValueError) as error:
        raise GenerateError(f"cannot read {directory / CONFIG_FILE}: {error}") from None
    cfg = _model_config(_fields_of_hf_config(hf, str(directory / CONFIG_FILE)), str(directory / CONFIG_FILE))
    if differences := config_differences(hf, cfg):
        raise GenerateError(
            f"{directory / CONFIG_FILE} describes a model this project does not compute: {'; '.join(differences)}"
        )
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, SafetensorError) as error:
        raise GenerateError(f"cannot read {directory / WEIGHTS_FILE}: {error}") from None
    params = from_hf_state(state, cfg, str(directory / WEIGHTS_FILE))  # WeightsError names a wrong tensor
    model = _built(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name])
    return model, f"exported model {directory}, {num_parameters(model) / 1e6:.2f}M parameters"


def _fields_of_hf_config(hf: dict, source: str) -> dict:
    """ModelConfig's fields from a Llama config.json (the inverse of node.training.hf.hf_config)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    try:
        heads = hf["num_attention_heads"]
        return {
            "vocab_size": hf["vocab_size"],
            "hidden": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "intermediate": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"],
            "rope_theta": float(theta or 10000.0),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as error:
        raise GenerateError(f"{source} has no {error.args[0]}: not a Llama config") from None


# -- sampling ------------------------------------------------------------------------------------


def generate_ids(
    model: Transformer, prompt_ids: Sequence[int], sample: SampleConfig, stop_id: int | None = None
) -> list[int]:
    """The new token ids after `prompt_ids` (at most sample.max_new_tokens; `stop_id` ends them
    and is not returned). See the module docstring for greedy, seeded sampling and the context."""
    import torch

    if not prompt_ids:
        raise GenerateError("the prompt encodes to no tokens: give some text")
    vocab_size, context_len = model.config.vocab_size, model.config.max_seq_len
    if max(prompt_ids) >= vocab_size:
        raise GenerateError(
            f"the prompt has token id {max(prompt_ids)}, the model embeds {vocab_size}: "
            "this tokenizer is not the model's"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(sample.seed)
    ids, new = list(prompt_ids), []
    with torch.no_grad():
        # One host sync per token (int(...)): each step's input is the token the step before drew.
        for _ in range(sample.max_new_tokens):
            context = torch.tensor([ids[-context_len:]], dtype=torch.long, device=device)  # (1, T)
            logits = model(context)[0, -1].float().cpu()  # (V,)
            if sample.temperature == 0.0:
                token = int(logits.argmax())
            else:  # drawn with a CPU generator, whose stream a seed fixes on every machine (CUDA's is another)
                probs = torch.softmax(logits / sample.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token == stop_id:
                break
            ids.append(token)
            new.append(token)
    return new


def generate_text(model: Transformer, tokenizer: TextTokenizer, prompt: str, sample: SampleConfig) -> str:
    """The prompt followed by the sampled continuation."""
    prompt_ids = [tokenizer.bos_id] * (tokenizer.bos_id is not None) + tokenizer.encode(prompt)
    new_ids = generate_ids(model, prompt_ids, sample, stop_id=tokenizer.eos_id)
    # Decoded together with the prompt, so that a token which completes the prompt's last word or
    # character reads as it would in the text; the prompt's own decoding is then cut off.
    head, whole = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + new_ids)
    continuation = whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new_ids)
    return prompt + continuation
