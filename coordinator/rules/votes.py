"""Agreed digests: truth by standing, not by headcount (DESIGN.md, "Agreed state").

Applied reports. After applying round r a peer reports its parameter digest for the manifest
version it applied, with the digest's hash tree (`AppliedRequest.tree`, checked to hash to it):
one report per peer, round and version, immutable (the same again is answered as the first time,
another digest is refused ``conflicting_report``; a version the round never had,
``unknown_manifest_version``). Reports of an older version are kept but do not vote. The answer
carries the round's latest version and the recent rounds that were amended, so a node that applied
an older version recomputes or catches up; with snapshots in the packet mirror, the first votes of
a due round are handed a snapshot PUT URL (rules/snapshots.py).

Votes. A report is a vote when its peer's packet is in that version of the manifest (and, with
``membership.vote_after_rounds`` K > 0, in K earlier rounds' manifests), and void (`forked`) when
none of its peer's reports of r-1 names r-1's agreed digest on r-1's latest version: it applied r
from another start (an amendment learnt late), so it neither votes nor disputes. Votes weigh
their peer's credit (protocol/scoring.py rule 5; new keys have none), so keys that sent empty
updates or noise weigh nothing. With C the credit of the round's contributors, the leading digest
is agreed once at least two votes of credit back it with more than C/2, or once the round is
settled with more than half of the credit cast (`tally`). Settled: round r + `settle_lag` has
closed, so every honest contributor has voted (it applies r before training r+1; with
``outer.overlap`` it trains r+1 first). While no contributor has credit a digest is agreed only
when every vote names it, once every contributor voted or the round settled: a dispute waits for
credit, and every round still undecided is weighed again when credit moves (`count_votes`). With
``scoring.enabled`` false it is a headcount: an operator who turns scoring off trusts every key.
Until agreed a majority is provisional. A lone contributor's vote is agreed when r+1 closes, so a
solo honest peer goes on; a round whose other contributors died before voting settles on the
votes it has. The last rounds of a run that ended (finished, or closed by its operator), which no
later close settles, settle once each of their contributors reported on the latest version, left,
or fell silent past its silence limit (`final_votes_in`; the tick weighs them, `settle_ended`).
Agreed early only, a finished run's last round whose two contributors held unequal credit, or one
of which died after the close, was never agreed: every node held the same digest, and the status
page showed the run's final state as undecided (a chaos run, 4 nodes, 30 rounds).

An agreed digest never changes: only an amendment (a new manifest version) starts a new vote. A
peer whose report on the latest version differs from the agreed digest, then or later, is excluded
(``wrong_digest``: its credit is gone, so its votes weigh nothing in every round still undecided)
and the dispute is recorded with the chunks each side's leaves differ in (coordinator/disputes.py).
Reports that are not votes count here too (a peer whose packet missed the manifest, one on
probation): every peer that applied the version from the agreed start computes the agreed digest,
so another is a lie or a fault, and a liar's first lie is its last chance to be caught (its later
reports are `forked`).
Everything that trusts a digest (the join's snapshot source, a returning peer's state,
``params_mismatch`` flags, nodes' snapshots and checkpoints) trusts the agreed one only.

Empty rounds. A closed round whose latest manifest has no entry changes no parameter, so nobody
votes on it: its majority and agreed digest are its start's, round r-1's agreed digest, set as
soon as that is known and carried through consecutive empty rounds (`agree_empty_from`). Round
0's start, the seeded initialisation, has no recorded digest: an empty round 0 gets none.

Once a round's votes are in, its contributors are judged from the scores sent with those votes
(coordinator/scoring.py), once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Sequence

from coordinator import disputes, errors, recovery, scoring
from coordinator.rules import snapshots
from coordinator.rules.context import Context
from coordinator.rules.membership import silence_limit_s
from coordinator.rules.states import ENDED_STATES
from coordinator.storage import AppliedRow, PeerRow, RoundRow, RunRow
from protocol.http import MISSING_REPORT_ROUNDS, AppliedRequest, AppliedResponse
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

# How far back a change of credit weighs the votes of undecided rounds again.
RETALLY_ROUNDS = 16
# For how long after a run ended the tick weighs its last rounds' votes (`settle_ended`).
ENDED_SETTLE_WINDOW_S = 3600.0


def record_applied(
    ctx: Context, run: RunRow, round_index: int, peer: PeerRow, request: AppliedRequest, now: float
) -> tuple[AppliedResponse, bool]:
    """Record a live member's digest after applying a version of closed round r, and count it if
    it is a vote. Returns the answer, and whether it was a new vote on r's latest version."""
    run_id, peer_id = run.run_id, peer.peer_id
    round_row = ctx.closed_round(run_id, round_index)
    latest = round_row.manifest_version
    if request.manifest_version > latest:
        raise errors.UnknownManifestVersion(
            f"round {round_index}'s manifest is at version {latest}, not {request.manifest_version}"
        )
    # Having applied round r the peer holds round r+1's start (coordinator/recovery.py: a paused
    # run whose returning peers replay the last closed round resumes once one holds its start).
    holds_next = (
        {"state_round": round_index + 1, "state_digest": request.params_digest}
        if (peer.state_round or 0) <= round_index + 1
        else {}
    )
    report = ctx.storage.get_applied(run_id, round_index, peer_id, request.manifest_version)
    if report is not None:
        if report.params_digest != request.params_digest:
            raise errors.ConflictingReport(
                f"round {round_index} version {request.manifest_version}: this peer already reported"
                f" digest {report.params_digest[:16]}; a report cannot be changed"
            )
        # A retry, or a node that replays after a restart what it reported before: answered as
        # the first, and it holds round r+1's start again.
        if holds_next:
            ctx.storage.update_peer(run_id, peer_id, **holds_next)
        return _applied_response(ctx, run_id, round_row, report), False
    vote = _is_vote(ctx, run_id, round_index, peer_id, request.manifest_version, ctx.config(run))
    refused = json.dumps(request.refused, sort_keys=True) if request.refused else None
    report = AppliedRow(
        run_id,
        round_index,
        peer_id,
        request.params_digest,
        now,
        refused,
        request.manifest_version,
        vote=int(vote),
        scores=scoring.scores_json(request),
        sample=request.sample,
        leaves=request.tree.leaves if request.tree else None,
    )
    ctx.storage.add_applied(report)
    counted = request.manifest_version == latest and vote
    if counted:
        round_row = count_votes(ctx, run_id, round_index)
    if request.val_loss is not None:
        ctx.storage.record_val_loss(run_id, round_index, peer_id, request.manifest_version, request.val_loss)
    # Having applied round r, the peer now works on round r+1: from its inner step 0 (a count
    # left from round r would read as progress in r+1), until its next heartbeat says more.
    # Unless it already said it works on a later round (with overlap it applies r after
    # training r+1): then its own word stands.
    progress = max(round_index + 1, peer.progress_round or 0)
    fields: dict = {"progress_round": progress, "detail": None, **holds_next}
    if (peer.progress_round or 0) <= round_index:
        fields |= {"activity": "applied", "inner_step": None}
    ctx.storage.update_peer(run_id, peer_id, **fields)
    response = _applied_response(ctx, run_id, round_row, report)
    if counted and (url := snapshots.put_url_for(ctx, run, round_row, report, request.snapshot_bytes)):
        response = response.model_copy(update={"snapshot_put_url": url})
    return response, counted


