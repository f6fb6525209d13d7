"""Contribution scoring on the coordinator: stored scores -> verdicts -> standings -> exclusion.

The rule is protocol/scoring.py's (the simulator runs the same); this module reads and writes the
database around it, inside the service's transactions (coordinator/rules/votes.py and
rounds.py call it):

- `judge_round`, once per round (``rounds.scored``), when its votes are in: every contributor of
  its latest manifest version voted, or the round is settled (coordinator/rules/votes.py). The scores
  that count are those sent with votes on that version (``applied.scores``), so only contributors
  judge. Each contributor's standing (``peers.standing``) takes the round's verdict; a peer whose
  verdicts exclude it gets ``peers.excluded_round``, which the standing rule reads (coordinator/rules/
  standing.py: an excluded peer is waited for by no round).
- `check_submission`: a submission of an excluded peer is refused ``excluded`` (403), while the
  exclusion is in force; one that lapsed (``scoring.exclusion_rounds``) is cleared here and the
  submission accepted. Decision: refused rather than accepted and left out of the manifest, so that
  the manifest stays "the round's submissions less the dropped entries" everywhere (votes, standing,
  amendments), and the node learns at once why its packet is not in (node/round/steps.py applies
  the round without it and trains on, as after a late submission).

Scoring never holds up a round: a round without enough judges gives no verdict.
"""

from __future__ import annotations

import json
import logging

from coordinator import errors
from coordinator.storage import PeerRow, RoundRow, Storage
from protocol.http import AppliedRequest
from protocol.run_config import RunConfig
from protocol.scoring import Score, ScoringRule, Standing, round_verdicts, update_standing, withheld_again, wrong_digest

log = logging.getLogger("locoswarm.coordinator")


def scores_json(request: AppliedRequest) -> str | None:
    """The scores of an applied report as stored: {peer id: [loss_delta, cosine, overlap, overlap_with]}, or None."""
    if not request.scores:
        return None
    return json.dumps(
        {p: [s.loss_delta, s.cosine, s.overlap, s.overlap_with] for p, s in sorted(request.scores.items())}
    )


def due(storage: Storage, round_row: RoundRow, settled: bool) -> bool:
    """Whether round r's verdicts are due: not taken yet, and its votes are in."""
    if round_row.scored or round_row.closed_at is None:
        return False
    if settled:
        return True
    voters = {
        a.peer_id
        for a in storage.list_applied(round_row.run_id, round_row.round)
        if a.vote and a.manifest_version == round_row.manifest_version
    }
    return bool(voters) and voters >= _contributors(storage, round_row)


def judge_round(storage: Storage, round_row: RoundRow, config: RunConfig) -> dict[str, str]:
    """Take round r's verdicts into its contributors' standings (once); returns the peers it
    excluded, with why."""
    run_id, round_index = round_row.run_id, round_row.round
    storage.update_round(run_id, round_index, scored=1)
    if not config.scoring.enabled:
        return {}
    rule = ScoringRule.from_section(config.scoring)
    reports = {
        a.peer_id: {p: Score(float(v[0]), float(v[1]), *_overlap(v)) for p, v in json.loads(a.scores).items()}
        for a in storage.list_applied(run_id, round_index)
        if a.vote and a.manifest_version == round_row.manifest_version and a.scores
    }
    excluded = {}
    contributors = _contributors(storage, round_row)
    credit = {p: c for p, c in storage.credits(run_id).items() if p in contributors}
    submitted = {s.peer_id: s.submitted_at for s in storage.list_submissions(run_id, round_index)}
    for peer_id, verdict in round_verdicts(reports, contributors, rule, credit, submitted).items():
        peer = storage.get_peer(run_id, peer_id)
        if peer is None:
            continue
        standing = Standing.from_json(peer.standing)
        new = update_standing(standing, round_index, verdict, rule)
        if new == standing:
            continue
        fields: dict = {"standing": new.to_json(), "credit": new.credit}
        if new.excluded_at is not None and new.excluded_at != standing.excluded_at:
            fields["excluded_round"] = new.excluded_at
            excluded[peer_id] = new.reason
            log.warning("run %s: %s excluded after round %d: %s", run_id, peer_id, round_index, new.reason)
        storage.update_peer(run_id, peer_id, **fields)
    return excluded


def exclude_for_wrong_digest(
    storage: Storage, run_id: str, peer_id: str, round_index: int, reason: str, config: RunConfig
) -> None:
    """A contributor reported a digest of round r that the peers of credit did not compute: it loses its
    credit (so its votes weigh nothing, in round r and every round still undecided) and is excluded."""
    peer = storage.get_peer(run_id, peer_id)
    if peer is None:
        return
    standing = Standing.from_json(peer.standing)
    if standing.code == "wrong_digest" and standing.exclusion(round_index + 1) is not None:
        return
    new = wrong_digest(standing, round_index, reason, ScoringRule.from_section(config.scoring))
    storage.update_peer(run_id, peer_id, standing=new.to_json(), credit=0, excluded_round=round_index)
    log.warning("run %s: %s excluded after round %d: %s", run_id, peer_id, round_index, new.reason)


def exclude_for_withholding(storage: Storage, run_id: str, peer: PeerRow, round_index: int) -> None:
    """`peer`'s packet of round r was dropped as unfetchable while it was flagged for an earlier
    one (coordinator/rules/amendments.py): excluded for a while (protocol/scoring.py `withheld_again`),
    unless an exclusion is in force already."""
    standing = Standing.from_json(peer.standing)
    if standing.exclusion(round_index + 1) is not None or peer.withheld_round is None:
        return
    new = withheld_again(standing, round_index, peer.withheld_round)
    storage.update_peer(run_id, peer.peer_id, standing=new.to_json(), excluded_round=round_index)
    log.warning("run %s: %s excluded after round %d: %s", run_id, peer.peer_id, round_index, new.reason)


def _overlap(stored: list) -> tuple[float, tuple[str, ...]]:
    """A stored score's overlap and the peers it names (none in scores stored before they were sent)."""
    return (float(stored[2]), tuple(stored[3])) if len(stored) >= 4 else (0.0, ())


def check_submission(storage: Storage, peer: PeerRow, round_index: int) -> None:
    """Refuse a submission of a peer whose exclusion is in force; clear one that lapsed."""
    if peer.excluded_round is None:
        return
    why = Standing.from_json(peer.standing).exclusion(round_index)
    if why is not None:
        raise errors.Excluded(f"round {round_index}: {peer.peer_id} is excluded ({why})")
    storage.update_peer(peer.run_id, peer.peer_id, excluded_round=None)
    log.info("run %s: %s's exclusion lapsed; its submissions are accepted again", peer.run_id, peer.peer_id)


def _contributors(storage: Storage, round_row: RoundRow) -> set[str]:
    """The peers in round r's latest manifest version."""
    return storage.manifest_peers(round_row.run_id, round_row.round, round_row.manifest_version)
