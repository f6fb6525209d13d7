"""The multi-peer simulator: R peers in one process, through the real codec and packet bytes.

    locoswarm sim --algos sparseloco,diloco,ddp [--json] [--peers 4 --inner-steps 15 --rounds 20]
    locoswarm sim --peers 64 --max-contributors 8,16,32,64   # bounded rounds: one sparseloco run per M
    (the command line is tools/sim/cli.py)

Each strategy trains R identical models (same seed) on R disjoint shards of the corpus:

- sparseloco / diloco: every round each peer runs H inner AdamW steps, builds its payload (a
  signed SparseLoCo packet, or the dense delta as safetensors bytes), and every peer decodes all
  payloads and applies the outer step itself. After every round the simulator asserts that all
  peers hold bit-identical parameters (parameter digest).
- ddp: the dense baseline, gradients averaged over the R peers at every inner step (one model,
  since all replicas are identical by construction).

A fault spec (`poison`, node/faults.py's grammar, e.g. "poison@factor=1000,mode=sign-flip")
arms the last peer, as `--inject` arms a node: its packets are then refused or clipped like any
other; only its packets may be refused.

Contribution scoring (`scoring`, on as in a run's default config): after each outer step every peer
scores the others' updates on a batch of its own shard (node/training/scoring.py), and the round's
verdicts and standings follow protocol/scoring.py, as the coordinator's do: a peer excluded after
round r has its packets left out from round r+1 on (the coordinator refuses its submissions). The
result lists the exclusions (`excluded`: peer -> first round left out) and the final standings.

`simulate` returns the summary; `locoswarm sim` (tools/sim/cli.py) writes it to --out with its
figure (tools/sim/plot.py) and prints a table, or one JSON object with --json.

Bounded rounds (`max_contributors`, the run config's `outer.max_contributors` M): sparseloco runs
once per value of M (results `sparseloco_m8`...; 0: `sparseloco`, every packet applied). Each round
the manifest is protocol/selection.py's pick among the submitted packets, seeded by the digest the
round started from, as the coordinator builds it; a peer left out puts its packet back into its
error buffer (`OuterStep.return_unsent`) at once, as a node does when the manifest lacks it, and
every peer applies the picked packets only. diloco and ddp always take every peer. `picks` counts
each peer's rounds in a manifest and `longest_wait_rounds` is the most rounds any peer went
unpicked in a row.

`decode_once`: each round's packets are decoded and aggregated once and the result handed to every
peer's outer step (the aggregate is a function of the packets alone), instead of once per peer; for
many peers on few cores. Every peer still commits, and the digests are still compared (this checks
the commits agree, not the decoders; scoring needs each peer's own pass and turns it off).

Bytes received per peer per round: the sizes of the round's applied payloads other than the peer's
own, averaged over peers: what fetching the manifest costs a node (nodes fetch manifest packets
only).

Bytes sent per peer per round: the packet for sparseloco; the fp32 delta for diloco; for ddp,
what a ring all-reduce of fp32 gradients sends per peer over H steps, 2 (R-1)/R * 4 * numel * H
(and receives as much).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.packet import DEFAULT_MAX_PACKET_BYTES
from protocol.run_config import RunConfig
from protocol.selection import Candidate, round_seed, select

ALGOS = ("sparseloco", "diloco", "ddp")


class SimConfig(BaseModel):
    """The simulator's settings: the swarm, and each strategy's learning rates (the paper's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algos: tuple[Literal["sparseloco", "diloco", "ddp"], ...] = Field(ALGOS, description="Strategies, in order.")
    preset: str = Field("mini", description="Model preset (node.training.model.PRESETS).")
    num_peers: int = Field(4, ge=1, le=1024, description="R, peers in the swarm.")
    inner_steps: int = Field(15, ge=1, description="H, inner steps per round.")
    num_rounds: int = Field(20, ge=1, description="Rounds; each peer's inner-step budget is rounds * H.")
    batch_size: int = Field(8, ge=1, description="Sequences per inner step per peer.")
    seq_len: int = Field(64, ge=8, description="Tokens per sequence.")
    top_k: int = Field(64, ge=1, le=4096, description="SparseLoCo: values kept per 4096-element chunk.")
    error_decay: float = Field(0.95, ge=0.0, le=1.0, description="SparseLoCo error-feedback beta.")
    overlap: bool = Field(False, description="One-round-delayed outer step.")
    aggregation: Literal["median_clip", "mean"] = Field(
        "median_clip", description="SparseLoCo: median-norm clipping per tensor, or the plain scatter-mean."
    )
    poison: str | None = Field(None, description="A poison fault spec armed in the last peer (sparseloco, diloco).")
    scoring: bool = Field(
        True,
        description="Contribution scoring and exclusion, with the run config's [scoring]"
        " defaults (sparseloco, diloco).",
    )
    sparseloco_inner_lr: float = Field(1e-3, gt=0.0, le=1.0, description="Paper: 1e-3.")
    diloco_inner_lr: float = Field(8e-4, gt=0.0, le=1.0, description="Paper: 8e-4.")
    diloco_outer_lr: float = Field(0.7, gt=0.0, le=10.0, description="Paper: 0.6..0.7, Nesterov momentum 0.9.")
    ddp_lr: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW lr of the every-step baseline.")
    warmup_fraction: float = Field(0.1, ge=0.0, le=1.0, description="Warm-up, as a fraction of the step budget.")
    eval_every_rounds: int = Field(4, ge=1, description="Rounds between validations.")
    eval_batches: int = Field(8, ge=1, description="Validation batches per evaluation.")
    seed: int = Field(0, ge=0, description="Model init and batch sampling.")
    data: str | None = Field(None, description="Corpus path; None: the Python standard library's sources.")
    vocab_size: int | None = Field(
        None,
        ge=2,
        description="Token ids the model embeds; None: the preset's, or"
        " the vocabulary tagged shards record (`locoswarm data prepare`).",
    )
    tokenizer_id: str | None = Field(None, description="The data's tokenizer; None: the one tagged shards record.")
    max_contributors: tuple[int, ...] = Field(
        (0,),
        min_length=1,
        description="Bounded rounds (outer.max_contributors M): one sparseloco run per value; 0: unbounded.",
    )
    decode_once: bool = Field(
        False,
        description="Decode and aggregate each round once for every peer (many peers, few cores); needs scoring off.",
    )
    threads: int = Field(2, ge=1, description="Torch CPU threads.")
    device: str = Field("cpu", description="Torch device.")

    @property
    def total_steps(self) -> int:
        return self.num_rounds * self.inner_steps

    @model_validator(mode="after")
    def _decode_once_without_scoring(self) -> "SimConfig":
        if self.decode_once and self.scoring:
            raise ValueError("decode_once needs scoring off: every judge scores from its own decode")
        if any(m < 0 for m in self.max_contributors):
            raise ValueError("max_contributors: give values >= 0 (0: unbounded)")
        return self

    def run_config(self, algo: str, max_contributors: int = 0) -> RunConfig:
        """The run a node would be given for `algo`: the simulator builds its peers from it."""
        lr = {"sparseloco": self.sparseloco_inner_lr, "diloco": self.diloco_inner_lr, "ddp": self.ddp_lr}[algo]
        outer = (
            {"strategy": "diloco", "lr": self.diloco_outer_lr, "momentum": 0.9, "nesterov": True}
            if algo == "diloco"
            else {
                "strategy": algo,
                "top_k": self.top_k,
                "error_decay": self.error_decay,
                "aggregation": self.aggregation,
            }
        )
        return RunConfig.model_validate(
            {
                "name": f"sim-{algo}",
                "max_rounds": self.num_rounds,
                "model": {"preset": self.preset, "seed": self.seed, "data": self.data}
                | {k: v for k in ("vocab_size", "tokenizer_id") if (v := getattr(self, k)) is not None},
                "inner": {
                    "steps": self.inner_steps,
                    "lr": lr,
                    "total_steps": self.total_steps,
                    "warmup_steps": max(1, int(self.total_steps * self.warmup_fraction)),
                    "batch_size": self.batch_size,
                    "seq_len": self.seq_len,
                },
                "outer": outer | {"overlap": self.overlap, "max_contributors": max_contributors},
                "exchange": {"max_packet_bytes": DEFAULT_MAX_PACKET_BYTES},
                "membership": {"min_peers": self.num_peers},
                "scoring": {"enabled": self.scoring},
            }
        )


@dataclass(slots=True)
class StrategyResult:
    final_val_loss: float
    tokens: int
    bytes_sent_per_peer_per_round: float
    wall_s: float
    bytes_received_per_peer_per_round: float = 0.0
    max_contributors: int = 0  # 0: every packet applied
    picks: dict[str, int] = field(default_factory=dict)  # peer id -> rounds its packet was applied
    longest_wait_rounds: int = 0  # most rounds in a row any peer's packet was not applied
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, val loss)
    digests_identical_every_round: bool = True
    refused: dict[str, list[int]] = field(default_factory=dict)  # peer id -> rounds its payload was refused
    excluded: dict[str, int] = field(default_factory=dict)  # peer id -> first round its packets were left out
    standings: dict[str, dict] = field(default_factory=dict)  # peer id -> protocol.scoring.Standing, as JSON


