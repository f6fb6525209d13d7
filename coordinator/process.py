"""`coordinator serve` as a child process on 127.0.0.1, port 0: started, waited on, stopped.

Readiness is the line `serve` prints once it listens (`coordinator listening on URL`), read from its
stdout by a thread that keeps reading for the process's whole life, so a full pipe never blocks it.
Used by the load benchmark (tools/bench/load.py) and the integration tests
(tests/integration/coordinator_process.py); each stops the process by its own handle.
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

LISTENING = re.compile(r"coordinator listening on (http://\S+)")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CoordinatorProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)


def serve_command(db_url: str, port: int = 0) -> list[str]:
    # The standalone entry shares `register` with `locoswarm`; test_coordinator_cli checks that
    # `locoswarm` itself wires these commands in.
    return [
        sys.executable,
        "-m",
        "coordinator.cli",
        "coordinator",
        "serve",
        "--db",
        db_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def launch_coordinator(db_url: str, log_path: Path, admin_token: str, timeout_s: float = 30.0) -> CoordinatorProcess:
    """Start `serve` on `db_url` (stderr appended to `log_path`) and return once it printed its
    listening line; if it exits or stays silent for `timeout_s`, kill it and raise with its log."""
    env = {**os.environ, "LOCOSWARM_ADMIN_TOKEN": admin_token, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            serve_command(db_url), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=timeout_s)
            if line is None:
                raise RuntimeError(f"the coordinator exited early:\n{log_path.read_text()[-3000:]}")
            if match := LISTENING.search(line):
                return CoordinatorProcess(match.group(1), process, log_path)
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise
