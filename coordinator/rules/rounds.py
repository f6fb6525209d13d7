"""Rounds and deadlines: opening, closing, submissions, the restart grace, newcomers in step.

- Round 0 opens once ``membership.min_peers`` peers are live. Round r closes at its deadline, or as
  soon as every peer it waits for has submitted (coordinator/rules/standing.py; an empty set never
  closes a round early: that would spin through empty rounds). Closing fixes the manifest, settles
  the round ``settle_lag`` before it (coordinator/rules/votes.py) and opens r+1 with a fresh
  deadline (``deadline``: fixed, or adaptive from recent submission times); the run finishes once
  ``max_rounds`` rounds have closed. A run every peer has left is paused instead, and the round
  it reopens also waits for the peers of the last closed round (coordinator/recovery.py).
- Bounded rounds (``outer.max_contributors`` M > 0, coordinator/rules/picks.py): closing also
  picks at most M of the submissions by protocol/selection.py, and the manifest holds only those;
  the others were accepted and are shown as not picked, with why. Such a round closes early once
  its picks are settled: no waited-for peer, nor proven member whose turn it is, that has not
  submitted could still take a place.
- Submissions go to the open round before its deadline, once per peer (the same digest again is
  answered as the first time; another is ``conflicting_submission``), at most
  ``exchange.max_packet_bytes``, never from an excluded peer (coordinator/scoring.py). A
  submission to a closed round is ``late`` when it is the round just closed at its deadline, else
  ``stale_round``. With a packet mirror (``exchange.mirror``), the answer to an accepted one
  carries a presigned URL to PUT exactly the submitted size into the store (coordinator/mirror.py).
- Newcomers in step. A round whose waited-for peers have all submitted stays open a little longer
  for a peer on probation that is training it right now (its heartbeat says so for this round) in
  its first ``max_missed_rounds`` rounds as a member: until the last waited-for submission plus a
  quarter of the time the round took to get there (at least 1 s), at most until the deadline.
  Without it a newcomer, which starts each round a replay behind, loses every race by a fraction
  of a second and never contributes. A key that claims to train and never submits costs each round
  at most that quarter, for its first K rounds only.
- Held for the previous round. A round at its deadline does not close while most of the previous
  round's live contributors (by credit, as votes weigh: coordinator/rules/votes.py; a headcount
  while none has any, or with scoring off) have not submitted to it and have not had a round's time
  to train it: those still on an earlier round by their heartbeats (fetching the previous round's
  packets, waiting for its amendment, catching up) are owed a round timeout from now, those that
  applied the previous round after half of this round's time had gone a round timeout from then.
  The deadline moves to when those still owed time weigh half or less. A hold never goes past the
  round's opening + two round timeouts + ``missing_grace_s`` + the nodes' default fetch time-out
  (60 s), and a peer silent for 2.5 heartbeat periods (one that was killed) is owed nothing.
  Without it one modified node that withholds its packet (or trickles it) keeps the others
  fetching until about the next round's deadline while it trains that round alone: the round
  closes with its packet alone, its lone vote is the agreed digest, a round built on it can no
  longer be amended, and the others wait for a packet nobody serves
  (tests/integration/test_held_rounds.py).
- Restart grace. Peers cannot reach a coordinator that is down, nor get anything written while its
  database fails, and that time is not theirs to answer for. ``resumed_at`` is when the service
  started (`CoordinatorService.resume`), or when it began its first transaction after the database
  failed an operation. A live peer's silence counts from max(its last sign of life, resumed_at)
  (coordinator/rules/membership.py). A round still open that opened before resumed_at gets its
  deadline moved to resumed_at + ``heartbeat_timeout_s`` if it was earlier (never earlier, written
  on the first `advance`): the peers get as long to come back and submit as they get to come back
  at all, and the round still closes early once every expected peer has submitted. Rounds opened
  after resumed_at keep their deadlines.

`advance` applies these rules at a given time. Rounds advance on the coordinator's own clock (the
service's background tick, a few times a second) and on writes; reads never advance them.
"""