def _applied_response(ctx: Context, run_id: str, round_row: RoundRow, report: AppliedRow) -> AppliedResponse:
    latest = round_row.manifest_version
    majority = round_row.majority_digest
    return AppliedResponse(
        round=round_row.round,
        majority_digest=majority,
        agrees=report.manifest_version == latest and report.params_digest == majority,
        num_reports=sum(a.manifest_version == latest for a in ctx.storage.list_applied(run_id, round_row.round)),
        manifest_version=latest,
        amended=ctx.storage.amended_rounds(run_id, ctx.run(run_id).current_round - MISSING_REPORT_ROUNDS - 1),
        agreed_digest=round_row.agreed_digest,
        provisional=majority is not None and round_row.agreed_digest is None,
        num_votes=round_row.num_votes,
        vote=bool(report.vote),
    )


def _is_vote(ctx: Context, run_id: str, round_index: int, peer_id: str, version: int, config: RunConfig) -> bool:
    """Whether this peer's report of that version votes: its packet is in it (and, with
    ``membership.vote_after_rounds`` K, in K earlier rounds' manifests)."""
    if peer_id not in ctx.storage.manifest_peers(run_id, round_index, version):
        return False
    needed = config.membership.vote_after_rounds
    return needed == 0 or ctx.storage.contributed_rounds_before(run_id, peer_id, round_index) >= needed


