"""Every query the coordinator makes: `Storage`, one method per question, over a `Database`.

The rules (coordinator/rules/) and the views ask; the SQL here only fetches and writes rows, and
decides nothing: who a round waits for, when an entry is dropped, what is agreed are decided in
Python by the rules that own them. One definition is shared in SQL: a round's latest manifest is
the view ``manifest_entries`` (coordinator/storage/schema.py), and every query about manifests
reads it.

Statements use ``?`` placeholders and the SQL that SQLite and PostgreSQL share; the connection
(`self.db`, coordinator/storage/database.py) adapts them to its engine.

    storage = open_storage("sqlite:///coordinator.db")
    with storage.transaction():
        storage.update_peer(run_id, peer_id, status="gone", reason="silent")
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from typing import Any

from coordinator.storage.database import Database, open_database
from coordinator.storage.rows import (
    AppliedRow,
    DroppedRow,
    MemberRow,
    MissingReportRow,
    PeerRow,
    RoundRow,
    RoundStats,
    RunRow,
    SelectionRow,
    SubmissionRow,
)


class Storage:
    """The coordinator's questions to its database. Each is a statement or two; a caller that
    needs several to agree runs them inside `transaction()`."""

    def __init__(self, db: Database):
        self.db = db

    @property
    def num_failures(self) -> int:
        """Operations the database failed so far (the service notices outages by it)."""
        return self.db.num_failures

    def transaction(self, serialised: bool = True) -> AbstractContextManager[None]:
        return self.db.transaction(serialised)

    def probe(self, now: float) -> None:
        """The readiness check behind ``/readyz`` (`Database.probe`)."""
        self.db.probe(now)

    def announce(self, run_id: str) -> None:
        """Inside a write transaction: wake `run_id`'s long-polls on the other replicas once it
        commits (`Database.announce`)."""
        self.db.announce(run_id)

    def replica(self) -> "Storage":
        """The same questions over a second, read-only connection (`Database.replica`): the app
        reads its heavy views there, on a thread of its own."""
        return Storage(self.db.replica())

    def close(self) -> None:
        self.db.close()

    # -- runs ---------------------------------------------------------------------------------

    def insert_run(self, row: RunRow) -> None:
        self.db.insert("runs", row)

    def get_run(self, run_id: str) -> RunRow | None:
        return self.db.one(RunRow, "SELECT * FROM runs WHERE run_id = ?", (run_id,))

    def list_runs(self) -> list[RunRow]:
        return self.db.many(RunRow, "SELECT * FROM runs ORDER BY created_at, run_id", ())

    def active_run_ids(self) -> list[str]:
        rows = self.db.rows("SELECT run_id FROM runs WHERE state IN ('waiting', 'running')")
        return [row["run_id"] for row in rows]

    def run_ids_ended_since(self, since: float) -> list[str]:
        """The runs that finished or were closed at `since` or later."""
        rows = self.db.rows(
            "SELECT run_id FROM runs WHERE state IN ('finished', 'closed') AND closed_at >= ?", (since,)
        )
        return [row["run_id"] for row in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        self.db.update("runs", RunRow, {"run_id": run_id}, fields)

    # -- peers --------------------------------------------------------------------------------

    def insert_peer(self, row: PeerRow) -> None:
        self.db.insert("peers", row)

    def get_peer(self, run_id: str, peer_id: str) -> PeerRow | None:
        return self.db.one(PeerRow, "SELECT * FROM peers WHERE run_id = ? AND peer_id = ?", (run_id, peer_id))

    def find_public_key(self, peer_id: str) -> str | None:
        """The key of a peer id in any run (ids derive from keys, so all runs agree)."""
        rows = self.db.rows("SELECT public_key FROM peers WHERE peer_id = ? LIMIT 1", (peer_id,))
        return rows[0]["public_key"] if rows else None

    def list_peers(self, run_id: str) -> list[PeerRow]:
        return self.db.many(PeerRow, "SELECT * FROM peers WHERE run_id = ? ORDER BY peer_index", (run_id,))

    def silent_live_peers(self, run_id: str, seen_before: float, now: float) -> list[PeerRow]:
        """Live peers last seen before `seen_before` and more than four of their told heartbeat
        periods before `now`: the heartbeat timeout's candidates, found by the database rather than
        by reading every peer on every request."""
        return self.db.many(
            PeerRow,
            "SELECT * FROM peers WHERE run_id = ? AND status = 'live' AND last_seen_at < ?"
            " AND last_seen_at + 4 * COALESCE(heartbeat_period_s, 0) < ? ORDER BY peer_index",
            (run_id, seen_before, now),
        )

    def dialable_peers_doing(self, run_id: str, activity: str, now: float, exclude: str, limit: int) -> list[PeerRow]:
        """Live peers other than `exclude` whose latest heartbeat said `activity`, beat within two
        of their told periods before `now`, and that no dial-back found undialable (reachable not
        false); most recently seen first, at most `limit`."""
        return self.db.many(
            PeerRow,
            "SELECT * FROM peers WHERE run_id = ? AND status = 'live' AND activity = ? AND peer_id <> ?"
            " AND last_seen_at + 2 * COALESCE(heartbeat_period_s, 0) >= ? AND (reachable IS NULL OR reachable <> 0)"
            " ORDER BY last_seen_at DESC, peer_index LIMIT ?",
            (run_id, activity, exclude, now, limit),
        )

    def count_live_peers(self, run_id: str) -> int:
        rows = self.db.rows("SELECT COUNT(*) AS n FROM peers WHERE run_id = ? AND status = 'live'", (run_id,))
        return int(rows[0]["n"])

    def next_peer_index(self, run_id: str) -> int:
        rows = self.db.rows("SELECT MAX(peer_index) AS m FROM peers WHERE run_id = ?", (run_id,))
        top = rows[0]["m"]
        return 0 if top is None else int(top) + 1

    def update_peer(self, run_id: str, peer_id: str, **fields: Any) -> None:
        self.db.update("peers", PeerRow, {"run_id": run_id, "peer_id": peer_id}, fields)

    def credits(self, run_id: str) -> dict[str, int]:
        """The peers of the run that have credit (protocol/scoring.py, rule 5), with it; the others have none."""
        return {
            row["peer_id"]: int(row["credit"])
            for row in self.db.rows("SELECT peer_id, credit FROM peers WHERE run_id = ? AND credit > 0", (run_id,))
        }

    def members_of_round(self, run_id: str, round_index: int, window_rounds: int) -> list[MemberRow]:
        """The live members of round r (members since r opened or before), by peer index, each with
        whether it submitted to r and whether the manifest of one of the `window_rounds` rounds
        before r holds a packet of its: what the standing rule weighs (coordinator/rules/standing.py).
        Every heartbeat may ask: one seek per peer (index ``submissions_by_peer``)."""
        rows = self.db.rows(
            "SELECT p.peer_id, s.peer_id IS NOT NULL AS submitted, EXISTS (SELECT 1 FROM manifest_entries c"
            " WHERE c.run_id = p.run_id AND c.peer_id = p.peer_id AND c.round >= ? AND c.round < ?) AS contributor,"
            " p.standing IS NOT NULL AS judged, p.credit, p.withheld_round, p.excluded_round"
            " FROM peers p LEFT JOIN submissions s ON s.run_id = p.run_id AND s.round = ? AND s.peer_id = p.peer_id"
            " WHERE p.run_id = ? AND p.status = 'live' AND p.member_since_round <= ?"
            " ORDER BY p.peer_index",
            (round_index - window_rounds, round_index, round_index, run_id, round_index),
        )
        return [
            MemberRow(
                peer_id=row["peer_id"],
                submitted=bool(row["submitted"]),
                contributor=bool(row["contributor"]),
                judged=bool(row["judged"]),
                credit=int(row["credit"]),
                withheld_round=row["withheld_round"],
                excluded_round=row["excluded_round"],
            )
            for row in rows
        ]

    def mark_contributors(self, run_id: str, round_index: int) -> None:
        """Round r closed: its manifest's peers contributed to it last."""
        self.db.execute(
            "UPDATE peers SET last_contributed_round = ? WHERE run_id = ? AND peer_id IN"
            " (SELECT peer_id FROM manifest_entries WHERE run_id = ? AND round = ?)",
            (round_index, run_id, run_id, round_index),
        )

    def refresh_last_contributed(self, run_id: str, peer_id: str) -> None:
        """Recompute a peer's latest closed round whose manifest holds a packet of its, after an
        amendment dropped one."""
        self.db.execute(
            "UPDATE peers SET last_contributed_round = (SELECT MAX(m.round) FROM manifest_entries m JOIN rounds r"
            " ON r.run_id = m.run_id AND r.round = m.round WHERE m.run_id = ? AND m.peer_id = ?"
            " AND r.closed_at IS NOT NULL) WHERE run_id = ? AND peer_id = ?",
            (run_id, peer_id, run_id, peer_id),
        )

    def contributed_rounds_before(self, run_id: str, peer_id: str, round_index: int) -> int:
        """Rounds before r whose manifest holds a packet of this peer."""
        rows = self.db.rows(
            "SELECT COUNT(*) AS n FROM manifest_entries WHERE run_id = ? AND peer_id = ? AND round < ?",
            (run_id, peer_id, round_index),
        )
        return int(rows[0]["n"])

    # -- rounds -------------------------------------------------------------------------------

    def insert_round(self, row: RoundRow) -> None:
        self.db.insert("rounds", row)

    def get_round(self, run_id: str, round_index: int) -> RoundRow | None:
        return self.db.one(RoundRow, "SELECT * FROM rounds WHERE run_id = ? AND round = ?", (run_id, round_index))

    def closed_rounds(self, run_id: str, limit: int) -> list[RoundRow]:
        """The latest `limit` closed rounds, oldest first."""
        rows = self.db.many(
            RoundRow,
            "SELECT * FROM rounds WHERE run_id = ? AND closed_at IS NOT NULL ORDER BY round DESC LIMIT ?",
            (run_id, limit),
        )
        return rows[::-1]

    def latest_agreed_round(self, run_id: str) -> RoundRow | None:
        """The latest round with an agreed parameter digest."""
        return self.db.one(
            RoundRow,
            "SELECT * FROM rounds WHERE run_id = ? AND agreed_digest IS NOT NULL ORDER BY round DESC LIMIT 1",
            (run_id,),
        )

    def amended_rounds(self, run_id: str, first_round: int) -> dict[int, int]:
        """Rounds from `first_round` on whose manifest was amended: round -> latest version."""
        rows = self.db.rows(
            "SELECT round, manifest_version FROM rounds WHERE run_id = ? AND round >= ?"
            " AND manifest_version > 1 ORDER BY round",
            (run_id, first_round),
        )
        return {int(r["round"]): int(r["manifest_version"]) for r in rows}

    def delete_rounds_from(self, run_id: str, first_round: int) -> None:
        """Forget rounds >= first_round and everything recorded for them (a rewind, recovery.py)."""
        for table in ("dropped_entries", "missing_reports", "applied", "selections", "submissions", "rounds"):
            self.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND round >= ?", (run_id, first_round))

    def prune_rounds(self, run_id: str, first_round: int, end_round: int) -> None:
        """Delete the per-peer rows of rounds first_round <= r < end_round, keeping their round rows
        and manifests (coordinator/rules/retention.py): first the submissions no manifest holds,
        then the dropped entries and picks (which the manifest view no longer needs), reports and
        votes."""
        span = (run_id, first_round, end_round)
        self.db.execute(
            "DELETE FROM submissions WHERE run_id = ? AND round >= ? AND round < ? AND NOT EXISTS"
            " (SELECT 1 FROM manifest_entries m WHERE m.run_id = submissions.run_id"
            " AND m.round = submissions.round AND m.peer_id = submissions.peer_id)",
            span,
        )
        for table in ("dropped_entries", "selections", "missing_reports", "applied"):
            self.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND round >= ? AND round < ?", span)

    def update_round(self, run_id: str, round_index: int, **fields: Any) -> None:
        self.db.update("rounds", RoundRow, {"run_id": run_id, "round": round_index}, fields)

    # -- submissions and manifests ------------------------------------------------------------

    def insert_submission(self, row: SubmissionRow) -> None:
        self.db.insert("submissions", row)

    def get_submission(self, run_id: str, round_index: int, peer_id: str) -> SubmissionRow | None:
        return self.db.one(
            SubmissionRow,
            "SELECT * FROM submissions WHERE run_id = ? AND round = ? AND peer_id = ?",
            (run_id, round_index, peer_id),
        )

    def list_submissions(self, run_id: str, round_index: int) -> list[SubmissionRow]:
        """Every submission to round r, by peer id: its first manifest version, dropped entries too."""
        return self.db.many(
            SubmissionRow,
            "SELECT * FROM submissions WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    def count_submissions(self, run_id: str, round_index: int) -> int:
        rows = self.db.rows(
            "SELECT COUNT(*) AS n FROM submissions WHERE run_id = ? AND round = ?",
            (run_id, round_index),
        )
        return int(rows[0]["n"])

    def manifest_entries(self, run_id: str, round_index: int) -> list[SubmissionRow]:
        """Round r's latest manifest, by peer id (while r is open: what was submitted so far)."""
        return self.db.many(
            SubmissionRow,
            "SELECT * FROM manifest_entries WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    def insert_selections(self, rows: list[SelectionRow]) -> None:
        """A bounded round's pick, written as it closes: one row per submission."""
        for row in rows:
            self.db.insert("selections", row)

    def list_selections(self, run_id: str, round_index: int) -> list[SelectionRow]:
        """A bounded round's pick (empty: unbounded, or still open), by peer id."""
        return self.db.many(
            SelectionRow,
            "SELECT * FROM selections WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    def selections_between(self, run_id: str, first_round: int, last_round: int) -> dict[int, list[SelectionRow]]:
        """The picks of the bounded rounds in [first, last], by round (status history)."""
        rows = self.db.many(
            SelectionRow,
            "SELECT * FROM selections WHERE run_id = ? AND round BETWEEN ? AND ? ORDER BY round, peer_id",
            (run_id, first_round, last_round),
        )
        by_round: dict[int, list[SelectionRow]] = {}
        for row in rows:
            by_round.setdefault(row.round, []).append(row)
        return by_round

    def manifest_peers(self, run_id: str, round_index: int, version: int | None = None) -> set[str]:
        """The publishers in version `version` of round r's manifest (None: its latest). An older
        version also holds the entries dropped after it."""
        rows = self.db.rows(
            "SELECT peer_id FROM manifest_entries WHERE run_id = ? AND round = ?", (run_id, round_index)
        )
        peers = {r["peer_id"] for r in rows}
        if version is not None:
            peers |= {d.peer_id for d in self.list_dropped(run_id, round_index) if d.manifest_version > version}
        return peers

    def round_stats(self, run_id: str, first_round: int, last_round: int) -> dict[int, RoundStats]:
        rows = self.db.rows(
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
        manifest version: reports are immutable (the rules compare the two)."""
        return (
            self.db.execute(
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

    def get_applied(self, run_id: str, round_index: int, peer_id: str, manifest_version: int) -> AppliedRow | None:
        return self.db.one(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND round = ? AND peer_id = ? AND manifest_version = ?",
            (run_id, round_index, peer_id, manifest_version),
        )

    def list_applied(self, run_id: str, round_index: int) -> list[AppliedRow]:
        """Every report of round r, all versions, by peer then version."""
        return self.db.many(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND round = ? ORDER BY peer_id, manifest_version",
            (run_id, round_index),
        )

    def update_applied(self, row: AppliedRow, **fields: Any) -> None:
        keys = {"run_id": row.run_id, "round": row.round, "peer_id": row.peer_id}
        self.db.update("applied", AppliedRow, keys | {"manifest_version": row.manifest_version}, fields)

    def count_snapshot_uploaders(self, run_id: str, round_index: int, manifest_version: int) -> int:
        """Reports of that round and version whose answers carried a snapshot PUT URL."""
        rows = self.db.rows(
            "SELECT COUNT(*) AS n FROM applied WHERE run_id = ? AND round = ? AND manifest_version = ?"
            " AND snapshot_bytes IS NOT NULL",
            (run_id, round_index, manifest_version),
        )
        return int(rows[0]["n"])

    def newest_mirrored_snapshot(self, run_id: str) -> AppliedRow | None:
        """The report, of the latest round that has one, of a snapshot uploaded to the packet mirror
        whose parameters are its round's agreed digest (of the latest manifest version)."""
        return self.db.one(
            AppliedRow,
            "SELECT a.* FROM applied a JOIN rounds r ON a.run_id = r.run_id AND a.round = r.round"
            " WHERE a.run_id = ? AND a.snapshot_digest IS NOT NULL AND a.params_digest = r.agreed_digest"
            " AND a.manifest_version = r.manifest_version ORDER BY a.round DESC, a.reported_at LIMIT 1",
            (run_id,),
        )

    def latest_applied_by_peer(self, run_id: str) -> dict[str, AppliedRow]:
        """Each peer's report of its latest round (of that round's newest version it reported)."""
        rows = self.db.many(
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
        self.db.execute(
            "UPDATE applied SET val_loss = ? WHERE run_id = ? AND round = ? AND peer_id = ? AND manifest_version = ?",
            (val_loss, run_id, round_index, peer_id, manifest_version),
        )

    def refusals(self, run_id: str, first_round: int, last_round: int) -> dict[int, dict[str, str]]:
        """Per round, the packets peers left out: {peer id: reason}, the first reporter's reason."""
        rows = self.db.rows(
            "SELECT round, refused FROM applied WHERE run_id = ? AND round BETWEEN ? AND ?"
            " AND refused IS NOT NULL ORDER BY round, reported_at, peer_id",
            (run_id, first_round, last_round),
        )
        out: dict[int, dict[str, str]] = {}
        for row in rows:
            for peer_id, reason in json.loads(row["refused"]).items():
                out.setdefault(int(row["round"]), {}).setdefault(peer_id, reason)
        return out

    def latest_sample(self, run_id: str) -> AppliedRow | None:
        """The applied report with the newest text sample: of the newest round, the last reported (on
        a tie, the lowest peer id). The primary key's round order serves the sort (SQLite: 0.4 ms with a
        million reports, 5,000 rounds x 200 peers)."""
        return self.db.one(
            AppliedRow,
            "SELECT * FROM applied WHERE run_id = ? AND sample IS NOT NULL"
            " ORDER BY round DESC, reported_at DESC, peer_id LIMIT 1",
            (run_id,),
        )

    def val_losses(self, run_id: str, first_round: int, last_round: int) -> dict[int, float]:
        """Per round, the mean validation loss reported with applied reports of its latest manifest
        version whose digest is the round's agreed one (else its majority; any, while it has neither):
        the loss of the model the swarm holds."""
        rows = self.db.rows(
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
        rows = self.db.rows(
            "SELECT round, COUNT(DISTINCT peer_id) AS n FROM applied WHERE run_id = ? AND round BETWEEN ? AND ?"
            " GROUP BY round",
            (run_id, first_round, last_round),
        )
        return {int(r["round"]): int(r["n"]) for r in rows}

    # -- missing reports and dropped entries --------------------------------------------------

    def add_missing_report(self, row: MissingReportRow) -> bool:
        """Record a report; False when this reporter already reported this entry."""
        changed = self.db.execute(
            "INSERT INTO missing_reports (run_id, round, peer_id, reporter_id, reported_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, round, peer_id, reporter_id) DO NOTHING",
            (row.run_id, row.round, row.peer_id, row.reporter_id, row.reported_at),
        )
        return changed == 1

    def list_missing_reports(self, run_id: str, round_index: int) -> list[MissingReportRow]:
        return self.db.many(
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
        rows = self.db.rows(sql + " ORDER BY m.run_id, m.round", params)
        return [(row["run_id"], int(row["round"])) for row in rows]

    def insert_dropped(self, row: DroppedRow) -> None:
        self.db.insert("dropped_entries", row)

    def list_dropped(self, run_id: str, round_index: int) -> list[DroppedRow]:
        return self.db.many(
            DroppedRow,
            "SELECT * FROM dropped_entries WHERE run_id = ? AND round = ? ORDER BY peer_id",
            (run_id, round_index),
        )

    # -- nonces -------------------------------------------------------------------------------

    def add_nonce(self, peer_id: str, nonce: int, seen_at: float) -> bool:
        """Record a used nonce; False when this peer already used it (a replay)."""
        changed = self.db.execute(
            "INSERT INTO nonces (peer_id, nonce, seen_at) VALUES (?, ?, ?) ON CONFLICT (peer_id, nonce) DO NOTHING",
            (peer_id, nonce, seen_at),
        )
        return changed == 1

    def prune_nonces(self, seen_before: float) -> int:
        return self.db.execute("DELETE FROM nonces WHERE seen_at < ?", (seen_before,))


def open_storage(url: str) -> Storage:
    """The storage at `url`: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, a bare path, or
    ``postgresql://`` (`open_database`)."""
    return Storage(open_database(url))
