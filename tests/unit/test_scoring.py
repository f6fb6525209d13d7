"""Contribution scores (node/training/scoring.py) on a real tiny model: a peer whose update is a
real training step's lowers the held-out loss and points along the aggregate; its sign-flipped or
random twin raises the loss or points away; scoring leaves the model's parameters as they were."""

from __future__ import annotations

import pytest
import torch

from locoswarm_kernels.chunking import chunk_layout
from locoswarm_kernels.sparse import compress
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
    delta = {n: start[n] - p.detach() for n, p in params.items()}  # the model stays trained: the judge's own

    def sparse(tensors):
        return {n: compress(t, chunk_layout(t.shape, top_k=512)) for n, t in tensors.items()}

    updates = {
        "honest": sparse(delta),
        "flipped": sparse({n: -d for n, d in delta.items()}),
        "random": sparse({n: torch.randn_like(d) * d.abs().mean() * 20 for n, d in delta.items()}),
    }
    before = {n: p.detach().clone() for n, p in params.items()}
    versions = {n: p._version for n, p in params.items()}  # bumped by any in-place write

    # The cosine is against the judge's own update: start minus the parameters the call finds.
    scores = score_updates(model, start, updates, batch)
    # Scoring only reads the live parameters: it runs in a thread a cancelled round does not stop,
    # and must never write over what the node loaded meanwhile (a snapshot, the next outer step).
    assert {n: p._version for n, p in params.items()} == versions
    model_loss = float(lm_loss(model, *batch))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(start[n])
        assert scores["honest"].loss_delta == pytest.approx(
            score_updates(model, start, {"honest": updates["honest"]}, batch)["honest"].loss_delta
        )
        for n, p in params.items():
            p.copy_(before[n])
    assert float(lm_loss(model, *batch)) == model_loss

    assert scores["honest"].loss_delta < 0 < scores["flipped"].loss_delta
    assert scores["random"].loss_delta > scores["honest"].loss_delta
    assert scores["honest"].cosine > 0.5 and scores["flipped"].cosine < -0.5
    assert abs(scores["random"].cosine) < 0.2
    assert all(torch.equal(p, before[n]) for n, p in params.items())


def test_dense_updates_score_as_their_sparse_form_does():
    """DiLoCo's dense deltas go through the same scoring as decoded sparse updates."""
    from locoswarm_kernels.sparse import decompress

    torch.manual_seed(1)
    model = build_model("tiny", seed=0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    sparse = {n: compress(torch.randn_like(t) * 1e-2, chunk_layout(t.shape, top_k=64)) for n, t in start.items()}
    dense = {n: decompress(s).reshape(start[n].shape) for n, s in sparse.items()}
    with torch.no_grad():  # the scorer's own update: half of the peer's
        for n, p in model.named_parameters():
            p.copy_(start[n] - 0.5 * dense[n])
    batch = (x, torch.roll(x, -1, dims=1))
    a = score_updates(model, start, {"p": sparse}, batch)["p"]
    b = score_updates(model, start, {"p": dense}, batch)["p"]
    assert a.loss_delta == pytest.approx(b.loss_delta, abs=1e-6) and a.cosine == pytest.approx(b.cosine, abs=1e-9)
    assert a.cosine == pytest.approx(1.0)


def test_peers_picked_for_scoring_leave_out_the_scorer_and_rotate_when_many():
    from node.training.scoring import pick_peers

    few = ["p1", "p2", "p3", "p4"]
    assert pick_peers(few, "p2", 0, 16) == ["p1", "p3", "p4"]
    many = [f"p{i:03d}" for i in range(100)]
    picks = [pick_peers(many, "p007", r, 16) for r in range(20)]
    assert all(len(p) == 16 and "p007" not in p and p == sorted(p) for p in picks)
    assert picks[0] == pick_peers(many, "p007", 0, 16)  # anyone can recompute it
    assert len({tuple(p) for p in picks}) == 20  # a new pick each round
    assert len({peer for p in picks for peer in p}) > 80  # over rounds, most peers get this judge


def test_reported_scores_are_finite_and_bounded():
    import math

    from node.training.scoring import MAX_ABS_LOSS_DELTA, PeerScore, reportable
    from protocol.http import MAX_ABS_LOSS_DELTA as WIRE_BOUND

    assert MAX_ABS_LOSS_DELTA == WIRE_BOUND
    out = reportable(
        {
            "a": PeerScore(math.inf, 0.1),
            "b": PeerScore(math.nan, math.nan),
            "c": PeerScore(-1e9, -1.0),
            "d": PeerScore(-0.25, 0.5),
        }
    )
    assert out["a"].loss_delta == out["b"].loss_delta == MAX_ABS_LOSS_DELTA and out["b"].cosine == 0.0
    assert out["c"].loss_delta == -MAX_ABS_LOSS_DELTA and out["d"] == PeerScore(-0.25, 0.5)


def test_index_overlaps_find_a_copy_and_its_copies():
    """A re-signed copy holds every entry of its original; independent top-k selections share few, and
    an update on the same positions with other codes (honest peers early in a run) is no copy."""
    from node.training.scoring import index_overlaps

    def update(seed: int):
        x = torch.randn(512, 512, generator=torch.Generator().manual_seed(seed))
        return {"w": compress(x, chunk_layout(x.shape, top_k=64))}

    updates = {"a": update(0), "b": update(1), "c": update(0), "d": update(0)}  # c and d copy a
    overlaps = index_overlaps(updates, ["a", "b", "c", "d"], round=3, copy_overlap=0.8)
    assert overlaps["c"] == (1.0, ("a", "d")) and overlaps["a"] == (1.0, ("c", "d"))
    share, peers = overlaps["b"]
    assert share < 0.1 and len(peers) == 1, overlaps["b"]

    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    flipped = {"w": compress(-x, chunk_layout(x.shape, top_k=64))}  # a's positions, every sign the other way
    assert torch.equal(flipped["w"].positions, updates["a"]["w"].positions)
    share, _ = index_overlaps({"a": updates["a"], "e": flipped}, ["e"], round=3, copy_overlap=0.8)["e"]
    assert share < 0.1, share