from __future__ import annotations

import dataclasses
import json

from coordinator import errors, recovery, scoring
from coordinator.rules import membership, picks, standing, votes
from coordinator.rules.context import Context
from coordinator.rules.states import ACTIVE_STATES, ENDED_STATES
from coordinator.storage import PeerRow, RoundRow, RunRow, SubmissionRow
from protocol.http import SubmitRequest, SubmitResponse
from protocol.run_config import NODE_FETCH_TIMEOUT_S, RunConfig

# Newcomers in step: how long a round whose waited-for peers all submitted stays open for a peer
# on probation that trains it (see the module docstring).
NEWCOMER_GRACE_FRACTION = 0.25
NEWCOMER_GRACE_MIN_S = 1.0
NEWCOMER_STEP_STATES = frozenset({"training", "encoding", "submitting"})
# Held for the previous round: how long a node waits on a packet before it reports it missing (the
# nodes' default `fetch_timeout_s`), which a hold may add to the round's time; and the least a held
# deadline moves by, so a hold writes the round once a second, not every tick.
HELD_FETCH_S = NODE_FETCH_TIMEOUT_S
HELD_DEADLINE_STEP_S = 1.0
HELD_SILENCE_PERIODS = 2.5  # a peer silent for this many heartbeat periods holds no round (killed ones)
MAX_KEPT_TIMEOUTS = 4096  # `Context.round_timeouts` entries before it starts afresh


def advance(ctx: Context, run: RunRow, now: float) -> None:
    """Apply liveness and the round rules to `run` at `now`: mark silent peers gone, open round 0,
    pause or resume (coordinator/recovery.py), extend a deadline by the restart grace, close the
    open round when it is due."""
    if run.state not in ACTIVE_STATES:
        return
    config = ctx.config(run)
    membership.mark_silent_gone(ctx, run, config, now)
    if run.state == "waiting":
        if ctx.storage.count_live_peers(run.run_id) >= config.membership.min_peers:
            _open_round(ctx, run.run_id, 0, now, config)
            ctx.storage.update_run(run.run_id, state="running", current_round=0)
        return
    if recovery.hold(
        ctx.storage,
        run,
        config,
        now,
        lambda r: _round_timeout_s(ctx, run.run_id, r, config),
        lambda r: votes.count_votes(ctx, run.run_id, r, settled=True),
    ):
        return  # paused: every peer stopped
    run = ctx.run(run.run_id)  # a resume or rewind reopened a round
    open_round = ctx.storage.get_round(run.run_id, run.current_round)
    if open_round is None or open_round.closed_at is not None:
        raise errors.StorageError(f"run {run.run_id}: round {run.current_round} is not open")
    grace_deadline = ctx.resumed_at + config.membership.heartbeat_timeout_s
    if open_round.opened_at < ctx.resumed_at and open_round.deadline < grace_deadline:
        ctx.storage.update_round(run.run_id, open_round.round, deadline=grace_deadline)
        open_round = dataclasses.replace(open_round, deadline=grace_deadline)
    timeout_s = _timeout_of(ctx, run.run_id, open_round, config)
    held = now >= open_round.opened_at + timeout_s and _held_for_the_previous_round(
        ctx, run, open_round, config, timeout_s, now
    )
    if (now >= open_round.deadline and not held) or (
        _all_waited_submitted(ctx, run.run_id, open_round.round, config)
        and not _newcomers_in_step(ctx, run.run_id, open_round, config, now)
        and not recovery.regrouping(ctx.storage, run.run_id, open_round)
    ):
        _close_round(ctx, run, open_round, now, config)


