"""tools/netlab/timeline.py on a workdir written by the nodes' own log formats (node/cli/logs.py,
the fetch and push lines of node/exchange/fetch.py and push.py), so a changed line breaks here."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from node.cli.logs import LOG_FORMAT
from node.exchange.fetch import FETCHED_LINE
from node.exchange.push import PUSHED_LINE
from tools.netlab import timeline

T = 1_796_610_000.0  # round 1's first submission, epoch s
RATES = {"h1": 10.0, "h2": 100.0, "h3": 100.0, "h4": 100.0}


def _libp2p_id(host: str) -> str:
    return f"12D3KooWExampleIdOfHost{host}xyz{host}"


def _write_node(
    workdir: Path,
    host: str,
    submitted: dict[int, float],
    lines: list[tuple[float, str, str, tuple]],
    reported: dict[int, dict] | None = None,
):
    """node<i>.log through a real Formatter with the nodes' format, and node<i>.report.json (each
    round's entry: its submission time, and `reported`'s fields for it)."""
    formatter = logging.Formatter(LOG_FORMAT)
    out = [(T - 30, "node.exchange.p2p", "exchange up: libp2p id %s at %s", (_libp2p_id(host), "/ip4/10.0.0.1/tcp/1"))]
    with open(workdir / f"node{host[1:]}.log", "w") as log:
        for at, name, msg, args in out + lines:
            record = logging.LogRecord(name, logging.DEBUG, __file__, 0, msg, args, None)
            record.created, record.msecs = at, (at % 1) * 1000
            log.write(formatter.format(record) + "\n")
    rounds = [{"round": r, "submitted_at": t, **(reported or {}).get(r, {})} for r, t in submitted.items()]
    report = {"peer_id": f"p{host}", "rounds": rounds}
    (workdir / f"node{host[1:]}.report.json").write_text(json.dumps(report))


def _fetched(at: float, round: int, publisher: str, holder: str, answer_s: float, bytes_s: float):
    args = (round, f"p{publisher}", _libp2p_id(holder)[-8:], 1_570_000, answer_s, bytes_s, 9.0, 4)
    return (at, "node.exchange.fetch", FETCHED_LINE, args)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Round 1: h2 (fast) submits at T, h3 (fast, behind NAT, pushes to h2) at T+1, h1 (slow) at
    T+2; round 0 has a fetch 9 s late that the medians leave out."""
    subs = {"h1": T + 2, "h2": T, "h3": T + 1, "h4": T + 0.5}
    _write_node(
        tmp_path,
        "h1",
        {0: T - 20, 1: subs["h1"]},
        [_fetched(T + 1.5, 1, "h2", "h2", 0.1, 1.3), _fetched(T + 2.6, 1, "h3", "h2", 0.1, 1.4)],
    )
    _write_node(
        tmp_path,
        "h2",
        {0: T - 21, 1: subs["h2"]},
        [_fetched(T - 11, 0, "h1", "h1", 0.1, 1.3), _fetched(T + 3.8, 1, "h1", "h1", 0.3, 1.4)],
    )
    _write_node(
        tmp_path,
        "h3",
        {0: T - 22, 1: subs["h3"]},
        [
            _fetched(T + 0.4, 1, "h2", "h2", 0.05, 0.3),
            _fetched(T + 3.9, 1, "h1", "h2", 0.2, 1.5),
            (T + 1.3, "node.exchange.push", PUSHED_LINE, (1, 1_570_000, "h2h2h2h2", 4, 0.05, 0.08, 0.2)),
        ],
    )
    _write_node(tmp_path, "h4", {1: subs["h4"]}, [_fetched(T + 1.5, 1, "h3", "h2", 0.1, 0.3)])
    return tmp_path


def test_the_medians_leave_round_0_out_and_sort_packets_by_their_publishers_link(workdir):
    run = timeline.load(workdir)
    assert len(run.fetches) == 7 and len(run.pushes) == 1
    summary = timeline.summarize(run, RATES, nat={"h3"})
    assert summary["fast_late_s"] == {
        "n": 1,
        "median": pytest.approx(0.4, abs=2e-3),
        "min": pytest.approx(0.4, abs=2e-3),
        "max": pytest.approx(0.4, abs=2e-3),
    }
    assert summary["fast_nat_late_s"]["median"] == pytest.approx(0.5, abs=2e-3)
    assert summary["slow_late_s"]["n"] == 2 and summary["slow_late_s"]["median"] == pytest.approx(1.85, abs=2e-3)
    assert summary["slow_publisher_answer_s"] == {"n": 1, "median": 0.3, "min": 0.3, "max": 0.3}
    assert summary["push_written_s"]["median"] == 0.08 and summary["slow_push_written_s"] == {"n": 0}


def test_a_round_prints_each_fetch_from_the_first_submission(workdir, capsys):
    lab = workdir / "run.json"
    lab.write_text(json.dumps({"link": {"host_rates_mbps": [100.0, *RATES.values()]}, "nat": {"hosts": ["h3"]}}))
    assert timeline.main([str(workdir), "--lab-json", str(lab), "--round", "1", "--hosts", "h3"]) == 0
    out = capsys.readouterr().out
    assert "submissions: h2@0.00 h4@0.50 h3@1.00 h1@2.00" in out
    assert "h3 (100 Mbps):" in out and "h1 (10 Mbps):" not in out, "only the hosts asked for"
    assert "h2's from h2*  answer 0.05 s, bytes 0.30 s, late 0.40 s" in out
    assert "h1's from h2   answer 0.20 s, bytes 1.50 s, late 1.90 s" in out


def test_a_workdir_without_debug_lines_says_how_to_get_them(tmp_path, capsys):
    _write_node(tmp_path, "h1", {1: T}, [])
    assert timeline.main([str(tmp_path)]) == 1
    assert "LOCOSWARM_LOG_LEVEL=DEBUG" in capsys.readouterr().err


def test_busy_splits_the_transfer_figure_into_logged_fetches_and_answer_waits(tmp_path):
    """Two hosts submit 1.25 MB packets at once: each one's ideal is 1.0 s (the 10 Mbps link binds
    either way). h1 (10 Mbps) reports 1.5 s fetching, logged one fetch of 1.3 s of which 0.2 s
    waited for the answer; h2 (100 Mbps) 1.2 s, one fetch of 1.2 s, 0.4 s of it the answer."""
    packet = {"packet_bytes": 1_250_000}
    _write_node(
        tmp_path, "h1", {1: T}, [_fetched(T + 1.3, 1, "h2", "h2", 0.2, 1.1)], {1: {**packet, "fetching_s": 1.5}}
    )
    _write_node(
        tmp_path, "h2", {1: T}, [_fetched(T + 1.2, 1, "h1", "h1", 0.4, 0.8)], {1: {**packet, "fetching_s": 1.2}}
    )
    split = timeline.busy(timeline.load(tmp_path), {"h1": 10.0, "h2": 100.0})
    assert split == {
        "10": {
            "n": 1,
            "fetching_over_ideal": pytest.approx(1.5),
            "fetches_over_ideal": pytest.approx(1.3, abs=2e-3),
            "without_answers_over_ideal": pytest.approx(1.1, abs=2e-3),
        },
        "100": {
            "n": 1,
            "fetching_over_ideal": pytest.approx(1.2),
            "fetches_over_ideal": pytest.approx(1.2, abs=2e-3),
            "without_answers_over_ideal": pytest.approx(0.8, abs=2e-3),
        },
    }
