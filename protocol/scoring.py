"""Contribution scoring's rule: from the scores peers report to a standing per peer, and exclusion.

Pure and torch-free. The coordinator (coordinator/service.py) runs it on the scores stored with the
applied reports, the simulator (node/round/sim.py) in process: both exclude the same peers from the
same scores. A node's scores of round r (node/training/scoring.py): for each peer p in r's manifest,
`loss_delta` (held-out loss on the node's own data after p's update alone, minus before) and
`cosine` (p's update against the round's aggregate).

Once round r's votes are in (every contributor reported, or round r+1 closed):

1. Judges. Only the reports of r's contributors count (peers whose packet is in r's manifest: the
   same reports that vote on the digest), and never a peer's score of its own update (it trained
   on that data). A key that never contributed can neither frame nor clear anyone.
2. Judgement. Each judge compares p's update with the typical update it scored in the round,
   whose gain is g = -(median of its loss deltas). With g > 0 it finds p's update hurting when
   `loss_delta > max_loss_delta + loss_tolerance * g` (applied alone to the round's start, it
   raised the loss on data p never trained on by a fair part of what a typical update lowered it)
   or when `cosine < min_cosine` (it points against the round's aggregate). With g <= 0 (updates
   do not help on its data: a plateau, where harm cannot be told from noise) it abstains. The
   loss decides in practice: sparse updates barely overlap, so every update's cosine with an
   aggregate it is part of is about its own share (near +0.5 at 4 peers, sign-flipped or not).
   Measured in the simulator (tiny, 4 peers, H = 4; node/round/sim.py): honest loss deltas start
   near -0.05..-0.2 and shrink to -0.03..+0.02 by round 12, where an honest peer's can be positive
   for two rounds running (a fixed threshold of 0 excluded one); sign-flipped ones are about the
   honest gain with the sign turned, +0.05..+0.19.
3. Verdict. p hurt in round r when more than half of its judges say so: the median judgement, so
   one lying judge among three can neither frame an honest peer nor clear a harmful one. With
   fewer than `min_reporters` judges there is no verdict. The medians of the judges' figures are
   kept for the status page.
4. Standing. The last `window_rounds` verdicts; a peer with `exclude_after_rounds` hurting ones
   among them is excluded from the next round on, for `exclusion_rounds` rounds (0: for good): its
   submissions are refused ("excluded"), so its packets leave the manifests. The window then starts
   afresh, so a peer whose exclusion lapsed is judged on its new rounds only. The running figures
   are exponential averages of the medians (weight `EMA_WEIGHT` on the newest round).

    verdicts = round_verdicts(reports, contributors, rule)     # {peer: Verdict}; judge() per judge
    standing = update_standing(standing, round, verdicts[p], rule)
    standing.exclusion(round + 1)                              # None, or why p is refused
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

EMA_WEIGHT = 0.5  # of the newest round in the running figures
ExclusionCode = Literal["hurting_updates"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoringRule:
    """The run config's [scoring] section, as the rule reads it (protocol/run_config.py documents each)."""

    max_loss_delta: float = 0.0
    loss_tolerance: float = 0.5
    min_cosine: float = -0.25
    min_reporters: int = 2
    window_rounds: int = 4
    exclude_after_rounds: int = 2
    exclusion_rounds: int = 0  # 0: for good

    @classmethod
    def from_section(cls, section) -> ScoringRule:
        return cls(**{name: getattr(section, name) for name in cls.__slots__})


@dataclass(frozen=True, slots=True)
class Score:
    """One judge's figures for one peer's update of a round."""

    loss_delta: float  # held-out loss after the update alone minus before; < 0 helps
    cosine: float  # with the round's aggregate, in [-1, 1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """The round's judgement of one peer."""

    hurt: bool | None  # None: fewer than min_reporters judges
    num_judges: int
    num_hurt: int  # judges that found it hurting
    loss_delta: float | None  # medians over the judges
    cosine: float | None


def judge(scores: Mapping[str, Score], rule: ScoringRule) -> dict[str, bool]:
    """One judge's findings on the updates it scored in a round (peer -> hurting); {} when it
    abstains (its typical update did not lower the loss)."""
    gain = -_median([s.loss_delta for s in scores.values()]) if scores else 0.0
    if not gain > 0:
        return {}
    bound = rule.max_loss_delta + rule.loss_tolerance * gain
    return {peer: s.loss_delta > bound or s.cosine < rule.min_cosine for peer, s in scores.items()}


def round_verdicts(reports: Mapping[str, Mapping[str, Score]], contributors: Collection[str],
                   rule: ScoringRule) -> dict[str, Verdict]:
    """Each contributor's verdict for a round from `reports` (judge -> peer -> score): only
    contributors judge, only contributors are judged, nobody judges itself."""
    judged: dict[str, list[tuple[Score, bool]]] = {peer: [] for peer in contributors}
    for judge_id in sorted(reports):
        if judge_id not in judged:
            continue
        scores = {peer: s for peer, s in reports[judge_id].items() if peer != judge_id and peer in judged}
        for peer, hurting in judge(scores, rule).items():
            judged[peer].append((scores[peer], hurting))
    verdicts = {}
    for peer, findings in sorted(judged.items()):
        num_hurt = sum(hurting for _, hurting in findings)
        verdicts[peer] = Verdict(
            hurt=2 * num_hurt > len(findings) if len(findings) >= max(1, rule.min_reporters) else None,
            num_judges=len(findings), num_hurt=num_hurt,
            loss_delta=_median([s.loss_delta for s, _ in findings]), cosine=_median([s.cosine for s, _ in findings]))
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
    recent = (*standing.recent, round)[-rule.window_rounds:]
    recent_hurt = tuple(r for r in (*standing.recent_hurt, *([round] if verdict.hurt else [])) if r in recent)
    new = replace(standing, num_rounds=standing.num_rounds + 1, num_hurt=standing.num_hurt + verdict.hurt,
                  recent=recent, recent_hurt=recent_hurt,
                  loss_delta=_ema(standing.loss_delta, verdict.loss_delta), cosine=_ema(standing.cosine, verdict.cosine))
    if len(recent_hurt) >= rule.exclude_after_rounds and new.exclusion(round + 1) is None:
        until = round + 1 + rule.exclusion_rounds if rule.exclusion_rounds else None
        # The window starts afresh: a peer back from an exclusion is judged on its new rounds.
        new = replace(new, recent=(), recent_hurt=(), excluded_at=round, excluded_until=until, code="hurting_updates",
                      reason=(
            f"its updates hurt in {len(recent_hurt)} of its last {len(recent)} scored rounds"
            f" ({', '.join(map(str, recent_hurt))}; round {round}: {verdict.num_hurt} of {verdict.num_judges} judges,"
            f" median loss delta {verdict.loss_delta:+.4g}, cosine {verdict.cosine:+.3f})"
            + (f"; refused until round {until}" if until is not None else "; refused for the rest of the run")))
    return new


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):  # a non-finite loss delta (a diverging update) is the largest
        finite += [math.inf] * (len(values) - len(finite))
    return statistics.median(finite) if finite else None


def _ema(previous: float | None, value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return previous
    return value if previous is None else EMA_WEIGHT * value + (1 - EMA_WEIGHT) * previous
