"""Contribution scores (node/training/scoring.py) on a real tiny model: a peer whose update is a
real training step's lowers the held-out loss and points along the aggregate; its sign-flipped or
random twin raises the loss or points away; scoring leaves the model's parameters as they were."""

from __future__ import annotations

import pytest
import torch

from kernels.chunking import chunk_layout
from kernels.sparse import compress
from node.training.model import build_model, lm_loss
from node.training.scoring import score_updates

pytestmark = pytest.mark.usefixtures("single_thread")


def test_honest_updates_score_better_than_flipped_and_random_ones():
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    params = dict(model.named_parameters())
    start = {n: p.detach().clone() for n, p in params.items()}
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (4, 32))
    batch = (x, torch.roll(x, -1, dims=1))  # a learnable pattern: the next token is the following input

    # One honest update: the delta of a few SGD steps on the batch's pattern (delta = start - local).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        lm_loss(model, *batch).backward()
        optimizer.step()
    delta = {n: start[n] - p.detach() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(start[n])

    def sparse(tensors):
        return {n: compress(t, chunk_layout(t.shape, top_k=512)) for n, t in tensors.items()}

    updates = {
        "honest": sparse(delta),
        "flipped": sparse({n: -d for n, d in delta.items()}),
        "random": sparse({n: torch.randn_like(d) * d.abs().mean() * 20 for n, d in delta.items()}),
    }
    aggregate = {n: d.clone() for n, d in delta.items()}
    before = {n: p.detach().clone() for n, p in params.items()}

    scores = score_updates(model, start, updates, aggregate, batch)

    assert scores["honest"].loss_delta < 0 < scores["flipped"].loss_delta
    assert scores["random"].loss_delta > scores["honest"].loss_delta
    assert scores["honest"].cosine > 0.5 and scores["flipped"].cosine < -0.5
    assert abs(scores["random"].cosine) < 0.2
    assert all(torch.equal(p, before[n]) for n, p in params.items())