def _evaluate(model, corpus, cfg: SimConfig) -> float:
    from node.training.data import evaluate

    return evaluate(
        model, corpus.val, cfg.eval_batches, batch_size=cfg.batch_size, seq_len=cfg.seq_len, device=cfg.device
    )


def run_local_updates(algo: str, cfg: SimConfig, corpus, progress, max_contributors: int = 0) -> StrategyResult:
    """sparseloco or diloco: H local steps, exchange payload bytes, every peer applies the outer step.

    Each peer is built and trained as a node's is (node.training.peer.PeerTraining, from the run
    config a coordinator would hand out), and overlap follows the node's pipeline
    (node.round.overlap.Pipeline)."""
    import torch

    from node.faults import FaultInjector
    from node.round.overlap import Pipeline
    from node.training.model import build_model, model_config
    from node.training.params import flat_named_params, param_digest
    from node.training.peer import PeerTraining
    from protocol.signing import PeerKey

    run = cfg.run_config(algo, max_contributors)
    peer_ids = _peer_ids(cfg)
    keys = {p: PeerKey.from_seed(p.encode()) for p in peer_ids}
    public = {p: k.public_bytes for p, k in keys.items()}
    peers = [PeerTraining.build(run, cfg.device, corpus.train.shard(i, cfg.num_peers)) for i in range(cfg.num_peers)]
    if cfg.poison is not None:
        peers[-1] = FaultInjector.parse([cfg.poison]).wrap_training(peers[-1])
    outers = [peer.outer for peer in peers]
    result = StrategyResult(
        final_val_loss=float("nan"),
        tokens=0,
        bytes_sent_per_peer_per_round=0.0,
        wall_s=0.0,
        max_contributors=max_contributors,
    )
    scorer = _Scorer(run, peer_ids, peers, result) if run.scoring.enabled else None
    selector = _Selector(peer_ids, max_contributors, result, scorer)
    eval_model = build_model(model_config(run), cfg.seed).to(cfg.device)  # holds the global model for evaluation

    def evaluate_global() -> float:
        with torch.no_grad():
            for name, p in flat_named_params(eval_model).items():
                p.copy_(outers[0].start[name])
        return _evaluate(eval_model, corpus, cfg)

    result.curve.append((0, evaluate_global()))
    start, bytes_sent, bytes_received = time.perf_counter(), 0, 0
    digest = param_digest(peers[0].model)
    pipeline: Pipeline[dict[str, bytes]] = Pipeline(cfg.overlap)
    for r in range(cfg.num_rounds):
        for outer in outers:
            outer.begin_round()
        payloads = {}
        for peer_id, peer in zip(peer_ids, peers):
            peer.train_round(r, on_step=lambda *_: progress.update(1))
            payloads[peer_id] = peer.outer.make_payload(
                run_id="sim", round=r, peer_id=peer_id, base_digest=digest, key=keys[peer_id]
            )
            bytes_sent += len(payloads[peer_id])
        if scorer is not None:  # as the coordinator refuses an excluded peer's submission
            payloads = {p: payload for p, payload in payloads.items() if not scorer.excluded(p, r)}
        picked = selector.pick(payloads, round_seed("sim", r, digest), r)
        for index, peer_id in enumerate(peer_ids):
            if peer_id in payloads and peer_id not in picked:  # left out: its values go back, as on a node
                outers[index].return_unsent(payloads[peer_id], public[peer_id], peer_id=peer_id, run_id="sim", round=r)
        payloads = {p: payload for p, payload in payloads.items() if p in picked}
        manifest_bytes = sum(len(payload) for payload in payloads.values())
        bytes_received += sum(manifest_bytes - len(payloads.get(p, b"")) for p in peer_ids)
        if (landed := pipeline.land(r, payloads)) is not None:
            applied_round, to_apply = landed
            digest = _apply_everywhere(outers, to_apply, public, applied_round, result, cfg, scorer)
        result.tokens += cfg.num_peers * cfg.inner_steps * cfg.batch_size * cfg.seq_len
        if (r + 1) % cfg.eval_every_rounds == 0 or r + 1 == cfg.num_rounds:
            if r + 1 == cfg.num_rounds and (landed := pipeline.drain()) is not None:
                digest = _apply_everywhere(outers, landed[1], public, landed[0], result, cfg, scorer)  # after training
            result.curve.append((result.tokens, evaluate_global()))
        progress.set_postfix_str(f"{algo} round {r + 1}/{cfg.num_rounds} val {result.curve[-1][1]:.3f}")
    result.wall_s = time.perf_counter() - start
    result.final_val_loss = result.curve[-1][1]
    result.bytes_sent_per_peer_per_round = bytes_sent / (cfg.num_peers * cfg.num_rounds)
    result.bytes_received_per_peer_per_round = bytes_received / (cfg.num_peers * cfg.num_rounds)
    selector.finish(cfg.num_rounds)
    return result