def settle_lag(config: RunConfig) -> int:
    """How many rounds after r closes every honest contributor has applied r: 1 (a node applies r
    before it trains r+1), 2 with the one-round-delayed outer step (`outer.overlap`: a node trains
    r+1 first and applies r before it trains r+2). Settling after one round with overlap let a
    lone early vote (a peer whose packet was later dropped, racing ahead on the old manifest)
    become the agreed digest before the others had voted: they were told they had forked."""
    return 2 if config.outer.overlap else 1


def is_settled(ctx: Context, run_id: str, round_index: int) -> bool:
    """Round r is settled once round r + `settle_lag` has closed: every honest contributor has
    applied r by then, so its vote is in. So is the last closed round of a paused run: its votes
    are final from the pause on (coordinator/recovery.py), and so are those of peers that return
    and apply it during the pause, on a version amended meanwhile too. Counted unsettled, a lone
    contributor's vote on such a version was never agreed, and the run waited for ever for a peer
    holding an agreed start of its open round (a chaos run: every node killed twice around round 3,
    the gone author's entry dropped in between). And the last rounds of an ended run, once every
    contributor reported or left (`final_votes_in`)."""
    run = ctx.run(run_id)
    if run.paused_since is not None and round_index == run.current_round - 1:
        return True
    later = ctx.storage.get_round(run_id, round_index + settle_lag(ctx.config(run)))
    if later is not None and later.closed_at is not None:
        return True
    return run.state in ENDED_STATES and final_votes_in(ctx, run, round_index)


def last_closed_round(run: RunRow) -> int:
    """The last round an ended run closed: a finished run moved past it, an operator's close did not."""
    return run.current_round - 1 if run.state == "finished" else run.current_round


def final_votes_in(ctx: Context, run: RunRow, round_index: int, now: float | None = None) -> bool:
    """Whether every contributor of round r of an ended run has voted as it will: reported on r's
    latest version, left, or (with `now`) stayed silent past its silence limit. Once a run ended
    no tick marks a member gone, so a node killed after the last close stays "live"."""
    round_row = ctx.storage.get_round(run.run_id, round_index)
    if round_row is None or round_row.closed_at is None:
        return False
    version = round_row.manifest_version
    reported = {a.peer_id for a in ctx.storage.list_applied(run.run_id, round_index) if a.manifest_version == version}
    config = ctx.config(run)
    for peer_id in ctx.storage.manifest_peers(run.run_id, round_index) - reported:
        peer = ctx.storage.get_peer(run.run_id, peer_id)
        if peer is None or peer.status != "live":
            continue
        if now is None or now - peer.last_seen_at <= silence_limit_s(config, peer):
            return False
    return True


def settle_ended(ctx: Context, run: RunRow, now: float) -> None:
    """Weigh the votes of an ended run's last undecided rounds, which no later close settles, once
    their votes are in (`final_votes_in`). The tick's, for runs that ended within
    `ENDED_SETTLE_WINDOW_S`; a report or a leave counts them at once."""
    last = last_closed_round(run)
    for r in range(max(0, last - settle_lag(ctx.config(run)) + 1), last + 1):
        row = ctx.storage.get_round(run.run_id, r)
        if row is None or row.closed_at is None or row.agreed_digest is not None or not row.num_votes:
            continue
        if final_votes_in(ctx, run, r, now):
            count_votes(ctx, run.run_id, r, settled=True)
            ctx.changed.add(run.run_id)


def count_votes(ctx: Context, run_id: str, round_index: int, settled: bool = False) -> RoundRow:
    """Recount the votes on round r's latest manifest version (`_tally`), then take its
    contribution verdicts when they are due; credit they move weighs again in every round still
    undecided. `settled`: the caller knows r is settled, else it is looked up."""
    round_row, credit_moved = _tally(ctx, run_id, round_index, settled)
    if not round_row.scored and scoring.due(ctx.storage, round_row, settled or is_settled(ctx, run_id, round_index)):
        if scoring.judge_round(ctx.storage, round_row, ctx.config(ctx.run(run_id))):
            ctx.changed.add(run_id)
        credit_moved = True
    if credit_moved:  # verdicts, or a liar's exclusion: weigh the undecided rounds again
        for r in range(max(0, round_index - RETALLY_ROUNDS), round_index + 1):
            row = ctx.storage.get_round(run_id, r)
            if row is not None and row.closed_at is not None and row.agreed_digest is None and row.num_votes:
                _tally(ctx, run_id, r)
        round_row = ctx.closed_round(run_id, round_index)
    return round_row


