"""Fixtures that start real processes, for the integration tests only.

- `postgres_url`: a real PostgreSQL server started for the session from Debian's binaries, as the
  ``postgres`` OS user when we are root, on a unix socket in a temp dir; skipped with the reason
  when the binaries or the user are missing. `storage_url` gives each test its own schema (and a
  SQLite file); `postgres_schema_url`, its own PostgreSQL schema only.
- `start_coordinator`: real ``locoswarm coordinator serve`` processes on port 0
  (tests/integration/coordinator_process.py), each stopped by its own handle after the test.

The in-process coordinator and the signed-peer helpers, which unit tests use too, are in
tests/fixtures/coordinator.py.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integration.coordinator_process import CoordinatorProcess, launch_coordinator

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


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
        as_user
        + [str(bin_dir / "initdb"), "-D", str(data_dir), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    # Unix socket only (no TCP), fsync off: a throwaway server for tests.
    options = f"-k {base} -p {port} -c listen_addresses='' -c fsync=off"
    subprocess.run(
        as_user
        + [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(log_file), "-o", options, "-w", "-t", "30", "start"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        yield f"postgresql://postgres@/postgres?host={base}&port={port}"
    finally:
        subprocess.run(
            as_user + [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


def _new_schema_url(base_url: str) -> str:
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{base_url}&options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database for each backend: a file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    return _new_schema_url(request.getfixturevalue("postgres_url"))


@pytest.fixture
def postgres_schema_url(postgres_url: str) -> str:
    """A fresh, empty PostgreSQL schema of its own (several coordinator replicas share it)."""
    return _new_schema_url(postgres_url)


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[Any]:
    """A factory: `start_coordinator(db_path)` -> CoordinatorProcess; all are stopped after."""
    started: list[CoordinatorProcess] = []

    def start(db_path: Path | None = None) -> CoordinatorProcess:
        coordinator = launch_coordinator(db_path or tmp_path / "coordinator.db", tmp_path / f"serve-{len(started)}.log")
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop()