def _timeout_of(ctx: Context, run_id: str, open_round: RoundRow, config: RunConfig) -> float:
    """`_round_timeout_s` of the open round, kept in `ctx` (it depends on earlier rounds only)."""
    key = (run_id, open_round.round, open_round.opened_at)
    if (timeout_s := ctx.round_timeouts.get(key)) is None:
        if len(ctx.round_timeouts) >= MAX_KEPT_TIMEOUTS:
            ctx.round_timeouts.clear()
        timeout_s = ctx.round_timeouts[key] = _round_timeout_s(ctx, run_id, open_round.round, config)
    return timeout_s


def _held_for_the_previous_round(
    ctx: Context, run: RunRow, open_round: RoundRow, config: RunConfig, timeout_s: float, now: float
) -> bool:
    """Whether open round r, past its own timeout (`timeout_s`), waits for round r-1's contributors that have not
    had a round's time to train it, and if so moves its deadline to when most have (see "Held for
    the previous round" above)."""
    r = open_round.round
    if r == 0:
        return False
    limit = open_round.opened_at + 2 * timeout_s + config.exchange.missing_grace_s + HELD_FETCH_S
    if now >= limit:
        return False
    contributors = ctx.storage.manifest_peers(run.run_id, r - 1)
    live = [p for p in ctx.storage.list_peers(run.run_id) if p.status == "live" and p.peer_id in contributors]
    if not live:
        return False
    submitted = {s.peer_id for s in ctx.storage.list_submissions(run.run_id, r)}
    heartbeat_timeout_s = config.membership.heartbeat_timeout_s

    def silence_s(peer: PeerRow) -> float:  # how long it may have been silent and still hold the round
        period_s = peer.heartbeat_period_s
        return min(heartbeat_timeout_s, HELD_SILENCE_PERIODS * period_s) if period_s else heartbeat_timeout_s

    # When each contributor not in yet can have had a round's time to train r: a round timeout
    # past now while it is still on an earlier round, past when it applied r-1 if that came after
    # half the round's time (its transfer took that long), else already.
    applied_at: dict[str, float] = {}
    for report in ctx.storage.list_applied(run.run_id, r - 1):
        applied_at[report.peer_id] = max(applied_at.get(report.peer_id, 0.0), report.reported_at)
    back_late = open_round.opened_at + timeout_s / 2
    needs: dict[str, float] = {}
    for p in live:
        if p.peer_id in submitted or now - p.last_seen_at > silence_s(p) or p.progress_round is None:
            continue
        if p.progress_round < r:
            needs[p.peer_id] = now + timeout_s
        elif applied_at.get(p.peer_id, 0.0) > back_late:
            needs[p.peer_id] = applied_at[p.peer_id] + timeout_s
    credit = ctx.storage.credits(run.run_id) if config.scoring.enabled else {}
    if not any(credit.get(p.peer_id, 0) for p in live):  # no credit earned yet, or scoring off: a headcount
        credit = dict.fromkeys((p.peer_id for p in live), 1)
    # The round may close once those still owed time weigh half the live contributors or less.
    half, owed, until = sum(credit.get(p.peer_id, 0) for p in live) / 2, 0.0, now
    for peer_id, at in sorted(needs.items(), key=lambda item: -item[1]):
        owed += credit.get(peer_id, 0)
        if owed > half:
            until = at
            break
    if until <= now:
        return False
    deadline = min(limit, until)
    if deadline >= open_round.deadline + HELD_DEADLINE_STEP_S:
        ctx.storage.update_round(run.run_id, r, deadline=deadline)
        ctx.changed.add(run.run_id)
    return True  # until > now, and limit > now


def _all_waited_submitted(ctx: Context, run_id: str, round_index: int, config: RunConfig) -> bool:
    """Whether every peer the round waits for submitted, or, in a bounded round, whether its picks
    are settled (coordinator/rules/picks.py)."""
    if not ctx.storage.count_submissions(run_id, round_index):
        # Most of a round, while its peers train: with nothing submitted nobody waited for has,
        # and every heartbeat asks, so the question needs no pass over the run's peers.
        return False
    window, forming = config.membership.max_missed_rounds, config.membership.min_peers
    waited = standing.waited_for(ctx.storage, run_id, round_index, window, forming)
    if not waited:
        return False
    bound = config.outer.max_contributors
    if picks.bounded(bound):  # also waits for the proven members whose turn it is
        return picks.settled(ctx.storage, run_id, round_index, bound, window, waited)
    return all(waited.values())


