"""Contribution scoring's rule: from the scores peers report to a standing per peer, and exclusion.

Pure and torch-free. The coordinator (coordinator/service.py) runs it on the scores stored with the
applied reports, the simulator (tools/sim/engine.py) in process: both exclude the same peers from the
same scores. A node's scores of round r (node/training/scoring.py): for each peer p in r's manifest,
`loss_delta` (held-out loss on the node's own data after p's update alone, minus before) and
`cosine` (p's update against the node's own update of the round, on the coordinates p sent).

Once round r's votes are in (every contributor reported, or round r+1 closed):

1. Judges. Only the reports of r's contributors count (peers whose packet is in r's manifest: the
   same reports that vote on the digest), and never a peer's score of its own update (it trained
   on that data). A key that never contributed can neither frame nor clear anyone.
2. Judgement. Each judge compares p's update with its own update of the round (the dense delta it
   trained), on the coordinates p sent: p's update is hurting when their cosine is below
   `min_cosine` (p moved those coordinates against the way the judge's own data moved them), or
   when applied alone to the round's start it raised the loss on the judge's data (which p never
   trained on) more than SEVERE_FACTOR times `max_loss_delta + loss_tolerance * g`, g the gain of
   the typical update it scored (-(median of its loss deltas)); with g <= 0 the cosine alone
   decides. A loss rise short of that condemns nobody: late in a run an honest peer whose data
   differs from the judge's raises the judge's loss for rounds running. Measured in the simulator
   (tiny, 4 peers, H = 4, 32 rounds, seeds 0-3; tools/sim/engine.py): the median judge's cosine of an
   honest update starts at +0.8..+0.9 and falls to about +0.3 by round 30; one peer's fell to -0.17
   with loss deltas of up to 4x the typical gain from round 15 on (a rule on the loss excluded it
   in every seed, and "loss up and cosine below 0" in one); a single judge's lowest was -0.25; a
   sign-flipped update's median stays at -0.64..-0.95.
3. Verdict. p hurt in round r when more than half of its judges' weight says so: the weighted
   median judgement, so one lying judge among three can neither frame an honest peer nor clear a
   harmful one. p was useful when more than half of its judges' weight found it useful: not
   hurting, and either agreeing with the judge's own update (cosine at least `useful_cosine`) or
   lowering the judge's held-out loss by at least `useful_gain` times the most any update it
   scored lowered it. The loss test is there for a judge whose own update says nothing (an empty
   one: every cosine with it is 0); an empty update lowers nobody's loss, and noise lowers it by
   far less than honest work does. A copy is never useful: an update that shares `copy_overlap`
   of its entries (position and 2-bit code) with a packet submitted before it in the round (a
   re-signed copy shares all; honest peers' updates share far fewer, though early in a run they
   pick many of the same positions: 0.55 in the mini preset after 3 inner steps) is a
   copy of that packet in the judge's finding, and the verdict names the original when more than
   half of the judges' weight found the same. Judges weigh their credit (5.)
   once any judge of the round has some; until then (a run's first rounds) each weighs one. A
   judge without credit then weighs nothing: a flood of fresh keys cannot judge. With less than
   `min_reporters` judges of weight there is no verdict. The medians of the judges' figures are
   kept for the status page.
4. Exclusion. The last `window_rounds` verdicts; a peer with `exclude_after_rounds` hurting ones
   among them is excluded from the next round on, for `exclusion_rounds` rounds (0: for good): its
   submissions are refused ("excluded"), so its packets leave the manifests. The window then starts
   afresh, so a peer whose exclusion lapsed is judged on its new rounds only. The running figures
   are exponential averages of the medians (weight `EMA_WEIGHT` on the newest round).
5. Credit: standing earned by useful work. Every key starts with none. A useful verdict adds one,
   up to `max_credit`; a verdict neither useful nor hurting (an empty update, noise, an update
   unrelated to what the judges' data wants) halves it, rounded down; a hurting one takes it all.
   Credit is a peer's weight as a judge (3.) and as a voter on the round's digest
   (coordinator/service.py, "Agreed digests"): a peer that reported a digest the credited peers
   did not compute loses it all and is excluded (`wrong_digest`). Why each parameter:
   ``useful_cosine`` 0.1 (an empty update scores 0, noise at any scale about 0 on the k
   coordinates it sends, an honest update +0.3..+0.9: measured in tools/sim/engine.py);
   ``useful_gain`` 0.25 (an empty update's loss delta is exactly 0; an honest update's, on a
   judge's data, -0.06..-0.48 in the tiny preset's first rounds, tests/integration/sybil_lab.py); halving
   rather than zeroing, so an honest peer whose data once pulled elsewhere keeps most of its
   weight; ``max_credit`` 8, so a peer that trained long is trusted more than a newcomer, but
   eight newcomers that proved useful for eight rounds weigh as much as it.

    verdicts = round_verdicts(reports, contributors, rule)     # {peer: Verdict}; judge() per judge
    standing = update_standing(standing, round, verdicts[p], rule)
    standing.exclusion(round + 1)                              # None, or why p is refused
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

EMA_WEIGHT = 0.5  # of the newest round in the running figures
SEVERE_FACTOR = 20.0  # a loss rise this many times past the bound condemns an update whatever its cosine
ExclusionCode = Literal["hurting_updates", "wrong_digest", "withheld_packets"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoringRule:
    """The run config's [scoring] section, as the rule reads it (protocol/run_config.py documents each)."""

    max_loss_delta: float = 0.0
    loss_tolerance: float = 0.5
    min_cosine: float = -0.4
    min_reporters: int = 2
    window_rounds: int = 4
    exclude_after_rounds: int = 2
    exclusion_rounds: int = 0  # 0: for good
    useful_cosine: float = 0.1
    useful_gain: float = 0.25
    max_credit: int = 8
    copy_overlap: float = 0.8

    @classmethod
    def from_section(cls, section) -> ScoringRule:
        return cls(**{name: getattr(section, name) for name in cls.__slots__})


