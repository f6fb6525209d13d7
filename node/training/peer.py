"""One peer's training state for a run, and the two things a round asks of it: train H steps, encode.

    training = PeerTraining.build(run, device, shard)        # model, AdamW, outer step, data shard
    result = training.train_round(round, on_step)            # H inner steps from this round's batches
    payload = training.outer.make_payload(...)               # the round's signed packet

The node (node/round/) and the simulator (node/round/sim.py) both build their peers here, so a
run config means the same model, optimizers and data order in either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.training.build import inner_config, outer_config
from node.training.data import TokenDataset
from node.training.inner import InnerConfig, InnerResult, make_inner_optimizer, run_inner_steps
from node.training.model import build_model
from node.training.outer import DiLoCoOuter, SparseLoCoOuter, make_outer
from node.training.params import flat_named_params
from protocol.run_config import RunConfig


@dataclass(slots=True)
class PeerTraining:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inner: InnerConfig
    outer: SparseLoCoOuter | DiLoCoOuter
    shard: TokenDataset  # this peer's part of the training data
    device: torch.device
    seed: int  # data order
    inner_steps: int  # H

    @classmethod
    def build(cls, run: RunConfig, device: torch.device | str, shard: TokenDataset,
              inner: InnerConfig | None = None) -> "PeerTraining":
        """The peer's state at the run's start (seeded initialisation, zero error feedback);
        `inner` replaces the run's inner config (the simulator's per-strategy learning rates)."""
        device = torch.device(device)
        model = build_model(run.model.preset, run.model.seed).to(device)
        inner = inner or inner_config(run)
        return cls(model=model, optimizer=make_inner_optimizer(model, inner), inner=inner,
                   outer=make_outer(flat_named_params(model), outer_config(run)), shard=shard, device=device,
                   seed=run.model.seed, inner_steps=run.inner.steps)

    def train_round(self, round: int, on_step: Callable[[int, float, float], None] | None = None,
                    on_step_queued: Callable[[int], None] | None = None) -> InnerResult:
        """Round `round`'s H inner steps: global steps round*H ..., on the batches of those steps."""
        start_step = round * self.inner_steps
        batches = self.shard.batches(self.inner.batch_size, self.inner.seq_len, self.seed, self.device,
                                     start_step=start_step)
        return run_inner_steps(self.model, self.optimizer, batches, start_step, self.inner_steps, self.inner,
                               self.device, on_step, on_step_queued)
