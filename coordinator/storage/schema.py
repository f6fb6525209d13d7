"""The coordinator's SQL schema, as numbered migrations shared by SQLite and PostgreSQL.

The DDL sticks to the common subset of both (TEXT, BIGINT, DOUBLE PRECISION, composite primary
keys, plain views), so one list serves both backends. `schema_migrations` records which versions
a database has; opening a database applies the missing ones in order inside one transaction. A
released migration is never edited: a change is a new entry appended to `MIGRATIONS`.

A round row with ``closed_at`` NULL is the run's open round. A round's latest manifest is its rows
in ``submissions`` (refused once the round closes) less its rows in ``dropped_entries``
(amendments; ``rounds.manifest_version`` counts them) and less those a bounded round did not pick
(``selections.picked`` 0): the view ``manifest_entries``, the one place that rule is written. A migration that adds a column to ``submissions`` recreates the view
(PostgreSQL fixes a view's columns when it is created).
"""

from __future__ import annotations

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE runs (
                run_id TEXT PRIMARY KEY,
                name TEXT NOT NULL,
                config_json TEXT NOT NULL,
                join_token_hashes TEXT NOT NULL,
                state TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                closed_at DOUBLE PRECISION,
                current_round BIGINT NOT NULL
            )""",
            """CREATE TABLE peers (
                run_id TEXT NOT NULL REFERENCES runs (run_id),
                peer_id TEXT NOT NULL,
                public_key TEXT NOT NULL,
                peer_index BIGINT NOT NULL,
                status TEXT NOT NULL,
                reason TEXT,
                activity TEXT NOT NULL,
                device TEXT NOT NULL,
                listen_multiaddrs TEXT NOT NULL,
                bandwidth_mbps DOUBLE PRECISION,
                last_loss DOUBLE PRECISION,
                joined_at DOUBLE PRECISION NOT NULL,
                last_seen_at DOUBLE PRECISION NOT NULL,
                member_since_round BIGINT NOT NULL,
                progress_round BIGINT,
                PRIMARY KEY (run_id, peer_id),
                UNIQUE (run_id, peer_index)
            )""",
            "CREATE INDEX peers_by_peer_id ON peers (peer_id)",
            """CREATE TABLE rounds (
                run_id TEXT NOT NULL REFERENCES runs (run_id),
                round BIGINT NOT NULL,
                opened_at DOUBLE PRECISION NOT NULL,
                deadline DOUBLE PRECISION NOT NULL,
                closed_at DOUBLE PRECISION,
                majority_digest TEXT,
                PRIMARY KEY (run_id, round)
            )""",
            """CREATE TABLE submissions (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                packet_digest TEXT NOT NULL,
                packet_size_bytes BIGINT NOT NULL,
                train_loss DOUBLE PRECISION NOT NULL,
                compute_s DOUBLE PRECISION NOT NULL,
                encode_s DOUBLE PRECISION NOT NULL,
                multiaddrs TEXT NOT NULL,
                submitted_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, round, peer_id)
            )""",
            """CREATE TABLE applied (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                params_digest TEXT NOT NULL,
                reported_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, round, peer_id)
            )""",
            """CREATE TABLE nonces (
                peer_id TEXT NOT NULL,
                nonce BIGINT NOT NULL,
                seen_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (peer_id, nonce)
            )""",
            "CREATE INDEX nonces_by_seen_at ON nonces (seen_at)",
        ),
    ),
    (
        2,
        # Packets a peer left out of round r, as JSON {peer id: reason}; NULL: none.
        ("ALTER TABLE applied ADD COLUMN refused TEXT",),
    ),
    (
        3,
        # The upload rate a peer's operator stated at join (Mbps); NULL: not stated.
        ("ALTER TABLE peers ADD COLUMN uplink_mbps DOUBLE PRECISION",),
    ),
    (
        4,
        # Written by the readiness check (`Storage.probe`): row 0 gets a fresh random payload on
        # each probe, committed; other rows are only inserted in transactions that roll back.
        (
            """CREATE TABLE readiness_probe (
                id BIGINT PRIMARY KEY,
                probed_at DOUBLE PRECISION NOT NULL,
                payload TEXT
            )""",
            "INSERT INTO readiness_probe (id, probed_at, payload) VALUES (0, 0, NULL)",
        ),
    ),
    (
        5,
        # Amended manifests (coordinator/rules/amendments.py): a closed round's manifest version, the
        # version each applied report is of, the latest round whose packet a peer withheld (NULL:
        # in good standing), who reported which entry missing, and the entries dropped.
        (
            "ALTER TABLE rounds ADD COLUMN manifest_version BIGINT NOT NULL DEFAULT 1",
            "ALTER TABLE applied ADD COLUMN manifest_version BIGINT NOT NULL DEFAULT 1",
            "ALTER TABLE peers ADD COLUMN withheld_round BIGINT",
            """CREATE TABLE missing_reports (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                reporter_id TEXT NOT NULL,
                reported_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, round, peer_id, reporter_id)
            )""",
            """CREATE TABLE dropped_entries (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                reason TEXT NOT NULL,
                manifest_version BIGINT NOT NULL,
                dropped_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, round, peer_id)
            )""",
        ),
    ),
    (
        6,
        # Inner steps a peer reported done in its progress_round (heartbeats); NULL: not reported.
        ("ALTER TABLE peers ADD COLUMN inner_step BIGINT",),
    ),
    (
        7,
        # Whole-swarm restart (coordinator/recovery.py): when the run lost its last live peer, when
        # the first one came back, the rewinds so far (JSON list); the state a peer said it holds.
        (
            "ALTER TABLE runs ADD COLUMN paused_since DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN state_wait_since DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN rewinds TEXT",
            "ALTER TABLE peers ADD COLUMN state_round BIGINT",
            "ALTER TABLE peers ADD COLUMN state_digest TEXT",
        ),
    ),
    (
        8,
        # Agreed digests and standing (coordinator/rules/votes.py, standing.py): a round's agreed digest (fixed once
        # set) and how many votes its latest version has; applied reports one per manifest version,
        # each marked whether it is a vote (the table is rebuilt for its new key); a peer's latest
        # round whose manifest holds a packet of its (NULL: on probation); the run's secret for the
        # join proof-of-work salts (coordinator/join_guard.py; '' until first needed). Rounds whose
        # majority was recorded before votes existed keep it as their agreed digest.
        (
            "ALTER TABLE rounds ADD COLUMN agreed_digest TEXT",
            "ALTER TABLE rounds ADD COLUMN num_votes BIGINT NOT NULL DEFAULT 0",
            "UPDATE rounds SET agreed_digest = majority_digest WHERE majority_digest IS NOT NULL",
            "ALTER TABLE runs ADD COLUMN join_secret TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE peers ADD COLUMN last_contributed_round BIGINT",
            """UPDATE peers SET last_contributed_round = (
                SELECT MAX(s.round) FROM submissions s JOIN rounds r ON r.run_id = s.run_id AND r.round = s.round
                WHERE s.run_id = peers.run_id AND s.peer_id = peers.peer_id AND r.closed_at IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM dropped_entries d WHERE d.run_id = s.run_id
                                AND d.round = s.round AND d.peer_id = s.peer_id)
            )""",
            # Columns in the order of coordinator.storage.rows.AppliedRow (rows are read by position).
            """CREATE TABLE applied_reports (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                params_digest TEXT NOT NULL,
                reported_at DOUBLE PRECISION NOT NULL,
                refused TEXT,
                manifest_version BIGINT NOT NULL,
                vote BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (run_id, round, peer_id, manifest_version)
            )""",
            "INSERT INTO applied_reports (run_id, round, peer_id, params_digest, reported_at, refused,"
            " manifest_version, vote) SELECT run_id, round, peer_id, params_digest, reported_at, refused,"
            " manifest_version, 0 FROM applied",
            "DROP TABLE applied",
            "ALTER TABLE applied_reports RENAME TO applied",
            # Standing: a peer's packets in a window of rounds (coordinator/rules/standing.py), one seek per peer.
            "CREATE INDEX submissions_by_peer ON submissions (run_id, peer_id, round)",
        ),
    ),
    (
        9,
        # The validation loss a peer reported with its applied report (nodes evaluate every few
        # rounds; NULL: not evaluated).
        ("ALTER TABLE applied ADD COLUMN val_loss DOUBLE PRECISION",),
    ),
    (
        10,
        # Contribution scoring (protocol/scoring.py): the scores a peer reported with its applied
        # report (JSON {peer id: [loss_delta, cosine]}; NULL: none); whether a round's verdicts were
        # taken; a peer's standing (JSON of protocol.scoring.Standing; NULL: never judged) and, while
        # an exclusion is in force, the round whose verdict excluded it (for the waited-for query).
        (
            "ALTER TABLE applied ADD COLUMN scores TEXT",
            "ALTER TABLE rounds ADD COLUMN scored BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE peers ADD COLUMN standing TEXT",
            "ALTER TABLE peers ADD COLUMN excluded_round BIGINT",
        ),
    ),
    (
        11,
        # What a peer says it is stuck on (its heartbeat's `detail`; NULL: nothing).
        ("ALTER TABLE peers ADD COLUMN detail TEXT",),
    ),
    (
        12,
        # A text sample of the model a peer sent with its validation loss (NULL: none).
        ("ALTER TABLE applied ADD COLUMN sample TEXT",),
    ),
    (
        13,
        # Truth by standing, not headcount (coordinator/rules/votes.py, "Agreed digests"): the leaf hashes of
        # the digest an applied report names (hex; NULL: sent none), a peer's credit (protocol/scoring.py
        # rule 5, also in its standing JSON: here for the tally's query), and a round's dispute as
        # decided (JSON; NULL: none).
        (
            "ALTER TABLE applied ADD COLUMN leaves TEXT",
            "ALTER TABLE peers ADD COLUMN credit BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE rounds ADD COLUMN dispute TEXT",
        ),
    ),
    (
        14,
        # Manifest entries: a round's latest manifest, its submissions less the entries amendments
        # dropped; columns in the order of coordinator.storage.rows.SubmissionRow.
        (
            """CREATE VIEW manifest_entries AS
            SELECT s.run_id, s.round, s.peer_id, s.packet_digest, s.packet_size_bytes, s.train_loss,
                   s.compute_s, s.encode_s, s.multiaddrs, s.submitted_at
            FROM submissions s
            WHERE NOT EXISTS (SELECT 1 FROM dropped_entries d
                              WHERE d.run_id = s.run_id AND d.round = s.round AND d.peer_id = s.peer_id)""",
        ),
    ),
    (
        15,
        # Whether peers elsewhere can dial a member (coordinator/reachability.py: 1 yes, 0 no; NULL:
        # not known), as its latest join found.
        ("ALTER TABLE peers ADD COLUMN reachable BIGINT",),
    ),
    (
        16,
        # The heartbeat period a member was last told (coordinator/rules/membership.py, "Heartbeat
        # period"): it is gone after four of them, or the run's heartbeat timeout, whichever is
        # longer (NULL: told none yet; the timeout alone). The round before which a run's per-peer
        # rows were pruned (coordinator/rules/retention.py).
        (
            "ALTER TABLE peers ADD COLUMN heartbeat_period_s DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN pruned_before BIGINT NOT NULL DEFAULT 0",
        ),
    ),
    (
        17,
        # Snapshots in the packet mirror (coordinator/rules/snapshots.py): the size a report's answer
        # signed a snapshot PUT URL for (NULL: it was handed none), and the snapshot digest its peer
        # reported once the store took it (NULL: not reported).
        (
            "ALTER TABLE applied ADD COLUMN snapshot_bytes BIGINT",
            "ALTER TABLE applied ADD COLUMN snapshot_digest TEXT",
        ),
    ),
    (
        18,
        # Bounded rounds (protocol/selection.py, coordinator/rules/rounds.py): a bounded round's pick
        # at its close, one row per submission with the rule's inputs and its rank (columns in the
        # order of coordinator.storage.rows.SelectionRow), and the round whose agreed digest seeded
        # it (NULL: none agreed yet, or unbounded). A submission with ``picked`` 0 is not in the
        # manifest: the view leaves it out, like a dropped entry.
        (
            """CREATE TABLE selections (
                run_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                peer_id TEXT NOT NULL,
                proven BIGINT NOT NULL,
                waited_rounds BIGINT NOT NULL,
                rank BIGINT NOT NULL,
                tier_size BIGINT NOT NULL,
                tier_places BIGINT NOT NULL,
                picked BIGINT NOT NULL,
                PRIMARY KEY (run_id, round, peer_id)
            )""",
            "ALTER TABLE rounds ADD COLUMN seed_round BIGINT",
            "DROP VIEW manifest_entries",
            """CREATE VIEW manifest_entries AS
            SELECT s.run_id, s.round, s.peer_id, s.packet_digest, s.packet_size_bytes, s.train_loss,
                   s.compute_s, s.encode_s, s.multiaddrs, s.submitted_at
            FROM submissions s
            WHERE NOT EXISTS (SELECT 1 FROM dropped_entries d
                              WHERE d.run_id = s.run_id AND d.round = s.round AND d.peer_id = s.peer_id)
            AND NOT EXISTS (SELECT 1 FROM selections x
                            WHERE x.run_id = s.run_id AND x.round = s.round AND x.peer_id = s.peer_id
                            AND x.picked = 0)""",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1][0]

CREATE_MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version BIGINT PRIMARY KEY,
    applied_at DOUBLE PRECISION NOT NULL
)"""