def _peer_ids(cfg: SimConfig) -> list[str]:
    return [f"p{i:02d}" for i in range(cfg.num_peers)]


class _Selector:
    """Bounded rounds in the simulator: each round's manifest by protocol/selection.py, from what
    the coordinator would know (who was picked when, who is proven), and the picks' statistics."""

    def __init__(self, peer_ids: list[str], max_contributors: int, result: StrategyResult, scorer: "_Scorer | None"):
        self.peer_ids, self.max_contributors, self.result, self.scorer = peer_ids, max_contributors, result, scorer
        self.last_picked: dict[str, int | None] = {p: None for p in peer_ids}
        result.picks = {p: 0 for p in peer_ids}

    def pick(self, payloads: dict[str, bytes], seed: bytes, round: int) -> set[str]:
        candidates = [Candidate(p, self._proven(p), self._waited(p, round)) for p in self.peer_ids]
        picked = set(select(candidates, payloads.keys(), self.max_contributors, seed).picked)
        for p in picked:
            self._waited_out(p, round)
            self.last_picked[p] = round
            self.result.picks[p] += 1
        return picked

    def finish(self, num_rounds: int) -> None:
        for p in self.peer_ids:
            self._waited_out(p, num_rounds)

    def _proven(self, peer_id: str) -> bool:
        if self.last_picked[peer_id] is None:
            return False
        if self.scorer is None:
            return True
        standing = self.scorer.standings[peer_id]
        return standing.num_rounds == 0 or standing.credit > 0

    def _waited(self, peer_id: str, round: int) -> int:
        last = self.last_picked[peer_id]
        return round if last is None else round - 1 - last  # every peer is a member from round 0

    def _waited_out(self, peer_id: str, round: int) -> None:
        """Record the run of rounds `peer_id` went unpicked before `round`."""
        self.result.longest_wait_rounds = max(self.result.longest_wait_rounds, self._waited(peer_id, round))


