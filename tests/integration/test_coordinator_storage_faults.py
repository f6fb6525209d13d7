"""The coordinator's database fails for real under it: every failed operation answers 503
``storage_unavailable`` with Retry-After (never a 500, never a dropped connection), /healthz stays
200 and /readyz turns 503, committed data stays readable, and once the database works again the
same requests succeed with nothing committed lost.

The faults are the real SQLite engine refusing, never a mock:

- `disk_full`: the database lives on a 4 MiB tmpfs mounted for the test, then filled with a file
  until ENOSPC; every write fails ("database or disk is full"). Freeing the file ends it. Needs
  root to mount; skipped with the reason otherwise.
- `page_limit`: ``PRAGMA max_page_count`` at the database's current size, so SQLite refuses every
  write that needs a new page with the same SQLITE_FULL. The requests here carry rows of a few KiB
  so that each needs pages; a small row can still fit into a page that has room.
- `read_only`: ``PRAGMA query_only``: SQLite refuses every write (SQLITE_READONLY), as for a
  read-only file (root ignores file modes, so chmod cannot make one here).

The PostgreSQL test terminates the coordinator's server connection (``pg_terminate_backend``): one
answer is 503, the next request reconnects.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.fixtures.coordinator import ADMIN_HEADERS, ADMIN_TOKEN, SignedPeer, coordinator_on, create_run, run_config
from tests.integration.coordinator_process import launch_coordinator

pytestmark = pytest.mark.timeout(120)

# 16 multiaddrs of the longest length a request may carry (256 characters): a peer or submission
# row over a 4 KiB page, which needs an overflow page; and a run config of ~14 KiB.
LONG_ADDRS = [f"/dns4/h{i:02d}{'h' * 226}.example.org/tcp/4001" for i in range(16)]
BIG_RUN = {"exchange.dht_bootstrap": [f"/ip4/10.0.0.{i}/tcp/4001/p2p/Qm{'b' * 200}" for i in range(64)]}
FULL = "database or disk is full"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test and unmounted after it: a disk that really fills."""
    mount_dir = tmp_path / "small-disk"
    mount_dir.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no 'mount' command to mount a small tmpfs")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "locoswarm-test", str(mount_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_dir
    finally:
        if subprocess.run(["umount", str(mount_dir)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mount_dir)], capture_output=True, timeout=30)


class DiskFull:
    """Fills the filesystem under the database; `stop` frees it."""

    detail = FULL
    every_write_fails = True

    def __init__(self, mount_dir: Path):
        self.filler = mount_dir / "filler"

    def start(self) -> None:
        with open(self.filler, "wb", buffering=0) as f:
            chunk = b"\0" * 65536
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise

    def stop(self) -> None:
        self.filler.unlink()


class PageLimit:
    """SQLite's page limit at the current size, on the coordinator's own connection (the limit
    is a per-connection setting)."""

    detail = FULL
    every_write_fails = False

    def __init__(self, storage: Any):
        self.storage = storage

    def start(self) -> None:
        with self.storage.db._lock:
            # Free pages (a migration that rebuilt a table leaves some) take writes without growing
            # the file: compact first, so that the next write needing a page fails.
            self.storage.db._conn.execute("VACUUM")
            pages = self.storage.db._conn.execute("PRAGMA page_count").fetchone()[0]
            self.storage.db._conn.execute(f"PRAGMA max_page_count = {pages}")

    def stop(self) -> None:
        with self.storage.db._lock:
            self.storage.db._conn.execute("PRAGMA max_page_count = 4294967294")


class ReadOnly:
    """Every write refused by SQLite on the coordinator's connection."""

    detail = "attempt to write a readonly database"
    every_write_fails = True

    def __init__(self, storage: Any):
        self.storage = storage

    def start(self) -> None:
        with self.storage.db._lock:
            self.storage.db._conn.execute("PRAGMA query_only = 1")

    def stop(self) -> None:
        with self.storage.db._lock:
            self.storage.db._conn.execute("PRAGMA query_only = 0")


@pytest.fixture
def faulty_coordinator(request: pytest.FixtureRequest, tmp_path: Path, fake_clock) -> Iterator[tuple]:
    """(client, fault): an in-process coordinator with a fake clock, and the fault it will get."""
    kind = request.param
    db_dir = request.getfixturevalue("small_disk") if kind == "disk_full" else tmp_path
    with coordinator_on(db_dir / "coordinator.db", fake_clock) as (client, storage):
        fault = {
            "disk_full": lambda: DiskFull(db_dir),
            "page_limit": lambda: PageLimit(storage),
            "read_only": lambda: ReadOnly(storage),
        }[kind]()
        yield client, fault


