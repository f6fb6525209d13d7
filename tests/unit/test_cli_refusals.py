"""What a user can get wrong on the command line is refused in one line that says what to do, with
a non-zero exit code and no traceback: `node join` (a CUDA device on a CPU-only torch, a wrong
coordinator address, https for a plain one, a URL with a path, a run that does not exist, a
misspelt config key, a bound, a data path or key file that is not one), `status` and
`run close` (a run that does not exist), `run create` (no admin token). Also: the node's summary
and its Ctrl+C handling, the logging levels, and the help texts that point at `doctor`.

The coordinator, where one is needed, is the real app served by uvicorn in a thread of this
process on 127.0.0.1, port 0; its real-process twin is tests/integration/test_cli_refusals.py.
"""

from __future__ import annotations

import logging
import re
import shlex
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from locoswarm.cli import main, parse_args
from node.cli.join import Interrupts, format_bytes, summary_line
from node.cli.logs import LIBRARY_LOGGERS, OWN_LOGGERS, configure_logging
from node.round.reports import CatchUpReport, RoundReport
from tests.fixtures.coordinator import ADMIN_TOKEN, REPO_ROOT, coordinator_in_thread

pytestmark = pytest.mark.timeout(60)

CUDA_FIX = (
    'reinstall with TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" '
    "bash deploy/setup.sh (check nvidia-smi), or use --device cpu"
)


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    """`node join` sets logger levels and HIVEMIND_LOGLEVEL; put them back for the next test."""
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "WARNING")
    monkeypatch.delenv("LOCOSWARM_LOG_LEVEL", raising=False)
    names = (*LIBRARY_LOGGERS, *OWN_LOGGERS)
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="module")
def coordinator_url(tmp_path_factory) -> Iterator[str]:
    """A real coordinator (app, storage, uvicorn) in a thread, on a free port of 127.0.0.1."""
    with coordinator_in_thread(tmp_path_factory.mktemp("coordinator") / "c.db") as url:
        yield url


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


def refused(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit code, the last line on stderr) of `locoswarm ARGV`, checked to carry no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.strip().splitlines()[-1]


def join_argv(tmp_path: Path, *flags: str) -> list[str]:
    return ["node", "join", "--key", str(tmp_path / "peer.key"), "--no-progress", *flags]


# -- node join ------------------------------------------------------------------------------------


