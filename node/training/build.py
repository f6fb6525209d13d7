"""The one place a run config becomes the training objects' configs.

    model = model_config(run)      # node.training.model.ModelConfig: the preset, its vocabulary the run's
    inner = inner_config(run)      # node.training.inner.InnerConfig: AdamW, schedule, batches
    outer = outer_config(run)      # node.training.outer.OuterConfig: outer step and compression

The round loop and the simulator both build from here, so a field of protocol.run_config.RunConfig
reaches the optimizers the same way in either. The run config's sections are the wire's (bounds
checked on arrival); the dataclasses built here are what the training code reads.
"""

from __future__ import annotations

import dataclasses

from node.training.inner import InnerConfig
from node.training.model import ModelConfig, resolve_config
from node.training.outer import OuterConfig
from protocol.run_config import RunConfig


def model_config(run: RunConfig) -> ModelConfig:
    """The model of `run` ([model]): its preset, with the run's vocabulary and tokenizer when it
    names them (a run on tokenized shards embeds its tokenizer's ids, not the preset's 256 bytes)."""
    preset = resolve_config(run.model.preset)
    return dataclasses.replace(
        preset, vocab_size=run.model.vocab_size or preset.vocab_size, tokenizer_id=run.model.tokenizer_id
    )


def inner_config(run: RunConfig) -> InnerConfig:
    """The inner AdamW steps of `run` ([inner]); the rest of InnerConfig keeps its defaults."""
    inner = run.inner
    return InnerConfig(
        lr=inner.lr,
        betas=tuple(inner.betas),
        weight_decay=inner.weight_decay,
        grad_clip=inner.grad_clip,
        warmup_steps=inner.warmup_steps,
        total_steps=inner.total_steps,
        min_lr_ratio=inner.min_lr_ratio,
        batch_size=inner.batch_size,
        seq_len=inner.seq_len,
    )


def outer_config(run: RunConfig) -> OuterConfig:
    """The outer step of `run` ([outer], and the packet bound of [exchange]).

    Raises ValueError for the "ddp" baseline: it syncs every inner step and has no outer step
    (the simulator runs it apart)."""
    outer = run.outer
    if outer.strategy == "ddp":
        raise ValueError("the ddp baseline has no outer step: it syncs every inner step, in the simulator only")
    return OuterConfig(
        strategy=outer.strategy,
        outer_lr=outer.lr,
        outer_momentum=outer.momentum,
        nesterov=outer.nesterov,
        top_k=outer.top_k,
        chunk_size=outer.chunk_size,
        error_decay=outer.error_decay,
        aggregation=outer.aggregation,
        max_abs_value=outer.max_abs_value,
        overlap=outer.overlap,
        max_packet_bytes=run.exchange.max_packet_bytes,
    )