@dataclass(frozen=True, slots=True)
class Score:
    """One judge's figures for one peer's update of a round."""

    loss_delta: float  # held-out loss after the update alone minus before; < 0 helps
    cosine: float  # with the judge's own update of the round, on this update's coordinates, in [-1, 1]
    overlap: float = 0.0  # the largest share of its positions another packet of the round also holds
    overlap_with: tuple[str, ...] = ()  # the peers whose packets share copy_overlap of them, or the one


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """The round's judgement of one peer."""

    hurt: bool | None  # None: fewer than min_reporters judges
    num_judges: int
    num_hurt: int  # judges that found it hurting
    useful: bool | None = None  # more than half of the judges' weight found it useful; None: no verdict
    num_useful: int = 0  # judges that found it useful
    copy_of: str | None = None  # more than half of the judges' weight found it a copy of this peer's packet
    loss_delta: float | None  # medians over the judges
    cosine: float | None


def judge(scores: Mapping[str, Score], rule: ScoringRule) -> dict[str, bool]:
    """One judge's findings on the updates it scored in a round (peer -> hurting). When its typical
    update did not lower the loss (a plateau: harm cannot be told from noise) the cosine alone decides."""
    gain = -_median([s.loss_delta for s in scores.values()]) if scores else 0.0
    bound = rule.max_loss_delta + rule.loss_tolerance * gain if gain > 0 else math.inf
    # A loss rise is no proof: late in a run an honest peer whose data differs from the judge's raises
    # the judge's loss for rounds running (measured up to about 4x the typical gain, its cosine drifting
    # to -0.17). Only a rise SEVERE_FACTOR times past the bound condemns by itself.
    return {peer: s.cosine < rule.min_cosine or s.loss_delta > SEVERE_FACTOR * bound for peer, s in scores.items()}


