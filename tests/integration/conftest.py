"""Fixtures that start real processes, for the integration tests only.

- `postgres_url`: a real PostgreSQL server started for the session from Debian's binaries, as the
  ``postgres`` OS user when we are root, on a unix socket in a temp dir (tools/bench/postgres.py);
  skipped with the reason when the binaries or the user are missing. `storage_url` gives each
  test its own schema (and a SQLite file); `postgres_schema_url`, its own PostgreSQL schema only.
- `start_coordinator`: real ``locoswarm coordinator serve`` processes on port 0
  (tests/integration/coordinator_process.py), each stopped by its own handle after the test.

The in-process coordinator and the signed-peer helpers, which unit tests use too, are in
tests/fixtures/coordinator.py.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integration.coordinator_process import CoordinatorProcess, launch_coordinator
from tools.bench import postgres as throwaway_postgres


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    base = Path(tempfile.mkdtemp(prefix="locoswarm-pg-"))
    try:
        url = throwaway_postgres.start(base)
    except throwaway_postgres.PostgresMissing as e:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(str(e))
    try:
        yield url
    finally:
        throwaway_postgres.stop(base)


def _new_schema_url(base_url: str) -> str:
    return throwaway_postgres.new_schema(base_url)[1]


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
