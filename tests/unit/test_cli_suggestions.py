"""A misspelt command, subcommand, choice or flag is answered with the closest known one, at every
level of the `locoswarm` command line (locoswarm/cli.py, SuggestingParser), and only when one is
close; exit code 2 and argparse's usage line as before. Valid command lines still parse, and
`bench` still hands its arguments to the benchmark's own parser.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from locoswarm.cli import main, parse_args
from tests.fixtures.coordinator import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

URL = "http://127.0.0.1:8000"


def refusal(capsys, argv: list[str]) -> str:
    """The error line `locoswarm ARGV` exits with (code 2), after checking a usage line precedes it."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: locoswarm"), err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nod", "join"], "locoswarm: error: argument COMMAND: invalid choice: 'nod' (did you mean 'node'?)"),
        (["node", "jion"], "locoswarm node: error: argument COMMAND: invalid choice: 'jion' (did you mean 'join'?)"),
        (
            ["coordinator", "serv"],
            "locoswarm coordinator: error: argument COMMAND: invalid choice: 'serv' (did you mean 'serve'?)",
        ),
        (["bench", "codc"], "locoswarm bench: error: argument BENCH: invalid choice: 'codc' (did you mean 'codec'?)"),
        (
            ["run", "craete"],
            "locoswarm run: error: argument COMMAND: invalid choice: 'craete' (did you mean 'create'?)",
        ),
        (
            ["coordinator", "serve", "--log-level", "warnin"],
            "locoswarm coordinator serve: error: argument --log-level: invalid choice: 'warnin' (did you mean 'warning'?)",
        ),
    ],
)
def test_a_misspelt_command_or_choice_gets_the_closest(capsys, argv, message):
    assert refusal(capsys, argv) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["node", "join", "--coordinatr", URL],
            f"locoswarm node join: error: unrecognized arguments: --coordinatr {URL} (did you mean --coordinator?)",
        ),
        (
            ["node", "join", f"--coordinatr={URL}"],
            f"locoswarm node join: error: unrecognized arguments: --coordinatr={URL} (did you mean --coordinator?)",
        ),
        (
            ["status", "--coordinator", URL, "--wach"],
            "locoswarm status: error: unrecognized arguments: --wach (did you mean --watch?)",
        ),
        (
            ["node", "join", "--coordinatr", URL, "--rn", "r1"],
            f"locoswarm node join: error: unrecognized arguments: --coordinatr {URL} --rn r1 "
            "(did you mean --coordinator for --coordinatr, --run for --rn?)",
        ),
        (
            ["run", "create", "--coordinatr", URL, "--config", "run.toml"],
            "locoswarm run create: error: the following arguments are required: --coordinator "
            "(unrecognized: --coordinatr; did you mean --coordinator?)",
        ),
    ],
)
def test_a_misspelt_flag_gets_the_closest_of_its_command(capsys, argv, message):
    assert refusal(capsys, argv) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["xyzzy"], "locoswarm: error: argument COMMAND: invalid choice: 'xyzzy' (choose from 'version', "),
        (["node", "join", "--zzqq", "3"], "locoswarm node join: error: unrecognized arguments: --zzqq 3"),
        (
            ["run", "create", "--config", "run.toml"],
            "locoswarm run create: error: the following arguments are required: --coordinator",
        ),
    ],
)
def test_nothing_close_gets_argparses_plain_message(capsys, argv, message):
    line = refusal(capsys, argv)
    assert line.startswith(message) and "did you mean" not in line, line


def test_valid_command_lines_still_parse():
    args = parse_args(["node", "join", "--coordinator", URL, "--run", "r1"])
    assert (args.coordinator, args.run_id) == (URL, "r1")
    assert parse_args(["node", "join", "--coord", URL]).coordinator == URL  # argparse's abbreviations stand
    args = parse_args(["bench", "codec", "--json", "--repeats", "1"])
    assert args.bench_command == "codec" and args.passthrough == ["--json", "--repeats", "1"]


def test_bench_hands_help_to_the_benchmarks_own_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "codec", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: locoswarm bench codec [-h] [--json]")


def test_the_installed_command_suggests():
    """The same through `python -m locoswarm`, as a user runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "locoswarm", "nod", "join"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "usage: locoswarm [-h] COMMAND ...",
        "locoswarm: error: argument COMMAND: invalid choice: 'nod' (did you mean 'node'?)",
    ]