def round_verdicts(
    reports: Mapping[str, Mapping[str, Score]],
    contributors: Collection[str],
    rule: ScoringRule,
    credit: Mapping[str, int] | None = None,
    submitted: Mapping[str, float] | None = None,
) -> dict[str, Verdict]:
    """Each contributor's verdict for a round from `reports` (judge -> peer -> score): only
    contributors judge, only contributors are judged, nobody judges itself. `credit`: each judge's
    (absent: none); once a judge of the round has some, judges weigh their credit, else one each.
    `submitted`: when each contributor's submission was accepted, which tells a copy (the later of
    two packets that share `copy_overlap` of their positions) from its original."""
    credit, submitted = credit or {}, submitted or {}

    def copied(peer: str, score: Score) -> str | None:
        if score.overlap < rule.copy_overlap or peer not in submitted:
            return None
        earlier = [p for p in score.overlap_with if p in submitted and submitted[p] < submitted[peer]]
        return min(earlier, key=lambda p: (submitted[p], p), default=None)

    judges = [j for j in sorted(reports) if j in contributors]
    weighted = any(credit.get(j, 0) > 0 for j in judges)
    judged: dict[str, list[tuple[Score, bool, bool, str | None, int]]] = {peer: [] for peer in contributors}
    for judge_id in judges:
        weight = credit.get(judge_id, 0) if weighted else 1
        if weight <= 0:
            continue
        scores = {peer: s for peer, s in reports[judge_id].items() if peer != judge_id and peer in judged}
        best = max((-s.loss_delta for s in scores.values() if math.isfinite(s.loss_delta)), default=0.0)
        for peer, hurting in judge(scores, rule).items():
            copy = copied(peer, scores[peer])
            useful = (
                not hurting
                and copy is None
                and (
                    scores[peer].cosine >= rule.useful_cosine
                    or (best > 0 and scores[peer].loss_delta <= -rule.useful_gain * best)
                )
            )
            judged[peer].append((scores[peer], hurting, useful, copy, weight))
    verdicts = {}
    for peer, findings in sorted(judged.items()):
        total = sum(weight for *_, weight in findings)
        decided = len(findings) >= max(1, rule.min_reporters)
        copies: Counter[str] = Counter()
        for _, _, _, copy, weight in findings:
            if copy is not None:
                copies[copy] += weight
        original, copy_weight = max(sorted(copies.items()), key=lambda kv: kv[1], default=(None, 0))
        verdicts[peer] = Verdict(
            hurt=2 * sum(f[4] for f in findings if f[1]) > total if decided else None,
            useful=2 * sum(f[4] for f in findings if f[2]) > total if decided else None,
            num_judges=len(findings),
            num_hurt=sum(f[1] for f in findings),
            num_useful=sum(f[2] for f in findings),
            copy_of=original if decided and 2 * copy_weight > total else None,
            loss_delta=_median([s.loss_delta for s, *_ in findings]),
            cosine=_median([s.cosine for s, *_ in findings]),
        )
    return verdicts


@dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """A peer's running score and exclusion, as the coordinator stores it (JSON) and shows it."""

    num_rounds: int = 0  # rounds with a verdict
    num_hurt: int = 0  # of them, hurting (over the whole run)
    recent: tuple[int, ...] = ()  # the rounds with a verdict in the window, oldest first
    recent_hurt: tuple[int, ...] = ()  # those of them that hurt
    loss_delta: float | None = None  # running median loss delta (negative helps)
    cosine: float | None = None  # running median cosine (positive helps)
    excluded_at: int | None = None  # the round whose verdict excluded it (None: not excluded)
    excluded_until: int | None = None  # the first round it may submit to again (None with excluded_at: never)
    code: ExclusionCode | None = None
    reason: str | None = None  # for a person
    credit: int = 0  # earned by useful verdicts (rule 5): its weight as a judge and a voter
    num_useful: int = 0  # verdicts that found it useful (over the whole run)
    num_withheld_exclusions: int = 0  # times it was excluded for packets nobody could fetch (`withheld_again`)
    last_verdict: Literal["useful", "not_useful", "copy", "hurt"] | None = None

    def exclusion(self, round: int) -> str | None:
        """Why a submission to `round` is refused, or None when it is not."""
        if self.excluded_at is None or (self.excluded_until is not None and round >= self.excluded_until):
            return None
        return f"{self.code}: {self.reason}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | None) -> Standing:
        if not text:
            return cls()
        fields = json.loads(text)
        return cls(**{k: tuple(v) if k in ("recent", "recent_hurt") else v for k, v in fields.items()})


