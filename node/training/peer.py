"""One peer's training state for a run, and what a round asks of it: train H steps, encode, evaluate.

    training = PeerTraining.build(run, device, shard, val=val)  # model, AdamW, outer step, data
    result = training.train_round(round, on_step)               # H inner steps on this round's batches
    payload = training.outer.make_payload(...)                  # the round's signed packet
    val_loss = training.evaluate_global()                       # the global model, held-out batches

The node (node/round/) and the simulator (tools/sim/engine.py) both build their peers here, so a
run config means the same model, optimizers and data order in either: the model from its [model]
section (`model_config`), the inner steps from [inner] and the outer step from [outer], each section
as it is. `PeerTraining` is the `Training` protocol (node/training/base.py) of a 1-rank node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from node.training.data import EmptyData, TokenDataset, check_vocabulary, evaluate
from node.training.inner import ExecutionConfig, InnerResult, make_inner_optimizer, prepare_model, run_inner_steps
from node.training.model import build_model, model_config
from node.training.outer import DiLoCoOuter, SparseLoCoOuter, make_outer
from node.training.params import flat_named_params
from protocol.run_config import InnerSection, RunConfig

if TYPE_CHECKING:
    from node.config import NodeConfig

log = logging.getLogger("locoswarm.node")


@dataclass(slots=True)
class PeerTraining:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inner: InnerSection
    outer: SparseLoCoOuter | DiLoCoOuter
    shard: TokenDataset  # this peer's part of the training data
    device: torch.device
    seed: int  # data order
    inner_steps: int  # H
    val: TokenDataset | None = None  # the held-out split, for `evaluate_global` (None: no evaluation)
    execution: ExecutionConfig = ExecutionConfig()  # this node's micro-batches, checkpointing, compile

    @staticmethod
    def execution_of(node: "NodeConfig") -> ExecutionConfig:
        """The inner-step execution choices of a node config (node/config.py)."""
        memory = node.memory
        return ExecutionConfig(
            micro_batch_size=memory.micro_batch_size,
            compile=node.training.compile_model,
            activation_checkpointing=memory.activation_checkpointing,
            loss_chunk_tokens=memory.loss_chunk_tokens,
        )

    @classmethod
    def build(
        cls,
        run: RunConfig,
        device: torch.device | str,
        shard: TokenDataset,
        val: TokenDataset | None = None,
        node: "NodeConfig | None" = None,
    ) -> "PeerTraining":
        """The peer's state at the run's start (seeded initialisation or the run's init_from, zero
        error feedback); `val` is the held-out split `evaluate_global` reads. A shard the run's
        model cannot train on is refused before anything is built (node.training.data.DataMismatch),
        and so is an init_from that is not the run's (node.training.hf.InitMismatch): each says what
        to do. `node` brings this node's choices: where the outer state lives (memory.state_placement)
        and how the inner steps run (`execution_of`); unset: the defaults."""
        device = torch.device(device)
        cfg = model_config(run)
        # Before anything is built: shards of another tokenizer, or with ids the model cannot embed,
        # would train garbage (or fail with an index error deep in the first step).
        for data in (shard, val) if val is not None else (shard,):
            check_vocabulary(data, cfg.vocab_size, cfg.tokenizer_id)
        model = build_model(cfg, run.model.seed)
        if run.model.init_from is not None:
            from node.training.hf import load_init_weights

            load_init_weights(model, run.model.init_from, run.model.init_sha256)
        model = model.to(device)
        execution = cls.execution_of(node) if node is not None else ExecutionConfig()
        prepare_model(model, execution)
        outer = make_outer(
            flat_named_params(model),
            run.outer,
            max_packet_bytes=run.exchange.max_packet_bytes,
            state_placement=node.memory.state_placement if node is not None else "host",
        )
        return cls(
            model=model,
            optimizer=make_inner_optimizer(model, run.inner),
            inner=run.inner,
            outer=outer,
            shard=shard,
            device=device,
            seed=run.model.seed,
            inner_steps=run.inner.steps,
            val=val,
            execution=execution,
        )

    def evaluate_global(self, num_batches: int = 1) -> float | None:
        """Mean loss of the global model (`outer.start`, the same on every peer) on the first
        `num_batches` fixed batches of the held-out split, at the run's batch shape; None without
        a split, or with one too short for a sequence (then never again; logged). With overlap the
        parameters run ahead of the global model (this peer's update in flight is on them), so they
        are swapped for the global ones while it evaluates."""
        if self.val is None:
            return None
        try:
            next(self.val.val_batches(self.inner.batch_size, self.inner.seq_len, 1))  # long enough?
        except EmptyData as e:
            log.warning("no validation loss: %s", e)
            self.val = None
            return None
        params = flat_named_params(self.model)
        local = {name: p.detach().clone() for name, p in params.items()} if self.outer.cfg.overlap else None
        try:
            with torch.no_grad():
                if local is not None:
                    for name, p in params.items():
                        p.copy_(self.outer.start[name])
            return evaluate(
                self.model,
                self.val,
                num_batches,
                batch_size=self.inner.batch_size,
                seq_len=self.inner.seq_len,
                device=self.device,
            )
        finally:
            if local is not None:
                with torch.no_grad():
                    for name, p in params.items():
                        p.copy_(local[name])

    def train_round(
        self,
        round: int,
        on_step: Callable[[int, float, float], None] | None = None,
        on_step_queued: Callable[[int], None] | None = None,
    ) -> InnerResult:
        """Round `round`'s H inner steps: global steps round*H ..., on the batches of those steps."""
        start_step = round * self.inner_steps
        batches = self.shard.batches(
            self.inner.batch_size, self.inner.seq_len, self.seed, self.device, start_step=start_step
        )
        return run_inner_steps(
            self.model,
            self.optimizer,
            batches,
            start_step,
            self.inner_steps,
            self.inner,
            self.device,
            on_step,
            on_step_queued,
            self.execution,
        )
