"""`locoswarm node join` as a volunteer runs it, a real process against a real coordinator process:
a refusal is one line on stderr after the resolved config (no library log lines, no traceback;
both with `-v`), and Ctrl+C says at once what happens, stops after the step with a summary, and a
second Ctrl+C quits at once. Every process a test starts, it stops by its own handle; the node
processes lead their own sessions, so their p2pd daemons go with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from node.cli.processes import stop_processes
from tests.fixtures.coordinator import ADMIN_HEADERS, REPO_ROOT, create_run
from tests.integration.test_p2p_exchange import p2pd_children, pid_alive

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOCOSWARM_LOG_LEVEL": "INFO"}


def locoswarm(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "locoswarm", *argv],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_cuda_on_a_cpu_only_torch_is_the_only_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    done = locoswarm(
        "node", "join", "--coordinator", "http://127.0.0.1:9", "--device", "cuda", "--key", str(tmp_path / "peer.key")
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: cuda requested but this torch is a CPU-only build -> reinstall with ")
    assert done.stderr.count("\n") == 1


def test_a_run_that_does_not_exist_quietly_and_verbosely(tmp_path, start_coordinator):
    url = start_coordinator().url
    argv = (
        "node",
        "join",
        "--coordinator",
        url,
        "--run",
        "run-doesnotexist",
        "--device",
        "cpu",
        "--key",
        str(tmp_path / "peer.key"),
    )
    error = (
        f"error: run run-doesnotexist does not exist on {url}: list the runs with "
        f"`locoswarm run list --coordinator {url}`"
    )
    done = locoswarm(*argv)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr
    assert lines[0].startswith("node config: ") and lines[1] == error
    verbose = locoswarm(*argv, "-v")
    assert verbose.returncode == 2 and verbose.stderr.splitlines()[-1] == error
    assert "HTTP Request: GET" in verbose.stderr and "Traceback" in verbose.stderr


def test_a_closed_run_and_a_missing_join_token(tmp_path, start_coordinator):
    url = start_coordinator().url
    with httpx.Client(base_url=url, timeout=10) as client:
        closed = create_run(client, {"exchange.dht_bootstrap": []})
        assert client.post(f"/v1/runs/{closed}/close", headers=ADMIN_HEADERS).status_code == 200
        guarded = create_run(
            client,
            {
                "exchange.dht_bootstrap": [],
                "membership.join_policy": "token",
                "membership.join_tokens": ["long-enough-token"],
            },
        )
    runs_hint = f"list the runs with `locoswarm run list --coordinator {url}`"
    for run_id, token, error in [
        (closed, None, f"error: run {closed} is closed: nothing to join; {runs_hint}"),
        (
            guarded,
            None,
            f"error: run {guarded} refused this node: this run needs a join token; pass the join "
            f"token from the run's operator with --token T",
        ),
        (
            guarded,
            "wrong-token-0",
            f"error: run {guarded} refused this node: the join token is not valid for this "
            f"run; pass the join token from the run's operator with --token T",
        ),
    ]:
        done = locoswarm(
            "node",
            "join",
            "--coordinator",
            url,
            "--run",
            run_id,
            "--device",
            "cpu",
            "--key",
            str(tmp_path / "peer.key"),
            *(("--token", token) if token else ()),
        )
        assert done.returncode == 2 and done.stderr.splitlines()[-1] == error, done.stderr
        assert "Traceback" not in done.stderr and "HTTP Request" not in done.stderr


def _start_node(tmp_path: Path, url: str, name: str) -> tuple[subprocess.Popen, Path]:
    err_path = tmp_path / f"{name}.err"
    with open(err_path, "wb") as err, open(tmp_path / f"{name}.out", "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locoswarm",
                "node",
                "join",
                "--coordinator",
                url,
                "--device",
                "cpu",
                "--threads",
                "1",
                "--no-progress",
                "--key",
                str(tmp_path / f"{name}.key"),
            ],
            cwd=REPO_ROOT,
            env=ENV,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return process, err_path


def _wait_for(path: Path, text: str, process: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until `text` shows in the file at `path` (fails if the process exits first)."""
    start = time.monotonic()
    while text not in path.read_text():
        assert process.poll() is None, f"exited with {process.returncode}:\n{path.read_text()}"
        assert time.monotonic() - start < timeout_s, f"no {text!r} in {timeout_s} s:\n{path.read_text()}"
        time.sleep(0.05)
    return time.monotonic() - start


def _left(url: str, run_id: str) -> bool:
    """Whether the run's one peer has told the coordinator it left (a node does so before it stops
    its p2pd)."""
    peers = httpx.get(f"{url}/v1/runs/{run_id}/status", timeout=10).json()["peers"]
    return [p["status"] for p in peers] == ["left"]


def test_ctrl_c_once_stops_after_the_step_twice_quits_now(tmp_path, start_coordinator):
    url = start_coordinator().url

    def new_run() -> str:
        with httpx.Client(base_url=url, timeout=10) as client:
            # One peer suffices to open round 0; 40 inner steps keep it training for a few seconds.
            # Heartbeats every second (a quarter of the time-out), so that training shows at once.
            return create_run(
                client,
                {
                    "membership.min_peers": 1,
                    "membership.heartbeat_timeout_s": 4.0,
                    "max_rounds": 20,
                    "exchange.dht_bootstrap": [],
                    "inner": {"steps": 40, "batch_size": 8, "seq_len": 64, "warmup_steps": 5},
                },
            )

    first_run = new_run()
    nodes: list[subprocess.Popen] = []
    try:
        first, first_err = _start_node(tmp_path, url, "first")
        nodes.append(first)
        _wait_for(first_err, "joined run", first, timeout_s=120)
        (daemon,) = p2pd_children({first.pid})
        # A terminal's Ctrl+C goes to its whole foreground process group: p2pd, which the node
        # still needs to finish its step, must not get it (node/exchange/host.py DAEMON_LAUNCHER).
        assert os.getpgid(daemon) == daemon != os.getpgid(first.pid), "p2pd is in the node's process group"
        os.killpg(first.pid, signal.SIGINT)
        assert _wait_for(first_err, "stopping after this step; Ctrl+C again to quit now", first, 5) < 5
        time.sleep(1.0)
        # A node that was between steps may have stopped already: it leaves the run, then stops p2pd.
        assert pid_alive(daemon) or first.poll() is not None or _left(url, first_run), "p2pd died of the Ctrl+C"
        assert first.wait(timeout=120) == 0
        summary = (tmp_path / "first.out").read_text()
        assert summary.startswith("summary: ") and summary.count("\n") == 1, summary
        assert "Traceback" not in first_err.read_text()
        assert not pid_alive(daemon), "the node's exit left its p2pd behind"

        # A run of its own, from round 0: in the first one it would wait for a snapshot of round 1
        # that only the node that left ever held.
        assert httpx.post(f"{url}/v1/runs/{first_run}/close", headers=ADMIN_HEADERS, timeout=10).status_code == 200
        new_run()
        second, second_err = _start_node(tmp_path, url, "second")
        nodes.append(second)
        _wait_for(second_err, "joined run", second, timeout_s=120)
        _wait_for(second_err, "round 0: loss", second, timeout_s=120)  # round 1 now: a round to finish
        second.send_signal(signal.SIGINT)
        _wait_for(second_err, "stopping after this step", second, 5)
        second.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert second.wait(timeout=15) == 130
        assert time.monotonic() - start < 10
        assert "quitting now" in second_err.read_text()
        assert (tmp_path / "second.out").read_text().startswith("summary: ")
    finally:
        stop_processes(nodes, grace_s=10)
