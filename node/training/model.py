"""A LLaMA-style decoder-only transformer, readable in one sitting.

RMSNorm (pre-norm), rotary position embeddings, SwiGLU MLP, causal attention through
`F.scaled_dot_product_attention`, optional grouped-query attention, tied or untied embeddings.
The same shapes as the LLaMA family the SparseLoCo paper (arXiv 2508.15706) trains at 512M.

Every peer must start from bit-identical parameters, so `build_model(preset, seed)` builds the
module on the meta device (no memory, no draw from the global RNG) and then initialises every
parameter from a private `torch.Generator(seed)` on the CPU, in sorted-name order. Parameters are
fp32: they are the master copy the outer step updates; the inner loop runs bf16 autocast on CUDA.

Usage:
    model = build_model("small", seed=0)         # nn.Module on the CPU, fp32
    model = build_model(model_config(run), seed) # a run's model: its preset, vocabulary and tokenizer
    logits = model(tokens)                       # (B, T) int64 -> (B, T, vocab) fp32
    loss = lm_loss(model, x, y)                  # scalar mean next-token cross-entropy (chunked when large)
    model.activation_checkpointing = True        # a node option: recompute each block in backward
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from protocol.run_config import RunConfig

# SDPA's own grouped-query attention (`enable_gqa`) arrived in torch 2.5.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
# Tokens per piece of the chunked cross-entropy (`lm_loss`): at most this many rows of fp32 logits
# exist at once, 2048 x 128256 x 4 B = 1 GB for the 8B vocabulary instead of 4 GB per 8192 tokens.
LOSS_CHUNK_TOKENS = 2048


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int  # number of token ids; 256 for the byte-level corpora
    hidden: int  # residual stream width C
    num_layers: int  # transformer blocks
    num_heads: int  # query heads; head_dim = hidden // num_heads
    num_kv_heads: int  # key/value heads; < num_heads is grouped-query attention
    intermediate: int  # SwiGLU inner width
    max_seq_len: int  # longest sequence the rotary tables cover
    rope_theta: float = 10000.0  # rotary base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # output head shares the token embedding matrix
    # What the ids mean: sha256 of the tokenizer.json (node.training.shards.tokenizer_id); None for
    # byte-level text or an unnamed tokenizer. Not used by the maths: it travels with the model into
    # checkpoints so that an export (node/training/hf.py) can ship the right tokenizer.
    tokenizer_id: str | None = None

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden // self.num_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        for name in ("vocab_size", "hidden", "num_layers", "intermediate", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # ~0.84M parameters: unit tests and quick smoke runs.
    "tiny": ModelConfig(
        vocab_size=256,
        hidden=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        intermediate=352,
        max_seq_len=256,
    ),
    # ~4.9M parameters: the simulator's default, so that 3 strategies x 4 peers x 300 inner
    # steps fit in 10 minutes on 2 CPU cores.
    "mini": ModelConfig(
        vocab_size=256,
        hidden=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=4,
        intermediate=704,
        max_seq_len=256,
    ),
    # ~10.7M parameters: CPU benchmarks and longer simulator runs.
    "small": ModelConfig(
        vocab_size=256,
        hidden=384,
        num_layers=6,
        num_heads=6,
        num_kv_heads=6,
        intermediate=1024,
        max_seq_len=256,
    ),
    # The paper's 512M LLaMA: ~512.4M parameters with a LLaMA-2 sized vocabulary (32000) and
    # untied embeddings (the count the paper's name refers to).
    "512m": ModelConfig(
        vocab_size=32000,
        hidden=1536,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate=5440,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    # ~1.1B parameters for GPU volunteers: the TinyLlama-1.1B shape (hidden 2048, 22 layers,
    # 32 query heads sharing 4 key/value heads, SwiGLU 5632, vocab 32000, untied).
    "1b": ModelConfig(
        vocab_size=32000,
        hidden=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        intermediate=5632,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    # ~3.2B: the LLaMA-3.2-3B shape (hidden 3072, 28 layers, 24 query heads over 8 key/value heads,
    # SwiGLU 8192, the LLaMA-3 vocabulary of 128256, tied embeddings; rope base 500000, without
    # LLaMA-3.2's long-context rope scaling).
    "3b": ModelConfig(
        vocab_size=128256,
        hidden=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        intermediate=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # ~8.0B: the LLaMA-3-8B shape (hidden 4096, 32 layers, 32 query heads over 8 key/value heads,
    # SwiGLU 14336, vocab 128256, untied; rope base 500000). An 8-GPU peer shards it (FSDP2).
    "8b": ModelConfig(
        vocab_size=128256,
        hidden=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
}


def resolve_config(preset_or_config: str | ModelConfig) -> ModelConfig:
    if isinstance(preset_or_config, ModelConfig):
        return preset_or_config
    try:
        return PRESETS[preset_or_config]
    except KeyError:
        raise ValueError(f"unknown model preset {preset_or_config!r}; known: {sorted(PRESETS)}") from None


def model_config(run: RunConfig) -> ModelConfig:
    """The model of `run` ([model]): its preset, with the run's vocabulary and tokenizer when it
    names them (a run on tokenized shards embeds its tokenizer's ids, not the preset's 256 bytes)."""
    preset = resolve_config(run.model.preset)
    return dataclasses.replace(
        preset, vocab_size=run.model.vocab_size or preset.vocab_size, tokenizer_id=run.model.tokenizer_id
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses too much in bf16.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim), in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv_freq)  # (T, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, head_dim)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos, sin: (T, D). Rotates each (x_i, x_{i+D/2}) pair by its angle.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads == self.num_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        elif SDPA_HAS_GQA:
            # Grouped-query attention: each key/value head serves num_heads/num_kv_heads queries.
            # SDPA broadcasts the groups itself, so K/V are never copied out to H heads.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)
        else:  # torch < 2.5 has no enable_gqa: copy each K/V head out to its group of queries
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, C)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Derived from the config, never trained or saved (persistent=False).
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # A node option, not part of the architecture: when training, keep only each block's input
        # and recompute its activations in the backward pass (about one extra forward of compute).
        self.activation_checkpointing = False

    def reset_rope(self) -> None:
        """Recompute the rotary tables (after `to_empty`, which leaves buffers uninitialised)."""
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final normalised residual stream, (B, T) int64 -> (B, T, C): the logits before lm_head."""
        B, T = tokens.shape  # (B, T)
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        x = self.embed(tokens)  # (B, T, C)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)  # (B, T, C), activations dropped
            else:
                x = layer(x, cos, sin)  # (B, T, C)
        return self.norm(x)  # (B, T, C)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens))  # (B, T, V)


