"""The storage layer against both backends: a real SQLite file and a real PostgreSQL server.

Each test gets an empty database (a new file, or a new PostgreSQL schema); the same assertions
run on both, which is what keeps the shared SQL honest.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.errors import StorageError
from coordinator.rules import standing
from coordinator.service import CoordinatorService
from coordinator.storage import (
    AppliedRow,
    DroppedRow,
    MissingReportRow,
    PeerRow,
    RoundRow,
    RunRow,
    SqliteDatabase,
    Storage,
    SubmissionRow,
    open_storage,
)
from coordinator.storage.schema import LATEST_VERSION
from protocol.http import JoinRequest, SubmitRequest
from protocol.run_config import RunConfig
from protocol.signing import PeerKey
from tests.fixtures.coordinator import FakeClock

pytestmark = pytest.mark.timeout(60)


def a_run(run_id: str = "run-1") -> RunRow:
    return RunRow(run_id, "r", "{}", "[]", "waiting", 1.0, None, 0)


def a_peer(peer_id: str, index: int, run_id: str = "run-1") -> PeerRow:
    return PeerRow(
        run_id, peer_id, "00" * 32, index, "live", None, "joining", "cpu", "[]", None, None, 1.0, 1.0, 0, None
    )


def expected_and_missing(storage: Storage, round_index: int) -> tuple[int, int]:
    """How many live peers round r waits for (window 1, min_peers 1), and how many of them have not submitted."""
    waited = standing.waited_for(storage, "run-1", round_index, window_rounds=1, min_contributors=1)
    return len(waited), sum(not submitted for submitted in waited.values())


def test_migrations_apply_once(storage_url):
    storage = open_storage(storage_url)
    assert storage.db.schema_version() == LATEST_VERSION
    storage.insert_run(a_run())
    storage.close()
    again = open_storage(storage_url)  # reopening migrates nothing and keeps the rows
    assert again.db.schema_version() == LATEST_VERSION
    assert again.get_run("run-1").state == "waiting"
    again.close()


def test_rows_round_trip_and_update(storage_url):
    storage = open_storage(storage_url)
    with storage.transaction():
        storage.insert_run(a_run())
        storage.insert_peer(a_peer("pb", 1))
        storage.insert_peer(a_peer("pa", 0))
        storage.insert_round(RoundRow("run-1", 0, 10.0, 40.0, None, None))
    storage.update_run("run-1", state="running", current_round=0)
    storage.update_peer("run-1", "pa", status="gone", reason="silent", last_loss=2.5)
    assert storage.get_run("run-1").state == "running"
    assert [p.peer_id for p in storage.list_peers("run-1")] == ["pa", "pb"]
    assert storage.get_peer("run-1", "pa").reason == "silent"
    assert storage.get_peer("run-1", "pa").last_loss == 2.5
    assert storage.next_peer_index("run-1") == 2
    assert storage.find_public_key("pb") == "00" * 32 and storage.find_public_key("px") is None
    assert storage.active_run_ids() == ["run-1"]
    with pytest.raises(ValueError):
        storage.update_peer("run-1", "pa", no_such_column=1)
    storage.close()


def test_flags_written_as_python_bools_read_back(storage_url):
    """A join's dial-back verdict is a bool; the shared schema keeps flags as BIGINT 0/1, which
    PostgreSQL refused a boolean for (every join with listen addresses failed there)."""
    storage = open_storage(storage_url)
    with storage.transaction():
        storage.insert_run(a_run())
        storage.insert_peer(dataclasses.replace(a_peer("pa", 0), reachable=True))
        storage.insert_peer(dataclasses.replace(a_peer("pb", 1), reachable=False))
    storage.update_peer("run-1", "pb", reachable=True)
    assert [bool(p.reachable) for p in storage.list_peers("run-1")] == [True, True]
    storage.close()


def test_dialable_peers_doing_an_activity(storage_url):
    """Connection reversal's read (coordinator/rules/membership.py): live, fresh within two told
    periods, not known undialable, not the caller; newest first, bounded."""
    storage = open_storage(storage_url)
    loading = "loading_snapshot"
    rows = {
        "pa": dict(reachable=True, last_seen_at=100.0),
        "pb": dict(reachable=None, last_seen_at=101.0),
        "pc": dict(reachable=False, last_seen_at=102.0),  # nobody can dial it
        "pd": dict(reachable=True, last_seen_at=103.0, status="gone"),
        "pe": dict(reachable=True, last_seen_at=104.0, activity="training"),
        "pf": dict(reachable=True, last_seen_at=90.0),  # silent for more than two 5 s periods
        "pg": dict(reachable=True, last_seen_at=105.0),  # the caller
    }
    with storage.transaction():
        storage.insert_run(a_run())
        for index, (peer_id, fields) in enumerate(rows.items()):
            row = dataclasses.replace(a_peer(peer_id, index), activity=loading, heartbeat_period_s=5.0)
            storage.insert_peer(dataclasses.replace(row, **fields))
    found = storage.dialable_peers_doing("run-1", loading, 105.0, exclude="pg", limit=4)
    assert [p.peer_id for p in found] == ["pb", "pa"]
    assert [p.peer_id for p in storage.dialable_peers_doing("run-1", loading, 105.0, "pg", 1)] == ["pb"]
    storage.close()


def test_transactions_roll_back_as_a_whole(storage_url):
    storage = open_storage(storage_url)
    storage.insert_run(a_run())
    with pytest.raises(RuntimeError):
        with storage.transaction():
            storage.update_run("run-1", state="running")
            with storage.transaction():  # nested: part of the outer one
                storage.insert_peer(a_peer("pa", 0))
            raise RuntimeError("abort")
    assert storage.get_run("run-1").state == "waiting"
    assert storage.list_peers("run-1") == []
    storage.close()


def test_submissions_stats_and_expected(storage_url):
    storage = open_storage(storage_url)
    storage.insert_run(a_run())
    for index, peer_id in enumerate(["pa", "pb", "pc"]):
        storage.insert_peer(a_peer(peer_id, index))
    storage.update_peer("run-1", "pc", member_since_round=1)
    storage.insert_round(RoundRow("run-1", 0, 0.0, 30.0, None, None))
    assert expected_and_missing(storage, 0) == (2, 2)
    for peer_id, loss in [("pb", 3.0), ("pa", 2.0)]:
        storage.insert_submission(SubmissionRow("run-1", 0, peer_id, "ab" * 32, 100, loss, 1.0, 0.1, "[]", 5.0))
    assert expected_and_missing(storage, 0) == (2, 0)
    assert [s.peer_id for s in storage.list_submissions("run-1", 0)] == ["pa", "pb"]
    assert storage.count_submissions("run-1", 0) == 2
    stats = storage.round_stats("run-1", 0, 0)[0]
    assert (stats.num_contributors, stats.mean_loss) == (2, 2.5)
    storage.update_round("run-1", 0, closed_at=6.0)
    assert [r.round for r in storage.closed_rounds("run-1", 10)] == [0]
    storage.close()


def test_applied_reports_latest_and_nonces(storage_url):
    storage = open_storage(storage_url)
    storage.insert_run(a_run())
    assert storage.add_applied(AppliedRow("run-1", 0, "pa", "22" * 16, 2.0)) is True
    assert storage.add_applied(AppliedRow("run-1", 0, "pa", "11" * 16, 1.0)) is False, "reports are immutable"
    storage.add_applied(AppliedRow("run-1", 1, "pa", "33" * 16, 3.0))
    storage.add_applied(AppliedRow("run-1", 0, "pb", "22" * 16, 4.0))
    assert [a.params_digest for a in storage.list_applied("run-1", 0)] == ["22" * 16] * 2
    latest = storage.latest_applied_by_peer("run-1")
    assert (latest["pa"].round, latest["pb"].round) == (1, 0)
    assert storage.applied_counts("run-1", 0, 1) == {0: 2, 1: 1}
    big_nonce = 1_800_000_000_000_000_000
    assert storage.add_nonce("pa", big_nonce, 10.0) is True
    assert storage.add_nonce("pa", big_nonce, 11.0) is False
    assert storage.add_nonce("pb", big_nonce, 11.0) is True
    assert storage.prune_nonces(10.5) == 1
    assert storage.add_nonce("pa", big_nonce, 12.0) is True
    storage.close()


def test_missing_reports_dropped_entries_and_versions(storage_url):
    storage = open_storage(storage_url)
    storage.insert_run(a_run())
    for index, peer_id in enumerate(["pa", "pb", "pw"]):
        storage.insert_peer(a_peer(peer_id, index))
    storage.insert_round(RoundRow("run-1", 0, 0.0, 30.0, 6.0, None))
    assert storage.get_round("run-1", 0).manifest_version == 1
    assert storage.add_missing_report(MissingReportRow("run-1", 0, "pw", "pa", 7.0)) is True
    assert storage.add_missing_report(MissingReportRow("run-1", 0, "pw", "pa", 8.0)) is False
    storage.add_missing_report(MissingReportRow("run-1", 0, "pw", "pb", 9.0))
    assert [(m.reporter_id, m.reported_at) for m in storage.list_missing_reports("run-1", 0)] == [
        ("pa", 7.0),
        ("pb", 9.0),
    ]
    assert storage.rounds_with_pending_reports(4) == [("run-1", 0)]
    assert storage.rounds_with_pending_reports(4, "run-2") == []
    storage.update_run("run-1", current_round=5)
    assert storage.rounds_with_pending_reports(4) == [], "out of the window"
    storage.update_run("run-1", current_round=1)
    storage.insert_dropped(DroppedRow("run-1", 0, "pw", "unserved", 2, 10.0))
    storage.update_round("run-1", 0, manifest_version=2)
    storage.update_peer("run-1", "pw", withheld_round=0)
    assert storage.rounds_with_pending_reports(4) == []
    assert [(d.peer_id, d.reason, d.manifest_version) for d in storage.list_dropped("run-1", 0)] == [
        ("pw", "unserved", 2)
    ]
    assert storage.get_round("run-1", 0).manifest_version == 2
    storage.insert_round(RoundRow("run-1", 1, 6.0, 36.0, None, None))
    assert expected_and_missing(storage, 1) == (2, 2), "a withholding peer is not expected"
    storage.add_applied(AppliedRow("run-1", 0, "pa", "11" * 16, 11.0, None, 2))
    storage.add_applied(AppliedRow("run-1", 0, "pw", "22" * 16, 12.0))
    assert {a.peer_id: a.manifest_version for a in storage.list_applied("run-1", 0)} == {"pa": 2, "pw": 1}
    storage.close()


def test_service_round_flow_on_both_backends(storage_url):
    """The same rules on either backend: join, open, submit, close, next round."""
    clock = FakeClock()
    storage = open_storage(storage_url)
    service = CoordinatorService(storage, clock=clock)
    run_id = service.create_run(RunConfig(name="both", model={"preset": "tiny"}, membership={"min_peers": 2}))
    keys = [PeerKey.generate() for _ in range(2)]
    peer_ids = [service.join(run_id, *_join(key)).peer_id for key in keys]
    for peer_id in peer_ids:
        service.submit(run_id, 0, peer_id, SubmitRequest(packet_digest="cd" * 32, packet_size_bytes=10, train_loss=1.0))
    view = service.views.round_view(run_id, 0)
    assert view.state == "closed" and [e.peer_id for e in view.manifest] == sorted(peer_ids)
    assert service.views.round_view(run_id, 1).state == "open"
    storage.close()


def _join(key: PeerKey) -> tuple[str, JoinRequest]:
    from protocol.http import peer_id_from_public_key

    return peer_id_from_public_key(key.public_bytes), JoinRequest(public_key=key.public_hex)


def test_unopenable_databases_raise_storage_error(tmp_path):
    with pytest.raises(StorageError, match="cannot open SQLite"):
        open_storage(f"sqlite:///{tmp_path}/missing-dir/c.db")
    with pytest.raises(StorageError):
        open_storage("sqlite://:memory:")
    with pytest.raises(StorageError, match="PostgreSQL"):
        open_storage("postgresql://nobody@/nodb?host=/nonexistent-socket-dir&connect_timeout=2")
    assert isinstance(open_storage(f"sqlite:///{tmp_path}/c.db").db, SqliteDatabase)


def test_sqlite_uses_wal(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/c.db")
    assert storage.db.rows("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    storage.close()
