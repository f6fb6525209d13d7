"""Stopping the child processes a launcher started: SIGINT first, then SIGKILL to their sessions.

Used by `node.cli.demo.LocalSwarm` (the one-machine demo swarm) and `tools.netlab.lab` (the network
lab). Standard library only, so that importing it (and so `tools/netlab/lab.py`) stays cheap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence


def stop_processes(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Stop `processes` and whatever they started; returns once each of them is reaped.

    Each one still running gets SIGINT (a node then writes its report and leaves the run), and
    all share one deadline, `grace_s` from now. One still running at its turn after the deadline
    is sent SIGKILL with its process group, then waited for. Last, the group of every process
    given, including those that had exited before this call, is sent SIGKILL once more: a
    child that outlived its parent (a node's p2pd daemon) goes too.

    Assumes each process was started with ``start_new_session=True``, so that its pid is its
    process group's id and `os.killpg` reaches its children. One started without it shares its
    parent's group: it is still killed on its own (`Popen.kill`), but its children are not.
    The closing sweep names each group by the pid of a process already reaped: Linux does not
    reuse a pid while a group of that id has a member, so a group found there is the process's
    own, unless it had emptied and a new session leader took the pid in the meantime.
    """
    running = [p for p in processes if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            p.kill()  # the process itself, should it lead no group of its own
            p.wait()
    for p in processes:
        _kill_group(p.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (all exited), or it is no group of ours to signal
