"""A real ``locoswarm coordinator serve`` process on port 0, for the integration tests.

Readiness is the line it prints once it serves; every process is stopped by its own handle. The
`start_coordinator` fixture (tests/integration/conftest.py) starts them per test; a module-scoped
fixture calls `launch_coordinator` itself.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.coordinator import ADMIN_TOKEN, REPO_ROOT

LISTENING = re.compile(r"coordinator listening on (http://\S+)")


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
