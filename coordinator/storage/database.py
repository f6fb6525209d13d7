"""The connection layer: one database connection, its transactions, its failures and its schema.

`Database` runs SQL and knows nothing of runs or rounds (coordinator/storage/queries.py does).
Two backends implement its hooks: `SqliteDatabase` (stdlib ``sqlite3``, a real file in WAL mode,
the default) and `PostgresDatabase` (psycopg 3, chosen by a ``postgresql://`` URL). Both run the
same statements, written with ``?`` placeholders; what differs between engines (the placeholder,
how a transaction begins, which errors mean "the database is down", reconnecting) stays here.
`open_database(url)` picks the backend.

Every state change goes through `transaction()`, so killing the process at any instant leaves the
database at a transaction boundary and a restart resumes from it. The app calls storage from one
thread, its database thread (`coordinator.db_worker`), one call at a time, on one connection; the
lock only guards tests and tools that share a connection between threads.

When the database itself fails (disk full, read-only, locked past the busy timeout, I/O error,
connection lost), the statement raises `StorageUnavailable` (HTTP 503 with ``Retry-After``) and its
transaction is rolled back, so committed state is untouched and the next operation works once the
database does; a lost PostgreSQL connection is replaced between transactions. Errors that are bugs
(a constraint, bad SQL) pass unchanged. `num_failures` counts the failures (the service reads it
to notice an outage: coordinator/rules/rounds.py, "Restart grace"). `probe` is the readiness
check behind ``/readyz``. Opening a writable connection applies the missing migrations
(coordinator/storage/schema.py).

Several `coordinator serve` processes (replicas) may share one PostgreSQL database. Every write
transaction there begins by taking the transaction-scoped advisory lock `WRITE_LOCK`, so the
replicas' transactions run one at a time, as one process's do on its database thread: each sees
every commit before it, and the round rules need no other locking (those that need no turn say
so: `transaction(serialised=False)`). `announce(run_id)` tells the other replicas, on commit,
that a run's long-polls should wake (``NOTIFY`` on `channel`). The lock keys and the channel are
scoped to the connection's schema, so replicas of different coordinators, or tests, sharing one
server never contend. SQLite serves one process: there the
lock is its ``BEGIN IMMEDIATE`` and there is nobody to tell (coordinator/storage/cluster.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import sqlite3
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from coordinator.errors import StorageError, StorageUnavailable
from coordinator.storage.rows import columns
from coordinator.storage.schema import CREATE_MIGRATIONS_TABLE, MIGRATIONS

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
# PostgreSQL advisory locks, in the two-key form (schema key, purpose): every write transaction
# holds WRITE_LOCK until it ends; the leading replica holds LEADER_LOCK for its session.
WRITE_LOCK = 1
LEADER_LOCK = 2


class _RollBackProbe(Exception):
    """Ends the readiness probe's first transaction without committing it."""


