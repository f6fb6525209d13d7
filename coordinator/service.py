"""The coordinator's write side: `CoordinatorService`, the facade the routes and tests call.

Each public method is one transaction (or, for `tick`, one per run) that applies the rules of
coordinator/rules/, one module per concept, whose docstrings are the contract
(docs/design-coordinator.md puts them together). Time comes from an injected clock (Unix
seconds) so tests can drive deadlines and liveness; nothing is kept only in memory except parsed
configs, the join rate limits, and when the service resumed.

A peer's write to a run begins with the same preamble (`_write`): the transaction opens, the round
rules are applied at the clock's "now" (a deadline or a time-out that passed is in force before
the write is judged), and the run is read as they left it. Reads never apply rules: rounds advance
on writes and on the coordinator's own clock, `tick`, which the app calls a few times a second,
so a deadline that passes with nobody writing still closes the round.

`on_change(run_id)` is called after a commit that opened or closed a round, accepted a submission
or amended a manifest; the HTTP layer uses it to wake long-polls. The same commit announces the
change to the other replicas on the database (`Storage.announce`: coordinator/storage/cluster.py). What is read back (status, round
views, the join answer) is `coordinator.views.Views`, held as ``service.views``.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from coordinator import errors
from coordinator.join_guard import JoinGuard
from coordinator.rules import amendments, membership, nonces, retention, rounds, runs, snapshots, votes
from coordinator.rules.context import Context
from coordinator.rules.states import ENDED_STATES
from coordinator.storage import RunRow, Storage
from coordinator.views import Views
from protocol.http import (
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
    SnapshotRecorded,
    SnapshotUploaded,
    SubmitRequest,
    SubmitResponse,
    peer_id_from_public_key,
)
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

Clock = Callable[[], float]
# How often the tick weighs the last rounds of runs that ended (rules/votes.py `settle_ended`).
ENDED_SETTLE_EVERY_S = 5.0


class CoordinatorService:
    """Runs, membership, rounds, votes and amendments over `storage`, on `clock`."""

    def __init__(
        self,
        storage: Storage,
        clock: Clock = time.time,
        on_change: Callable[[str], None] | None = None,
        keep_rounds: int = retention.DEFAULT_KEEP_ROUNDS,
    ):
        self.storage = storage
        self.keep_rounds = keep_rounds  # rounds whose per-peer rows the tick keeps (rules/retention.py)
        self.views = Views(storage)
        self.clock = clock
        self.on_change = on_change or (lambda run_id: None)
        # resumed_at: coordinator/rules/rounds.py, "Restart grace"; `resume` sets it again.
        self.ctx = Context(storage, self.views, resumed_at=clock())
        self.join_guard = JoinGuard()  # rate limits of new keys, in memory (rules/membership.py)
        self._failures_seen = storage.num_failures
        self._nonces_pruned_at = 0.0
        self._rounds_pruned_at = 0.0
        self._ended_settled_at = 0.0

    @property
    def resumed_at(self) -> float:
        return self.ctx.resumed_at

    @contextmanager
    def _tx(self, serialised: bool = True) -> Iterator[None]:
        """A transaction whose change notifications go out only after it commits (`serialised`:
        `Database.transaction`)."""
        if self.storage.num_failures != self._failures_seen:
            # The database failed since our last transaction: resume counting from now.
            self._failures_seen = self.storage.num_failures
            self.ctx.resumed_at = self.clock()
        try:
            with self.storage.transaction(serialised):
                yield
                for run_id in sorted(self.ctx.changed):
                    self.storage.announce(run_id)  # the other replicas' long-polls, on commit
        except BaseException:
            self.ctx.changed.clear()  # rolled back: nothing changed
            raise
        changed, self.ctx.changed = self.ctx.changed, set()
        for run_id in sorted(changed):
            self.on_change(run_id)

    @contextmanager
    def _write(self, run_id: str) -> Iterator[tuple[RunRow, float]]:
        """The preamble of a peer's write to a run: a transaction, the rules applied now, and
        (the run as they left it, now)."""
        now = self.clock()
        with self._tx():
            rounds.advance(self.ctx, self.ctx.run(run_id), now)
            yield self.ctx.run(run_id), now

    # -- runs (the operator) ------------------------------------------------------------------

    def create_run(self, config: RunConfig) -> str:
        if config.exchange.mirror is not None:  # refused now rather than found out at the first packet
            from coordinator.mirror import Mirror, MirrorUnavailable  # boto3: only for runs with a mirror

            try:
                Mirror(config.exchange.mirror)
            except MirrorUnavailable as e:
                raise errors.InvalidConfig(str(e)) from e
        run = runs.new_run(config, self.clock())
        with self._tx():
            self.storage.insert_run(run)
            rounds.advance(self.ctx, self.ctx.run(run.run_id), self.clock())
        return run.run_id

    def close_run(self, run_id: str) -> None:
        """Stop a run: its open round closes now with what was submitted; nobody can join."""
        with self._tx():
            runs.close_run(self.ctx, self.ctx.run(run_id), self.clock())

    # -- the coordinator's clock --------------------------------------------------------------

    def tick(self) -> None:
        """Apply deadlines and liveness to every active run, and due amendments to every run; weigh
        the last votes of runs that ended lately; forget nonces past the window and old rounds'
        per-peer rows."""
        now = self.clock()
        for run_id in self.storage.active_run_ids():
            with self._tx():
                run = self.storage.get_run(run_id)
                if run is not None:
                    rounds.advance(self.ctx, run, now)
        for run_id, round_index in amendments.pending_rounds(self.ctx):
            with self._tx():
                amendments.amend(self.ctx, run_id, round_index, now)
        if now - self._ended_settled_at > ENDED_SETTLE_EVERY_S:
            for run_id in self.storage.run_ids_ended_since(now - votes.ENDED_SETTLE_WINDOW_S):
                with self._tx():
                    votes.settle_ended(self.ctx, self.ctx.run(run_id), now)
            self._ended_settled_at = now
        if now - self._nonces_pruned_at > nonces.PRUNE_INTERVAL_S:
            with self._tx():
                nonces.prune(self.storage, now)
            self._nonces_pruned_at = now
        if now - self._rounds_pruned_at > retention.PRUNE_INTERVAL_S:
            for run in self.storage.list_runs():
                with self._tx():
                    retention.prune(self.ctx, run.run_id, self.keep_rounds)
            self._rounds_pruned_at = now

    def advance(self, run_id: str) -> None:
        """What `tick` does, for one run: its deadlines and liveness, then its amendments due."""
        now = self.clock()
        with self._tx():
            rounds.advance(self.ctx, self.ctx.run(run_id), now)
            for _, round_index in amendments.pending_rounds(self.ctx, run_id):
                amendments.amend(self.ctx, run_id, round_index, now)

    def resume(self, serving_since: float | None = None) -> None:
        """On start: the restart grace counts from now, or from `serving_since` when other
        replicas on the database have served since then (coordinator/storage/cluster.py), and the
        rules are applied once, so extended deadlines are in the database before anyone asks. A
        database that fails here does not stop the start: the grace is applied when it comes back."""
        now = self.clock()
        self.ctx.resumed_at = now if serving_since is None else min(now, serving_since)
        self._failures_seen = self.storage.num_failures
        try:
            self.tick()
        except errors.StorageUnavailable as e:
            log.error("cannot apply deadlines and timeouts at start: %s", e.detail)

    # -- signed requests ----------------------------------------------------------------------

    def record_nonce(self, peer_id: str, nonce: int) -> None:
        """Refuse a nonce outside the time window or already used by this peer (rules/nonces.py)."""
        now = self.clock()
        nonces.check_window(nonce, now)
        with self._tx(serialised=False):  # the primary key refuses a replay, on any replica
            nonces.record(self.storage, peer_id, nonce, now)

    # -- membership ---------------------------------------------------------------------------

    def join(
        self,
        run_id: str,
        signer_id: str,
        request: JoinRequest,
        source: str | None = None,
        reachable: bool | None = None,
    ) -> JoinResponse:
        """Join or rejoin; `source` is the caller's address, for the rate limit of new keys;
        `reachable`, whether the route's dial-back to it connected (coordinator/reachability.py)."""
        peer_id = peer_id_from_public_key(bytes.fromhex(request.public_key))
        if signer_id != peer_id:
            raise errors.PeerMismatch("the join must be signed by the key it registers")
        with self._write(run_id) as (run, now):
            membership.join(self.ctx, run, peer_id, request, source, self.join_guard, now, reachable)
            membership.tell_period(self.ctx, run_id, peer_id, self.ctx.config(run), now)
            rounds.advance(self.ctx, self.ctx.run(run_id), now)  # enough peers may open round 0
            return self.views.join_response(self.ctx.run(run_id), peer_id)

    def join_challenge(self, run_id: str) -> JoinChallenge:
        """The proof of work a new key solves before it joins (bits 0: none asked)."""
        now = self.clock()
        with self._tx():
            return membership.join_challenge(self.ctx, self.ctx.run(run_id), now)

    def heartbeat(self, run_id: str, peer_id: str, request: HeartbeatRequest) -> HeartbeatResponse:
        with self._write(run_id) as (_, now):
            return membership.heartbeat(self.ctx, run_id, peer_id, request, now)

    def leave(self, run_id: str, peer_id: str, request: LeaveRequest) -> LeaveResponse:
        now = self.clock()
        with self._tx():
            run = self.ctx.run(run_id)
            response = membership.leave(self.ctx, run_id, peer_id, request, now)
            # Its departure may leave everyone else the round waits for already submitted, or
            # every vote of an ended run's last round in.
            rounds.advance(self.ctx, run, now)
            if run.state in ENDED_STATES:
                votes.settle_ended(self.ctx, run, now)
        return response

    # -- rounds, votes, amendments ------------------------------------------------------------

    def submit(self, run_id: str, round_index: int, peer_id: str, request: SubmitRequest) -> SubmitResponse:
        if request.peer_id is not None and request.peer_id != peer_id:
            raise errors.PeerMismatch(f"peer {peer_id} cannot submit for {request.peer_id}")
        with self._write(run_id) as (run, now):
            peer = membership.require_live_member(self.ctx, run_id, peer_id, now)
            return rounds.submit(self.ctx, run, round_index, peer, request, now)

    def applied(self, run_id: str, round_index: int, peer_id: str, request: AppliedRequest) -> AppliedResponse:
        """Record a peer's parameter digest after applying a version of round r's manifest, and
        count it if it is a vote (rules/votes.py)."""
        with self._write(run_id) as (run, now):
            peer = membership.require_live_member(self.ctx, run_id, peer_id, now)
            response, voted = votes.record_applied(self.ctx, run, round_index, peer, request, now)
            if voted:  # on the latest manifest: its flagged publishers got their packets through
                amendments.clear_withheld(self.ctx, run_id, round_index, peer_id)
            return response

    def snapshot_uploaded(
        self, run_id: str, round_index: int, peer_id: str, request: SnapshotUploaded
    ) -> SnapshotRecorded:
        """Record that `peer_id` put the snapshot of round r+1's start into the packet mirror
        (rules/snapshots.py)."""
        with self._write(run_id) as (run, now):
            peer = membership.require_live_member(self.ctx, run_id, peer_id, now)
            return snapshots.record_uploaded(self.ctx, run, round_index, peer, request)

    def report_missing(
        self, run_id: str, round_index: int, reporter_id: str, request: MissingRequest
    ) -> MissingResponse:
        """Record that `reporter_id` could not fetch these entries of closed round r; drop those
        now due (rules/amendments.py)."""
        with self._write(run_id) as (run, now):
            membership.require_live_member(self.ctx, run_id, reporter_id, now)
            return amendments.report_missing(self.ctx, run, round_index, reporter_id, request, now)
