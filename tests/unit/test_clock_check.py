"""Clocks: `doctor` measures this machine's clock against the coordinator's and `node join`
refuses a clock hivemind's DHT would crash on, in one line that says to turn on NTP.

The clock is injected (a function returning unix seconds, offset from the real one), never the
system clock changed. The coordinator is the real app served by uvicorn in a thread on
127.0.0.1, port 0; an older coordinator (no `server_time`, only the HTTP Date header) is a
stdlib HTTP server.
"""

from __future__ import annotations

import inspect
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from locoswarm.cli import parse_args
from node.cli import doctor
from node.cli.doctor import FAIL, OK, WARN, check_clock, clock_refusal, measure_clock_offset
from node.cli.join import _join_checked
from tests.fixtures.coordinator import coordinator_in_thread, json_server

pytestmark = pytest.mark.timeout(60)


def skewed(offset_s: float):
    return lambda: time.time() + offset_s


@pytest.fixture(scope="module")
def coordinator_url(tmp_path_factory) -> Iterator[str]:
    with coordinator_in_thread(tmp_path_factory.mktemp("coordinator") / "c.db") as url:
        yield url


@pytest.fixture
def older_coordinator_url() -> Iterator[str]:
    """A /healthz without `server_time`: the Date header (whole seconds) is all there is."""
    with json_server(lambda path: (200, {"status": "ok"})) as url:
        yield url


def test_the_tolerance_is_hiveminds_and_its_ping_still_enforces_it():
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

    assert doctor.HIVEMIND_CLOCK_TOLERANCE_S == MAX_DHT_TIME_DISCREPANCY_SECONDS
    assert 0 < doctor.CLOCK_WARN_S < doctor.CLOCK_REFUSE_S < MAX_DHT_TIME_DISCREPANCY_SECONDS
    source = inspect.getsource(DHTProtocol.call_ping)
    assert "MAX_DHT_TIME_DISCREPANCY_SECONDS" in source and "local time must be within" in source


def test_the_offset_comes_from_the_round_trip_midpoint(coordinator_url):
    offset = measure_clock_offset(coordinator_url)
    assert offset.source == "server_time"
    assert abs(offset.offset_s) <= offset.error_s + 0.05 and offset.error_s < 0.5  # loopback
    ahead = measure_clock_offset(coordinator_url, skewed(250.0))
    assert abs(ahead.offset_s - 250.0) <= ahead.error_s + 0.05


def test_doctor_says_how_far_off_the_clock_is_and_what_to_do(coordinator_url):
    good = check_clock(coordinator_url)
    assert good.status == OK and "the coordinator's (+-" in good.detail, good.line()
    behind = check_clock(coordinator_url, skewed(-250.0))
    assert behind.status == FAIL and behind.detail.startswith("250.0")
    assert " s behind the coordinator's" in behind.detail
    assert "refuses peers over 3 s apart" in behind.detail and "`node join` refuses to start" in behind.detail
    assert "timedatectl set-ntp true" in behind.line() and "chrony" in behind.line()
    ahead = check_clock(coordinator_url, skewed(1.5))  # within hivemind's 3 s, but half of it used up
    assert ahead.status == WARN and " s ahead of the coordinator's" in ahead.detail, ahead.line()
    assert check_clock(coordinator_url, skewed(2.6)).status == FAIL


def test_an_older_coordinator_is_measured_by_its_date_header(older_coordinator_url):
    offset = measure_clock_offset(older_coordinator_url)
    assert offset.source == "Date header" and 0.5 <= offset.error_s < 1.0
    assert abs(offset.offset_s) <= offset.error_s + 0.05
    assert check_clock(older_coordinator_url).status in (OK, WARN)  # +-0.5 s of resolution may warn
    assert check_clock(older_coordinator_url, skewed(250.0)).status == FAIL
    assert clock_refusal(older_coordinator_url, skewed(1.2)) is None, "maybe off, not certainly: no refusal"


def test_no_coordinator_to_ask_is_a_warning_not_a_refusal():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens
    assert check_clock(url).status == WARN
    assert clock_refusal(url, skewed(250.0)) is None  # the join reports the unreachable coordinator itself


def test_join_refuses_a_bad_clock_in_one_line_before_starting(coordinator_url, tmp_path: Path, capsys):
    args = parse_args(
        [
            "node",
            "join",
            "--coordinator",
            coordinator_url,
            "--device",
            "cpu",
            "--no-progress",
            "--key",
            str(tmp_path / "peer.key"),
        ]
    )
    assert _join_checked(args, clock=skewed(-250.0)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: this machine's clock is 250.0") and " s behind the coordinator's (+-" in err
    assert "peers' DHT nodes refuse each other beyond 3 s: turn on NTP: `sudo timedatectl set-ntp true`" in err
    assert err.rstrip().endswith("then join again")
    assert not (tmp_path / "peer.key").exists(), "it stopped before the node started"
    assert clock_refusal(coordinator_url, skewed(0.5)) is None