class _Scorer:
    """Contribution scoring in the simulator: every peer scores the others' updates after each
    outer step; verdicts and standings by protocol/scoring.py, as on the coordinator."""

    def __init__(self, run: RunConfig, peer_ids: list[str], peers: list, result: StrategyResult):
        from protocol.scoring import ScoringRule, Standing

        self.section, self.rule = run.scoring, ScoringRule.from_section(run.scoring)
        self.peer_ids, self.peers, self.result = peer_ids, peers, result
        self.outer_lr = run.outer.lr
        self.standings = {p: Standing() for p in peer_ids}

    def excluded(self, peer_id: str, round: int) -> bool:
        return self.standings[peer_id].exclusion(round) is not None

    def score(self, index: int, outer, prepared, round: int) -> dict:
        """Peer `index`'s scores of the round's accepted updates, before its outer step."""
        from node.training.scoring import score_round
        from protocol.scoring import Score

        if prepared.aggregates is None:
            return {}
        scores = score_round(
            self.peers[index], outer.start, prepared, self.peer_ids[index], round, self.section, self.outer_lr
        )
        return {p: Score(s.loss_delta, s.cosine, s.overlap, s.overlap_with) for p, s in scores.items()}

    def judge(self, reports: dict, contributors: list[str], round: int) -> None:
        from protocol.scoring import round_verdicts, update_standing

        credit = {p: self.standings[p].credit for p in contributors if p in self.standings}
        for peer_id, verdict in round_verdicts(reports, contributors, self.rule, credit).items():
            was = self.standings[peer_id]
            self.standings[peer_id] = now = update_standing(was, round, verdict, self.rule)
            if now.excluded_at is not None and now.excluded_at != was.excluded_at:
                self.result.excluded[peer_id] = round + 1
        self.result.standings = {p: json.loads(s.to_json()) for p, s in self.standings.items()}


