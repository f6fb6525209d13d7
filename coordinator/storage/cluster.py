"""Which replica leads, and the other replicas' changes: one process among several on a database.

Any number of `coordinator serve` processes (replicas) may serve one PostgreSQL database behind a
load balancer. Each answers any request: its writes are serialised with everyone's by the write
lock (coordinator/storage/database.py), and its reads see every commit. Two things need more:

- *One clock.* Exactly one replica, the leader, runs the service's tick (deadlines, heartbeat
  timeouts, amendments due, old nonces). It is the one holding the session advisory lock
  `LEADER_LOCK` on its link connection; PostgreSQL releases it when that connection ends, so a
  leader killed by SIGKILL hands over at once, and one cut off as soon as the server notices
  (`KEEPALIVE`). The others try
  to take it every `retry_s`. Two leaders for a moment (a partitioned leader that has not noticed
  yet) are harmless: every tick is a write transaction under the write lock, and the rules advance
  state only from what is committed, so a round closes once whoever applies them.
- *Long-polls of other replicas' changes.* A commit that wakes a run's long-polls also sends a
  ``NOTIFY`` of the run id (`Database.announce`, sent only if it commits); each replica ``LISTEN``s
  on its link and wakes its own long-polls. Its own notifications are skipped (it woke them
  already). After the link was lost and made again, notifications may have been missed: every
  long-poll is woken (`on_missed`), and re-checks.

The link is one dedicated connection per replica, on a thread of its own (`PostgresCluster`):
the leader's lock lives exactly as long as its listening does. SQLite serves one process, which
always leads and hears nothing (`SoloCluster`). `first_tick_at` is when the leader's first tick of
its current lead finished (`ticked`), for /metrics and the failover test.

*Joining a serving cluster is no restart.* The restart grace (coordinator/rules/rounds.py) counts
from when the coordinator came back; a replica started while another leads is not that moment:
peers could reach the others all along. `start` finds out: `serving_since` is then when the
leader's link connected (PostgreSQL's ``backend_start`` of the session holding the leader lock),
and the service resumes from that (`CoordinatorService.resume`). Replicas started together after
an outage thus share the first one's grace; one added later extends no deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from coordinator.storage.database import LEADER_LOCK, PostgresDatabase

log = logging.getLogger("locoswarm.coordinator")

RETRY_S = 1.0  # how often a follower tries the leader lock, and a lost link is made again
# TCP keepalives of the link, both ends (idle s, interval s, count): a leader cut off without its
# socket closing (a partition, a frozen host) is noticed, and its lock released, within about
# idle + interval x count = 11 s instead of the system's default two hours. Unix sockets ignore them.
KEEPALIVE = (5, 2, 3)


class Cluster(Protocol):
    is_leader: bool
    leader_since: float | None  # Unix time this replica took the lead; None while it follows
    first_tick_at: float | None
    serving_since: float | None  # found at start: since when another replica leads (None: none did)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def ticked(self, now: float) -> None: ...


class SoloCluster:
    """The only process on its database: it leads from the start and hears nobody."""

    def __init__(self) -> None:
        self.is_leader = True
        self.leader_since: float | None = time.time()
        self.first_tick_at: float | None = None
        self.serving_since: float | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def ticked(self, now: float) -> None:
        if self.first_tick_at is None:
            self.first_tick_at = now


class PostgresCluster:
    """A replica's link to the others over `db`'s server: the leader lock and the change channel.
    `on_change(run_id)` and `on_missed()` are called on the link's thread."""

    def __init__(
        self,
        db: PostgresDatabase,
        on_change: Callable[[str], None],
        on_missed: Callable[[], None],
        retry_s: float = RETRY_S,
    ):
        self.db = db
        self.on_change = on_change
        self.on_missed = on_missed
        self.retry_s = retry_s
        self.is_leader = False
        self.leader_since: float | None = None
        self.first_tick_at: float | None = None
        self.serving_since: float | None = None
        self._conn: Any = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Link now (so a lone replica leads before it serves), then keep the link on a thread."""
        self._step(first=True)
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and the connection; the leader lock goes with it."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_s + 5.0)
        self.is_leader, self.leader_since, self.first_tick_at = False, None, None
        self._drop()

    def ticked(self, now: float) -> None:
        if self.is_leader and self.first_tick_at is None:
            self.first_tick_at = now

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._step(first=False)

    def _step(self, first: bool) -> None:
        """Link if unlinked, try the lead if following, then hear notifications for `retry_s`."""
        import psycopg

        try:
            if self._conn is None:
                self._link(first)
            if not self.is_leader:
                self._try_lead()
            if first:
                self.serving_since = None if self.is_leader else self._leader_linked_at()
                return
            own_pid = self.db.backend_pid
            for notify in self._conn.notifies(timeout=self.retry_s):
                if notify.pid != own_pid:
                    self.on_change(notify.payload)
        except psycopg.Error as e:
            self._lost(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)

    def _link(self, first: bool) -> None:
        import psycopg
        from psycopg import sql

        idle_s, interval_s, count = KEEPALIVE
        self._conn = psycopg.connect(
            self.db.url,
            autocommit=True,
            connect_timeout=10,
            keepalives=1,
            keepalives_idle=idle_s,
            keepalives_interval=interval_s,
            keepalives_count=count,
        )
        for name, value in zip(("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"), KEEPALIVE):
            self._conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.db.channel)))
        if not first:
            log.warning("linked to the other replicas again; waking every long-poll")
            self.on_missed()

    def _try_lead(self) -> None:
        row = self._conn.execute("SELECT pg_try_advisory_lock(%s, %s)", self.db.lock_key(LEADER_LOCK)).fetchone()
        if row[0]:
            self.is_leader, self.leader_since, self.first_tick_at = True, time.time(), None
            log.warning("this replica leads: it applies deadlines and timeouts")

    def _leader_linked_at(self) -> float | None:
        """When the leading replica's link connected, or None when nobody leads (or the server
        does not show it to this role)."""
        schema_key, purpose = self.db.lock_key(LEADER_LOCK)
        row = self._conn.execute(
            "SELECT extract(epoch FROM a.backend_start) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
            " AND l.classid::bigint = %s AND l.objid::bigint = %s",
            (schema_key & 0xFFFFFFFF, purpose),  # the keys are shown as unsigned oids
        ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def _lost(self, why: str) -> None:
        if self.is_leader:
            log.error("lost the link to PostgreSQL (%s): no longer leading", why)
        else:
            log.warning("lost the link to PostgreSQL (%s); retrying", why)
        self.is_leader, self.leader_since, self.first_tick_at = False, None, None
        self._drop()
        self._stopping.wait(self.retry_s)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as e:  # closing a broken connection: nothing left to release
                log.debug("closing the link failed: %s", e)


def open_cluster(
    db: Any, on_change: Callable[[str], None], on_missed: Callable[[], None], retry_s: float = RETRY_S
) -> Cluster:
    """The replica link for `db`: `PostgresCluster` on PostgreSQL, `SoloCluster` otherwise."""
    if isinstance(db, PostgresDatabase):
        return PostgresCluster(db, on_change, on_missed, retry_s)
    return SoloCluster()