def _newcomers_in_step(ctx: Context, run_id: str, open_round: RoundRow, config: RunConfig, now: float) -> bool:
    """Whether the round, its waited-for peers all in, still gives a newcomer in step a moment."""
    r, window = open_round.round, config.membership.max_missed_rounds
    submissions = ctx.storage.list_submissions(run_id, r)
    submitted = {s.peer_id for s in submissions}
    in_step = [
        p
        for p in ctx.storage.list_peers(run_id)
        if p.status == "live"
        and p.peer_id not in submitted
        and p.withheld_round is None
        and p.member_since_round <= r < p.member_since_round + window
        and p.progress_round == r
        and p.activity in NEWCOMER_STEP_STATES
        and not standing.is_contributor(p, r, window)
    ]
    if not in_step:
        return False
    last_s = max(s.submitted_at for s in submissions)
    grace_s = max(NEWCOMER_GRACE_MIN_S, NEWCOMER_GRACE_FRACTION * (last_s - open_round.opened_at))
    return now < last_s + grace_s


def _open_round(ctx: Context, run_id: str, round_index: int, now: float, config: RunConfig) -> None:
    deadline = now + _round_timeout_s(ctx, run_id, round_index, config)
    ctx.storage.insert_round(RoundRow(run_id, round_index, now, deadline, None, None))
    ctx.changed.add(run_id)


def _round_timeout_s(ctx: Context, run_id: str, round_index: int, config: RunConfig) -> float:
    """The fixed timeout, or the adaptive one from recent submission times (see AdaptiveDeadline)."""
    policy = config.deadline
    if policy.kind == "fixed":
        return policy.round_timeout_s
    took_s = []
    for r in range(max(0, round_index - policy.window_rounds), round_index):
        round_row = ctx.storage.get_round(run_id, r)
        if round_row is None:
            continue
        took_s += [s.submitted_at - round_row.opened_at for s in ctx.storage.list_submissions(run_id, r)]
    if not took_s:
        return policy.initial_s
    took_s.sort()
    at_quantile = took_s[min(len(took_s) - 1, int(policy.quantile * len(took_s)))]
    return min(policy.max_s, max(policy.min_s, at_quantile * policy.margin))


def _close_round(ctx: Context, run: RunRow, open_round: RoundRow, now: float, config: RunConfig) -> None:
    ctx.storage.update_round(run.run_id, open_round.round, closed_at=now)
    picks.pick(ctx.storage, run.run_id, open_round.round, config.outer.max_contributors)
    ctx.storage.mark_contributors(run.run_id, open_round.round)
    votes.agree_empty_from(ctx, run.run_id, open_round.round)
    settled = open_round.round - votes.settle_lag(config)  # settled now
    if settled >= 0:
        votes.count_votes(ctx, run.run_id, settled, settled=True)
    next_round = open_round.round + 1
    if config.max_rounds is not None and next_round >= config.max_rounds:
        ctx.storage.update_run(run.run_id, state="finished", closed_at=now, current_round=next_round)
    else:
        _open_round(ctx, run.run_id, next_round, now, config)
        ctx.storage.update_run(run.run_id, current_round=next_round)
    ctx.changed.add(run.run_id)


