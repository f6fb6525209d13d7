"""Fixtures and helpers for the coordinator tests (loaded from tests/conftest.py).

- `FakeClock` and `coordinator_client`: the app in-process (TestClient) with a clock the test moves.
- `SignedPeer`: a peer key plus the signing of its requests, over any httpx-like client.
- `error_of`: the code of a refused request, checked to have the error body's shape.
- `postgres_url`: a real PostgreSQL server started for the session from Debian's binaries, as the
  ``postgres`` OS user when we are root, on a unix socket in a temp dir; skipped with the reason
  when the binaries or the user are missing. `storage_url` gives each test its own schema.
- `start_coordinator`: a real ``locoswarm coordinator serve`` process on port 0; readiness is the
  line it prints once it serves, and every process is stopped by its own handle.
"""

from __future__ import annotations

import json
import os
import pwd
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from protocol.http import sign_request
from protocol.signing import PeerKey

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
START_TIME_S = 1_700_000_000.0
LISTENING = re.compile(r"coordinator listening on (http://\S+)")
PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


class FakeClock:
    """Unix seconds that move only when the test says so."""

    def __init__(self, start_s: float = START_TIME_S):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@dataclass
class SignedPeer:
    """One simulated peer: its key, and signed calls through `client` (TestClient or httpx)."""

    client: Any
    key: PeerKey = field(default_factory=PeerKey.generate)
    clock: FakeClock | None = None
    _nonce_bump: int = 0

    @property
    def peer_id(self) -> str:
        from protocol.http import peer_id_from_public_key

        return peer_id_from_public_key(self.key.public_bytes)

    def nonce(self) -> int | None:
        if self.clock is None:
            return None  # sign_request uses the real nanosecond clock
        self._nonce_bump += 1
        return int(self.clock() * 1e9) + self._nonce_bump

    def post(self, path: str, payload: Any, nonce: int | None = None) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = sign_request(self.key, "POST", path, body, nonce=nonce or self.nonce())
        headers["Content-Type"] = "application/json"
        return self.client.post(path, content=body, headers=headers)

    def join(self, run_id: str, **fields: Any) -> Any:
        payload = {"public_key": self.key.public_hex, "device": "cpu", **fields}
        return self.post(f"/v1/runs/{run_id}/join", payload)

    def submit(self, run_id: str, round_index: int, digest: str | None = None,
               train_loss: float = 3.0, **fields: Any) -> Any:
        payload = {
            "packet_digest": digest or packet_digest(self.peer_id, round_index),
            "packet_size_bytes": 1234,
            "train_loss": train_loss,
            "compute_s": 1.5,
            "encode_s": 0.1,
            **fields,
        }
        return self.post(f"/v1/runs/{run_id}/rounds/{round_index}/submit", payload)

    def heartbeat(self, run_id: str, round_index: int, state: str = "training") -> Any:
        return self.post(f"/v1/runs/{run_id}/heartbeat", {"round": round_index, "state": state})

    def applied(self, run_id: str, round_index: int, params_digest: str) -> Any:
        return self.post(
            f"/v1/runs/{run_id}/rounds/{round_index}/applied", {"params_digest": params_digest}
        )


def packet_digest(peer_id: str, round_index: int) -> str:
    import hashlib

    return hashlib.sha256(f"{peer_id}/{round_index}".encode()).hexdigest()


def run_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "test-run",
        "preset": "tiny",
        "min_peers": 2,
        "deadline_policy": {"kind": "fixed", "round_timeout_s": 30.0},
        "heartbeat_timeout_s": 20.0,
        "dht_bootstrap": ["/ip4/127.0.0.1/tcp/4001/p2p/QmBootstrap"],
    }
    config.update(overrides)
    return config


def create_run(client: Any, **overrides: Any) -> str:
    response = client.post("/v1/runs", json=run_config(**overrides), headers=ADMIN_HEADERS)
    assert response.status_code == 200, response.text
    return response.json()["run_id"]