def assert_storage_unavailable(response: Any, detail: str) -> None:
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["Retry-After"] == "5"
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == "storage_unavailable", body
    assert detail in body["detail"], body


def heartbeat(peer: SignedPeer, run_id: str, **fields: Any) -> Any:
    return peer.post(f"/v1/runs/{run_id}/heartbeat", {"round": 1, "state": "training", **fields})


@pytest.mark.parametrize("faulty_coordinator", ["disk_full", "page_limit", "read_only"], indirect=True)
def test_failed_writes_answer_503_reads_work_and_nothing_committed_is_lost(faulty_coordinator, fake_clock):
    client, fault = faulty_coordinator
    run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": 60.0})
    a, b, c = (SignedPeer(client, clock=fake_clock) for _ in range(3))
    assert a.join(run_id).status_code == 200 and b.join(run_id).status_code == 200
    assert a.submit(run_id, 0).status_code == 200 and b.submit(run_id, 0).status_code == 200
    assert a.applied(run_id, 0, "ee" * 32).status_code == 200
    assert b.applied(run_id, 0, "ee" * 32).status_code == 200  # agreed now: round 1's close changes nothing
    assert a.submit(run_id, 1).status_code == 200
    reads = [
        "/v1/runs",
        f"/v1/runs/{run_id}",
        f"/v1/runs/{run_id}/rounds/0",
        f"/v1/runs/{run_id}/rounds/1",
        f"/v1/runs/{run_id}/status",
    ]
    committed = {path: client.get(path).json() for path in reads}
    assert client.get("/readyz").json() == {"status": "ready"}

    fault.start()
    writes = {
        "create_run": lambda: client.post("/v1/runs", json=run_config(BIG_RUN), headers=ADMIN_HEADERS),
        "join": lambda: c.join(run_id, listen_multiaddrs=LONG_ADDRS),
        "submit": lambda: b.submit(run_id, 1, multiaddrs=LONG_ADDRS),
        "heartbeat": lambda: heartbeat(a, run_id, listen_multiaddrs=LONG_ADDRS),
    }
    for write in writes.values():
        assert_storage_unavailable(write(), fault.detail)
    if fault.every_write_fails:
        assert_storage_unavailable(heartbeat(b, run_id), fault.detail)
    assert client.get("/healthz").json()["status"] == "ok"
    assert_storage_unavailable(client.get("/readyz"), fault.detail)
    assert {path: client.get(path).json() for path in reads} == committed
    assert "locoswarm_http_responses_total" in client.get("/metrics").text

    fault.stop()
    assert client.get("/readyz").json() == {"status": "ready"}
    assert {path: client.get(path).json() for path in reads} == committed, "failed writes left nothing"
    for name, write in writes.items():
        response = write()
        assert response.status_code == 200, (name, response.text)
    assert [p["peer_index"] for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]] == [0, 1, 2]
    round_1 = client.get(f"/v1/runs/{run_id}/rounds/1").json()
    assert round_1["state"] == "closed" and [e["peer_id"] for e in round_1["manifest"]] == sorted(
        [a.peer_id, b.peer_id]
    )
    assert {e["peer_id"]: e["multiaddrs"] for e in round_1["manifest"]}[b.peer_id] == LONG_ADDRS
    assert client.get(f"/v1/runs/{run_id}/rounds/0").json() == committed[f"/v1/runs/{run_id}/rounds/0"]
    assert client.get(f"/v1/runs/{run_id}/status").json()["history"][0]["majority_digest"] == "ee" * 32
    assert len(client.get("/v1/runs").json()["runs"]) == 2


