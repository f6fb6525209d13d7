"""The coordinator's database work runs on its own threads, never on the event loop.

A real uvicorn server on 127.0.0.1 (port 0, in a thread of this process) with a real SQLite file:
while the database is held (the test takes the storage's lock, so the database thread waits on its
next statement), /healthz still answers and a request that needs the database is parked, not
lost; once released it completes. While the read side is held (its replica's lock), a status read
waits and heartbeats do not. `SharedReads` is checked on a real `DatabaseWorker`: identical reads
that arrive while one is unfinished share it, and a later read runs anew. `tune_gc` changes the
garbage collector of the process that asks for it, and no other.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from coordinator.db_worker import DatabaseWorker, SharedReads
from tests.fixtures.coordinator import ADMIN_TOKEN, SignedPeer, create_run

pytestmark = pytest.mark.timeout(60)


class ServerThread:
    """uvicorn serving `app` on a socket bound here; `stop` ends it by its own handle."""

    def __init__(self, app: Any):
        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        ready = threading.Event()

        def poll() -> None:
            while not self.server.started and self.thread.is_alive():
                ready.wait(0.01)
            ready.set()

        threading.Thread(target=poll, daemon=True).start()
        assert ready.wait(timeout_s) and self.server.started, "uvicorn did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.socket.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServerThread, Any, Any]]:
    from coordinator.app import create_app
    from coordinator.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
    app = create_app(storage, ADMIN_TOKEN)
    server = ServerThread(app)
    try:
        server.wait_ready()
        yield server, storage, app
    finally:
        server.stop()
        storage.close()


def test_healthz_answers_while_the_database_is_busy(served):
    server, storage, _ = served
    with (
        httpx.Client(base_url=server.url, timeout=30) as peer_client,
        httpx.Client(base_url=server.url, timeout=10) as client,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        run_id = create_run(client, {"membership.min_peers": 1})
        peer = SignedPeer(peer_client)
        assert peer.join(run_id).status_code == 200
        with storage.db._lock:  # the database thread now waits on its next statement
            parked_heartbeat = pool.submit(lambda: peer.heartbeat(run_id, 0))
            for _ in range(20):  # the event loop is free: liveness answers, again and again
                assert client.get("/healthz").json()["status"] == "ok"
            # The status reads on the read side's own connection: it answers meanwhile.
            assert httpx.get(f"{server.url}/v1/runs/{run_id}/status", timeout=30).status_code == 200
            assert not parked_heartbeat.done()
        assert parked_heartbeat.result(timeout=30).status_code == 200
        assert client.get("/readyz").json() == {"status": "ready"}


def test_heartbeats_do_not_wait_behind_a_status_read(served):
    server, _, app = served
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(max_workers=1) as pool:
        run_id = create_run(client, {"membership.min_peers": 1})
        peer = SignedPeer(client)
        assert peer.join(run_id).status_code == 200
        status = f"{server.url}/v1/runs/{run_id}/status"
        assert httpx.get(status).status_code == 200  # the read side's replica is open now
        with app.state.read.storage.db._lock:  # the read thread now waits on its next statement
            parked_status = pool.submit(httpx.get, status, timeout=30)
            for round_index in range(5):
                assert peer.heartbeat(run_id, round_index).status_code == 200
            assert not parked_status.done()
        assert parked_status.result(timeout=30).json()["peers"][0]["peer_id"] == peer.peer_id


def test_identical_reads_share_one_unfinished_call_and_later_ones_run_anew():
    worker = DatabaseWorker()
    reads = SharedReads(worker)
    release = threading.Event()
    calls: list[str] = []

    def slow_read(name: str) -> str:
        calls.append(name)
        assert release.wait(10)
        return f"answer {len(calls)}"

    async def scenario() -> tuple[list[str], str, str]:
        first = [asyncio.ensure_future(reads.run("status", lambda: slow_read("status"))) for _ in range(5)]
        other = asyncio.ensure_future(reads.run("round", lambda: slow_read("round")))
        await asyncio.sleep(0.05)
        assert reads.num_shared == 4  # the four after the first joined its call
        release.set()
        answers = await asyncio.gather(*first)
        later = await reads.run("status", lambda: slow_read("status again"))
        return answers, await other, later

    try:
        answers, other, later = asyncio.run(scenario())
    finally:
        worker.stop()
    assert answers == [answers[0]] * 5
    assert calls == ["status", "round", "status again"]  # one call per key while unfinished
    assert other != answers[0] and later == "answer 3"


def test_a_waiter_that_goes_away_does_not_cancel_the_shared_call():
    worker = DatabaseWorker()
    reads = SharedReads(worker)
    release = threading.Event()

    async def scenario() -> str:
        leaving = asyncio.ensure_future(reads.run("k", lambda: release.wait(10) and "done"))
        staying = asyncio.ensure_future(reads.run("k", lambda: "never run"))
        await asyncio.sleep(0.01)
        leaving.cancel()
        release.set()
        return await staying

    try:
        assert asyncio.run(scenario()) == "done"
    finally:
        worker.stop()


def test_a_read_after_detach_does_not_join_the_unfinished_call():
    """What a long-poll woken by another replica's change needs (routes.RunEvents): the call that
    began before that change still answers its own waiters, and the re-check runs anew."""
    worker = DatabaseWorker()
    reads = SharedReads(worker)
    release = threading.Event()

    async def scenario() -> tuple[str, str]:
        before = asyncio.ensure_future(reads.run("k", lambda: release.wait(10) and "before the change"))
        await asyncio.sleep(0.01)
        reads.detach()
        after = asyncio.ensure_future(reads.run("k", lambda: "after the change"))
        await asyncio.sleep(0.01)
        release.set()
        return await before, await after

    try:
        assert asyncio.run(scenario()) == ("before the change", "after the change")
    finally:
        worker.stop()


def test_tune_gc_applies_to_the_serving_process_only(tmp_path):
    """`tune_gc=True` changes the garbage collector of the process it starts in: checked in a
    process of its own, and a default app leaves this one's alone."""
    import gc
    import subprocess
    import sys

    from tests.fixtures.coordinator import REPO_ROOT

    script = (
        "import gc\n"
        "from fastapi.testclient import TestClient\n"
        "from coordinator.app import create_app\n"
        "from coordinator.storage import open_storage\n"
        f"storage = open_storage('sqlite:///{tmp_path / 'c.db'}')\n"
        "with TestClient(create_app(storage, 'x' * 16, tick_s=None, tune_gc=True)) as client:\n"
        "    assert client.get('/healthz').status_code == 200\n"
        "print(gc.get_threshold()[0], gc.get_freeze_count() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["50000", "True"]
    threshold = gc.get_threshold()
    from fastapi.testclient import TestClient

    from coordinator.app import create_app
    from coordinator.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'd.db'}")
    try:
        with TestClient(create_app(storage, ADMIN_TOKEN, tick_s=None)):
            pass
    finally:
        storage.close()
    assert gc.get_threshold() == threshold