def _tally(ctx: Context, run_id: str, round_index: int, settled: bool = False) -> tuple[RoundRow, bool]:
    """Weigh the votes on round r's latest manifest version and fix its agreed digest when it is
    due; an agreed digest is never changed here. A peer whose report (a vote or not) differs from
    the agreed digest is excluded (``wrong_digest``), and the dispute recorded. Returns the round, and whether
    it excluded anyone (their credit is gone)."""
    round_row = ctx.closed_round(run_id, round_index)  # votes are on closed rounds only
    version = round_row.manifest_version
    config = ctx.config(ctx.run(run_id))
    void = forked(ctx, run_id, round_index)
    witnesses = [  # applied this version from the agreed start: each must name the agreed digest
        a
        for a in ctx.storage.list_applied(run_id, round_index)
        if a.manifest_version == version and a.peer_id not in void
    ]
    reports = [a for a in witnesses if a.vote]
    fields: dict = {"num_votes": len(reports)}
    excluded_any = False
    contributors = ctx.storage.manifest_peers(run_id, round_index) - void
    credit = {p: c for p, c in ctx.storage.credits(run_id).items() if p in contributors}
    weighed = config.scoring.enabled
    if round_row.agreed_digest is None and reports:
        settled = settled or is_settled(ctx, run_id, round_index)
        leader, agreed = tally(
            [(a.params_digest, credit.get(a.peer_id, 0)) for a in reports],
            len(contributors),
            settled,
            round_row.majority_digest,
            sum(credit.values()) if weighed else None,
        )
        fields |= {"majority_digest": leader, "agreed_digest": agreed}
        if agreed is not None:
            backers = [a.peer_id for a in reports if a.params_digest == agreed]
            log.info(
                "run %s round %d: digest %s agreed by %d of %d vote(s) (credit %d of %d), %d contributor(s)%s",
                run_id,
                round_index,
                agreed[:16],
                len(backers),
                len(reports),
                sum(credit.get(p, 0) for p in backers),
                sum(credit.values()),
                len(contributors),
                " (settled)" if settled else "",
            )
    agreed = fields.get("agreed_digest", round_row.agreed_digest)
    if agreed is not None and weighed and any(a.params_digest != agreed for a in witnesses):
        old = disputes.load(round_row.dispute)
        if old is None or disputes.voters(old) != {a.peer_id for a in witnesses}:  # decided as first seen
            record = disputes.decide(witnesses, agreed, ctx.storage.credits(run_id), old)
            fields["dispute"] = json.dumps(record, sort_keys=True)
            for peer_id in record["excluded"]:
                scoring.exclude_for_wrong_digest(
                    ctx.storage,
                    run_id,
                    peer_id,
                    round_index,
                    disputes.reason(record, peer_id, round_index),
                    config,
                )
            ctx.changed.add(run_id)
            excluded_any = bool(record["excluded"])
    ctx.storage.update_round(run_id, round_index, **fields)
    if fields.get("agreed_digest") is not None:
        agree_empty_from(ctx, run_id, round_index + 1)
    return dataclasses.replace(round_row, **fields), excluded_any


def forked(ctx: Context, run_id: str, round_index: int) -> set[str]:
    """The peers whose reports of round r are void: none of their reports of round r-1 names its
    agreed digest on its latest manifest version, so they applied r from another start (an
    amendment they learnt of late, a wrong digest of r-1). Their reports of r neither vote nor
    dispute: a fork of an earlier round is not a lie about this one, and a liar gains nothing
    by it. Peers that did not report r-1 (they joined from a snapshot) vote."""
    previous = ctx.storage.get_round(run_id, round_index - 1) if round_index > 0 else None
    if previous is None or previous.agreed_digest is None:
        return set()
    reports: dict[str, bool] = {}
    for a in ctx.storage.list_applied(run_id, round_index - 1):
        held = a.manifest_version == previous.manifest_version and a.params_digest == previous.agreed_digest
        reports[a.peer_id] = reports.get(a.peer_id, False) or held
    return {peer_id for peer_id, held in reports.items() if not held}


