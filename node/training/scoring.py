"""Contribution scoring: how much each peer's update helps, judged by every peer on its own data.

Production SparseLoCo has a central validator that scores miners; here each node scores each
accepted packet of a round itself, after the outer step's aggregate is known:

- `loss_delta`: the loss on a small held-out batch of the node's own shard at theta_r - outer_lr
  * update_p (the peer's decoded update applied alone to the round's start), minus the loss at
  theta_r. A useful update lowers it (negative); a sign-flipped or random one raises it.
- `cosine`: the cosine between the peer's update and this node's own update of the round (its
  dense delta theta_r - theta_local) on the coordinates the peer sent. Peers training
  the same model on the same kind of data move those coordinates the same way: clearly positive
  for an honest peer, negative for a sign-flipped one, near 0 for noise. (Against the round's
  aggregate instead, every update's cosine is about its own share of it, flipped or not: sparse
  updates barely overlap.)

The node reports the scores with its applied digest; the coordinator keeps a running score per
peer from every reporter's figures and refuses the packets of a peer whose updates keep hurting
(the rule: protocol/scoring.py). Scores never change what a node applies in the round they are
computed for: the outer step stays identical on every honest peer.

The batch (`scoring_batch`) is `scoring.batch_sequences` windows of the node's own shard, drawn
for the round with a seed apart from training's: data the other peers never trained on (shards
are disjoint), so an update is judged on how it generalises. A node does not score itself, and
scores at most `scoring.max_peers_per_round` peers (`pick_peers`: a pick that rotates with the
round and the node, so every peer gets judges at any swarm size).

Cost: one forward pass on the batch for the start and one per scored peer, with one dense copy of
the parameters at a time, in no_grad. The passes run on a parameter-less copy of the model's
structure (`torch.func.functional_call`), never on the live parameters: scoring runs in a worker
thread that a cancelled round does not stop, and writing candidates into the live parameters could
leave a stale model over a snapshot loaded meanwhile.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call

from locoswarm_kernels.sparse import SparseTensor, decompress
from node.training.data import TokenDataset
from node.training.model import Transformer, lm_loss
from protocol.http import MAX_ABS_LOSS_DELTA  # reported loss deltas are clamped to it

SCORING_SEED = 0x5C0E  # added to the run's seed: scoring batches are not training's


OVERLAP_ROWS = 256  # chunk rows per tensor that index overlap samples (all when fewer)
MAX_OVERLAP_PEERS = 8  # peers one score names as sharing its positions (protocol.http's bound)


@dataclass(frozen=True, slots=True)
class PeerScore:
    loss_delta: float  # held-out loss after the peer's update alone minus before; < 0 helps
    cosine: float  # with this node's own update, on the coordinates the peer sent, in [-1, 1]
    overlap: float = 0.0  # the largest share of its positions another packet of the round also holds
    overlap_with: tuple[str, ...] = ()  # the peers whose packets share copy_overlap of them, or that one


@torch.no_grad()
def score_updates(
    model: Transformer,
    start: Mapping[str, torch.Tensor],
    updates: Mapping[str, Mapping[str, SparseTensor | torch.Tensor]],
    batch: tuple[torch.Tensor, torch.Tensor],
    outer_lr: float = 1.0,
) -> dict[str, PeerScore]:
    """Score each peer's decoded update (peer id -> name -> SparseTensor, or a dense delta). The
    cosine is taken against this node's own update: `start` minus the parameters as the call finds
    them (the trained model, before the outer step). The model itself is only read."""
    params = dict(model.named_parameters())
    loss_of = _LossOf(model)
    buffers = {f"model.{name}": b for name, b in model.named_buffers()}

    def loss(values: Mapping[str, torch.Tensor]) -> float:
        # `start` may live in host memory (the outer state's placement on CUDA): on the model's device.
        named = {f"model.{name}": values[name].to(p.device) if name in values else p for name, p in params.items()}
        return float(functional_call(loss_of, {**named, **buffers}, batch))

    loss_start = loss(start)
    scores = {}
    for peer_id in sorted(updates):
        dot, squares, reference_squares = 0.0, 0.0, 0.0
        candidate = dict(start)
        for name, sparse in updates[peer_id].items():
            dense = decompress(sparse) if isinstance(sparse, SparseTensor) else sparse
            dense = dense.to(params[name].device, torch.float32).reshape(params[name].shape)
            base = start[name].to(dense.device)
            candidate[name] = base - outer_lr * dense
            # Own update on the coordinates the peer sent (all of them for a dense delta).
            mine = base - params[name].detach()
            own = mine.to(torch.float64).reshape(dense.shape) * (dense != 0)
            dot += float((dense.double() * own).sum())
            squares += float(dense.double().square().sum())
            reference_squares += float(own.square().sum())
        loss_peer = loss(candidate)
        del candidate  # one dense copy of the parameters at a time
        norm = math.sqrt(squares) * math.sqrt(reference_squares)
        cosine = dot / norm if norm > 0 else 0.0
        finite = math.isfinite(loss_peer) and math.isfinite(loss_start)
        scores[peer_id] = PeerScore(
            loss_delta=loss_peer - loss_start if finite else math.inf, cosine=max(-1.0, min(1.0, cosine))
        )
    return scores


class _LossOf(nn.Module):
    """`lm_loss` of a copy of `model`'s structure whose parameters and buffers are on the meta
    device (no memory): `functional_call` supplies the real ones for each call, so every pass reads
    the tensors it is given and the live model is never written."""

    def __init__(self, model: Transformer):
        super().__init__()
        with torch.device("meta"):
            self.model = Transformer(model.config)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, x, y)


def score_round(
    training, start: Mapping[str, torch.Tensor], prepared, scorer_id: str, round: int, section, outer_lr: float
) -> dict[str, PeerScore]:
    """`scorer_id`'s reportable scores of round r's accepted updates (`prepared`, node/training/base.py,
    before its outer step), on its own scoring batch; `training` is its PeerTraining, `section` the
    run's [scoring]. The node (node/round/steps.py) and the simulator (tools/sim/engine.py) both call it."""
    picked = pick_peers(prepared.result.accepted, scorer_id, round, section.max_peers_per_round)
    if not picked:
        return {}
    batch = scoring_batch(
        training.shard, round, section.batch_sequences, training.inner.seq_len, training.seed, training.device
    )
    scores = score_updates(training.model, start, {p: prepared.updates[p] for p in picked}, batch, outer_lr)
    overlaps = index_overlaps(prepared.updates, picked, round, section.copy_overlap)
    return reportable({p: replace(sc, overlap=overlaps[p][0], overlap_with=overlaps[p][1]) for p, sc in scores.items()})