@pytest.mark.parametrize("faulty_coordinator", ["disk_full", "read_only"], indirect=True)
def test_an_outage_longer_than_the_timeouts_gets_the_restart_grace(faulty_coordinator, fake_clock):
    """While nothing can be written, heartbeats and submissions fail and deadlines pass; once
    the database works again peers are live and the round open, as after a restart."""
    client, fault = faulty_coordinator
    run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": 20.0})
    a, b = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    assert a.join(run_id).status_code == 200 and b.join(run_id).status_code == 200
    deadline = client.get(f"/v1/runs/{run_id}/rounds/0").json()["deadline"]
    fault.start()
    fake_clock.advance(100.0)  # past round 0's deadline and the heartbeat timeout
    assert_storage_unavailable(a.heartbeat(run_id, 0), fault.detail)
    assert_storage_unavailable(a.submit(run_id, 0), fault.detail)
    view = client.get(f"/v1/runs/{run_id}/rounds/0").json()
    assert (view["state"], view["deadline"]) == ("open", deadline), "reads answer what is committed"
    fault.stop()
    back_at = fake_clock()
    client.app.state.service.tick()  # the coordinator's clock: its first transaction since the outage
    view = client.get(f"/v1/runs/{run_id}/rounds/0").json()
    assert (view["state"], view["deadline"]) == ("open", back_at + 20.0)
    peers = client.get(f"/v1/runs/{run_id}/status").json()["peers"]
    assert [p["status"] for p in peers] == ["live", "live"]
    assert a.submit(run_id, 0).status_code == 200 and b.submit(run_id, 0).status_code == 200
    assert len(client.get(f"/v1/runs/{run_id}/rounds/0").json()["manifest"]) == 2


def test_a_real_server_on_a_full_disk_answers_503_on_a_kept_connection(small_disk, tmp_path):
    """Through uvicorn: the 503s come over one keep-alive connection that the server never closes,
    and its log has no traceback."""
    coordinator = launch_coordinator(small_disk / "coordinator.db", tmp_path / "serve.log")
    fault = DiskFull(small_disk)
    try:
        with httpx.Client(base_url=coordinator.url, timeout=10) as client:
            run_id = create_run(client, {"membership.min_peers": 1})
            peer = SignedPeer(client)
            assert peer.join(run_id).status_code == 200
            fault.start()
            answers = [
                peer.heartbeat(run_id, 0),
                peer.submit(run_id, 0),
                client.get("/readyz"),
                client.post("/v1/runs", json=run_config(), headers=ADMIN_HEADERS),
                peer.heartbeat(run_id, 0),
            ]
            for response in answers:
                assert_storage_unavailable(response, FULL)
            assert client.get("/healthz").status_code == 200
            assert client.get(f"/v1/runs/{run_id}/rounds/0").json()["state"] == "open"
            fault.stop()
            assert client.get("/readyz").status_code == 200
            assert peer.submit(run_id, 0).json()["num_submitted"] == 1
            answers.append(client.get("/healthz"))
            local_ends = {r.extensions["network_stream"].get_extra_info("client_addr") for r in answers}
            assert len(local_ends) == 1, f"the server closed the connection: {local_ends}"
    finally:
        fault.filler.unlink(missing_ok=True)
        coordinator.stop()
    log = coordinator.log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_a_bug_is_not_a_storage_failure(tmp_path):
    """Bad SQL or a broken constraint is a bug: it passes unchanged (a 500), not as a 503."""
    import sqlite3

    from coordinator.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            storage.db.rows("SELECT * FROM no_such_table")
        with pytest.raises(sqlite3.IntegrityError), storage.transaction():
            storage.add_nonce("pa", 1, 1.0)
            storage.db.execute("INSERT INTO readiness_probe (id, probed_at) VALUES (0, 0)")
        assert storage.add_nonce("pa", 1, 2.0), "the failed transaction was rolled back"
        assert storage.num_failures == 0
    finally:
        storage.close()


def test_postgres_connection_lost_answers_503_then_reconnects(postgres_url, fake_clock):
    import psycopg

    from coordinator.storage import open_storage

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        storage = open_storage(f"{postgres_url}&options=-csearch_path%3D{schema}")
        try:
            from fastapi.testclient import TestClient

            from coordinator.app import create_app

            with TestClient(create_app(storage, ADMIN_TOKEN, clock=fake_clock, tick_s=None)) as client:
                run_id = create_run(client, {"membership.min_peers": 2})
                peer = SignedPeer(client, clock=fake_clock)
                assert peer.join(run_id).status_code == 200
                admin.execute("SELECT pg_terminate_backend(%s)", (storage.db._conn.info.backend_pid,))
                lost = client.get("/v1/runs")
                assert_storage_unavailable(lost, "")
                assert [r["run_id"] for r in client.get("/v1/runs").json()["runs"]] == [run_id]
                assert client.get("/readyz").json() == {"status": "ready"}
                assert peer.heartbeat(run_id, 0).status_code == 200
        finally:
            storage.close()