def submit(
    ctx: Context, run: RunRow, round_index: int, peer: PeerRow, request: SubmitRequest, now: float
) -> SubmitResponse:
    """Accept a live member's packet digest for round r (see the module docstring)."""
    run_id, peer_id = run.run_id, peer.peer_id
    existing = ctx.storage.get_submission(run_id, round_index, peer_id)
    if existing is not None:
        if existing.packet_digest != request.packet_digest:
            raise errors.ConflictingSubmission(
                f"round {round_index} already has digest {existing.packet_digest} from this peer"
            )
        # A retried submission that already counts: answer as the first time.
        return _submit_response(ctx, run_id, round_index, peer_id)
    _check_round_accepts(ctx, run, round_index, now)
    scoring.check_submission(ctx.storage, peer, round_index)
    config = ctx.config(run)
    if request.packet_size_bytes > config.exchange.max_packet_bytes:
        raise errors.PacketTooLarge(
            f"packet of {request.packet_size_bytes} bytes exceeds exchange.max_packet_bytes"
            f" {config.exchange.max_packet_bytes}"
        )
    multiaddrs = json.dumps(request.multiaddrs) if request.multiaddrs is not None else peer.listen_multiaddrs
    ctx.storage.insert_submission(
        SubmissionRow(
            run_id=run_id,
            round=round_index,
            peer_id=peer_id,
            packet_digest=request.packet_digest,
            packet_size_bytes=request.packet_size_bytes,
            train_loss=request.train_loss,
            compute_s=request.compute_s,
            encode_s=request.encode_s,
            multiaddrs=multiaddrs,
            submitted_at=now,
        )
    )
    # "submitted" unless the peer already said it works on a later round (with overlap it
    # submits round r while it trains r+1): then its own word stands.
    ctx.storage.update_peer(
        run_id,
        peer_id,
        last_loss=request.train_loss,
        progress_round=max(round_index, peer.progress_round or 0),
        detail=None,
        **({"activity": "submitted"} if (peer.progress_round or 0) <= round_index else {}),
    )
    ctx.changed.add(run_id)
    response = _submit_response(ctx, run_id, round_index, peer_id)
    advance(ctx, run, now)  # this packet may be the last the round waits for
    return response


def _check_round_accepts(ctx: Context, run: RunRow, round_index: int, now: float) -> None:
    if run.state in ENDED_STATES:
        raise errors.RunClosed(f"run {run.run_id} is {run.state}")
    if run.state == "waiting":
        raise errors.RoundNotOpen(f"round 0 opens when {ctx.config(run).membership.min_peers} joined")
    if round_index > run.current_round:
        raise errors.FutureRound(f"round {round_index} is not open; open: {run.current_round}")
    round_row = ctx.storage.get_round(run.run_id, round_index)
    if round_row is None:
        raise errors.RoundNotFound(f"round {round_index} does not exist")
    if round_index < run.current_round:
        if round_row.closed_at is not None and round_row.closed_at >= round_row.deadline:
            if round_index == run.current_round - 1:
                raise errors.Late(f"round {round_index} closed at its deadline {now - round_row.deadline:.1f} s ago")
        raise errors.StaleRoundRefused(f"round {round_index} is closed; open: {run.current_round}")
    if now >= round_row.deadline:
        raise errors.Late(f"round {round_index}'s deadline passed")


def _submit_response(ctx: Context, run_id: str, round_index: int, peer_id: str) -> SubmitResponse:
    round_row = ctx.storage.get_round(run_id, round_index)
    assert round_row is not None  # a submission exists only for an opened round
    mirror = ctx.views.mirror_of(ctx.run(run_id))
    put_url = None
    if mirror is not None:  # the accepted submission's size is the only one the store takes
        submission = ctx.storage.get_submission(run_id, round_index, peer_id)
        assert submission is not None  # answered for an accepted submission only
        put_url = mirror.put_url(run_id, round_index, peer_id, submission.packet_size_bytes)
    return SubmitResponse(
        run_id=run_id,
        round=round_index,
        peer_id=peer_id,
        num_submitted=ctx.storage.count_submissions(run_id, round_index),
        deadline=round_row.deadline,
        mirror_put_url=put_url,
    )
