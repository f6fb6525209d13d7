"""`node.cli.processes.stop_processes` on real child processes: SIGINT within the grace, SIGKILL to
the whole session after it, and the sweep of a session whose leader already exited.

The test process makes itself a child subreaper for the duration, so that a grandchild orphaned
by its parent's death becomes our child: we can then reap it and see that its pid is gone,
whatever the machine's init does with zombies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest

from node.cli.processes import stop_processes

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (prctl, sessions)"),
]

PR_SET_CHILD_SUBREAPER = 36

# Prints "ready" once SIGINT would interrupt it (Python's handler is set), then sleeps. The handler is
# set explicitly: started from a background job (no job control), the suite and its children inherit
# SIGINT ignored, and Python then installs none.
EXITS_ON_SIGINT = (
    "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "print('ready', flush=True); time.sleep(60)"
)
# Ignores SIGINT, starts a grandchild that ignores it too, prints the grandchild's pid once both
# are ready, then sleeps (or with `exit` as argv[1], exits and leaves the grandchild behind).
IGNORES_SIGINT_WITH_GRANDCHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                           "print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
assert grandchild.stdout.readline() == b"ready\\n"
print(grandchild.pid, flush=True)
if sys.argv[1:] != ["exit"]:
    time.sleep(60)
"""


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@pytest.fixture
def subreaper():
    _set_subreaper(True)
    try:
        yield
    finally:
        _set_subreaper(False)


class Started:
    """The processes a test starts, each stopped by its own handle at the end."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self.grandchildren: set[int] = set()  # pids re-parented to us and not yet reaped

    def start(self, code: str, *args: str, new_session: bool = True) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=new_session,
        )
        self.processes.append(process)
        return process

    def read_line(self, process: subprocess.Popen) -> str:
        return process.stdout.readline().decode().strip()

    def start_with_grandchild(self, *args: str) -> tuple[subprocess.Popen, int]:
        process = self.start(IGNORES_SIGINT_WITH_GRANDCHILD, *args)
        grandchild = int(self.read_line(process))
        self.grandchildren.add(grandchild)
        return process, grandchild

    def reap(self, pid: int, timeout_s: float = 10.0) -> int:
        """Wait for a re-parented grandchild's exit; its wait status, or fail if it still runs."""
        deadline = time.monotonic() + timeout_s
        while True:
            reaped, status = os.waitpid(pid, os.WNOHANG)
            if reaped == pid:
                self.grandchildren.discard(pid)
                return status
            assert time.monotonic() < deadline, f"grandchild {pid} still runs"
            time.sleep(0.02)

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()
        for pid in list(self.grandchildren):  # ours (subreaper) and not reaped: the pid is still this one
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap(pid)


@pytest.fixture
def started(subreaper):
    processes = Started()
    try:
        yield processes
    finally:
        processes.cleanup()


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sigint_then_kill_of_the_session_and_sweep_of_an_exited_one(started):
    polite = started.start(EXITS_ON_SIGINT)
    assert started.read_line(polite) == "ready"
    stubborn, stubborn_grandchild = started.start_with_grandchild()
    # Exited before the call, leaving a grandchild in its session (a crashed node's p2pd).
    crashed, orphan = started.start_with_grandchild("exit")
    assert crashed.wait(timeout=10) == 0
    done = started.start("pass")  # exited, nothing left behind
    assert done.wait(timeout=10) == 0

    began = time.monotonic()
    stop_processes([polite, stubborn, crashed, done], grace_s=0.5)
    elapsed_s = time.monotonic() - began

    assert polite.returncode == -signal.SIGINT  # stopped by SIGINT within the grace
    assert stubborn.returncode == -signal.SIGKILL  # killed after it
    assert crashed.returncode == 0 and done.returncode == 0
    assert elapsed_s < 10.0
    for pid in (stubborn_grandchild, orphan):
        status = started.reap(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert_gone(pid)


def test_a_process_without_a_session_of_its_own_is_still_killed(started):
    # It shares our process group: killpg by its pid finds no group, the process itself is killed.
    stubborn = started.start(
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
        new_session=False,
    )
    assert started.read_line(stubborn) == "ready"
    stop_processes([stubborn], grace_s=0.2)
    assert stubborn.returncode == -signal.SIGKILL


def test_nothing_to_stop():
    stop_processes([], grace_s=0.1)
