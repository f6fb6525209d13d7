"""The coordinator's persistence: runs, peers, rounds, submissions, applied reports, amendments and
used nonces, in SQLite (the default) or PostgreSQL.

| module | owns |
| --- | --- |
| `rows` | the row dataclasses, one per table, fields in column order |
| `database` | one connection: transactions, the database's failures as `StorageUnavailable`, the readiness probe, migrations; the SQLite and PostgreSQL backends |
| `schema` | the numbered migrations, and the ``manifest_entries`` view |
| `queries` | `Storage`: every question the coordinator asks, over a `Database` |

    from coordinator.storage import open_storage, RoundRow
"""

from coordinator.storage.database import Database, PostgresDatabase, SqliteDatabase, open_database
from coordinator.storage.queries import Storage, open_storage
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

__all__ = [
    "AppliedRow",
    "Database",
    "DroppedRow",
    "MemberRow",
    "MissingReportRow",
    "PeerRow",
    "PostgresDatabase",
    "RoundRow",
    "RoundStats",
    "RunRow",
    "SelectionRow",
    "SqliteDatabase",
    "Storage",
    "SubmissionRow",
    "open_database",
    "open_storage",
]