class Database:
    """One connection and its transactions; subclasses connect it to an engine."""

    _begin_sql = "BEGIN"

    def __init__(self, read_only: bool = False) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._serialised = False  # the open transaction holds the write lock (PostgreSQL)
        self._closed = False
        self.read_only = read_only  # a `replica`: its connection refuses writes, and it migrates nothing
        self.num_failures = 0  # operations the database failed so far
        self._conn: Any = self._connect()
        if read_only:
            return
        try:
            self._migrate()
        except StorageUnavailable as e:
            self._conn.close()
            raise StorageError(f"cannot prepare the database: {e.detail}") from e

    def announce(self, run_id: str) -> None:
        """Inside a write transaction: once it commits, wake the long-polls of `run_id` on every
        other process serving this database. A no-op where one process serves it (SQLite)."""

    def replica(self) -> "Database":
        """A second, read-only connection to the same database, for a thread of its own. It sees
        every transaction committed before each of its reads begins (SQLite WAL, PostgreSQL read
        committed), and is closed by whoever opened it."""
        raise NotImplementedError

    # -- backend hooks ------------------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        """The rows a statement returns, as dicts by column name."""
        raise NotImplementedError

    def execute(self, sql: str, params: tuple = ()) -> int:
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

    # -- rows ---------------------------------------------------------------------------------

    def one(self, row_type: type, sql: str, params: tuple) -> Any:
        rows = self.many(row_type, sql, params)
        return rows[0] if rows else None

    def many(self, row_type: type, sql: str, params: tuple) -> list:
        return [row_type(**row) for row in self.rows(sql, params)]

    def insert(self, table: str, row: Any) -> None:
        names = columns(type(row))
        values = tuple(getattr(row, n) for n in names)
        marks = ", ".join("?" for _ in names)
        self.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})", values)

    def update(self, table: str, row_type: type, keys: dict, fields: dict) -> None:
        allowed = set(columns(row_type))
        if not fields or not set(fields) <= allowed:
            raise ValueError(f"bad columns for {table}: {sorted(set(fields) - allowed)}")
        assignments = ", ".join(f"{name} = ?" for name in fields)
        where = " AND ".join(f"{name} = ?" for name in keys)
        self.execute(
            f"UPDATE {table} SET {assignments} WHERE {where}",
            tuple(fields.values()) + tuple(keys.values()),
        )

    # -- transactions and schema --------------------------------------------------------------

    @contextmanager
    def transaction(self, serialised: bool = True) -> Iterator[None]:
        """All statements inside commit together or not at all; nesting joins the outer one. A
        failure anywhere, COMMIT included, rolls the whole transaction back and propagates.

        `serialised=False` is for a transaction whose every statement is atomic on its own and
        decides nothing from what it read (a nonce's insert, where the primary key decides; the
        readiness probe): on PostgreSQL it does not wait for the write lock (the module
        docstring), which a nested serialised one takes."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    if serialised:
                        self._serialise()
                    yield
                finally:
                    self._depth -= 1
                return
            self.execute(self._begin_sql)
            self._depth = 1  # from here on a lost connection is not replaced: it held our statements
            try:
                if serialised:
                    self._serialise()
                yield
                self.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            finally:
                self._depth = 0
                self._serialised = False

    def _serialise(self) -> None:
        """Take turns with the other processes' write transactions (SQLite: BEGIN IMMEDIATE did)."""

    def _rollback(self) -> None:
        # SQLite may already have rolled back (it does on some full-disk and I/O errors), and a
        # lost connection has nothing left to roll back: the error to report is the first one.
        try:
            if self._in_transaction():
                self._conn.execute("ROLLBACK")
        except Exception as e:
            log.warning("rollback after a failed transaction failed too: %s", e)

    def schema_version(self) -> int:
        rows = self.rows("SELECT MAX(version) AS v FROM schema_migrations")
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
            with contextlib.suppress(_RollBackProbe), self.transaction(serialised=False):
                self.execute(
                    "INSERT INTO readiness_probe (id, probed_at, payload) VALUES (?, ?, ?)",
                    (1, now, "x" * PROBE_PADDING_CHARS),
                )
                raise _RollBackProbe
            with self.transaction(serialised=False):
                self.execute(
                    "UPDATE readiness_probe SET probed_at = ?, payload = ? WHERE id = 0",
                    (now, secrets.token_hex(8)),
                )

    def _migrate(self) -> None:
        with self.transaction():
            self.execute(CREATE_MIGRATIONS_TABLE)
            current = self.schema_version()
            for version, statements in MIGRATIONS:
                if version <= current:
                    continue
                for statement in statements:
                    self.execute(statement)
                self.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )


