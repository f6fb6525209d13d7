"""Persistence of runs, peers, rounds, submissions, applied digests, amendments and used nonces.

One `Storage` class speaks SQL; two small subclasses connect it to SQLite (stdlib ``sqlite3``, a
real file in WAL mode, the default) and PostgreSQL (psycopg 3, chosen by a ``postgresql://`` URL).
Both run the same statements from `coordinator.schema`; only the placeholder style and the
connection differ. `open_storage(url)` picks the backend.

Every state change the coordinator makes goes through here inside `transaction()`, so killing the
process at any instant leaves the database at a transaction boundary and a restart resumes from
it. The app calls storage from one thread, its database thread (`coordinator.db_worker`), one
call at a time, on one connection; the lock only guards tests and tools that share a `Storage`
between threads.

When the database itself fails (disk full, read-only, locked past the busy timeout, I/O error,
connection lost), the statement raises `StorageUnavailable` (HTTP 503 with ``Retry-After``) and its
transaction is rolled back, so committed state is untouched and the next operation works once the
database does; a lost PostgreSQL connection is replaced between transactions. Errors that are bugs
(a constraint, bad SQL) pass unchanged. `probe` is the readiness check behind ``/readyz``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import sqlite3
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from coordinator.errors import StorageError, StorageUnavailable
from coordinator.schema import CREATE_MIGRATIONS_TABLE, MIGRATIONS

log = logging.getLogger("locoswarm.coordinator")

# SQLite result codes (the low byte of an extended code) that mean the database cannot be used
# right now, as opposed to a bug in a statement (SQLITE_ERROR, SQLITE_CONSTRAINT, ...).
SQLITE_UNAVAILABLE_CODES = frozenset(
    {
        3,  # SQLITE_PERM
        5,  # SQLITE_BUSY: locked by another process past the busy timeout
        6,  # SQLITE_LOCKED
        7,  # SQLITE_NOMEM
        8,  # SQLITE_READONLY
        10,  # SQLITE_IOERR
        11,  # SQLITE_CORRUPT
        13,  # SQLITE_FULL: "database or disk is full" (the disk, or PRAGMA max_page_count)
        14,  # SQLITE_CANTOPEN
        15,  # SQLITE_PROTOCOL
        22,  # SQLITE_NOLFS
        26,  # SQLITE_NOTADB
    }
)
# Characters the readiness probe writes and rolls back: a few pages, so it needs room to grow.
PROBE_PADDING_CHARS = 8192


class _RollBackProbe(Exception):
    """Ends the readiness probe's first transaction without committing it."""


@dataclass(slots=True)
class RunRow:
    run_id: str
    name: str
    config_json: str
    join_token_hashes: str  # JSON list of sha256 hex strings
    state: str  # waiting | running | finished | closed
    created_at: float
    closed_at: float | None
    current_round: int  # the open round, or the next to open
    paused_since: float | None = None  # no live peer since then (coordinator/recovery.py)
    state_wait_since: float | None = None  # while paused: when the first peer came back
    rewinds: str | None = None  # JSON list of {at, from_round, to_round, reason}
    join_secret: str = ""  # hex; the join proof-of-work salts derive from it ('' until first needed)


@dataclass(slots=True)
class PeerRow:
    run_id: str
    peer_id: str
    public_key: str
    peer_index: int
    status: str  # live | gone | left
    reason: str | None
    activity: str
    device: str
    listen_multiaddrs: str  # JSON list
    bandwidth_mbps: float | None
    last_loss: float | None
    joined_at: float
    last_seen_at: float
    member_since_round: int  # first round it is expected to submit to
    progress_round: int | None  # latest round it reported working on
    uplink_mbps: float | None = None  # stated by its operator at join
    withheld_round: int | None = None  # latest round whose packet of its was dropped as unfetchable
    inner_step: int | None = None  # inner steps done in progress_round, per its last heartbeat
    state_round: int | None = None  # the round start it said at its latest join that it holds
    state_digest: str | None = None  # and that state's parameter digest
    last_contributed_round: int | None = None  # latest round whose manifest holds its packet (None: probation)
    standing: str | None = None  # JSON of protocol.scoring.Standing (None: never judged)
    excluded_round: int | None = None  # while an exclusion is in force: the round whose verdict decided it
    detail: str | None = None  # what its last heartbeat said it is stuck on (None: nothing)
    credit: int = 0  # its standing's credit (protocol/scoring.py, rule 5): its weight as judge and voter


