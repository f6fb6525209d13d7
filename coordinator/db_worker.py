"""The coordinator's database thread: every call that touches storage runs here, one at a time.

The HTTP app is asynchronous, but its database work (sqlite3, psycopg) is synchronous. Run on the
event loop, each statement would stop every other request, /healthz included, for as long as it
takes. So the routes, the background tick and the readiness probe hand their work to one
dedicated thread and await it (`await worker.run(fn, *args)`), and the loop stays free to parse
requests, park long-polls and answer /healthz.

One thread, not a pool: the service's rules (round closes, nonces, the restart grace, the
runs changed and ``resumed_at`` it holds in memory) were written for calls that never overlap, and a
single connection in one thread keeps that true with no locking and no "database is locked"
retries, on SQLite and PostgreSQL alike. (Several processes on one PostgreSQL database keep it
true across them with the database's write lock: coordinator/storage/database.py.) Each call is a short transaction or a few reads, so the
thread's queue, not the loop, is where requests wait under load; `queue_depth` says how deep it is.
A call cancelled before it starts (its client went away) never runs; one that started finishes.

The worker starts on first use and `stop` ends it (the app's lifespan does); a later call starts
it again.

`SharedReads` lets identical reads share one call. Hundreds of peers ask the same thing at the
same moment (the member list when a round opens, the round view when it closes); answered one by
one they would keep the thread busy for seconds while heartbeats queue behind them.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class DatabaseWorker:
    def __init__(self, name: str = "coordinator-db"):
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.queue_depth = 0  # calls submitted and not finished (read on the loop, for metrics)

    def _started(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            return self._executor

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the database thread; its result or its exception."""
        self.queue_depth += 1
        try:
            return await asyncio.wrap_future(self._started().submit(fn, *args))
        finally:
            self.queue_depth -= 1

    def stop(self) -> None:
        """Wait for the call in progress, drop the queued ones, end the thread."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.finished = False  # set on the database thread as the call ends
        self.future: asyncio.Future[T] | None = None

    def __call__(self) -> T:
        try:
            return self.fn()
        finally:
            self.finished = True


class SharedReads:
    """Identical reads share one call on the worker: a request joins the call of its key that has
    not finished yet, queued or running. Its answer is never older than the request: the worker
    runs one call at a time, so any write that completed before the request arrived completed
    before that unfinished call began. Only reads go through here: they write nothing. A write
    of another replica on the database is not ordered with this thread's calls: a long-poll woken
    by one detaches the unfinished calls (`detach`) so that its re-check sees it."""

    def __init__(self, worker: DatabaseWorker):
        self.worker = worker
        self._calls: dict[Hashable, _Call] = {}  # touched on the event loop only
        self.num_shared = 0  # requests answered by another request's call (tests and metrics)

    async def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        call = self._calls.get(key)
        if call is not None and not call.finished:
            self.num_shared += 1
        else:
            call = self._calls[key] = _Call(fn)
            call.future = asyncio.ensure_future(self.worker.run(call))
            call.future.add_done_callback(lambda future: self._forget(key, call, future))
        assert call.future is not None
        # One waiter going away (its client hung up) must not cancel the others' answer.
        return await asyncio.shield(call.future)

    def detach(self) -> None:
        """Later requests start calls of their own: the unfinished ones may have begun before a
        change committed elsewhere (another replica) that those requests must see. Their own
        waiters still get their answers."""
        self._calls.clear()

    def _forget(self, key: Hashable, call: _Call, future: asyncio.Future) -> None:
        if self._calls.get(key) is call:
            del self._calls[key]
        if not future.cancelled():
            future.exception()  # retrieved: each waiter got it; none left is no error to log
