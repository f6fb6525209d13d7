"""Runs, membership and rounds: the coordinator's rules, independent of HTTP.

Time comes from an injected clock (unix seconds) so tests can drive deadlines and liveness.
Everything is a transaction on `Storage`; nothing is kept only in memory except parsed configs.

Rules (the contract is written out in `protocol.http`):

- Round 0 opens once ``min_peers`` peers are live. Round r closes at its deadline, or as soon as
  every peer it waits for has submitted (see "Standing"; an empty set never closes a round early:
  that would spin through empty rounds). Closing fixes the manifest and opens r+1 with a fresh
  deadline; the run finishes once ``max_rounds`` rounds have closed.
- Standing (DESIGN.md, "Strangers are on probation"). A peer is on probation until one of its
  packets is in a manifest: no round waits for it, though it may submit like anyone. Round r waits
  for its contributors: the live members since r opened, not flagged ``withheld_round``, with a
  packet in the manifest of one of the ``membership.max_missed_rounds`` (K) rounds before r. A
  contributor that misses K rounds in a row is no longer waited for (it stays a member; its next
  packet in a manifest makes it a contributor again). Nor is a contributor whose updates were
  judged and earned no credit (empty, noise, copies, harm: protocol/scoring.py rule 5), while any
  contributor has credit: a key sending empty packets cannot hold rounds to their deadlines by
  skipping every other one. So a key that joins and only heartbeats, or
  stalls after contributing, costs no round its deadline. Decision for a forming swarm: while
  fewer live members are contributors than ``membership.min_peers`` (round 0, where there are
  none, so it is not closed on its first packet; a swarm whose contributors left; peers dropped as
  silent at start and back since) the round waits for every live member that was one when it
  opened, as it did before standing existed: the operator said the run needs that many peers, so
  the swarm is still forming. A silent member can thus hold rounds until their deadlines only
  while the live contributors are fewer than ``min_peers``. A peer that misses the deadline is cut
  off as before; one slower than the contributors every round stays on probation (nobody waits
  for it), the price of not letting strangers set the pace.
- Newcomers in step. Nobody waits for a peer on probation, but a round whose waited-for peers
  have all submitted stays open a little longer for one that is training it right now (its
  heartbeat says so for this round) in its first ``max_missed_rounds`` rounds as a member: until
  the last waited-for submission plus a quarter of the time the round took to get there (at
  least 1 s), at most until the deadline. Without it a newcomer, which starts each round a replay
  behind, loses every race by a fraction of a second and never contributes. A key that claims to
  train and never submits costs each round at most that quarter, for its first K rounds only.
- Agreed digests (DESIGN.md, "Agreed state"): truth by standing, not by headcount. After applying
  round r every peer reports its parameter digest for the manifest version it applied, with the
  digest's hash tree (`AppliedRequest.tree`, checked to hash to it); one report per peer, round
  and version, immutable (the same again is answered as the first time, another digest is
  refused ``conflicting_report``). A report is a vote when its peer's packet is in that version
  of the manifest (and, with ``membership.vote_after_rounds`` K > 0, in K earlier rounds'
  manifests), and void (`_forked`) when none of its peer's reports of round r-1 names r-1's
  agreed digest on r-1's latest version: it applied r from another start (an amendment learnt
  late), so it neither votes nor disputes. Votes weigh their peer's credit, standing earned by
  useful work (protocol/scoring.py, rule 5; new keys have none), so keys that sent empty updates
  or noise, however many, weigh nothing (`tally`): with C the credit of the round's contributors,
  the leading digest is agreed once at least two votes of credit back it with more than C/2 (no
  later vote can overturn that), or once the round is settled - round r+1 has closed, so every
  honest contributor has voted, since it applies r before training r+1 (r+2 with
  ``outer.overlap``, whose nodes train r+1 before applying r: `settle_lag`) - with more than half
  of the credit cast. While no contributor has credit (a run's first round, before any verdict;
  ``outer.overlap``, whose nodes judge nobody) a digest is agreed only when every vote names it,
  once every contributor voted or the round settled: a dispute waits, and credit decides it when
  the next verdicts come (`_count_votes` weighs every round still undecided again). With
  ``scoring.enabled`` false it is a headcount as before standing existed (two votes and more than
  half of the contributors, or more than half of those cast once settled): an operator who turns
  scoring off trusts every key. Until agreed a majority is provisional. A peer whose report on the
  latest version differs from the agreed digest, then or later, is excluded (`wrong_digest`: its
  credit is gone, so its votes weigh nothing in every round still undecided) and the dispute is
  recorded with the chunks each side's leaves differ in (coordinator/disputes.py). That holds for
  reports that are not votes too (a peer whose packet missed the manifest, one on probation):
  every peer that applied the version from the agreed start computes the agreed digest, so another
  one is a lie or a fault, and a liar's first lie is its last (its later reports are `_forked`). Every contributor computed the
  whole outer step from r's start and r's packets, a recomputation of every chunk: the verdict is
  that of the peers with credit. A made-up digest is backed by no peer that did useful work, so it
  is never agreed. Decision for a round with exactly one contributor: its lone vote is agreed
  when r+1 closes, so a solo honest peer goes on (it never waits for agreement) and a newcomer
  catches up from its snapshot one round later. Likewise a round whose other contributors died
  before voting settles on the votes it has. The last round of a run that ended is never settled
  (agreed early only). An agreed digest never changes: only an amendment (a new manifest
  version) starts a new vote. Everything that trusts a digest (the join's snapshot source, a
  returning peer's state, ``params_mismatch`` flags, nodes' snapshots and checkpoints) trusts the
  agreed one only. A closed round whose latest manifest has
  no entry (nobody submitted, or amendments dropped them all) changes no parameter, so nobody
  votes on it: its majority and agreed digest are its start's, round r-1's agreed digest, set as
  soon as that is known (when r closes, when an amendment empties it, or when r-1's is agreed
  later, carried on through consecutive empty rounds; `_agree_empty_from`). Round 0's start, the
  seeded initialisation, has no recorded digest: an empty round 0 gets none. Without this, a node
  whose checkpoint starts the round after an empty one could never resume from it.
- Joining (coordinator/join_guard.py). A key new to the run is rate-limited per source address and
  per run (``membership.join_rate_*``, ``join_burst*``: 429 ``rate_limited`` with Retry-After), then
  checked against the join policy and, with ``membership.join_pow_bits``, a proof of work whose
  salt this service derives per period from a per-run secret (``join_challenge``). A member rejoins
  without either.
- A peer silent for longer than ``heartbeat_timeout_s`` is marked gone, with the reason; any signed
  call counts as a sign of life. A gone or departed peer rejoins with its key and keeps its id,
  index and data shard; it is expected from the next round on.
- `advance` applies these rules for the clock's "now". Every request calls it for its run first,
  and a background task calls `tick` a few times a second, so a deadline that passes with nobody
  asking still closes the round.
- Restart grace. Peers cannot reach a coordinator that is down, nor get anything written while
  its database fails, and that time is not theirs to answer for. ``resumed_at`` is when this
  service started (`resume`), or when it began its first transaction after the database failed an
  operation (`Storage.num_failures` moved). A live peer's silence counts from
  max(its last sign of life, resumed_at): nobody is marked gone before ``heartbeat_timeout_s`` has
  passed since then. A round still open that opened before resumed_at gets its deadline moved to
  resumed_at + ``heartbeat_timeout_s`` if it was earlier (never moved earlier, written to the
  database on the first `advance`): the peers get as long to come back and submit as they get to
  come back at all, and the round still closes early once every expected peer has submitted. So a
  deadline that passed during an outage does not close the round empty at the first tick after it.
  Rounds opened after resumed_at keep their deadlines. Everything is read from the injected clock.
- Amended manifests (never forked). A closed round's manifest is version 1. A live member that
  cannot fetch some of its entries reports them (`report_missing`): only entries of that round's
  manifest, never the reporter's own, only for rounds closed at most ``MISSING_REPORT_ROUNDS``
  before the open one (older packets are forgotten by design: catch up instead), one report per
  reporter and entry (a repeat changes nothing). An author that no longer holds its own packet of
  the round (it restarted without it) says so with ``lost_own``, stored as a report of its entry
  whose reporter is the author itself. A contributor of the round that reported applying it got
  every entry still undropped (every version so far held them all) and serves its copies on; a
  stranger's applied report is not believed. A reported entry is dropped:
  1. at once when no live contributor but the author and the entry's reporters applied the
     round, and either its author said it lost it or its author is not live (gone, left). Nobody
     can serve that packet now, and nobody will: waiting helps nobody. Why: a whole swarm killed
     after a round closed (its manifest here, its packets only in the dead nodes' memory) came
     back unable to fetch them, and stuck for good. An author cannot report its own entry, so a
     lone live author's entry never met rules 2 and 3, and elsewhere the swarm waited for every
     other contributor's report, or the grace, on a packet nobody holds. Rule 1 holds however
     few peers are live, all of them authors included;
  2. when every other live contributor of the round (the latest manifest's peers but its
     publisher) has reported it;
  3. when ``exchange.missing_grace_s`` has passed since its first report (any member's) and no
     contributor but its publisher and its reporters, live or not, applied the round. One that
     did got the packet: the fault is the reporters' links, and they catch up from a snapshot
     rather than take the packet from everyone (one peer that can fetch nothing must not empty
     every manifest).
  An entry still undecided when its round falls out of the report window stays. A round older
  than the window whose state nobody agreed since (no agreed digest at or after it: the swarm was
  down for more rounds than the window, and back before its heartbeat time-out) still takes
  reports, applied at once (rule 1): amending it is the only way on. Entries due
  together make one new version: ``manifest_version`` + 1, the entries recorded in
  ``dropped_entries`` with the reason (which rule), and a new vote on the new version (majority
  and agreed digest null until its votes come; an emptied round takes its start's, see "Agreed
  digests"). The publisher is flagged (``withheld_round``): not expected in any round while
  flagged, so rounds close without waiting for it; it may still submit. The flag clears once
  another peer votes on the latest manifest of a later round that holds a packet of its (the
  swarm could fetch it again). These rules are applied on reports, before reads (`advance`) and
  by the tick (so an entry becomes due when its author times out, or the grace ends), also in
  finished runs (their last round's stragglers still apply them). Amendments never hold up
  opening or closing rounds.
- Contribution scoring (coordinator/scoring.py, the rule in protocol/scoring.py). Applied reports
  may carry the reporter's scores of the round's updates. Once a round's votes are in (every
  contributor of its latest version voted, or the round settled) its contributors are judged from
  the scores sent with those votes, once; a peer whose updates keep hurting is excluded: its
  submissions are refused ``excluded`` (so its packets leave the manifests) and no round waits
  for it, for ``scoring.exclusion_rounds`` rounds (0: the rest of the run).
- Applied reports name the manifest version they applied; a version the round never had is
  refused. Reports of an older version are kept but do not vote. The answer
  carries the round's latest version, and the recent rounds that were amended, so that a node
  that applied an older version recomputes or catches up.

`on_change(run_id)` is called after a commit that opened or closed a round, accepted a
submission or amended a manifest; the HTTP layer uses it to wake long-polls. What is read back
(status, round views, the join answer) is `coordinator.views.Views`, held as ``service.views``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from coordinator import disputes, errors, recovery, scoring
from coordinator.join_guard import JoinGuard, check_proof, period_of, salt_of
from coordinator.storage import (
    AppliedRow,
    DroppedRow,
    MissingReportRow,
    PeerRow,
    RoundRow,
    RunRow,
    Storage,
    SubmissionRow,
)
from coordinator.views import Views
from protocol.http import (
    MISSING_REPORT_ROUNDS,
    NONCE_WINDOW_S,
    AppliedRequest,
    AppliedResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinChallenge,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    LeaveResponse,
    MissingRequest,
    MissingResponse,
    SubmitRequest,
    SubmitResponse,
    peer_id_from_public_key,
)
from protocol.join_pow import JOIN_POW_PERIOD_S
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

Clock = Callable[[], float]
ACTIVE_STATES = ("waiting", "running")
NONCE_PRUNE_INTERVAL_S = 30.0
# Newcomers in step: how long a round whose waited-for peers all submitted stays open for a peer
# on probation that trains it (see the module docstring).
NEWCOMER_GRACE_FRACTION = 0.25
NEWCOMER_GRACE_MIN_S = 1.0
NEWCOMER_STEP_STATES = frozenset({"training", "encoding", "submitting"})
# How far back a change of credit weighs the votes of undecided rounds again (see "Agreed digests").
RETALLY_ROUNDS = 16


def hash_join_token(token: str) -> str:
    """Join tokens are stored as sha256 hex; 'sha256:<hex>' in a config is already hashed."""
    if token.startswith("sha256:"):
        digest = token.removeprefix("sha256:").lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise errors.InvalidConfig("a 'sha256:' join token needs 64 hex characters")
        return digest
    return hashlib.sha256(token.encode()).hexdigest()


class CoordinatorService:
    """The write side. The read side (status, round views) is `self.views`, which the rules here
    also read runs and configs through."""

    def __init__(
        self,
        storage: Storage,
        clock: Clock = time.time,
        on_change: Callable[[str], None] | None = None,
    ):
        self.storage = storage
        self.views = Views(storage)
        self.clock = clock
        self.on_change = on_change or (lambda run_id: None)
        self._changed: set[str] = set()
        self._nonces_pruned_at = 0.0
        self.resumed_at = clock()  # see "Restart grace" above; `resume` sets it again
        self._failures_seen = storage.num_failures
        self.join_guard = JoinGuard()  # rate limits of new keys, in memory (see "Joining" above)

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """A transaction whose change notifications go out only after it commits."""
        if self.storage.num_failures != self._failures_seen:
            # The database failed since our last transaction: resume counting from now.
            self._failures_seen = self.storage.num_failures
            self.resumed_at = self.clock()
        try:
            with self.storage.transaction():
                yield
        except BaseException:
            self._changed.clear()  # rolled back: nothing changed
            raise
        changed, self._changed = self._changed, set()
        for run_id in sorted(changed):
            self.on_change(run_id)

    # -- runs ---------------------------------------------------------------------------------

    def create_run(self, config: RunConfig) -> str:
        if config.membership.join_policy == "token" and not config.membership.join_tokens:
            raise errors.InvalidConfig("membership.join_policy 'token' needs at least one join token")
        token_hashes = sorted({hash_join_token(t) for t in config.membership.join_tokens})
        run_id = f"run-{secrets.token_hex(5)}"
        with self._tx():
            self.storage.insert_run(
                RunRow(
                    run_id=run_id,
                    name=config.name,
                    config_json=config.redacted().model_dump_json(),
                    join_token_hashes=json.dumps(token_hashes),
                    state="waiting",
                    created_at=self.clock(),
                    closed_at=None,
                    current_round=0,
                )
            )
            self._advance(self.views.require_run(run_id), self.clock())
        return run_id

    def close_run(self, run_id: str) -> None:
        """Stop a run: its open round closes now with what was submitted; nobody can join."""
        with self._tx():
            run = self.views.require_run(run_id)
            if run.state not in ACTIVE_STATES:
                return
            now = self.clock()
            if run.state == "running":
                self.storage.update_round(run_id, run.current_round, closed_at=now)
                self.storage.mark_contributors(run_id, run.current_round)
                if run.current_round > 0:
                    self._count_votes(run_id, run.current_round - 1, settled=True)
                self._changed.add(run_id)
            self.storage.update_run(run_id, state="closed", closed_at=now)

    # -- time ---------------------------------------------------------------------------------

    def advance(self, run_id: str) -> None:
        """Apply the rules before a read. When the database cannot take the write, the read still
        answers with what is committed: the tick retries, and the restart grace covers the gap."""
        try:
            with self._tx():
                now = self.clock()
                self._advance(self.views.require_run(run_id), now)
                for _, round_index in self.storage.rounds_with_pending_reports(MISSING_REPORT_ROUNDS, run_id):
                    self._amend(run_id, round_index, now)
        except errors.StorageUnavailable as e:
            log.debug("rules not applied to %s before a read: %s", run_id, e.detail)

    def tick(self) -> None:
        """Apply deadlines and liveness to every active run, and due amendments to every run;
        forget nonces past the window."""
        now = self.clock()
        for run_id in self.storage.active_run_ids():
            with self._tx():
                run = self.storage.get_run(run_id)
                if run is not None:
                    self._advance(run, now)
        for run_id, round_index in self.storage.rounds_with_pending_reports(MISSING_REPORT_ROUNDS):
            with self._tx():
                self._amend(run_id, round_index, now)
        if now - self._nonces_pruned_at > NONCE_PRUNE_INTERVAL_S:
            with self._tx():
                self.storage.prune_nonces(now - 2 * NONCE_WINDOW_S)
            self._nonces_pruned_at = now

    def resume(self) -> None:
        """On start: the restart grace counts from now (see the module docstring), and the rules
        are applied once, so extended deadlines are in the database before anyone asks. A database
        that fails here does not stop the start: the grace is applied when it comes back."""
        self.resumed_at = self.clock()
        self._failures_seen = self.storage.num_failures
        try:
            self.tick()
        except errors.StorageUnavailable as e:
            log.error("cannot apply deadlines and timeouts at start: %s", e.detail)

    def _advance(self, run: RunRow, now: float) -> None:
        if run.state not in ACTIVE_STATES:
            return
        config = self.views.config_of(run)
        timeout_s = config.membership.heartbeat_timeout_s
        # Every request runs this: only the candidates are read, not every peer of the run (a
        # millisecond of slack so float rounding never hides one; the exact test below decides).
        cutoff = now - timeout_s + 1e-3
        candidates = self.storage.silent_live_peers(run.run_id, cutoff) if self.resumed_at < cutoff else []
        for peer in candidates:
            silent_s = now - max(peer.last_seen_at, self.resumed_at)
            if peer.status == "live" and silent_s > timeout_s:
                since = " since the coordinator resumed" if peer.last_seen_at < self.resumed_at else ""
                self.storage.update_peer(
                    run.run_id,
                    peer.peer_id,
                    status="gone",
                    reason=f"no heartbeat for {silent_s:.0f} s{since} (timeout {timeout_s:g} s)",
                )
        if run.state == "waiting":
            num_live = self.storage.count_live_peers(run.run_id)
            if num_live >= config.membership.min_peers:
                self._open_round(run.run_id, 0, now, config)
                self.storage.update_run(run.run_id, state="running", current_round=0)
            return
        if recovery.hold(
            self.storage,
            run,
            config,
            now,
            lambda r: self._round_timeout_s(run.run_id, r, config),
            lambda r: self._count_votes(run.run_id, r, settled=True),
        ):
            return  # paused: every peer stopped (coordinator/recovery.py)
        run = self.views.require_run(run.run_id)  # a resume or rewind reopened a round
        open_round = self.storage.get_round(run.run_id, run.current_round)
        if open_round is None or open_round.closed_at is not None:
            raise errors.StorageError(f"run {run.run_id}: round {run.current_round} is not open")
        grace_deadline = self.resumed_at + timeout_s
        if open_round.opened_at < self.resumed_at and open_round.deadline < grace_deadline:
            self.storage.update_round(run.run_id, open_round.round, deadline=grace_deadline)
            open_round = dataclasses.replace(open_round, deadline=grace_deadline)
        if now >= open_round.deadline or (
            self._all_waited_submitted(run.run_id, open_round.round, config)
            and not self._newcomers_in_step(run.run_id, open_round, config, now)
        ):
            self._close_round(run, open_round, now, config)

    def _all_waited_submitted(self, run_id: str, round_index: int, config: RunConfig) -> bool:
        """Whether every peer the round waits for submitted (see "Standing" above)."""
        if not self.storage.count_submissions(run_id, round_index):
            # Most of a round, while its peers train: with nothing submitted nobody waited for has,
            # and every heartbeat asks, so the question needs no pass over the run's peers.
            return False
        membership = config.membership
        waited = self.storage.waited_for(run_id, round_index, membership.max_missed_rounds, membership.min_peers)
        return bool(waited) and all(waited.values())

    def _newcomers_in_step(self, run_id: str, open_round: RoundRow, config: RunConfig, now: float) -> bool:
        """Whether the round, its waited-for peers all in, still gives a newcomer in step a moment
        (see "Newcomers in step" above)."""
        r, window = open_round.round, config.membership.max_missed_rounds
        submissions = self.storage.list_submissions(run_id, r)
        submitted = {s.peer_id for s in submissions}
        in_step = [
            p
            for p in self.storage.list_peers(run_id)
            if p.status == "live"
            and p.peer_id not in submitted
            and p.withheld_round is None
            and p.member_since_round <= r < p.member_since_round + window
            and p.progress_round == r
            and p.activity in NEWCOMER_STEP_STATES
            and (p.last_contributed_round is None or p.last_contributed_round < r - window)
        ]
        if not in_step:
            return False
        last_s = max(s.submitted_at for s in submissions)
        grace_s = max(NEWCOMER_GRACE_MIN_S, NEWCOMER_GRACE_FRACTION * (last_s - open_round.opened_at))
        return now < last_s + grace_s

    def _open_round(self, run_id: str, round_index: int, now: float, config: RunConfig) -> None:
        deadline = now + self._round_timeout_s(run_id, round_index, config)
        self.storage.insert_round(RoundRow(run_id, round_index, now, deadline, None, None))
        self._changed.add(run_id)

    def _round_timeout_s(self, run_id: str, round_index: int, config: RunConfig) -> float:
        """The fixed timeout, or the adaptive one from recent submission times (see AdaptiveDeadline)."""
        policy = config.deadline
        if policy.kind == "fixed":
            return policy.round_timeout_s
        took_s = []
        for r in range(max(0, round_index - policy.window_rounds), round_index):
            round_row = self.storage.get_round(run_id, r)
            if round_row is None:
                continue
            took_s += [s.submitted_at - round_row.opened_at for s in self.storage.list_submissions(run_id, r)]
        if not took_s:
            return policy.initial_s
        took_s.sort()
        at_quantile = took_s[min(len(took_s) - 1, int(policy.quantile * len(took_s)))]
        return min(policy.max_s, max(policy.min_s, at_quantile * policy.margin))

    def _close_round(self, run: RunRow, open_round: RoundRow, now: float, config: RunConfig) -> None:
        self.storage.update_round(run.run_id, open_round.round, closed_at=now)
        self.storage.mark_contributors(run.run_id, open_round.round)
        self._agree_empty_from(run.run_id, open_round.round)
        settled = open_round.round - settle_lag(config)  # settled now (see "Agreed digests")
        if settled >= 0:
            self._count_votes(run.run_id, settled, settled=True)
        next_round = open_round.round + 1
        if config.max_rounds is not None and next_round >= config.max_rounds:
            self.storage.update_run(run.run_id, state="finished", closed_at=now, current_round=next_round)
        else:
            self._open_round(run.run_id, next_round, now, config)
            self.storage.update_run(run.run_id, current_round=next_round)
        self._changed.add(run.run_id)

    # -- authentication support ---------------------------------------------------------------

    def record_nonce(self, peer_id: str, nonce: int) -> None:
        """Refuse a nonce outside the time window or already used by this peer."""
        now = self.clock()
        if abs(nonce / 1e9 - now) > NONCE_WINDOW_S:
            raise errors.StaleNonce(
                f"nonce is {nonce / 1e9 - now:+.0f} s from server time"
                f" (window +-{NONCE_WINDOW_S:g} s); check the peer's clock"
            )
        with self._tx():
            if not self.storage.add_nonce(peer_id, nonce, now):
                raise errors.ReplayedNonce("this nonce was already used by this peer")

    # -- membership ---------------------------------------------------------------------------

    def join(self, run_id: str, signer_id: str, request: JoinRequest, source: str | None = None) -> JoinResponse:
        """Join or rejoin; `source` is the caller's address, for the rate limit of new keys."""
        public_key = bytes.fromhex(request.public_key)
        peer_id = peer_id_from_public_key(public_key)
        if signer_id != peer_id:
            raise errors.PeerMismatch("the join must be signed by the key it registers")
        now = self.clock()
        with self._tx():
            run = self.views.require_run(run_id)
            self._advance(run, now)
            run = self.views.require_run(run_id)
            if run.state not in ACTIVE_STATES:
                raise errors.RunClosed(f"run {run_id} is {run.state}")
            existing = self.storage.get_peer(run_id, peer_id)
            membership = self.views.config_of(run).membership
            if existing is None:  # a new key pays its way in (see "Joining" above); members rejoin freely
                self.join_guard.admit(run_id, membership, source, now)
            self._check_join_token(run, request.join_token)
            if existing is None and membership.join_pow_bits:
                check_proof(
                    self._join_secret(run),
                    run_id,
                    request.public_key,
                    membership.join_pow_bits,
                    request.pow_salt,
                    request.pow_nonce,
                    now,
                )
            # A member from the round after the open one: it cannot have theta_r in time, unless it
            # says it holds exactly the agreed start of the open round (its own checkpoint).
            first_round = run.current_round + (1 if run.state == "running" else 0)
            if run.state == "running" and self._holds_open_round_start(run, request):
                first_round = run.current_round
            addrs = json.dumps(request.listen_multiaddrs)
            if existing is None:
                self.storage.insert_peer(
                    PeerRow(
                        run_id=run_id,
                        peer_id=peer_id,
                        public_key=request.public_key,
                        peer_index=self.storage.next_peer_index(run_id),
                        status="live",
                        reason=None,
                        activity="joining",
                        device=request.device,
                        listen_multiaddrs=addrs,
                        bandwidth_mbps=request.bandwidth_mbps,
                        last_loss=None,
                        joined_at=now,
                        last_seen_at=now,
                        member_since_round=first_round,
                        progress_round=None,
                        uplink_mbps=request.uplink_mbps,
                        state_round=request.state_round,
                        state_digest=request.state_digest,
                    )
                )
            else:
                rejoining = existing.status != "live"
                self.storage.update_peer(
                    run_id,
                    peer_id,
                    status="live",
                    reason=None,
                    activity="joining",
                    device=request.device,
                    listen_multiaddrs=addrs,
                    bandwidth_mbps=request.bandwidth_mbps,
                    uplink_mbps=request.uplink_mbps,
                    last_seen_at=now,
                    member_since_round=first_round if rejoining else existing.member_since_round,
                    state_round=request.state_round,
                    state_digest=request.state_digest,
                )
            self._advance(self.views.require_run(run_id), now)
            return self.views.join_response(self.views.require_run(run_id), peer_id)

    def _holds_open_round_start(self, run: RunRow, request: JoinRequest) -> bool:
        """Whether a joining peer's stated state is the agreed start of the run's open round."""
        if request.state_round is None or request.state_round != run.current_round:
            return False
        previous = self.storage.get_round(run.run_id, run.current_round - 1)
        return previous is not None and previous.agreed_digest == request.state_digest

    def join_challenge(self, run_id: str) -> JoinChallenge:
        """The proof of work a new key solves before it joins (protocol/join_pow.py); bits 0 and
        an empty salt when the run asks for none."""
        now = self.clock()
        with self._tx():
            run = self.views.require_run(run_id)
            bits = self.views.config_of(run).membership.join_pow_bits
            secret = self._join_secret(run) if bits else ""
        period = period_of(now)
        return JoinChallenge(
            run_id=run_id,
            bits=bits,
            salt=salt_of(secret, run_id, period) if bits else "",
            expires_at=(period + 2) * JOIN_POW_PERIOD_S,
        )

    def _join_secret(self, run: RunRow) -> str:
        """The run's secret for proof-of-work salts, made on first need (runs stored before it have none)."""
        if run.join_secret:
            return run.join_secret
        secret = secrets.token_hex(32)
        self.storage.update_run(run.run_id, join_secret=secret)
        run.join_secret = secret
        return secret

    def _check_join_token(self, run: RunRow, token: str | None) -> None:
        if self.views.config_of(run).membership.join_policy == "open":
            return
        if token is None:
            raise errors.JoinRefused("this run needs a join token")
        if hashlib.sha256(token.encode()).hexdigest() not in json.loads(run.join_token_hashes):
            raise errors.JoinRefused("the join token is not valid for this run")

    def heartbeat(self, run_id: str, peer_id: str, request: HeartbeatRequest) -> HeartbeatResponse:
        with self._tx():
            run = self.views.require_run(run_id)
            self._advance(run, self.clock())
            self._require_live_member(run_id, peer_id)
            # inner_step always: a step count left from an older round would read as progress in this one.
            fields: dict = {
                "activity": request.state,
                "progress_round": request.round,
                "inner_step": request.inner_step,
                "detail": request.detail,
            }
            if request.bandwidth_mbps is not None:
                fields["bandwidth_mbps"] = request.bandwidth_mbps
            if request.train_loss is not None:
                fields["last_loss"] = request.train_loss
            if request.listen_multiaddrs is not None:
                fields["listen_multiaddrs"] = json.dumps(request.listen_multiaddrs)
            self.storage.update_peer(run_id, peer_id, **fields)
            run = self.views.require_run(run_id)
            round_row = self.storage.get_round(run_id, run.current_round)
            round_state = "pending" if round_row is None else ("closed" if round_row.closed_at is not None else "open")
            return HeartbeatResponse(
                run_state=run.state,
                current_round=run.current_round,
                round_state=round_state,
                deadline=round_row.deadline if round_row else None,
            )

    def leave(self, run_id: str, peer_id: str, request: LeaveRequest) -> LeaveResponse:
        with self._tx():
            run = self.views.require_run(run_id)
            self._require_live_member(run_id, peer_id)
            self.storage.update_peer(run_id, peer_id, status="left", reason=f"left: {request.reason}", activity="left")
            # Its departure may leave everyone else expected in the round already submitted.
            self._advance(run, self.clock())
        return LeaveResponse(peer_id=peer_id, status="left")

    def _require_live_member(self, run_id: str, peer_id: str) -> PeerRow:
        """The caller's membership; any signed call also counts as a sign of life."""
        peer = self.storage.get_peer(run_id, peer_id)
        if peer is None:
            raise errors.NotMember(f"peer {peer_id} has not joined run {run_id}")
        if peer.status != "live":
            raise errors.PeerGone(f"peer {peer_id} is {peer.status} ({peer.reason}); rejoin")
        self.storage.update_peer(run_id, peer_id, last_seen_at=self.clock())
        return peer

    # -- rounds -------------------------------------------------------------------------------

    def submit(self, run_id: str, round_index: int, peer_id: str, request: SubmitRequest) -> SubmitResponse:
        if request.peer_id is not None and request.peer_id != peer_id:
            raise errors.PeerMismatch(f"peer {peer_id} cannot submit for {request.peer_id}")
        now = self.clock()
        with self._tx():
            run = self.views.require_run(run_id)
            self._advance(run, now)
            run = self.views.require_run(run_id)
            peer = self._require_live_member(run_id, peer_id)
            existing = self.storage.get_submission(run_id, round_index, peer_id)
            if existing is not None:
                if existing.packet_digest != request.packet_digest:
                    raise errors.ConflictingSubmission(
                        f"round {round_index} already has digest {existing.packet_digest} from this peer"
                    )
                # A retried submission that already counts: answer as the first time.
                return self._submit_response(run_id, round_index, peer_id)
            self._check_round_accepts(run, round_index, now)
            scoring.check_submission(self.storage, peer, round_index)
            config = self.views.config_of(run)
            if request.packet_size_bytes > config.exchange.max_packet_bytes:
                raise errors.PacketTooLarge(
                    f"packet of {request.packet_size_bytes} bytes exceeds exchange.max_packet_bytes"
                    f" {config.exchange.max_packet_bytes}"
                )
            multiaddrs = json.dumps(request.multiaddrs) if request.multiaddrs is not None else peer.listen_multiaddrs
            self.storage.insert_submission(
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
            self.storage.update_peer(
                run_id,
                peer_id,
                last_loss=request.train_loss,
                progress_round=max(round_index, peer.progress_round or 0),
                detail=None,
                **({"activity": "submitted"} if (peer.progress_round or 0) <= round_index else {}),
            )
            self._changed.add(run_id)
            response = self._submit_response(run_id, round_index, peer_id)
            self._advance(run, now)
            return response

    def _check_round_accepts(self, run: RunRow, round_index: int, now: float) -> None:
        if run.state in ("finished", "closed"):
            raise errors.RunClosed(f"run {run.run_id} is {run.state}")
        if run.state == "waiting":
            raise errors.RoundNotOpen(f"round 0 opens when {self.views.config_of(run).membership.min_peers} joined")
        if round_index > run.current_round:
            raise errors.FutureRound(f"round {round_index} is not open; open: {run.current_round}")
        round_row = self.storage.get_round(run.run_id, round_index)
        if round_row is None:
            raise errors.RoundNotFound(f"round {round_index} does not exist")
        if round_index < run.current_round:
            if round_row.closed_at is not None and round_row.closed_at >= round_row.deadline:
                if round_index == run.current_round - 1:
                    raise errors.Late(
                        f"round {round_index} closed at its deadline {now - round_row.deadline:.1f} s ago"
                    )
            raise errors.StaleRoundRefused(f"round {round_index} is closed; open: {run.current_round}")
        if now >= round_row.deadline:
            raise errors.Late(f"round {round_index}'s deadline passed")

    def _submit_response(self, run_id: str, round_index: int, peer_id: str) -> SubmitResponse:
        round_row = self.storage.get_round(run_id, round_index)
        assert round_row is not None  # a submission exists only for an opened round
        return SubmitResponse(
            run_id=run_id,
            round=round_index,
            peer_id=peer_id,
            num_submitted=self.storage.count_submissions(run_id, round_index),
            deadline=round_row.deadline,
        )

    def applied(self, run_id: str, round_index: int, peer_id: str, request: AppliedRequest) -> AppliedResponse:
        """Record a peer's parameter digest after applying a version of round r's manifest (once
        per version: a report is immutable) and count it if it is a vote (see "Agreed digests")."""
        now = self.clock()
        with self._tx():
            run = self.views.require_run(run_id)
            self._advance(run, now)
            peer = self._require_live_member(run_id, peer_id)
            round_row = self._closed_round(run_id, round_index)
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
            report = self.storage.get_applied(run_id, round_index, peer_id, request.manifest_version)
            if report is not None:
                if report.params_digest != request.params_digest:
                    raise errors.ConflictingReport(
                        f"round {round_index} version {request.manifest_version}: this peer already reported"
                        f" digest {report.params_digest[:16]}; a report cannot be changed"
                    )
                # A retry, or a node that replays after a restart what it reported before: answered as
                # the first, and it holds round r+1's start again.
                if holds_next:
                    self.storage.update_peer(run_id, peer_id, **holds_next)
                return self._applied_response(run_id, round_row, report)
            vote = self._is_vote(run_id, round_index, peer_id, request.manifest_version, self.views.config_of(run))
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
            self.storage.add_applied(report)
            if request.manifest_version == latest and vote:
                round_row = self._count_votes(run_id, round_index)
                self._clear_withheld(run_id, round_index, peer_id)
            if request.val_loss is not None:
                self.storage.record_val_loss(run_id, round_index, peer_id, request.manifest_version, request.val_loss)
            # Having applied round r, the peer now works on round r+1: from its inner step 0 (a count
            # left from round r would read as progress in r+1), until its next heartbeat says more.
            # Unless it already said it works on a later round (with overlap it applies r after
            # training r+1): then its own word stands.
            progress = max(round_index + 1, peer.progress_round or 0)
            fields: dict = {"progress_round": progress, "detail": None, **holds_next}
            if (peer.progress_round or 0) <= round_index:
                fields |= {"activity": "applied", "inner_step": None}
            self.storage.update_peer(run_id, peer_id, **fields)
            return self._applied_response(run_id, round_row, report)

    def _applied_response(self, run_id: str, round_row: RoundRow, report: AppliedRow) -> AppliedResponse:
        latest = round_row.manifest_version
        majority = round_row.majority_digest
        return AppliedResponse(
            round=round_row.round,
            majority_digest=majority,
            agrees=report.manifest_version == latest and report.params_digest == majority,
            num_reports=sum(a.manifest_version == latest for a in self.storage.list_applied(run_id, round_row.round)),
            manifest_version=latest,
            amended=self.storage.amended_rounds(
                run_id, self.views.require_run(run_id).current_round - MISSING_REPORT_ROUNDS - 1
            ),
            agreed_digest=round_row.agreed_digest,
            provisional=majority is not None and round_row.agreed_digest is None,
            num_votes=round_row.num_votes,
            vote=bool(report.vote),
        )

    def _in_manifest(self, run_id: str, round_index: int, peer_id: str, version: int) -> bool:
        """Whether version `version` of round r's manifest holds a packet of this peer."""
        return peer_id in self.storage.manifest_peers(run_id, round_index, version)

    def _is_vote(self, run_id: str, round_index: int, peer_id: str, version: int, config: RunConfig) -> bool:
        """Whether this peer's report of that version votes: its packet is in it (and, with
        ``membership.vote_after_rounds`` K, in K earlier rounds' manifests)."""
        if not self._in_manifest(run_id, round_index, peer_id, version):
            return False
        needed = config.membership.vote_after_rounds
        return needed == 0 or self.storage.contributed_rounds_before(run_id, peer_id, round_index) >= needed

    def _count_votes(self, run_id: str, round_index: int, settled: bool = False) -> RoundRow:
        """Recount the votes on round r's latest manifest version (`_tally`), then take its
        contribution verdicts when they are due; credit they move weighs again in every round still
        undecided. `settled`: the next round has closed (the caller knows), else it is looked up."""
        round_row, credit_moved = self._tally(run_id, round_index, settled)
        if not round_row.scored and scoring.due(self.storage, round_row, settled or self._settled(run_id, round_index)):
            run = self.views.require_run(run_id)
            if scoring.judge_round(self.storage, round_row, self.views.config_of(run)):
                self._changed.add(run_id)
            credit_moved = True
        if credit_moved:  # verdicts, or a liar's exclusion: weigh the undecided rounds again
            for r in range(max(0, round_index - RETALLY_ROUNDS), round_index + 1):
                row = self.storage.get_round(run_id, r)
                if row is not None and row.closed_at is not None and row.agreed_digest is None and row.num_votes:
                    self._tally(run_id, r)
            round_row = self._closed_round(run_id, round_index)
        return round_row

    def _tally(self, run_id: str, round_index: int, settled: bool = False) -> tuple[RoundRow, bool]:
        """Weigh the votes on round r's latest manifest version and fix its agreed digest when it is
        due (see "Agreed digests"); an agreed digest is never changed here. A peer whose report (a
        vote or not) differs from the agreed digest is excluded (`wrong_digest`), and the dispute
        recorded.
        Returns the round, and whether it excluded anyone (their credit is gone)."""
        round_row = self._closed_round(run_id, round_index)  # votes are on closed rounds only
        version = round_row.manifest_version
        run = self.views.require_run(run_id)
        config = self.views.config_of(run)
        forked = self._forked(run_id, round_index)
        witnesses = [  # applied this version from the agreed start: each must name the agreed digest
            a
            for a in self.storage.list_applied(run_id, round_index)
            if a.manifest_version == version and a.peer_id not in forked
        ]
        reports = [a for a in witnesses if a.vote]
        fields: dict = {"num_votes": len(reports)}
        excluded_any = False
        contributors = self.storage.manifest_peers(run_id, round_index, version) - forked
        credit = {p: c for p, c in self.storage.credits(run_id).items() if p in contributors}
        weighed = config.scoring.enabled
        if round_row.agreed_digest is None and reports:
            settled = settled or self._settled(run_id, round_index)
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
                record = disputes.decide(witnesses, agreed, self.storage.credits(run_id), old)
                fields["dispute"] = json.dumps(record, sort_keys=True)
                for peer_id in record["excluded"]:
                    scoring.exclude_for_wrong_digest(
                        self.storage,
                        run_id,
                        peer_id,
                        round_index,
                        disputes.reason(record, peer_id, round_index),
                        config,
                    )
                self._changed.add(run_id)
                excluded_any = bool(record["excluded"])
        self.storage.update_round(run_id, round_index, **fields)
        if fields.get("agreed_digest") is not None:
            self._agree_empty_from(run_id, round_index + 1)
        return dataclasses.replace(round_row, **fields), excluded_any

    def _forked(self, run_id: str, round_index: int) -> set[str]:
        """The peers whose reports of round r are void: none of their reports of round r-1 names its
        agreed digest on its latest manifest version, so they applied r from another start (an
        amendment they learnt of late, a wrong digest of r-1). Their reports of r neither vote nor
        dispute: a fork of an earlier round is not a lie about this one, and a liar gains nothing
        by it. Peers that did not report r-1 (they joined from a snapshot) vote."""
        previous = self.storage.get_round(run_id, round_index - 1) if round_index > 0 else None
        if previous is None or previous.agreed_digest is None:
            return set()
        reports: dict[str, bool] = {}
        for a in self.storage.list_applied(run_id, round_index - 1):
            held = a.manifest_version == previous.manifest_version and a.params_digest == previous.agreed_digest
            reports[a.peer_id] = reports.get(a.peer_id, False) or held
        return {peer_id for peer_id, held in reports.items() if not held}

    def _agree_empty_from(self, run_id: str, round_index: int) -> None:
        """Closed round r, and the closed rounds after it, whose latest manifest is empty take their
        start's agreed digest (see "Agreed digests"): the outer step of no packet changes nothing."""
        r = round_index
        while (row := self.storage.get_round(run_id, r)) is not None and row.closed_at is not None:
            if row.agreed_digest is not None or self.storage.manifest_peers(run_id, r, row.manifest_version):
                return
            start = recovery.agreed_start(self.storage, run_id, r)
            if start is None:
                return
            self.storage.update_round(run_id, r, majority_digest=start, agreed_digest=start)
            log.info(
                "run %s round %d: no packet in its manifest; its start's digest %s is agreed", run_id, r, start[:16]
            )
            r += 1

    def _settled(self, run_id: str, round_index: int) -> bool:
        """Round r is settled once round r + `settle_lag` has closed: every honest contributor has
        applied r by then, so its vote is in."""
        lag = settle_lag(self.views.config_of(self.views.require_run(run_id)))
        later = self.storage.get_round(run_id, round_index + lag)
        return later is not None and later.closed_at is not None

    def _closed_round(self, run_id: str, round_index: int) -> RoundRow:
        round_row = self.storage.get_round(run_id, round_index)
        if round_row is None:
            raise errors.RoundNotFound(f"round {round_index} has not opened")
        if round_row.closed_at is None:
            raise errors.RoundNotClosed(f"round {round_index} has no manifest yet")
        return round_row

    # -- amended manifests --------------------------------------------------------------------

    def report_missing(
        self, run_id: str, round_index: int, reporter_id: str, request: MissingRequest
    ) -> MissingResponse:
        """Record that `reporter_id` could not fetch these entries of closed round r; drop those
        now due (see "Amended manifests" in the module docstring)."""
        now = self.clock()
        with self._tx():
            run = self.views.require_run(run_id)
            self._advance(run, now)
            run = self.views.require_run(run_id)
            self._require_live_member(run_id, reporter_id)
            self._closed_round(run_id, round_index)
            if round_index < run.current_round - MISSING_REPORT_ROUNDS and self._settled_past(run_id, round_index):
                raise errors.RoundTooOld(
                    f"round {round_index} closed over {MISSING_REPORT_ROUNDS} rounds ago (open: {run.current_round});"
                    " its packets may be forgotten: catch up from a snapshot"
                )
            entries = {s.peer_id for s in self.storage.list_submissions(run_id, round_index)}
            wanted = sorted(set(request.peer_ids))
            if reporter_id in wanted:
                raise errors.InvalidRequest("a peer cannot report its own packet missing (lost_own says it lost it)")
            strangers = [p for p in wanted if p not in entries]
            if strangers:
                raise errors.NotInManifest(f"round {round_index}'s manifest has no entry of {', '.join(strangers[:4])}")
            if request.lost_own and reporter_id not in entries:
                raise errors.NotInManifest(f"round {round_index}'s manifest has no entry of {reporter_id}")
            dropped = {d.peer_id for d in self.storage.list_dropped(run_id, round_index)}
            # A lost packet is reported by its own author: the row whose reporter is the entry itself.
            for entry in wanted + ([reporter_id] if request.lost_own else []):
                if entry not in dropped:
                    self.storage.add_missing_report(MissingReportRow(run_id, round_index, entry, reporter_id, now))
            self._amend(run_id, round_index, now)
            round_row = self._closed_round(run_id, round_index)
            dropped_rows = self.storage.list_dropped(run_id, round_index)
            gone = {d.peer_id for d in dropped_rows}
            pending = {m.peer_id for m in self.storage.list_missing_reports(run_id, round_index)} - gone
            return MissingResponse(
                round=round_index,
                manifest_version=round_row.manifest_version,
                dropped={d.peer_id: d.reason for d in dropped_rows},
                pending=sorted(pending),
            )

    def _amend(self, run_id: str, round_index: int, now: float) -> None:
        """Drop the entries of closed round r that are due; all of them in one new version."""
        run = self.views.require_run(run_id)
        round_row = self.storage.get_round(run_id, round_index)
        if round_row is None or round_row.closed_at is None:
            return
        grace_s = self.views.config_of(run).exchange.missing_grace_s
        submitters = {s.peer_id for s in self.storage.list_submissions(run_id, round_index)}
        manifest = sorted(self.storage.manifest_peers(run_id, round_index))
        live = {p.peer_id for p in self.storage.list_peers(run_id) if p.status == "live"}
        # Every version so far held each entry still undropped: whoever applied one got its packet.
        # Only the round's contributors are believed: a stranger's report must not keep an entry
        # nobody serves.
        appliers = {a.peer_id for a in self.storage.list_applied(run_id, round_index) if a.peer_id in submitters}
        reports: dict[str, list[MissingReportRow]] = {}
        for report in self.storage.list_missing_reports(run_id, round_index):
            reports.setdefault(report.peer_id, []).append(report)
        due: dict[str, str] = {}
        for entry, rows in reports.items():
            if entry not in manifest:
                continue
            reporters = {r.reporter_id for r in rows}
            others = {p for p in manifest if p != entry and p in live}
            waited_s = now - min(r.reported_at for r in rows)
            # Rule 1: nobody can serve it. A live applier that did not report it holds a copy.
            copies = (appliers & live) - reporters - {entry}
            if entry in reporters and not copies:  # the author's own report: lost_own
                due[entry] = (
                    "its author said it lost the packet (restarted without it) and no live peer that "
                    "applied the round serves a copy"
                )
            elif entry not in live and not copies:
                due[entry] = (
                    f"reported missing; its author is not live ({self._status_of(run_id, entry)}) and no "
                    "live peer that applied the round serves a copy"
                )
            elif others and others <= reporters:
                due[entry] = f"reported missing by all {len(others)} other live contributors"
            elif waited_s >= grace_s and not appliers - reporters - {entry}:
                due[entry] = (
                    f"reported missing by {len(reporters)} peer(s) and not served for"
                    f" {waited_s:.0f} s (missing_grace_s {grace_s:g} s)"
                )
        if not due:
            return
        version = round_row.manifest_version + 1
        for entry, reason in sorted(due.items()):
            self.storage.insert_dropped(DroppedRow(run_id, round_index, entry, reason, version, now))
            peer = self.storage.get_peer(run_id, entry)
            if peer is not None and (peer.withheld_round is None or peer.withheld_round < round_index):
                self.storage.update_peer(run_id, entry, withheld_round=round_index)
            self.storage.refresh_last_contributed(run_id, entry)
        # A new version is a new vote: no report can name it yet.
        self.storage.update_round(
            run_id, round_index, manifest_version=version, majority_digest=None, agreed_digest=None, num_votes=0
        )
        self._agree_empty_from(run_id, round_index)
        log.warning(
            "run %s round %d: manifest version %d drops %s",
            run_id,
            round_index,
            version,
            "; ".join(f"{entry}: {reason}" for entry, reason in sorted(due.items())),
        )
        self._changed.add(run_id)

    def _settled_past(self, run_id: str, round_index: int) -> bool:
        """Whether the swarm agreed a state at or after round r, so a peer catches up past it from a
        snapshot. While it has not (every round since closed with nobody applying: a swarm down
        for more than MISSING_REPORT_ROUNDS deadlines, back before its heartbeat time-out), round r's
        missing entries are still taken, however old: amending r is the only way on."""
        latest = self.storage.latest_agreed_round(run_id)
        return latest is not None and latest.round >= round_index

    def _status_of(self, run_id: str, peer_id: str) -> str:
        peer = self.storage.get_peer(run_id, peer_id)
        return "unknown" if peer is None else peer.status

    def _clear_withheld(self, run_id: str, round_index: int, reporter_id: str) -> None:
        """A peer applied round r's latest manifest: the publishers in it that were flagged for an
        earlier round got a packet through, and are waited for again."""
        flagged = {
            p.peer_id: p
            for p in self.storage.list_peers(run_id)
            if p.withheld_round is not None and p.withheld_round < round_index and p.peer_id != reporter_id
        }
        if not flagged:
            return
        for peer_id in sorted(self.storage.manifest_peers(run_id, round_index) & set(flagged)):
            self.storage.update_peer(run_id, peer_id, withheld_round=None)
            log.info(
                "run %s: %s's packet of round %d was applied by %s; it is waited for again",
                run_id,
                peer_id,
                round_index,
                reporter_id,
            )


def settle_lag(config: RunConfig) -> int:
    """How many rounds after r closes every honest contributor has applied r: 1 (a node applies r
    before it trains r+1), 2 with the one-round-delayed outer step (`outer.overlap`: a node trains
    r+1 first and applies r before it trains r+2). Settling after one round with overlap let a
    lone early vote (a peer whose packet was later dropped, racing ahead on the old manifest)
    become the agreed digest before the others had voted: they were told they had forked."""
    return 2 if config.outer.overlap else 1


def tally(
    votes: Sequence[tuple[str, int]],
    num_contributors: int,
    settled: bool,
    previous: str | None,
    total_credit: int | None = None,
) -> tuple[str, str | None]:
    """(majority, agreed or None) of a round's votes, (digest, its voter's credit) each (see "Agreed
    digests"). On a tie the previous majority stays (so it does not flip back and forth as equal
    counts arrive), else the smallest digest (deterministic).

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
      settled (a lone vote too). A dispute
      waits until credit decides it (`_count_votes` weighs undecided rounds again as credit
      moves): a majority of fresh keys decides nothing."""
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