def index_overlaps(
    updates: Mapping[str, Mapping[str, SparseTensor | torch.Tensor]],
    picked: Collection[str],
    round: int,
    copy_overlap: float = 1.0,
) -> dict[str, tuple[float, tuple[str, ...]]]:
    """For each picked peer, the largest share of its update's entries (a position and its 2-bit code)
    that another update of the round (any in `updates`, this node's own included) also holds, and
    whose: every peer whose update shares at least `copy_overlap` (a copy of a copy shares all with
    both), else the one. A re-signed copy of another peer's packet holds all of them (1.0); honest
    updates of one round pick many of the same positions early in a run (0.55 of them in the mini
    preset after 3 inner steps) but far fewer of the same entries. The entries of up to OVERLAP_ROWS
    chunk rows per tensor are compared, the same rows for every pair (picked by the round), so the
    cost does not grow with the model. Dense updates (DiLoCo) hold every position: they are not
    compared (0.0)."""
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for peer_id, update in updates.items():
        keys = {}
        for name, sparse in update.items():
            if not isinstance(sparse, SparseTensor):
                break
            positions, codes = sparse.positions, sparse.codes
            if positions.shape[0] > OVERLAP_ROWS:
                generator = torch.Generator().manual_seed(round * 1_000_003 + len(name))
                sample = torch.randperm(positions.shape[0], generator=generator)[:OVERLAP_ROWS].sort().values
                positions, codes = positions[sample], codes[sample]
            offsets = torch.arange(positions.shape[0], dtype=torch.int64).unsqueeze(1) * (1 << 32)
            keys[name] = ((positions.to(torch.int64) + offsets) * 4 + codes.to(torch.int64)).reshape(-1)
        else:
            rows[peer_id] = keys
    out = {}
    for peer_id in picked:
        mine = rows.get(peer_id)
        shares: dict[str, float] = {}
        total = sum(len(v) for v in mine.values()) if mine else 0
        for other, theirs in sorted(rows.items()):
            if other == peer_id or not total:
                continue
            common = sum(int(torch.isin(keys, theirs[name]).sum()) for name, keys in mine.items() if name in theirs)
            shares[other] = common / total
        best = max(shares.values(), default=0.0)
        above = tuple(sorted(p for p, share in shares.items() if share >= copy_overlap))[:MAX_OVERLAP_PEERS]
        out[peer_id] = (best, (above or tuple(p for p in sorted(shares) if shares[p] == best)[:1]) if best else ())
    return out


def scoring_batch(
    shard: TokenDataset, round: int, num_sequences: int, seq_len: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round r's scoring batch from this node's shard: (B, T) inputs and targets."""
    return shard.batch(round, num_sequences, seq_len, (seed + SCORING_SEED) % 2**63, device)


def pick_peers(peer_ids: Collection[str], scorer_id: str, round: int, max_peers: int) -> list[str]:
    """The peers `scorer_id` scores in round r: all others when they are few, else `max_peers` of
    them by a hash of (round, scorer, peer), which every party can recompute."""
    others = sorted(p for p in peer_ids if p != scorer_id)
    if len(others) <= max_peers:
        return others
    rank = {p: hashlib.sha256(f"{round}:{scorer_id}:{p}".encode()).digest() for p in others}
    return sorted(sorted(others, key=rank.__getitem__)[:max_peers])


def reportable(scores: Mapping[str, PeerScore]) -> dict[str, PeerScore]:
    """Scores as the applied report carries them: finite, loss deltas within MAX_ABS_LOSS_DELTA."""
    out = {}
    for peer_id, score in scores.items():
        delta = score.loss_delta if not math.isnan(score.loss_delta) else math.inf
        cosine = score.cosine if math.isfinite(score.cosine) else 0.0
        out[peer_id] = PeerScore(
            loss_delta=max(-MAX_ABS_LOSS_DELTA, min(MAX_ABS_LOSS_DELTA, delta)),
            cosine=cosine,
            overlap=min(1.0, max(0.0, score.overlap)),
            overlap_with=score.overlap_with,
        )
    return out