def _chunk_loss_sum(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # hidden (N, C), targets (N,) -> summed fp32 cross-entropy; the (N, V) logits live only in here.
    return F.cross_entropy(lm_head(hidden).float(), targets, reduction="sum")


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """Mean next-token cross-entropy of `model` on inputs x and targets y, both (B, T) int64.

    Cross-entropy runs in fp32 (the log-softmax over a large vocabulary is not safe in bf16). With
    more than `chunk_tokens` tokens, the project's Transformer computes it chunk by chunk, each
    chunk's logits recomputed in the backward pass, so the full (B*T, V) fp32 logits never exist;
    equal to the plain loss up to the order of the float sums. Up to `chunk_tokens`, and for any
    other module, it is the plain form, bit for bit.
    """
    if not isinstance(model, Transformer) or x.numel() <= chunk_tokens:
        logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    hidden = model.hidden_states(x).flatten(0, 1)  # (N, C)
    targets = y.flatten()  # (N,)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):  # a few pieces, each one whole-tensor op
        piece = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(
                _chunk_loss_sum, model.lm_head, hidden[piece], targets[piece], use_reentrant=False
            )
        else:
            total = total + _chunk_loss_sum(model.lm_head, hidden[piece], targets[piece])
    return total / targets.numel()


def autocast_for(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; on any other device a no-op, so CPU runs stay in exact fp32."""
    if torch.device(device).type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def init_parameters(model: Transformer, seed: int) -> None:
    """Initialise every parameter from `seed` alone, the same bits on every machine.

    Values are drawn on the CPU from a private generator, in sorted-name order, and copied to the
    parameter's device: CUDA and CPU generators produce different streams, so drawing on the
    device would make a GPU peer disagree with a CPU peer. Scheme (GPT-2 / LLaMA practice):
    normal(0, 0.02) for matrices and embeddings, the two residual output projections scaled by
    1/sqrt(2 * num_layers) so the residual stream does not grow with depth, norm gains at 1.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        param.copy_(values)


def build_model(preset_or_config: str | ModelConfig, seed: int) -> Transformer:
    """The model for a preset name or config, fp32 on the CPU, parameters determined by `seed`."""
    cfg = resolve_config(preset_or_config)
    with torch.device("meta"):
        model = Transformer(cfg)
    # to_empty allocates without touching the global RNG, but it replaces each parameter
    # separately, so the embedding/lm_head tie must be made again.
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_rope()
    init_parameters(model, seed)
    return model


def llama_tensor_shapes(preset: str | ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's named parameter shapes, sorted by name, without allocating any storage."""
    with torch.device("meta"):
        model = Transformer(resolve_config(preset))
    return {name: tuple(p.shape) for name, p in sorted(model.named_parameters())}


def num_parameters(model_or_preset: nn.Module | str | ModelConfig) -> int:
    """Distinct parameters (a tied embedding counts once); presets are counted on the meta device."""
    if isinstance(model_or_preset, nn.Module):
        return sum(p.numel() for p in model_or_preset.parameters())
    return sum(math.prod(shape) for shape in llama_tensor_shapes(model_or_preset).values())