def error_of(response: Any) -> str:
    """The code of a refusal, after checking it is a 4xx whose body is ``{"error", "detail"}``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error", "detail"} and body["detail"]
    return body["error"]


# -- in-process app ---------------------------------------------------------------------------


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def coordinator_client(tmp_path: Path, fake_clock: FakeClock) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from coordinator.app import create_app
    from coordinator.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
    # No background tick: the rules apply on each request, at the fake clock's time.
    app = create_app(storage, ADMIN_TOKEN, clock=fake_clock, tick_s=None)
    with TestClient(app) as client:
        yield client
    storage.close()


# -- PostgreSQL -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    if not PG_BIN_DIRS or not (PG_BIN_DIRS[0] / "initdb").exists():
        pytest.skip("PostgreSQL binaries not found under /usr/lib/postgresql/*/bin")
    bin_dir = PG_BIN_DIRS[0]
    as_user: list[str] = []
    if os.geteuid() == 0:
        # initdb refuses to run as root: run the server as the postgres OS user.
        try:
            pg_user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' OS user for initdb")
        if shutil.which("runuser") is None:
            pytest.skip("running as root and 'runuser' is missing")
        as_user = ["runuser", "-u", "postgres", "--"]
    base = Path(tempfile.mkdtemp(prefix="locoswarm-pg-"))
    if as_user:
        os.chown(base, pg_user.pw_uid, pg_user.pw_gid)
    data_dir, log_file, port = base / "data", base / "server.log", _free_port()
    subprocess.run(
        as_user + [str(bin_dir / "initdb"), "-D", str(data_dir), "-A", "trust", "-U", "postgres",
                   "--no-sync", "-E", "UTF8"],
        check=True, capture_output=True, timeout=60,
    )
    # Unix socket only (no TCP), fsync off: a throwaway server for tests.
    options = f"-k {base} -p {port} -c listen_addresses='' -c fsync=off"
    subprocess.run(
        as_user + [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(log_file), "-o",
                   options, "-w", "-t", "30", "start"],
        check=True, capture_output=True, timeout=60,
    )
    try:
        yield f"postgresql://postgres@/postgres?host={base}&port={port}"
    finally:
        subprocess.run(
            as_user + [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", "immediate", "-w",
                       "stop"],
            capture_output=True, timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database for each backend: a file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    import psycopg

    base_url = request.getfixturevalue("postgres_url")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{base_url}&options=-csearch_path%3D{schema}"


# -- real coordinator processes ---------------------------------------------------------------


@dataclass
class CoordinatorProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def serve_command(db_url: str, port: int = 0) -> list[str]:
    # The standalone entry shares `register` with `locoswarm`; test_coordinator_cli checks that
    # `locoswarm` itself wires these commands in.
    return [sys.executable, "-m", "coordinator.cli", "coordinator", "serve", "--db", db_url,
            "--host", "127.0.0.1", "--port", str(port)]


def launch_coordinator(
    db_path: Path, log_path: Path, timeout_s: float = 30.0
) -> CoordinatorProcess:
    """Start `serve` and return once it printed its listening line (or fail with its log)."""
    env = {**os.environ, "LOCOSWARM_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "ab")
    process = subprocess.Popen(
        serve_command(f"sqlite:///{db_path}"), cwd=REPO_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    log.close()
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        # Keeps reading for the process's whole life, so a full pipe never blocks it.
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=timeout_s)
            if line is None:
                raise RuntimeError(f"coordinator exited early:\n{log_path.read_text()}")
            match = LISTENING.search(line)
            if match:
                return CoordinatorProcess(match.group(1), process, log_path)
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[Any]:
    """A factory: `start_coordinator(db_path)` -> CoordinatorProcess; all are stopped after."""
    started: list[CoordinatorProcess] = []

    def start(db_path: Path | None = None) -> CoordinatorProcess:
        coordinator = launch_coordinator(
            db_path or tmp_path / "coordinator.db", tmp_path / f"serve-{len(started)}.log"
        )
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop()