class SqliteDatabase(Database):
    """A SQLite file in WAL mode: readers never block the writer, and a commit survives SIGKILL."""

    _begin_sql = "BEGIN IMMEDIATE"

    def __init__(self, path: Path, read_only: bool = False):
        self.path = Path(path)
        super().__init__(read_only)

    def replica(self) -> "SqliteDatabase":
        return SqliteDatabase(self.path, read_only=True)

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

    def rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self._lock, self._failures():
            return [dict(row) for row in self._conn.execute(sql, params).fetchall()]

    def many(self, row_type: type, sql: str, params: tuple) -> list:
        # Straight into the row type, by position when the columns come in its field order (a
        # SELECT * whose dataclass lists the table's columns in order), without a dict per row:
        # reading the 500 peers of a run's status or manifest takes a third of the time.
        with self._lock, self._failures():
            cursor = self._conn.execute(sql, params)
            rows = cursor.fetchall()
            names = tuple(column[0] for column in cursor.description)
        if names == columns(row_type):
            return [row_type(*row) for row in rows]
        return [row_type(**dict(zip(names, row))) for row in rows]

    def execute(self, sql: str, params: tuple = ()) -> int:
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


class PostgresDatabase(Database):
    """PostgreSQL through psycopg 3; the same SQL with %s placeholders. A writable one takes
    `WRITE_LOCK` at the start of every serialised transaction (the module docstring: replicas)."""

    def __init__(self, url: str, read_only: bool = False):
        self.url = url
        self.schema = ""  # the connection's current schema, read as it connects
        super().__init__(read_only)

    def lock_key(self, purpose: int) -> tuple[int, int]:
        """The advisory lock (schema key, purpose) of this schema: two signed 32-bit keys."""
        return _int32(self.schema), purpose

    @property
    def channel(self) -> str:
        """The ``NOTIFY`` channel of this schema's changes (an identifier of at most 63 bytes)."""
        return f"locoswarm_changes_{hashlib.sha256(self.schema.encode()).hexdigest()[:16]}"

    @property
    def backend_pid(self) -> int | None:
        """The server process of this connection, the sender of its notifications (None while
        the connection is lost)."""
        conn = self._conn
        return None if conn.closed else conn.info.backend_pid

    def _serialise(self) -> None:
        if not self.read_only and not self._serialised:
            self.execute("SELECT pg_advisory_xact_lock(?, ?)", self.lock_key(WRITE_LOCK))
            self._serialised = True

    def announce(self, run_id: str) -> None:
        self.execute("SELECT pg_notify(?, ?)", (self.channel, run_id))

    def replica(self) -> "PostgresDatabase":
        return PostgresDatabase(self.url, read_only=True)

    def _connect(self) -> Any:
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError as e:
            raise StorageError("PostgreSQL needs psycopg: pip install 'psycopg[binary]'") from e
        try:
            conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row, connect_timeout=10)
            self.schema = conn.execute("SELECT current_schema() AS s").fetchone()["s"] or ""
            if self.read_only:
                conn.execute("SET default_transaction_read_only = on")
            return conn
        except psycopg.Error as e:
            raise StorageError(f"cannot connect to PostgreSQL: {str(e).strip()}") from e

    @staticmethod
    def _sql(sql: str) -> str:
        # The shared SQL contains no literal '?' or '%', so this rewrite is exact.
        return sql.replace("?", "%s")

    @staticmethod
    def _params(params: tuple) -> tuple:
        # The shared schema stores flags as BIGINT 0/1 (SQLite has no boolean); psycopg would send
        # a Python bool as a PostgreSQL boolean, which a BIGINT column refuses.
        return tuple(int(p) if isinstance(p, bool) else p for p in params)

    def rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self._lock, self._failures():
            self._reconnect_if_lost()
            return list(self._conn.execute(self._sql(sql), self._params(params)).fetchall())

    def execute(self, sql: str, params: tuple = ()) -> int:
        with self._lock, self._failures():
            self._reconnect_if_lost()
            return self._conn.execute(self._sql(sql), self._params(params)).rowcount

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


def _int32(text: str) -> int:
    """A stable signed 32-bit key for `text` (advisory lock keys are int4)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big", signed=True)


def open_database(url: str) -> Database:
    """``sqlite:///relative.db``, ``sqlite:////absolute.db``, a bare path, or ``postgresql://``."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(url)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise StorageError(f"bad SQLite URL {url!r}: use sqlite:///relative.db")
        path = path[1:]
    else:
        path = url
    if not path or path == ":memory:":
        raise StorageError("the coordinator needs a database file, not an in-memory database")
    return SqliteDatabase(Path(path))
