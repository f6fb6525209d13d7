"""A real ``locoswarm coordinator serve`` process on port 0, for the integration tests.

Readiness is the line it prints once it serves; every process is stopped by its own handle. The
`start_coordinator` fixture (tests/integration/conftest.py) starts them per test; a module-scoped
fixture calls `launch_coordinator` itself.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.process import CoordinatorProcess
from coordinator.process import launch_coordinator as _launch
from tests.fixtures.coordinator import ADMIN_TOKEN


def launch_coordinator(db_path: Path, log_path: Path, timeout_s: float = 30.0) -> CoordinatorProcess:
    """Start `serve` on the SQLite file `db_path` and return once it printed its listening line."""
    return _launch(f"sqlite:///{db_path}", log_path, ADMIN_TOKEN, timeout_s)
