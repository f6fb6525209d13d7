"""The inner optimizer: H local AdamW steps between two outer steps (SparseLoCo / DiLoCo).

Settings follow the SparseLoCo authors' 512M runs (README.md, "The algorithm"; their public
code, QErywan/RobustDiLoCo at 276fa59): AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0.1,
gradient norm clipped to 1.0, learning rate warmed up linearly from 0.1x to the peak (torch's
LinearLR with start_factor 0.1), then cosine-decayed to 0.1x of the peak at `total_steps` and
held there.

The settings are the run's [inner] section (protocol.run_config.InnerSection) as it is: its
defaults are those above, and every peer of a run trains with the same ones.

Weight decay: the authors' code decays every parameter, RMSNorm gains included, and that is
the default here (`make_inner_optimizer(..., decay_1d_params=True)`). The more customary choice,
no decay on 1-D parameters (norm gains; this model has no biases), is one flag away.

The step counter is global (it runs across rounds), so the schedule does not restart each round.
The loop keeps the loss on the device and synchronises with the host once at the end, unless
an `on_step` callback asks for figures (once every `report_every_steps` steps).

How a node runs the steps is its own choice (`ExecutionConfig`), none of which changes the maths
beyond float rounding: the run fixes the per-step batch (`InnerSection.batch_size`, the global
batch of one step), and the node splits it into micro-batches whose gradients accumulate, each
micro-batch's mean loss weighted by its share of the sequences; activation checkpointing per
block; `torch.compile` per block; the chunked cross-entropy of node.training.model.lm_loss.

Usage:
    optimizer = make_inner_optimizer(model, run.inner)
    prepare_model(model, execution)                       # checkpointing and compile, once
    batches = corpus.train.shard(peer, num_peers).batches(run.inner.batch_size, run.inner.seq_len, seed, device)
    result = run_inner_steps(model, optimizer, batches, start_step=r * H, num_steps=H, cfg=run.inner,
                             device=device, execution=execution)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from node.training.model import LOSS_CHUNK_TOKENS, Transformer, autocast_for, lm_loss
from node.training.params import flat_named_params
from protocol.run_config import InnerSection

WARMUP_START_RATIO = 0.1  # lr at step 0 as a fraction of the peak (torch's LinearLR start_factor)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionConfig:
    """How this node executes the run's inner steps: memory and speed, not the maths."""

    micro_batch_size: int = 0  # sequences per forward/backward, gradients accumulated; 0: the whole batch
    activation_checkpointing: bool = False  # keep each block's input only, recompute the rest in backward
    compile: bool = False  # torch.compile each transformer block (slow first step; pays on CUDA)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # rows of fp32 logits alive at once in the loss
    report_every_steps: int = 1  # on_step (a host sync) once every this many steps, and after the last

    def __post_init__(self) -> None:
        if self.micro_batch_size < 0 or self.loss_chunk_tokens < 1 or self.report_every_steps < 1:
            raise ValueError("micro_batch_size must be >= 0, loss_chunk_tokens and report_every_steps >= 1")


@dataclass(frozen=True, slots=True)
class InnerResult:
    mean_loss: float  # mean training loss over the steps run
    num_tokens: int  # input tokens processed
    compute_s: float  # wall time of the steps, device synchronised