def test_cuda_on_a_cpu_only_torch_is_refused_before_joining(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    # The port has nothing listening: reaching the coordinator would take 20 s and say so instead.
    code = main(join_argv(tmp_path, "--coordinator", f"http://127.0.0.1:{closed_port()}", "--device", "cuda"))
    err = capsys.readouterr().err
    reason = "this torch is a CPU-only build" if not torch.version.cuda else "no GPU visible to torch"
    assert (code, err) == (2, f"error: cuda requested but {reason} -> {CUDA_FIX}\n")
    assert not (tmp_path / "peer.key").exists()  # it stopped before the node started


def test_a_coordinator_that_never_answers_is_one_line(tmp_path, capsys, monkeypatch):
    import node.round.coordinator_client as coordinator_client

    monkeypatch.setattr(coordinator_client, "FIRST_CONTACT_S", 1.0)
    url = f"http://127.0.0.1:{closed_port()}"
    code, line = refused(capsys, join_argv(tmp_path, "--coordinator", url, "--device", "cpu"))
    assert code == 2
    assert re.fullmatch(
        rf"error: no answer from the coordinator at {re.escape(url)} in 1 s \(ConnectError: .+\): "
        rf"check the address, or run `locoswarm doctor --coordinator {re.escape(url)}`",
        line,
    ), line


def test_a_run_that_does_not_exist(tmp_path, capsys, coordinator_url):
    url = coordinator_url
    expected = (
        f"error: run run-doesnotexist does not exist on {url}: list the runs with "
        f"`locoswarm run list --coordinator {url}`"
    )
    assert refused(
        capsys, join_argv(tmp_path, "--coordinator", url, "--run", "run-doesnotexist", "--device", "cpu")
    ) == (2, expected)
    assert refused(capsys, ["status", "--coordinator", url, "--run", "run-doesnotexist"]) == (2, expected)
    assert refused(
        capsys, ["run", "close", "--coordinator", url, "--run", "run-doesnotexist", "--admin-token", ADMIN_TOKEN]
    ) == (2, expected)


def test_mistyped_paths_are_refused_before_the_coordinator_is_asked(tmp_path, capsys):
    """--data and --key are checked before any call: the coordinator's port here is closed, so a node
    that asked it first would say "no answer from the coordinator" instead."""
    url = f"http://127.0.0.1:{closed_port()}"
    argv = ["node", "join", "--coordinator", url, "--device", "cpu", "--no-progress"]
    key = str(tmp_path / "peer.key")
    missing = tmp_path / "no-such-corpus.txt"
    assert refused(capsys, [*argv, "--key", key, "--data", str(missing)]) == (
        2,
        f"error: the training data {missing} (--data): no such file or directory",
    )
    assert refused(capsys, [*argv, "--key", str(tmp_path)]) == (
        2,
        f"error: --key: the key path {tmp_path} is a directory: pass a file's path, such as {tmp_path / 'peer.key'}",
    )
    not_a_key = tmp_path / "id_rsa.pub"
    not_a_key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 volunteer@laptop\n")
    assert refused(capsys, [*argv, "--key", str(not_a_key)]) == (
        2,
        f"error: --key: {not_a_key} is not a peer key (an Ed25519 private key, 32 raw bytes; this file has "
        f"{not_a_key.stat().st_size}): "
        "pass the right file, or move this one away and a new key is made (a new key joins as a new peer)",
    )
    assert not_a_key.read_text().startswith("ssh-ed25519"), "the file that is not a key is left as it was"


def test_https_for_a_plain_coordinator_says_use_http_at_once(tmp_path, capsys, coordinator_url, monkeypatch):
    """A TLS handshake against plain HTTP fails the same way every time: no 20 s of retries. (Without
    the check, FIRST_CONTACT_S, made huge here, would run out the test's time-out.)"""
    import node.round.coordinator_client as coordinator_client

    monkeypatch.setattr(coordinator_client, "FIRST_CONTACT_S", 3600.0)
    https = "https://" + coordinator_url.removeprefix("http://")
    code, line = refused(capsys, join_argv(tmp_path, "--coordinator", https, "--device", "cpu"))
    assert (code, line) == (
        2,
        f"error: the coordinator at {https}: it answers in plain HTTP, not TLS (WRONG_VERSION_NUMBER): "
        f"use {coordinator_url}",
    )


def test_a_url_with_a_path_says_give_the_base_url(tmp_path, capsys, coordinator_url):
    url = coordinator_url + "/v1"
    assert refused(capsys, join_argv(tmp_path, "--coordinator", url, "--device", "cpu")) == (
        2,
        f"error: {url} has no such route (Not Found): give the coordinator's base URL, http://host:port without "
        "/v1 or a page's path; otherwise this node and the coordinator run different versions "
        "(`locoswarm version` on both)",
    )


def test_a_member_back_after_its_run_ended_exits_0_and_a_newcomer_is_refused(tmp_path, capsys, caplog):
    """A node whose checkpoint holds a run that ended while it was down (a crash, a reboot) has
    nothing to do: exit 0, which a service manager does not restart it for (deploy/
    locoswarm-node.service has Restart=on-failure: on exit 2 it started the node again every 15 s).
    A key that never was a member is refused as before."""
    import httpx

    from node.round import resume
    from node.training.data import load_corpus
    from node.training.peer import PeerTraining
    from protocol.run_config import RunConfig
    from tests.doubles.memory_exchange import MemorySwarm
    from tests.doubles.session import node_session
    from tests.fixtures.coordinator import create_run, run_config

    with coordinator_in_thread(tmp_path / "c.db") as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            run_id = create_run(client, {"exchange.dht_bootstrap": []})
            assert client.post(
                f"/v1/runs/{run_id}/close", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            ).is_success
        run = RunConfig.model_validate(run_config({"exchange.dht_bootstrap": []}))
        member = tmp_path / "member"
        s = node_session(
            member,
            run,
            client=None,
            exchange=MemorySwarm().exchange("node"),
            training=PeerTraining.build(run, "cpu", load_corpus(None).train),
            run_id=run_id,
            checkpoints={"checkpoint_dir": str(member / "ckpt")},
        )
        resume.save(s, applied_round=4)  # what the node wrote before it went down: the start of round 5
        argv = ["node", "join", "--coordinator", url, "--run", run_id, "--device", "cpu", "--no-progress"]
        code = main([*argv, "--key", str(member / "node.key"), "--checkpoint-dir", str(member / "ckpt")])
        err = capsys.readouterr().err
        assert code == 0 and "error:" not in err, err
        assert (
            f"run {run_id} ended while this node was away (run {run_id} is closed); its checkpoint holds the start"
            " of round 5" in caplog.text
        )
        assert refused(capsys, [*argv, "--key", str(tmp_path / "newcomer.key")]) == (
            2,
            f"error: run {run_id} is closed: nothing to join; list the runs with `locoswarm run list --coordinator {url}`",
        )


def test_status_without_runs_says_how_to_create_one(capsys, coordinator_url):
    url = coordinator_url  # no test here creates a run on it
    assert refused(capsys, ["status", "--coordinator", url]) == (
        2,
        f"error: no runs on {url}: create one with `locoswarm run create --coordinator {url} --config run.toml`",
    )


def test_misspelt_keys_get_the_closest_known_one(tmp_path, capsys):
    node_toml = tmp_path / "node.toml"
    node_toml.write_text('coordinator = "http://127.0.0.1:9"\nthreds = 2\n')
    assert refused(capsys, ["node", "join", "--config", str(node_toml)]) == (
        2,
        f"error: {node_toml}: threds: unknown key (did you mean training.threads?)",
    )
    run_toml = tmp_path / "run.toml"
    for text, message in [
        ("inner_step = 15\n", "inner_step: unknown key (did you mean inner.steps?)"),
        ("[inner]\nstepz = 15\n", "inner.stepz: unknown key (did you mean inner.steps?)"),
        ("[inner]\ntop_k = 8\n", "inner.top_k: unknown key (did you mean outer.top_k?)"),
        ("lr = 0.1\n", "lr: unknown key (did you mean inner.lr or outer.lr?)"),
        (
            '[deadline]\nkind = "adaptive"\nquantil = 0.5\n',
            "deadline.quantil: unknown key (did you mean deadline.quantile?)",
        ),
        (
            "[outer]\nspeed = 1\n",
            "outer.speed: unknown key (known keys: strategy, lr, momentum, nesterov, top_k, "
            "chunk_size, error_decay, aggregation, max_abs_value, overlap, max_contributors)",
        ),
    ]:
        head, _, section = text.partition("[")
        run_toml.write_text(f'name = "a"\n{head}[model]\npreset = "tiny"\n' + (f"[{section}" if section else ""))
        assert refused(
            capsys,
            [
                "run",
                "create",
                "--coordinator",
                "http://127.0.0.1:9",
                "--config",
                str(run_toml),
                "--admin-token",
                ADMIN_TOKEN,
            ],
        ) == (2, f"error: {run_toml}: {message}")


def test_bounds_are_plain_numbers(tmp_path, capsys):
    assert refused(capsys, join_argv(tmp_path, "--coordinator", "http://127.0.0.1:9", "--uplink-mbps", "1e9")) == (
        2,
        "error: command line: network.uplink_mbps: Input should be less than or equal to 10000000",
    )
    assert refused(capsys, join_argv(tmp_path, "--coordinator", "http://127.0.0.1:9", "--max-rounds", "200000000")) == (
        2,
        "error: command line: training.max_rounds: Input should be less than or equal to 100000000",
    )
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('name = "a"\n[model]\npreset = "tiny"\n[inner]\ngrad_clip = 1e9\nlr = 1e-9\n')
    from protocol.config_file import plain_number
    from protocol.run_config import ConfigError, load_run_config

    with pytest.raises(ConfigError) as error:
        load_run_config(run_toml)
    assert str(error.value) == f"{run_toml}: inner.grad_clip: Input should be less than or equal to 1000000"
    assert [plain_number(x) for x in (1e8, 1e-7, 2.5, 17179869184, 1.0, 0)] == [
        "100000000",
        "0.0000001",
        "2.5",
        "17179869184",
        "1",
        "0",
    ]


# -- run create -----------------------------------------------------------------------------------


def test_run_create_without_a_token_says_where_serve_wrote_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOCOSWARM_ADMIN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = ["run", "create", "--coordinator", "http://127.0.0.1:9", "--config", str(REPO_ROOT / "deploy/run.toml")]
    expected = (
        "error: no admin token: pass --admin-token-file PATH, the file `coordinator serve` printed as "
        "`admin token in PATH` (beside a SQLite database DB: DB.admin-token), or --admin-token T, or set "
        "LOCOSWARM_ADMIN_TOKEN"
    )
    assert refused(capsys, argv) == (2, expected)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "coordinator.db.admin-token").write_text("x" * 32)
    assert refused(capsys, argv) == (2, expected + "; in this directory: runs/coordinator.db.admin-token")