@dataclass(slots=True)
class RoundRow:
    run_id: str
    round: int
    opened_at: float
    deadline: float
    closed_at: float | None
    majority_digest: str | None  # the digest most votes on the latest manifest version name
    manifest_version: int = 1  # one more per amendment of the closed round's manifest
    agreed_digest: str | None = None  # fixed once set, until an amendment starts a new vote
    num_votes: int = 0  # votes on the latest manifest version
    scored: int = 0  # 1: its contribution verdicts were taken (protocol/scoring.py)
    dispute: str | None = None  # JSON of the dispute over its digest, as decided (None: none)


@dataclass(slots=True)
class SubmissionRow:
    run_id: str
    round: int
    peer_id: str
    packet_digest: str
    packet_size_bytes: int
    train_loss: float
    compute_s: float
    encode_s: float
    multiaddrs: str  # JSON list
    submitted_at: float


@dataclass(slots=True)
class AppliedRow:
    run_id: str
    round: int
    peer_id: str
    params_digest: str
    reported_at: float
    refused: str | None = None  # JSON {peer id: reason} of the packets it left out
    manifest_version: int = 1  # the version of the round's manifest it applied
    vote: int = 0  # 1: it counts towards the agreed digest (its peer has a packet in that version)
    val_loss: float | None = None  # the model's held-out loss after the round, when the peer evaluated it
    scores: str | None = None  # JSON {peer id: [loss_delta, cosine]}: its contribution scores (None: none)
    sample: str | None = None  # a text the model wrote after the round, sent with val_loss (None: none)
    leaves: str | None = None  # hex leaf hashes of params_digest's tree (None: sent none)


@dataclass(slots=True)
class MissingReportRow:
    """`reporter_id` could not fetch `peer_id`'s packet of a closed round."""

    run_id: str
    round: int
    peer_id: str
    reporter_id: str
    reported_at: float


@dataclass(slots=True)
class DroppedRow:
    """A manifest entry amended out of a closed round, from `manifest_version` on."""

    run_id: str
    round: int
    peer_id: str
    reason: str
    manifest_version: int
    dropped_at: float


@dataclass(slots=True)
class RoundStats:
    round: int
    num_contributors: int
    mean_loss: float | None
    packet_bytes: int = 0  # the submitted packets' sizes, summed


@functools.cache  # row types are fixed classes; every statement asks
def _columns(row_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(row_type))