def update_standing(standing: Standing, round: int, verdict: Verdict | None, rule: ScoringRule) -> Standing:
    """The standing after round r's verdict (a round without one changes nothing). An exclusion
    that is in force is not renewed; one that lapsed may be decided again."""
    if verdict is None or verdict.hurt is None or round in standing.recent:
        return standing
    recent = (*standing.recent, round)[-rule.window_rounds :]
    recent_hurt = tuple(r for r in (*standing.recent_hurt, *([round] if verdict.hurt else [])) if r in recent)
    if verdict.hurt:
        credit, last = 0, "hurt"
    elif standing.exclusion(round + 1) is not None:  # excluded (a wrong digest, say): earns nothing meanwhile
        credit, last = 0, "useful" if verdict.useful else "copy" if verdict.copy_of else "not_useful"
    elif verdict.useful:
        credit, last = min(rule.max_credit, standing.credit + 1), "useful"
    else:
        credit, last = standing.credit // 2, "copy" if verdict.copy_of else "not_useful"
    new = replace(
        standing,
        num_rounds=standing.num_rounds + 1,
        num_hurt=standing.num_hurt + verdict.hurt,
        recent=recent,
        recent_hurt=recent_hurt,
        credit=credit,
        last_verdict=last,
        num_useful=standing.num_useful + bool(verdict.useful),
        loss_delta=_ema(standing.loss_delta, verdict.loss_delta),
        cosine=_ema(standing.cosine, verdict.cosine),
    )
    if len(recent_hurt) >= rule.exclude_after_rounds and new.exclusion(round + 1) is None:
        until = round + 1 + rule.exclusion_rounds if rule.exclusion_rounds else None
        # The window starts afresh: a peer back from an exclusion is judged on its new rounds.
        new = replace(
            new,
            recent=(),
            recent_hurt=(),
            excluded_at=round,
            excluded_until=until,
            code="hurting_updates",
            reason=(
                f"its updates hurt in {len(recent_hurt)} of its last {len(recent)} scored rounds"
                f" ({', '.join(map(str, recent_hurt))}; round {round}: {verdict.num_hurt} of {verdict.num_judges} judges,"
                f" median loss delta {verdict.loss_delta:+.4g}, cosine {verdict.cosine:+.3f})"
                + (f"; refused until round {until}" if until is not None else "; refused for the rest of the run")
            ),
        )
    return new


# A peer excluded for withholding is refused this many rounds the first time, doubled each time after.
WITHHELD_EXCLUSION_ROUNDS = 4


def withheld_again(standing: Standing, round: int, flagged_round: int) -> Standing:
    """The standing of a peer whose packet of round r was dropped as unfetchable while it was still
    flagged for one of `flagged_round` (no packet of its applied in between): excluded from round
    r+1 on for WITHHELD_EXCLUSION_ROUNDS rounds, doubled at each repeat. A flagged peer is not
    waited for, but its packets still join the manifests: a node that submits every round and
    serves nobody cost every other peer a stall time-out of waiting each round, for the whole run
    (a chaos run, tools/chaos.py `--adversary withhold`). An honest peer dropped twice running (its
    pushes failed, it was killed twice) reached nobody in those rounds anyway; it trains on, and
    its values stay in its error feedback meanwhile."""
    rounds = WITHHELD_EXCLUSION_ROUNDS * 2**standing.num_withheld_exclusions
    until = round + 1 + rounds
    return replace(
        standing,
        excluded_at=round,
        excluded_until=until,
        code="withheld_packets",
        reason=f"its packets of rounds {flagged_round} and {round} were dropped as unfetchable; refused until round {until}",
        num_withheld_exclusions=standing.num_withheld_exclusions + 1,
    )


def wrong_digest(standing: Standing, round: int, reason: str, rule: ScoringRule) -> Standing:
    """The standing of a peer that reported a digest of round r the credited peers did not compute:
    no credit, and excluded from round r+1 on for `exclusion_rounds` (0: for good), as a harmful
    peer is."""
    until = round + 1 + rule.exclusion_rounds if rule.exclusion_rounds else None
    return replace(
        standing,
        credit=0,
        recent=(),
        recent_hurt=(),
        excluded_at=round,
        excluded_until=until,
        code="wrong_digest",
        reason=reason
        + (f"; refused until round {until}" if until is not None else "; refused for the rest of the run"),
    )


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):  # a non-finite loss delta (a diverging update) is the largest
        finite += [math.inf] * (len(values) - len(finite))
    return statistics.median(finite) if finite else None


def _ema(previous: float | None, value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return previous
    return value if previous is None else EMA_WEIGHT * value + (1 - EMA_WEIGHT) * previous
