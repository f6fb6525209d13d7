"""The node's table of refusals (node/round/refusals.py): every code of the protocol has an action,
the client's `Refused` carries it, the node's modules decide on actions and enum members (never on
code strings), and the lines a volunteer reads when a refusal stops `node join` are today's."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from node.cli.join import refusal_line
from node.errors import CannotStart
from node.round.coordinator_client import CoordinatorUnavailable, CoordinatorUnreachable, Refused
from node.round.refusals import ACTIONS, STOP_LINES, Action, Code, action_of, code_of
from protocol.http import ErrorCode

REPO = Path(__file__).resolve().parents[2]
URL = "http://c:8000"
RUNS_HINT = f"list the runs with `locoswarm run list --coordinator {URL}`"


def test_every_protocol_code_is_a_member_with_an_action():
    assert [code.value for code in Code] == list(get_args(ErrorCode))
    assert set(ACTIONS) == set(Code)
    assert set(STOP_LINES) <= set(Code)


@pytest.mark.parametrize(
    "code, action",
    [
        ("late", Action.DROP_PACKET),
        ("stale_round", Action.DROP_PACKET),
        ("round_not_open", Action.DROP_PACKET),
        ("excluded", Action.DROP_PACKET),
        ("conflicting_submission", Action.DROP_PACKET),
        ("run_closed", Action.RUN_OVER),
        ("round_not_found", Action.RUN_OVER),
        ("peer_gone", Action.REJOIN),
        ("conflicting_report", Action.CATCH_UP),
        ("round_too_old", Action.CATCH_UP),
        ("join_proof_required", Action.RETRY),
        ("rate_limited", Action.RETRY),
        ("internal", Action.RETRY),
        ("join_refused", Action.STOP),
        ("not_member", Action.STOP),
        ("invalid_request", Action.STOP),
    ],
)
def test_what_the_node_does_about_each_code(code, action):
    refused = Refused(409, code, "why")
    assert refused.code is Code(code) and refused.action is action
    assert str(refused) == f"409 {code}: why"


def test_a_code_unknown_here_stays_a_string_and_stops_the_node():
    refused = Refused(418, "teapot", "a newer coordinator's code")
    assert refused.code == "teapot" and not isinstance(refused.code, Code) and refused.action is Action.STOP
    assert code_of("teapot") == "teapot" and action_of("teapot") is Action.STOP


@pytest.mark.parametrize(
    "error, line",
    [
        (Refused(404, "run_not_found", "no run r1"), f"run r1 does not exist on {URL}: {RUNS_HINT}"),
        (Refused(409, "run_closed", "run r1 is closed"), f"run r1 is closed: nothing to join; {RUNS_HINT}"),
        (
            Refused(403, "join_refused", "this run needs a join token"),
            "run r1 refused this node: this run needs a join token; pass the join token from the run's operator with "
            "--token T",
        ),
        (Refused(401, "stale_nonce", "nonce 9 s off"), "the coordinator refused this node's clock: nonce 9 s off"),
        (
            Refused(422, "invalid_request", "bad body"),
            f"the coordinator at {URL} refused: 422 invalid_request: bad body",
        ),
        (
            CoordinatorUnavailable("GET /v1/runs: HTTP 503 (gave up after 3 s)"),
            f"the coordinator at {URL} stopped answering: GET /v1/runs: HTTP 503 (gave up after 3 s)",
        ),
        (CoordinatorUnreachable("no answer from the coordinator at ..."), "no answer from the coordinator at ..."),
        (
            CannotStart("no open run on http://c:8000: ask the operator"),
            "no open run on http://c:8000: ask the operator",
        ),
    ],
)
def test_the_line_a_volunteer_reads(error, line):
    assert refusal_line(error, URL + "/", "r1") == line


def test_without_a_run_id_the_line_says_the_run():
    line = refusal_line(Refused(404, "run_not_found", "x"), URL, None)
    assert line == f"the run does not exist on {URL}: {RUNS_HINT}"


def _string_code_comparisons(path: Path) -> list[str]:
    """`x.code == "late"`, `x.code in ("late", ...)`: comparisons of a `.code` with strings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(side, ast.Attribute) and side.attr == "code" for side in sides):
            continue
        strings = [
            c.value
            for side in sides
            for c in ast.walk(side)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        ]
        if strings:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {strings}")
    return found


def test_no_node_module_compares_codes_as_strings():
    codes = set(get_args(ErrorCode))
    found = [hit for path in sorted((REPO / "node").rglob("*.py")) for hit in _string_code_comparisons(path)]
    assert found == []
    literals = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted((REPO / "node").rglob("*.py"))
        if path.name != "refusals.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Tuple)
        and node.elts
        and all(isinstance(e, ast.Constant) and e.value in codes for e in node.elts)
    ]
    assert literals == [], "a tuple of error codes outside the table"