def lr_at(step: int, cfg: InnerSection) -> float:
    """Learning rate for global inner step `step` (0-based).

    Exact endpoints: lr_at(0) = WARMUP_START_RATIO * lr (when warmup_steps > 0),
    lr_at(warmup_steps) = lr, lr_at(s) = min_lr_ratio * lr for every s >= total_steps.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (WARMUP_START_RATIO + (1.0 - WARMUP_START_RATIO) * step / cfg.warmup_steps)
    if step >= cfg.total_steps:
        return cfg.lr * cfg.min_lr_ratio
    if step == cfg.warmup_steps:
        return cfg.lr
    progress = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_inner_optimizer(model: nn.Module, cfg: InnerSection, *, decay_1d_params: bool = True) -> torch.optim.AdamW:
    """AdamW over the trainable parameters in sorted-name order (see the module docstring on decay).

    Refuses (ValueError) a schedule whose warm-up outlasts it: the run config bounds each field of
    [inner] alone, and `lr_at` needs warmup_steps <= total_steps."""
    if cfg.warmup_steps > cfg.total_steps:
        raise ValueError(f"warmup_steps {cfg.warmup_steps} exceeds total_steps {cfg.total_steps}")
    params = flat_named_params(model)
    if decay_1d_params:
        groups = [{"params": list(params.values()), "weight_decay": cfg.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
        ]
    # The fused CUDA kernel is one launch per step instead of a few per tensor.
    on_cuda = all(p.is_cuda for p in params.values())
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=cfg.betas, fused=on_cuda or None)


def prepare_model(model: nn.Module, execution: ExecutionConfig) -> nn.Module:
    """Apply the execution choices that live on the module, once, before training: activation
    checkpointing and per-block `torch.compile` (in place, so parameter names and the optimizer's
    tensors stay those of the plain model). Returns the model."""
    if isinstance(model, Transformer):
        model.activation_checkpointing = execution.activation_checkpointing
        if execution.compile:
            for layer in model.layers:
                layer.compile()
    elif execution.activation_checkpointing or execution.compile:
        raise ValueError(
            f"activation checkpointing and compile need node.training.model.Transformer, not {type(model).__name__}"
        )
    return model


def accumulate_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, execution: ExecutionConfig
) -> torch.Tensor:
    """Forward and backward over one step's (B, T) batch in micro-batches, adding into `.grad`.

    Each micro-batch's mean loss is weighted by its share of the B sequences, so the gradients
    and the returned loss (a detached device scalar: no host sync) are those of the whole batch's
    mean, up to float rounding; with one micro-batch they are the unsplit step's, bit for bit.
    """
    batch = x.shape[0]
    micro = execution.micro_batch_size or batch
    loss_sum = torch.zeros((), device=device)
    for start in range(0, batch, micro):  # B / micro iterations, each a whole forward/backward
        x_micro = x[start : start + micro].to(device, non_blocking=True)  # (b, T)
        y_micro = y[start : start + micro].to(device, non_blocking=True)  # (b, T)
        with autocast_for(device):
            loss = lm_loss(model, x_micro, y_micro, execution.loss_chunk_tokens)
        if x_micro.shape[0] != batch:
            loss = loss * (x_micro.shape[0] / batch)
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def run_inner_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches_iter: Iterator[tuple[torch.Tensor, torch.Tensor]],
    start_step: int,
    num_steps: int,
    cfg: InnerSection,
    device: torch.device | str,
    on_step: Callable[[int, float, float], None] | None = None,
    on_step_queued: Callable[[int], None] | None = None,
    execution: ExecutionConfig = ExecutionConfig(),
) -> InnerResult:
    """Run `num_steps` AdamW steps on batches from `batches_iter`, global steps start_step...

    `on_step(step, loss, tokens_per_s)` is called after every `execution.report_every_steps`-th
    step and after the last, with the mean loss and the token rate since the previous call;
    each call costs one device synchronisation (the loss must reach the host).
    `on_step_queued(step)` costs none: it is called once a step's work is queued on the device
    (progress for heartbeats).
    """
    device = torch.device(device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    model.train()
    loss_sum = torch.zeros((), device=device)
    unreported_loss_sum = torch.zeros((), device=device)  # over the steps since the last on_step
    num_tokens = reported_tokens = reported_steps = 0
    start_s = last_s = time.perf_counter()
    for i in range(num_steps):
        step = start_step + i
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = next(batches_iter)
        optimizer.zero_grad(set_to_none=True)
        step_loss = accumulate_gradients(model, x, y, device, execution)
        loss_sum += step_loss
        unreported_loss_sum += step_loss
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        num_tokens += x.numel()
        if on_step_queued is not None:
            on_step_queued(step)
        if on_step is not None and ((i + 1) % execution.report_every_steps == 0 or i + 1 == num_steps):
            loss_value = (unreported_loss_sum / (i + 1 - reported_steps)).item()  # the synchronisation point
            unreported_loss_sum.zero_()
            now_s = time.perf_counter()
            on_step(step, loss_value, (num_tokens - reported_tokens) / max(now_s - last_s, 1e-9))
            last_s, reported_tokens, reported_steps = now_s, num_tokens, i + 1
    optimizer.zero_grad(set_to_none=True)
    mean_loss = (loss_sum / max(num_steps, 1)).item()  # waits for the device to finish
    return InnerResult(mean_loss=mean_loss, num_tokens=num_tokens, compute_s=time.perf_counter() - start_s)
