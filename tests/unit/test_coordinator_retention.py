"""Retention (coordinator/rules/retention.py) on the service with a real SQLite file and a fake
clock: old rounds lose their per-peer rows and keep their round rows and manifests; newer rounds
and the status page's history are untouched; a long backlog is pruned a bounded pass at a time."""

from __future__ import annotations

import argparse

import pytest

from coordinator.cli import register
from coordinator.rules import retention
from coordinator.storage import DroppedRow, MissingReportRow
from tests.unit.test_coordinator_votes import HONEST, Coordinator

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coordinator(tmp_path, fake_clock):
    c = Coordinator(tmp_path, fake_clock)
    yield c
    c.storage.close()


def rows(c: Coordinator, table: str, run_id: str) -> dict[int, int]:
    """Rows of `table` per round."""
    found = c.storage.db.rows(f"SELECT round, COUNT(*) AS n FROM {table} WHERE run_id = ? GROUP BY round", (run_id,))
    return {int(r["round"]): int(r["n"]) for r in found}


def play(c: Coordinator, run_id: str, peers: list[str], num_rounds: int) -> None:
    for r in range(num_rounds):
        c.submit(run_id, r, *peers)
        for peer_id in peers:
            c.applied(run_id, r, peer_id, HONEST)


def test_old_rounds_keep_their_digest_and_manifest_and_lose_per_peer_rows(coordinator, fake_clock):
    c = coordinator
    c.service.keep_rounds = 3
    run_id = c.create_run(**{"membership.min_peers": 2, "membership.heartbeat_timeout_s": 3600.0})
    a, b = c.join(run_id, 2)
    play(c, run_id, [a, b], 2)
    # Round 1 as an amendment leaves it: b's entry dropped after a's report that it was missing.
    c.storage.add_missing_report(MissingReportRow(run_id, 1, b, a, fake_clock()))
    c.storage.insert_dropped(DroppedRow(run_id, 1, b, "unfetchable", 2, fake_clock()))
    for r in range(2, 8):
        c.submit(run_id, r, a, b)
        for peer_id in (a, b):
            c.applied(run_id, r, peer_id, HONEST)
    before = {r: c.round(run_id, r) for r in range(8)}
    assert [e.peer_id for e in before[1].manifest] == [a]

    fake_clock.advance(retention.PRUNE_INTERVAL_S + 1)  # round 8 times out meanwhile: 9 is open
    c.service.tick()
    assert c.service.views.require_run(run_id).current_round == 9
    assert c.service.views.require_run(run_id).pruned_before == 9 - 3
    assert sorted(rows(c, "applied", run_id)) == [6, 7]
    assert rows(c, "submissions", run_id) == {0: 2, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2}
    assert rows(c, "missing_reports", run_id) == {} and rows(c, "dropped_entries", run_id) == {}
    for r in range(8):
        after = c.round(run_id, r)
        assert after.manifest == before[r].manifest, f"round {r}'s manifest changed"
        assert (after.agreed_digest, after.manifest_version) == (before[r].agreed_digest, before[r].manifest_version)
    history = {h.round: h for h in c.status(run_id).history}
    assert sorted(history) == list(range(9)) and history[1].num_contributors == 1

    fake_clock.advance(1.0)  # a pass runs once a minute at most
    c.submit(run_id, 9, a, b)
    c.service.tick()
    assert c.service.views.require_run(run_id).pruned_before == 6


def test_a_long_backlog_is_pruned_in_bounded_passes_and_zero_keeps_everything(coordinator, fake_clock, monkeypatch):
    c = coordinator
    monkeypatch.setattr(retention, "ROUNDS_PER_PASS", 2)
    c.service.keep_rounds = 0
    run_id = c.create_run(**{"membership.min_peers": 1, "membership.heartbeat_timeout_s": 3600.0})
    (a,) = c.join(run_id)
    play(c, run_id, [a], 7)
    fake_clock.advance(retention.PRUNE_INTERVAL_S + 1)
    c.service.tick()
    assert len(rows(c, "applied", run_id)) == 7, "keep_rounds 0 keeps everything"

    current = c.service.views.require_run(run_id).current_round
    passes = []
    for _ in range(current):  # the rule itself, pass after pass, with the clock stopped
        with c.storage.transaction():
            passes.append(retention.prune(c.service.ctx, run_id, keep_rounds=1))
    assert max(passes) == 2 and sum(passes) == current - 1 and passes[-1] == 0, passes
    assert c.service.views.require_run(run_id).pruned_before == current - 1
    assert sorted(rows(c, "applied", run_id)) == list(range(current - 1, 7))


def test_serve_keeps_the_status_history_by_default_and_refuses_a_negative_window():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["coordinator", "serve"]).keep_rounds == retention.DEFAULT_KEEP_ROUNDS
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator", "serve", "--keep-rounds", "-1"])