# -- stopping: Ctrl+C and the summary ---------------------------------------------------------------


def test_the_first_interrupt_stops_after_the_step_the_second_quits():
    said, calls = [], []
    interrupts = Interrupts(lambda: calls.append("stop"), lambda: calls.append("quit"), say=said.append)
    interrupts()
    assert (said, calls, interrupts.quitting) == (
        ["stopping after this step; Ctrl+C again to quit now"],
        ["stop"],
        False,
    )
    interrupts()
    assert (said[-1], calls, interrupts.quitting) == ("quitting now", ["stop", "quit"], True)


def _report(round: int, loss: float, started_at: float, ended_at: float) -> RoundReport:
    return RoundReport(
        round=round,
        train_loss=loss,
        digest="ab" * 16,
        num_packets=3,
        packet_bytes=800_000,
        downloaded_bytes=1_600_000,
        uploaded_bytes=1_200_000,
        started_at=started_at,
        ended_at=ended_at,
    )


def test_the_summary_says_rounds_loss_bytes_and_time():
    node = SimpleNamespace(
        reports=[
            _report(3, 5.81234, 1000.0, 1010.0),
            _report(4, 5.5, 1010.0, 1020.0),
            _report(5, 4.90111, 1020.0, 1250.0),
        ],
        resumed_from=None,
        catch_ups=[],
    )
    assert summary_line(node, 300.0) == (
        "summary: 3 rounds (3-5) in 4m10s, loss 5.8123 -> 4.9011, sent 3.6 MB, received 4.8 MB"
    )
    node.reports, node.resumed_from = node.reports[:1], 3
    node.catch_ups = [CatchUpReport(None, 3, "snapshot"), CatchUpReport(3, 3, "none")]
    assert summary_line(node, 30.0) == (
        "summary: 1 round (3) in 10s, loss 5.8123, sent 1.2 MB, received 1.6 MB, "
        "resumed from its checkpoint at round 3, caught up 1 time"
    )
    assert (
        summary_line(SimpleNamespace(reports=[], resumed_from=None, catch_ups=[]), 7.2)
        == "summary: no round completed in 7s"
    )
    assert [format_bytes(n) for n in (0, 999, 1000, 2_500_000, 3 * 10**9)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "2.5 MB",
        "3.0 GB",
    ]