def agree_empty_from(ctx: Context, run_id: str, round_index: int) -> None:
    """Closed round r, and the closed rounds after it, whose latest manifest is empty take their
    start's agreed digest: the outer step of no packet changes nothing."""
    r = round_index
    while (row := ctx.storage.get_round(run_id, r)) is not None and row.closed_at is not None:
        if row.agreed_digest is not None or ctx.storage.manifest_peers(run_id, r):
            return
        start = recovery.agreed_start(ctx.storage, run_id, r)
        if start is None:
            return
        ctx.storage.update_round(run_id, r, majority_digest=start, agreed_digest=start)
        log.info("run %s round %d: no packet in its manifest; its start's digest %s is agreed", run_id, r, start[:16])
        r += 1


def forget_empty_after(ctx: Context, run_id: str, round_index: int) -> None:
    """Round r takes a new vote (its manifest was amended): the closed empty rounds right after it,
    which took its old result as theirs (`agree_empty_from`), lose it and take the new one once
    r is agreed again."""
    r = round_index + 1
    while (row := ctx.storage.get_round(run_id, r)) is not None and row.closed_at is not None:
        if row.agreed_digest is None or ctx.storage.manifest_peers(run_id, r):
            return
        ctx.storage.update_round(run_id, r, majority_digest=None, agreed_digest=None)
        r += 1


def tally(
    votes: Sequence[tuple[str, int]],
    num_contributors: int,
    settled: bool,
    previous: str | None,
    total_credit: int | None = None,
) -> tuple[str, str | None]:
    """(majority, agreed or None) of a round's votes, (digest, its voter's credit) each. On a tie
    the previous majority stays (so it does not flip back and forth as equal counts arrive), else
    the smallest digest (deterministic).

    - `total_credit` None (scoring off): a headcount. Agreed with at least two votes and more
      than half of the contributors, which no later vote can overturn; or once the round is
      settled, with more than half of the votes cast (a lone vote too).
    - `total_credit` > 0, the credit of the round's contributors: votes weigh their credit, and
      a vote without credit weighs nothing. Agreed once at least two votes of credit back it and
      it holds more than half of `total_credit`; or once the round is settled, with more than
      half of the credit cast, and two votes of credit unless no other vote has any (an honest
      minority of one among keys without credit is agreed; one key of high credit against two
      that computed otherwise is not). While no vote of credit is in, the majority is the
      headcount's, never agreed.
    - `total_credit` 0 (no contributor has earned credit yet: a run's first rounds): agreed only
      when every vote names it, once every contributor voted (two at least) or the round
      settled (a lone vote too). A dispute waits until credit decides it (`count_votes` weighs
      undecided rounds again as credit moves): a majority of fresh keys decides nothing."""
    counts = Counter(digest for digest, _ in votes)
    weights = Counter({digest: 0 for digest in counts})
    backers = Counter()
    for digest, credit in votes:
        if total_credit and credit > 0:
            weights[digest] += credit
            backers[digest] += 1
    ranking = weights if total_credit and any(weights.values()) else counts
    top = max(ranking.values())
    leaders = sorted(digest for digest, value in ranking.items() if value == top)
    majority = previous if previous in leaders else leaders[0]
    if total_credit is None:
        count = counts[majority]
        if (count >= 2 and 2 * count > num_contributors) or (settled and 2 * count > len(votes)):
            return majority, majority
        return majority, None
    if total_credit == 0:
        everyone = len(votes) >= max(2, num_contributors)
        return majority, majority if len(counts) == 1 and (everyone or settled) else None
    weight = weights[majority]
    if backers[majority] >= 2 and 2 * weight > total_credit:
        return majority, majority
    # Once settled a lone vote of credit decides only against votes without any: one key that earned
    # more credit than the rest cannot outvote two peers that computed otherwise on its own.
    opposed = sum(weights.values()) > weight
    if settled and weight > 0 and 2 * weight > sum(weights.values()) and (backers[majority] >= 2 or not opposed):
        return majority, majority
    return majority, None