class Storage:
    """The SQL shared by both backends. Subclasses provide `_connect` and the placeholder."""

    placeholder = "?"

    def __init__(self, read_only: bool = False) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._closed = False
        self.read_only = read_only  # a `replica`: its connection refuses writes, and it migrates nothing
        # How many operations the database has failed so far; the service reads it to notice that
        # the database came back after an outage (see CoordinatorService's restart grace).
        self.num_failures = 0
        self._conn: Any = self._connect()
        if read_only:
            return
        try:
            self._migrate()
        except StorageUnavailable as e:
            self._conn.close()
            raise StorageError(f"cannot prepare the database: {e.detail}") from e

    def replica(self) -> "Storage":
        """A second, read-only connection to the same database, for a thread of its own: the app
        reads its heavy views (a run's status, a round's manifest) there, beside the writes. It sees
        every transaction committed before each of its reads begins (SQLite WAL, PostgreSQL read
        committed), and is closed by whoever opened it."""
        raise NotImplementedError

    # -- backend hooks ------------------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _exec(self, sql: str, params: tuple = ()) -> int:
        """Run a statement; return the number of rows it changed."""
        raise NotImplementedError

    def _is_unavailable(self, error: Exception) -> bool:
        """Whether the engine's error says the database cannot be used now (not a bug)."""
        raise NotImplementedError

    def _in_transaction(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """Raise the engine's failures of the database itself as `StorageUnavailable`."""
        try:
            yield
        except Exception as e:
            if isinstance(e, StorageUnavailable) or not self._is_unavailable(e):
                raise
            self.num_failures += 1
            message = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise StorageUnavailable(f"the database failed: {message}; retry later") from e

    # -- transactions and schema --------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All statements inside commit together or not at all; nesting joins the outer one. A
        failure anywhere, COMMIT included, rolls the whole transaction back and propagates."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._exec(self._begin_sql)
            self._depth = 1
            try:
                yield
                self._exec("COMMIT")
            except BaseException:
                self._rollback()
                raise
            finally:
                self._depth = 0

    def _rollback(self) -> None:
        # SQLite may already have rolled back (it does on some full-disk and I/O errors), and a
        # lost connection has nothing left to roll back: the error to report is the first one.
        try:
            if self._in_transaction():
                self._conn.execute("ROLLBACK")
        except Exception as e:
            log.warning("rollback after a failed transaction failed too: %s", e)

    _begin_sql = "BEGIN"

    def schema_version(self) -> int:
        rows = self._rows("SELECT MAX(version) AS v FROM schema_migrations")
        return int(rows[0]["v"] or 0)

    def probe(self, now: float) -> None:
        """Prove the database usable now, or raise `StorageUnavailable`: a read; a write of a few
        pages, rolled back (SQLite checks room to grow, its page limit included, as it allocates);
        and a one-row write, committed (a commit is what reaches the disk or the server). The
        committed value is random: SQLite writes nothing for an update that changes nothing."""
        with self._lock:
            if self._depth:
                raise RuntimeError("the readiness probe cannot run inside a transaction")
            self.schema_version()
            with contextlib.suppress(_RollBackProbe), self.transaction():
                self._exec(
                    "INSERT INTO readiness_probe (id, probed_at, payload) VALUES (?, ?, ?)",
                    (1, now, "x" * PROBE_PADDING_CHARS),
                )
                raise _RollBackProbe
            with self.transaction():
                self._exec(
                    "UPDATE readiness_probe SET probed_at = ?, payload = ? WHERE id = 0",
                    (now, secrets.token_hex(8)),
                )

    def _migrate(self) -> None:
        with self.transaction():
            self._exec(CREATE_MIGRATIONS_TABLE)
            current = self.schema_version()
            for version, statements in MIGRATIONS:
                if version <= current:
                    continue
                for statement in statements:
                    self._exec(statement)
                self._exec(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )

    # -- generic row helpers ------------------------------------------------------------------

    def _insert(self, table: str, row: Any) -> None:
        names = _columns(type(row))
        values = tuple(getattr(row, n) for n in names)
        marks = ", ".join("?" for _ in names)
        self._exec(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})", values)

    def _update(self, table: str, row_type: type, keys: dict, fields: dict) -> None:
        allowed = set(_columns(row_type))
        if not fields or not set(fields) <= allowed:
            raise ValueError(f"bad columns for {table}: {sorted(set(fields) - allowed)}")
        assignments = ", ".join(f"{name} = ?" for name in fields)
        where = " AND ".join(f"{name} = ?" for name in keys)
        self._exec(
            f"UPDATE {table} SET {assignments} WHERE {where}",
            tuple(fields.values()) + tuple(keys.values()),
        )

    def _one(self, row_type: type, sql: str, params: tuple) -> Any:
        rows = self._rows(sql, params)
        return row_type(**rows[0]) if rows else None

    def _many(self, row_type: type, sql: str, params: tuple) -> list:
        return [row_type(**row) for row in self._rows(sql, params)]

    # -- runs ---------------------------------------------------------------------------------

    def insert_run(self, row: RunRow) -> None:
        self._insert("runs", row)

    def get_run(self, run_id: str) -> RunRow | None:
        return self._one(RunRow, "SELECT * FROM runs WHERE run_id = ?", (run_id,))

    def list_runs(self) -> list[RunRow]:
        return self._many(RunRow, "SELECT * FROM runs ORDER BY created_at, run_id", ())

    def active_run_ids(self) -> list[str]:
        rows = self._rows("SELECT run_id FROM runs WHERE state IN ('waiting', 'running')")
        return [row["run_id"] for row in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        self._update("runs", RunRow, {"run_id": run_id}, fields)

    # -- peers --------------------------------------------------------------------------------

    def insert_peer(self, row: PeerRow) -> None:
        self._insert("peers", row)

    def get_peer(self, run_id: str, peer_id: str) -> PeerRow | None:
        return self._one(PeerRow, "SELECT * FROM peers WHERE run_id = ? AND peer_id = ?", (run_id, peer_id))

    def find_public_key(self, peer_id: str) -> str | None:
        """The key of a peer id in any run (ids derive from keys, so all runs agree)."""
        rows = self._rows("SELECT public_key FROM peers WHERE peer_id = ? LIMIT 1", (peer_id,))
        return rows[0]["public_key"] if rows else None

    def list_peers(self, run_id: str) -> list[PeerRow]:
        return self._many(PeerRow, "SELECT * FROM peers WHERE run_id = ? ORDER BY peer_index", (run_id,))

    def silent_live_peers(self, run_id: str, seen_before: float) -> list[PeerRow]:
        """Live peers last seen before `seen_before`: the heartbeat timeout's candidates, found by
        the database rather than by reading every peer on every request."""
        return self._many(
            PeerRow,
            "SELECT * FROM peers WHERE run_id = ? AND status = 'live' AND last_seen_at < ? ORDER BY peer_index",
            (run_id, seen_before),
        )

    def count_live_peers(self, run_id: str) -> int:
        rows = self._rows("SELECT COUNT(*) AS n FROM peers WHERE run_id = ? AND status = 'live'", (run_id,))
        return int(rows[0]["n"])

    def next_peer_index(self, run_id: str) -> int:
        rows = self._rows("SELECT MAX(peer_index) AS m FROM peers WHERE run_id = ?", (run_id,))
        top = rows[0]["m"]
        return 0 if top is None else int(top) + 1

    def update_peer(self, run_id: str, peer_id: str, **fields: Any) -> None:
        self._update("peers", PeerRow, {"run_id": run_id, "peer_id": peer_id}, fields)

    # -- rounds -------------------------------------------------------------------------------

    def insert_round(self, row: RoundRow) -> None:
        self._insert("rounds", row)

    def get_round(self, run_id: str, round_index: int) -> RoundRow | None:
        return self._one(RoundRow, "SELECT * FROM rounds WHERE run_id = ? AND round = ?", (run_id, round_index))

    def closed_rounds(self, run_id: str, limit: int) -> list[RoundRow]:
        """The latest `limit` closed rounds, oldest first."""
        rows = self._many(
            RoundRow,
            "SELECT * FROM rounds WHERE run_id = ? AND closed_at IS NOT NULL ORDER BY round DESC LIMIT ?",
            (run_id, limit),
        )
        return rows[::-1]

    def latest_agreed_round(self, run_id: str) -> RoundRow | None:
        """The latest round with an agreed parameter digest."""
        return self._one(
            RoundRow,
            "SELECT * FROM rounds WHERE run_id = ? AND agreed_digest IS NOT NULL ORDER BY round DESC LIMIT 1",
            (run_id,),
        )

    def delete_rounds_from(self, run_id: str, first_round: int) -> None:
        """Forget rounds >= first_round and everything recorded for them (a rewind, recovery.py)."""
        for table in ("dropped_entries", "missing_reports", "applied", "submissions", "rounds"):
            self._exec(f"DELETE FROM {table} WHERE run_id = ? AND round >= ?", (run_id, first_round))

    def update_round(self, run_id: str, round_index: int, **fields: Any) -> None:
        self._update("rounds", RoundRow, {"run_id": run_id, "round": round_index}, fields)

    def waited_for(
        self, run_id: str, round_index: int, window_rounds: int, min_contributors: int = 1
    ) -> dict[str, bool]:
        """The live peers round r waits for, each with whether it submitted to r. Of the live members
        since r opened that are neither flagged for a withheld packet nor excluded by scoring: those with a packet in the
        manifest of one of the `window_rounds` rounds before r (contributors); when there are fewer
        than `min_contributors` of them, all of them (round 0, a swarm still forming). Of the
        contributors, those whose updates were judged and earned no credit (empty, noise, copies:
        protocol/scoring.py rule 5) are not waited for, unless none has credit: a key that only
        sends empty packets cannot hold a round to its deadline by skipping one."""
        rows = self._rows(
            "SELECT p.peer_id, s.peer_id AS submitted, EXISTS (SELECT 1 FROM submissions c"
            " WHERE c.run_id = p.run_id AND c.peer_id = p.peer_id AND c.round >= ? AND c.round < ?"
            " AND NOT EXISTS (SELECT 1 FROM dropped_entries d WHERE d.run_id = c.run_id AND d.round = c.round"
            " AND d.peer_id = c.peer_id)) AS contributor, (p.standing IS NULL OR p.credit > 0) AS credited"
            " FROM peers p LEFT JOIN submissions s ON s.run_id = p.run_id AND s.round = ? AND s.peer_id = p.peer_id"
            " WHERE p.run_id = ? AND p.status = 'live' AND p.member_since_round <= ? AND p.withheld_round IS NULL"
            " AND p.excluded_round IS NULL"
            " ORDER BY p.peer_index",
            (round_index - window_rounds, round_index, round_index, run_id, round_index),
        )
        contributors = [row for row in rows if row["contributor"]]
        credited = [row for row in contributors if row["credited"]]
        waited = (credited or contributors) if contributors and len(contributors) >= min_contributors else rows
        return {row["peer_id"]: row["submitted"] is not None for row in waited}

    def expected_and_missing(
        self, run_id: str, round_index: int, window_rounds: int = 1, min_contributors: int = 1
    ) -> tuple[int, int]:
        """How many live peers round r waits for (`waited_for`), and how many of them have not submitted."""
        waited = self.waited_for(run_id, round_index, window_rounds, min_contributors)
        return len(waited), sum(not submitted for submitted in waited.values())

    def credits(self, run_id: str) -> dict[str, int]:
        """The peers of the run that have credit (protocol/scoring.py, rule 5), with it; the others have none."""
        return {
            row["peer_id"]: int(row["credit"])
            for row in self._rows("SELECT peer_id, credit FROM peers WHERE run_id = ? AND credit > 0", (run_id,))
        }

    def mark_contributors(self, run_id: str, round_index: int) -> None:
        """Round r closed: its manifest's peers contributed to it last."""
        self._exec(
            "UPDATE peers SET last_contributed_round = ? WHERE run_id = ? AND peer_id IN"
            " (SELECT peer_id FROM submissions WHERE run_id = ? AND round = ?)",
            (round_index, run_id, run_id, round_index),
        )

    def refresh_last_contributed(self, run_id: str, peer_id: str) -> None:
        """Recompute a peer's latest round with a packet in a (closed round's latest) manifest,
        after an amendment dropped one."""
        self._exec(
            "UPDATE peers SET last_contributed_round = (SELECT MAX(s.round) FROM submissions s JOIN rounds r"
            " ON r.run_id = s.run_id AND r.round = s.round WHERE s.run_id = ? AND s.peer_id = ?"
            " AND r.closed_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM dropped_entries d WHERE d.run_id = s.run_id"
            " AND d.round = s.round AND d.peer_id = s.peer_id)) WHERE run_id = ? AND peer_id = ?",
            (run_id, peer_id, run_id, peer_id),
        )

    def contributed_rounds_before(self, run_id: str, peer_id: str, round_index: int) -> int:
        """Rounds before r whose (latest) manifest holds a packet of this peer."""
        rows = self._rows(
            "SELECT COUNT(*) AS n FROM submissions s WHERE s.run_id = ? AND s.peer_id = ? AND s.round < ?"
            " AND NOT EXISTS (SELECT 1 FROM dropped_entries d WHERE d.run_id = s.run_id AND d.round = s.round"
            " AND d.peer_id = s.peer_id)",
            (run_id, peer_id, round_index),
        )
        return int(rows[0]["n"])

    # -- submissions --------------------------------------------------------------------------

    def insert_submission(self, row: SubmissionRow) -> None:
        self._insert("submissions", row)

    def get_submission(self, run_id: str, round_index: int, peer_id: str) -> SubmissionRow | None:
        return self._one(
            SubmissionRow,
            "SELECT * FROM submissions WHERE run_id = ? AND round = ? AND peer_id = ?",
            (run_id, round_index, peer_id),
        )

    def list_submissions(self, run_id: str, round_index: int) -> list[SubmissionRow]:
        return self._many(
            SubmissionRow,
            "SELECT * FROM submissions WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    def manifest_peers(self, run_id: str, round_index: int, version: int | None = None) -> set[str]:
        """The publishers in version `version` of round r's manifest (None: its latest): its
        submitters less the entries dropped by that version."""
        rows = self._rows(
            "SELECT peer_id FROM submissions WHERE run_id = ? AND round = ? AND peer_id NOT IN"
            " (SELECT peer_id FROM dropped_entries WHERE run_id = ? AND round = ? AND manifest_version <= ?)",
            (run_id, round_index, run_id, round_index, 2**62 if version is None else version),
        )
        return {r["peer_id"] for r in rows}

    def count_submissions(self, run_id: str, round_index: int) -> int:
        rows = self._rows(
            "SELECT COUNT(*) AS n FROM submissions WHERE run_id = ? AND round = ?",
            (run_id, round_index),
        )
        return int(rows[0]["n"])

    def round_stats(self, run_id: str, first_round: int, last_round: int) -> dict[int, RoundStats]:
        rows = self._rows(
            "SELECT round, COUNT(*) AS n, AVG(train_loss) AS mean_loss, SUM(packet_size_bytes) AS packet_bytes"
            " FROM submissions WHERE run_id = ? AND round BETWEEN ? AND ? GROUP BY round",
            (run_id, first_round, last_round),
        )
        return {
            int(r["round"]): RoundStats(int(r["round"]), int(r["n"]), r["mean_loss"], int(r["packet_bytes"]))
            for r in rows
        }

    # -- applied parameter digests ------------------------------------------------------------

    def add_applied(self, row: AppliedRow) -> bool:
        """Record a report; False (nothing written) when the peer already reported that round and
        manifest version: reports are immutable (the service compares the two)."""
        return (
            self._exec(
                "INSERT INTO applied (run_id, round, peer_id, params_digest, reported_at, refused,"
                " manifest_version, vote, scores, sample, leaves) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (run_id, round, peer_id, manifest_version) DO NOTHING",
                (
                    row.run_id,
                    row.round,
                    row.peer_id,
                    row.params_digest,
                    row.reported_at,
                    row.refused,
                    row.manifest_version,
                    row.vote,
                    row.scores,
                    row.sample,
                    row.leaves,
                ),
            )
            == 1
        )

    def upsert_applied(self, row: AppliedRow) -> None:
        """Record or replace a report (storage tests and tools; the service never replaces one)."""
        self._exec(
            "INSERT INTO applied (run_id, round, peer_id, params_digest, reported_at, refused,"
            " manifest_version, vote, scores) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (run_id, round, peer_id, manifest_version)"
            " DO UPDATE SET params_digest = excluded.params_digest,"
            " reported_at = excluded.reported_at, refused = excluded.refused, vote = excluded.vote,"
            " scores = excluded.scores",
            (
                row.run_id,
                row.round,
                row.peer_id,
                row.params_digest,
                row.reported_at,
                row.refused,
                row.manifest_version,
                row.vote,
                row.scores,
            ),
        )

    def get_applied(self, run_id: str, round_index: int, peer_id: str, manifest_version: int) -> AppliedRow | None:
        return self._one(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND round = ? AND peer_id = ? AND manifest_version = ?",
            (run_id, round_index, peer_id, manifest_version),
        )

    def refusals(self, run_id: str, first_round: int, last_round: int) -> dict[int, dict[str, str]]:
        """Per round, the packets peers left out: {peer id: reason}, the first reporter's reason."""
        rows = self._rows(
            "SELECT round, refused FROM applied WHERE run_id = ? AND round BETWEEN ? AND ?"
            " AND refused IS NOT NULL ORDER BY round, reported_at, peer_id",
            (run_id, first_round, last_round),
        )
        out: dict[int, dict[str, str]] = {}
        for row in rows:
            for peer_id, reason in json.loads(row["refused"]).items():
                out.setdefault(int(row["round"]), {}).setdefault(peer_id, reason)
        return out

    def list_applied(self, run_id: str, round_index: int) -> list[AppliedRow]:
        """Every report of round r, all versions, by peer then version."""
        return self._many(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND round = ? ORDER BY peer_id, manifest_version",
            (run_id, round_index),
        )

    def latest_applied_by_peer(self, run_id: str) -> dict[str, AppliedRow]:
        """Each peer's report of its latest round (of that round's newest version it reported)."""
        rows = self._many(
            AppliedRow,
            "SELECT a.* FROM applied a JOIN (SELECT peer_id, MAX(round) AS round FROM applied"
            " WHERE run_id = ? GROUP BY peer_id) latest"
            " ON a.peer_id = latest.peer_id AND a.round = latest.round WHERE a.run_id = ?"
            " ORDER BY a.manifest_version",
            (run_id, run_id),
        )
        return {row.peer_id: row for row in rows}

    def record_val_loss(
        self, run_id: str, round_index: int, peer_id: str, manifest_version: int, val_loss: float
    ) -> None:
        """The validation loss a peer reported with its applied report of that manifest version."""
        self._exec(
            "UPDATE applied SET val_loss = ? WHERE run_id = ? AND round = ? AND peer_id = ? AND manifest_version = ?",
            (val_loss, run_id, round_index, peer_id, manifest_version),
        )

    def latest_sample(self, run_id: str) -> AppliedRow | None:
        """The applied report with the newest text sample: of the newest round, the last reported (on
        a tie, the lowest peer id). The primary key's round order serves the sort (SQLite: 0.4 ms with a
        million reports, 5,000 rounds x 200 peers)."""
        rows = self._many(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND sample IS NOT NULL"
            " ORDER BY round DESC, reported_at DESC, peer_id LIMIT 1",
            (run_id,),
        )
        return rows[0] if rows else None

    def val_losses(self, run_id: str, first_round: int, last_round: int) -> dict[int, float]:
        """Per round, the mean validation loss reported with applied reports of its latest manifest
        version whose digest is the round's agreed one (else its majority; any, while it has neither):
        the loss of the model the swarm holds."""
        rows = self._rows(
            "SELECT a.round, AVG(a.val_loss) AS val_loss FROM applied a JOIN rounds r"
            " ON r.run_id = a.run_id AND r.round = a.round"
            " WHERE a.run_id = ? AND a.round BETWEEN ? AND ? AND a.val_loss IS NOT NULL"
            " AND a.manifest_version = r.manifest_version"
            " AND a.params_digest = COALESCE(r.agreed_digest, r.majority_digest, a.params_digest) GROUP BY a.round",
            (run_id, first_round, last_round),
        )
        return {int(r["round"]): float(r["val_loss"]) for r in rows}

    def applied_counts(self, run_id: str, first_round: int, last_round: int) -> dict[int, int]:
        """Per round, how many peers reported applying it (any version)."""
        rows = self._rows(
            "SELECT round, COUNT(DISTINCT peer_id) AS n FROM applied WHERE run_id = ? AND round BETWEEN ? AND ?"
            " GROUP BY round",
            (run_id, first_round, last_round),
        )
        return {int(r["round"]): int(r["n"]) for r in rows}

    # -- amended manifests --------------------------------------------------------------------

    def add_missing_report(self, row: MissingReportRow) -> bool:
        """Record a report; False when this reporter already reported this entry."""
        changed = self._exec(
            "INSERT INTO missing_reports (run_id, round, peer_id, reporter_id, reported_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, round, peer_id, reporter_id) DO NOTHING",
            (row.run_id, row.round, row.peer_id, row.reporter_id, row.reported_at),
        )
        return changed == 1

    def list_missing_reports(self, run_id: str, round_index: int) -> list[MissingReportRow]:
        return self._many(
            MissingReportRow,
            "SELECT * FROM missing_reports WHERE run_id = ? AND round = ? ORDER BY peer_id, reported_at, reporter_id",
            (run_id, round_index),
        )

    def rounds_with_pending_reports(self, window_rounds: int, run_id: str | None = None) -> list[tuple[str, int]]:
        """(run, round) pairs with an entry reported missing and not dropped yet, among rounds at
        most `window_rounds` before their run's open round (of one run, or all)."""
        sql = (
            "SELECT DISTINCT m.run_id, m.round FROM missing_reports m JOIN runs r ON r.run_id = m.run_id"
            " WHERE m.round >= r.current_round - ? AND NOT EXISTS"
            " (SELECT 1 FROM dropped_entries d WHERE d.run_id = m.run_id AND d.round = m.round"
            " AND d.peer_id = m.peer_id)"
        )
        params: tuple = (window_rounds,)
        if run_id is not None:
            sql, params = sql + " AND m.run_id = ?", (window_rounds, run_id)
        rows = self._rows(sql + " ORDER BY m.run_id, m.round", params)
        return [(row["run_id"], int(row["round"])) for row in rows]

    def amended_rounds(self, run_id: str, first_round: int) -> dict[int, int]:
        """Rounds from `first_round` on whose manifest was amended: round -> latest version."""
        rows = self._rows(
            "SELECT round, manifest_version FROM rounds WHERE run_id = ? AND round >= ?"
            " AND manifest_version > 1 ORDER BY round",
            (run_id, first_round),
        )
        return {int(r["round"]): int(r["manifest_version"]) for r in rows}

    def insert_dropped(self, row: DroppedRow) -> None:
        self._insert("dropped_entries", row)

    def list_dropped(self, run_id: str, round_index: int) -> list[DroppedRow]:
        return self._many(
            DroppedRow,
            "SELECT * FROM dropped_entries WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    # -- nonces -------------------------------------------------------------------------------

    def add_nonce(self, peer_id: str, nonce: int, seen_at: float) -> bool:
        """Record a used nonce; False when this peer already used it (a replay)."""
        changed = self._exec(
            "INSERT INTO nonces (peer_id, nonce, seen_at) VALUES (?, ?, ?) ON CONFLICT (peer_id, nonce) DO NOTHING",
            (peer_id, nonce, seen_at),
        )
        return changed == 1

    def prune_nonces(self, seen_before: float) -> int:
        return self._exec("DELETE FROM nonces WHERE seen_at < ?", (seen_before,))


class SqliteStorage(Storage):
    """A SQLite file in WAL mode: readers never block the writer, and a commit survives SIGKILL."""

    _begin_sql = "BEGIN IMMEDIATE"

    def __init__(self, path: Path, read_only: bool = False):
        self.path = Path(path)
        super().__init__(read_only)

    def replica(self) -> "SqliteStorage":
        return SqliteStorage(self.path, read_only=True)

    def _connect(self) -> sqlite3.Connection:
        try:
            # isolation_level=None: transactions are exactly the explicit BEGIN/COMMIT above.
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10.0)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit is in the WAL (OS page cache) before COMMIT returns, which is what
            # survives a killed process; only a power cut could lose the last commits.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            if self.read_only:
                conn.execute("PRAGMA query_only=1")
        except sqlite3.Error as e:
            raise StorageError(f"cannot open SQLite database {self.path}: {e}") from e
        return conn

    def _rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self._lock, self._failures():
            return [dict(row) for row in self._conn.execute(sql, params).fetchall()]

    def _many(self, row_type: type, sql: str, params: tuple) -> list:
        # Straight into the row type, by position when the columns come in its field order (a
        # SELECT * whose dataclass lists the table's columns in order), without a dict per row:
        # reading the 500 peers of a run's status or manifest takes a third of the time.
        with self._lock, self._failures():
            cursor = self._conn.execute(sql, params)
            rows = cursor.fetchall()
            names = tuple(column[0] for column in cursor.description)
        if names == _columns(row_type):
            return [row_type(*row) for row in rows]
        return [row_type(**dict(zip(names, row))) for row in rows]

    def _one(self, row_type: type, sql: str, params: tuple) -> Any:
        rows = self._many(row_type, sql, params)
        return rows[0] if rows else None

    def _exec(self, sql: str, params: tuple = ()) -> int:
        with self._lock, self._failures():
            return self._conn.execute(sql, params).rowcount

    def _is_unavailable(self, error: Exception) -> bool:
        if not isinstance(error, sqlite3.DatabaseError):
            return False
        code = getattr(error, "sqlite_errorcode", None)
        if code is None:
            # Python 3.10 has no error codes (3.11 added them): there, every operational error.
            return sys.version_info < (3, 11) and isinstance(error, sqlite3.OperationalError)
        return (code & 0xFF) in SQLITE_UNAVAILABLE_CODES

    def _in_transaction(self) -> bool:
        return self._conn.in_transaction


class PostgresStorage(Storage):
    """PostgreSQL through psycopg 3; the same SQL with %s placeholders."""

    def __init__(self, url: str, read_only: bool = False):
        self.url = url
        super().__init__(read_only)

    def replica(self) -> "PostgresStorage":
        return PostgresStorage(self.url, read_only=True)

    def _connect(self) -> Any:
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError as e:
            raise StorageError("PostgreSQL needs psycopg: pip install 'psycopg[binary]'") from e
        try:
            conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row, connect_timeout=10)
            if self.read_only:
                conn.execute("SET default_transaction_read_only = on")
            return conn
        except psycopg.Error as e:
            raise StorageError(f"cannot connect to PostgreSQL: {str(e).strip()}") from e

    @staticmethod
    def _sql(sql: str) -> str:
        # The shared SQL contains no literal '?' or '%', so this rewrite is exact.
        return sql.replace("?", "%s")

    def _rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self._lock, self._failures():
            self._reconnect_if_lost()
            return list(self._conn.execute(self._sql(sql), params).fetchall())

    def _exec(self, sql: str, params: tuple = ()) -> int:
        with self._lock, self._failures():
            self._reconnect_if_lost()
            return self._conn.execute(self._sql(sql), params).rowcount

    def _reconnect_if_lost(self) -> None:
        """Between transactions, replace a connection the server dropped (a restart, a failover);
        inside one, never: its earlier statements died with the old connection."""
        if self._depth or self._closed or not self._conn.closed:
            return
        try:
            self._conn = self._connect()
        except StorageError as e:
            self.num_failures += 1
            raise StorageUnavailable(f"{e}; retry later") from e
        log.warning("reconnected to PostgreSQL after the connection was lost")

    def _is_unavailable(self, error: Exception) -> bool:
        import psycopg

        # OperationalError: connection lost (class 08), disk full or out of memory (53), shutdown
        # or cancel (57), I/O (58), serialization failure or deadlock (40). A read-only standby
        # after a failover answers 25006.
        return isinstance(error, (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction))

    def _in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return not self._conn.closed and self._conn.info.transaction_status != TransactionStatus.IDLE


def open_storage(url: str) -> Storage:
    """``sqlite:///relative.db``, ``sqlite:////absolute.db``, a bare path, or ``postgresql://``."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStorage(url)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise StorageError(f"bad SQLite URL {url!r}: use sqlite:///relative.db")
        path = path[1:]
    else:
        path = url
    if not path or path == ":memory:":
        raise StorageError("the coordinator needs a database file, not an in-memory database")
    return SqliteStorage(Path(path))