# -- logging and help -----------------------------------------------------------------------------


def test_libraries_log_at_warning_unless_verbose():
    configure_logging(verbose=False)
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("locoswarm.node").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("node.round.coordinator_client").getEffectiveLevel() == logging.INFO
    configure_logging(verbose=True)
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.INFO
    for argv in (["node", "join", "-v"], ["demo", "--verbose"], ["coordinator", "serve", "-v"]):
        assert parse_args(argv).verbose


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width


def test_help_points_at_doctor_and_describes_every_flag(capsys):
    assert "locoswarm doctor --coordinator URL" in _help(capsys, [])
    assert "locoswarm doctor --coordinator URL" in _help(capsys, ["node", "join"])
    assert "--interval-s INTERVAL_S with --watch: seconds between refreshes (default 2)" in _help(capsys, ["status"])


def test_setup_prints_commands_the_cli_accepts():
    """deploy/setup.sh ends by printing what to run next; each of those command lines parses."""
    text = (REPO_ROOT / "deploy/setup.sh").read_text()
    commands = re.findall(r'echo "\s+\.venv/bin/locoswarm ([^"]+?)\s{2,}', text)
    assert [c.split()[0] for c in commands] == ["doctor", "node", "demo"]
    for command in commands:
        parse_args(shlex.split(command.replace("COORDINATOR", "127.0.0.1")))