def _apply_everywhere(
    outers,
    payloads: dict[str, bytes],
    public: dict[str, bytes],
    round: int,
    result: StrategyResult,
    cfg: SimConfig,
    scorer: _Scorer | None = None,
) -> str:
    """Every peer applies the round's payloads; they must agree bit for bit on the global model
    and refuse only the poisoned peer's payload (the last peer's, when cfg.poison is set). With
    `scorer`, every peer scores the round's updates before its outer step, and the round is judged."""
    from node.training.params import param_digest

    poisoned = _peer_ids(cfg)[-1] if cfg.poison is not None else None
    reports = {}
    shared = outers[0].prepare(payloads, public.__getitem__, run_id="sim", round=round) if cfg.decode_once else None
    for index, outer in enumerate(outers):
        prepared = shared or outer.prepare(payloads, public.__getitem__, run_id="sim", round=round)
        if scorer is not None:
            reports[scorer.peer_ids[index]] = scorer.score(index, outer, prepared, round)
        applied = outer.commit(prepared)
        if set(applied.refused) - {poisoned}:
            raise RuntimeError(f"round {round}: honest packets refused: {applied.refused}")
    if scorer is not None:
        scorer.judge(reports, applied.accepted, round)
    for peer in applied.refused:
        result.refused.setdefault(peer, []).append(round)
    digests = {param_digest(outer.start) for outer in outers}
    if len(digests) != 1:
        raise RuntimeError(f"round {round}: peers diverged: {sorted(digests)}")
    return digests.pop()


def run_ddp(cfg: SimConfig, corpus, progress) -> StrategyResult:
    """Every step: each peer's gradient on its own batch, averaged (fixed order), one AdamW step."""
    import torch

    from node.training.inner import lr_at, make_inner_optimizer
    from node.training.model import autocast_for, build_model, lm_loss, model_config, num_parameters

    run = cfg.run_config("ddp")
    inner = run.inner
    model = build_model(model_config(run), cfg.seed).to(cfg.device)
    optimizer = make_inner_optimizer(model, inner)
    streams = [
        corpus.train.shard(i, cfg.num_peers).batches(cfg.batch_size, cfg.seq_len, cfg.seed, cfg.device)
        for i in range(cfg.num_peers)
    ]
    result = StrategyResult(final_val_loss=float("nan"), tokens=0, bytes_sent_per_peer_per_round=0.0, wall_s=0.0)
    result.curve.append((0, _evaluate(model, corpus, cfg)))
    start = time.perf_counter()
    for step in range(cfg.total_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, inner)
        optimizer.zero_grad(set_to_none=True)
        for stream in streams:
            x, y = next(stream)
            with autocast_for(cfg.device):
                loss = lm_loss(model, x, y) / cfg.num_peers
            loss.backward()
            progress.update(1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        optimizer.step()
        result.tokens += cfg.num_peers * cfg.batch_size * cfg.seq_len
        if (step + 1) % (cfg.eval_every_rounds * cfg.inner_steps) == 0 or step + 1 == cfg.total_steps:
            result.curve.append((result.tokens, _evaluate(model, corpus, cfg)))
            progress.set_postfix_str(f"ddp step {step + 1}/{cfg.total_steps} val {result.curve[-1][1]:.3f}")
    result.wall_s = time.perf_counter() - start
    result.final_val_loss = result.curve[-1][1]
    ring = 2 * (cfg.num_peers - 1) / cfg.num_peers
    result.bytes_sent_per_peer_per_round = ring * 4 * num_parameters(model) * cfg.inner_steps
    result.bytes_received_per_peer_per_round = result.bytes_sent_per_peer_per_round  # a ring receives what it sends
    return result


def simulate(cfg: SimConfig, show_progress: bool = True) -> dict:
    """Every strategy of `cfg` on the same model and data; the summary (`locoswarm sim` writes it
    and draws its figure: tools/sim/cli.py, tools/sim/plot.py)."""
    import torch
    from tqdm import tqdm

    from node.training.data import check_vocabulary, load_corpus
    from node.training.model import model_config

    torch.set_num_threads(cfg.threads)
    corpus = load_corpus(cfg.data)
    if corpus.train.tokenizer_id is not None and cfg.tokenizer_id is None:  # the model follows tagged shards
        cfg = cfg.model_copy(
            update={"tokenizer_id": corpus.train.tokenizer_id, "vocab_size": cfg.vocab_size or corpus.train.vocab_size}
        )
    model = model_config(cfg.run_config("sparseloco"))  # the same model for every strategy
    for data in (corpus.train, corpus.val):  # DataMismatch before any training, with what to do
        check_vocabulary(data, model.vocab_size, model.tokenizer_id)
    results = {}
    for algo, bound in _runs(cfg):
        name = algo if not bound else f"{algo}_m{bound}"
        with tqdm(
            total=cfg.num_peers * cfg.total_steps, desc=name, unit="step", disable=not show_progress, leave=False
        ) as progress:
            if algo == "ddp":
                results[name] = run_ddp(cfg, corpus, progress)
            else:
                results[name] = run_local_updates(algo, cfg, corpus, progress, bound)
    return {
        "config": cfg.model_dump(mode="json"),
        "corpus": corpus.description,
        "strategies": {a: asdict(r) for a, r in results.items()},
    }


def _runs(cfg: SimConfig) -> list[tuple[str, int]]:
    """(strategy, M) per run: sparseloco once per bound, the others once with every peer."""
    return [(algo, m) for algo in cfg.algos for m in (cfg.max_contributors if algo == "sparseloco" else (0,))]
