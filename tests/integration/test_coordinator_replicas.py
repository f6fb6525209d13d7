"""Two real `coordinator serve` processes on one real PostgreSQL schema (coordinator/storage/
cluster.py): a long-poll on one wakes on a change made through the other, and when the leader is
killed by SIGKILL the other takes over the deadlines with no round lost or closed twice."""

from __future__ import annotations

import itertools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from coordinator.process import CoordinatorProcess, launch_coordinator
from tests.fixtures.coordinator import ADMIN_TOKEN, SignedPeer, create_run

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture
def replicas(postgres_schema_url: str, tmp_path: Path) -> Iterator[Callable[[], CoordinatorProcess]]:
    """A factory of replicas on one schema (safe to call from several threads at once); each is
    stopped after the test."""
    started: list[CoordinatorProcess] = []
    numbers = itertools.count()

    def start() -> CoordinatorProcess:
        replica = launch_coordinator(postgres_schema_url, tmp_path / f"replica-{next(numbers)}.log", ADMIN_TOKEN)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()


def metric(client: httpx.Client, name: str) -> float | None:
    """A sample without labels from the replica's /metrics, or None when it has none."""
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return None if match is None else float(match.group(1))


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    give_up_at = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > give_up_at:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def test_a_long_poll_on_one_replica_wakes_on_a_submission_to_the_other(replicas):
    with ThreadPoolExecutor(max_workers=2) as pool:  # both at once: their migrations take turns
        a, b = pool.map(lambda _: replicas(), range(2))
    with httpx.Client(base_url=a.url, timeout=10) as to_a, httpx.Client(base_url=b.url, timeout=60) as to_b:
        run_id = create_run(to_a, {"membership.min_peers": 2, "deadline": {"kind": "fixed", "round_timeout_s": 600.0}})
        first, second = SignedPeer(to_a), SignedPeer(to_a)
        assert first.join(run_id).status_code == 200 and second.join(run_id).status_code == 200
        with ThreadPoolExecutor(max_workers=1) as pool:
            poll = pool.submit(to_b.get, f"/v1/runs/{run_id}/rounds/0", params={"wait_s": 45, "submitted_gt": 0})
            wait_until(lambda: metric(to_b, "locoswarm_long_polls_waiting") == 1, 20, "the long-poll to park on B")
            submitted_at = time.monotonic()
            assert first.submit(run_id, 0).status_code == 200  # through A
            view = poll.result(timeout=60).json()
            woke_after_s = time.monotonic() - submitted_at
    print(f"\nlong-poll on B answered {woke_after_s * 1e3:.0f} ms after the submission to A")
    assert (view["state"], view["num_submitted"]) == ("open", 1)
    assert woke_after_s < 10, "B's long-poll ran to its wait_s: it never heard of A's change"


def test_the_other_replica_takes_over_when_the_leader_is_killed(replicas, postgres_schema_url):
    import psycopg

    a = replicas()  # first on the schema: it leads
    b = replicas()
    with httpx.Client(base_url=a.url, timeout=10) as to_a, httpx.Client(base_url=b.url, timeout=10) as to_b:
        assert (metric(to_a, "locoswarm_coordinator_leader"), metric(to_b, "locoswarm_coordinator_leader")) == (1, 0)
        run_id = create_run(
            to_a,
            {
                "membership.min_peers": 2,
                "membership.heartbeat_timeout_s": 10.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 1.0},
            },
        )
        peers = [SignedPeer(to_a), SignedPeer(to_a)]
        assert all(peer.join(run_id).status_code == 200 for peer in peers)

        # The peers keep heartbeating the survivor throughout; every answer is kept.
        answers: list[tuple[float, int]] = []
        stop = threading.Event()

        def heartbeat_b() -> None:
            with httpx.Client(base_url=b.url, timeout=10) as client:
                for peer in peers:
                    peer.client = client
                while not stop.wait(1.0):
                    for peer in peers:
                        try:
                            answers.append((time.time(), peer.heartbeat(run_id, 0).status_code))
                        except httpx.HTTPError:
                            answers.append((time.time(), 0))

        beating = threading.Thread(target=heartbeat_b, daemon=True)
        beating.start()
        try:
            wait_until(lambda: to_b.get(f"/v1/runs/{run_id}").json()["current_round"] >= 3, 30, "round 3 to open")
            open_at_kill = to_b.get(f"/v1/runs/{run_id}").json()["current_round"]
            killed_at = time.time()
            a.process.kill()
            assert a.process.wait(timeout=10) == -9
            wait_until(lambda: metric(to_b, "locoswarm_coordinator_first_tick_seconds"), 30, "B's first tick")
            led_at = metric(to_b, "locoswarm_coordinator_leader_since_seconds")
            first_tick_at = metric(to_b, "locoswarm_coordinator_first_tick_seconds")
            wait_until(
                lambda: to_b.get(f"/v1/runs/{run_id}").json()["current_round"] >= open_at_kill + 3,
                30,
                "three more rounds to close after the kill",
            )
        finally:
            stop.set()
            beating.join(timeout=15)

    with psycopg.connect(postgres_schema_url) as conn:
        rounds = conn.execute(
            "SELECT round, opened_at, deadline, closed_at FROM rounds WHERE run_id = %s ORDER BY round", (run_id,)
        ).fetchall()
        (current_round,) = conn.execute("SELECT current_round FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    closed_after_kill = next(r for r in rounds if r[0] == open_at_kill)
    print(
        f"\nSIGKILL of the leader at 0.00 s (round {open_at_kill} open, deadline"
        f" {closed_after_kill[2] - killed_at:+.2f} s); B leads at {led_at - killed_at:+.2f} s, first tick"
        f" {first_tick_at - killed_at:+.2f} s; round {open_at_kill} closed {closed_after_kill[3] - killed_at:+.2f} s;"
        f" latest close past its deadline {max(r[3] - r[2] for r in rounds if r[3] is not None):.2f} s;"
        f" {len(answers)} heartbeats to B, {sum(status == 200 for _, status in answers)} answered 200"
    )

    assert [r[0] for r in rounds] == list(range(len(rounds))), "a round number was skipped"
    assert [r[0] for r in rounds if r[3] is None] == [current_round] == [rounds[-1][0]]
    for earlier, later in zip(rounds, rounds[1:]):
        # One close opened the next round, at the same instant: a round closed twice would have
        # moved its close after the next round's opening (or failed to open it twice).
        assert later[1] == earlier[3], f"round {earlier[0]} closed at {earlier[3]}, round {later[0]} opened {later[1]}"
        assert earlier[3] >= earlier[2], f"round {earlier[0]} closed before its deadline"
    assert led_at - killed_at < 10
    assert answers and all(status == 200 for _, status in answers), [a for a in answers if a[1] != 200]


def test_write_transactions_of_two_connections_take_turns(postgres_schema_url):
    """The write lock (coordinator/storage/database.py): a second connection's transaction begins
    only once the first one's has ended, as on one process's database thread."""
    from coordinator.storage import PostgresDatabase

    first, second = PostgresDatabase(postgres_schema_url), PostgresDatabase(postgres_schema_url)
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with first.transaction():
            order.append("first begins")
            holding.set()
            release.wait(timeout=30)
            order.append("first commits")

    def follow() -> None:
        with second.transaction():
            order.append("second begins")

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(timeout=30)
    follower = threading.Thread(target=follow)
    follower.start()
    follower.join(timeout=0.5)  # time for the second to begin, were it not held
    release.set()
    holder.join(timeout=30)
    follower.join(timeout=30)
    first.close()
    second.close()
    assert order == ["first begins", "first commits", "second begins"]


def test_the_leader_lock_passes_on_when_its_holder_goes(postgres_schema_url):
    from coordinator.storage import PostgresDatabase
    from coordinator.storage.cluster import PostgresCluster

    databases = [PostgresDatabase(postgres_schema_url) for _ in range(2)]
    clusters = [
        PostgresCluster(db, on_change=lambda run_id: None, on_missed=lambda: None, retry_s=0.2) for db in databases
    ]
    try:
        for cluster in clusters:
            cluster.start()
        assert [c.is_leader for c in clusters] == [True, False]
        clusters[0].stop()
        wait_until(lambda: clusters[1].is_leader, 10, "the second to lead")
        assert not clusters[0].is_leader
    finally:
        for cluster in clusters:
            cluster.stop()
        for db in databases:
            db.close()


def test_a_replica_added_to_a_serving_one_extends_no_deadline(replicas):
    """A replica started while another leads is no restart (coordinator/storage/cluster.py): the
    open round keeps its deadline, where a restart would move it to the start plus the heartbeat
    timeout (the restart grace)."""
    a = replicas()
    with httpx.Client(base_url=a.url, timeout=10) as to_a:
        run_id = create_run(
            to_a,
            {
                "membership.min_peers": 1,
                "membership.heartbeat_timeout_s": 300.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 120.0},
            },
        )
        assert SignedPeer(to_a).join(run_id).status_code == 200
        before = to_a.get(f"/v1/runs/{run_id}/rounds/0").json()
        b = replicas()  # its start applies the rules once, with its own idea of the restart grace
        with httpx.Client(base_url=b.url, timeout=10) as to_b:
            after = to_b.get(f"/v1/runs/{run_id}/rounds/0").json()
    assert before["state"] == after["state"] == "open"
    assert after["deadline"] == before["deadline"], "B's start extended the open round's deadline"


def test_a_nonce_takes_no_turn_and_is_still_used_once_across_replicas(postgres_schema_url):
    """A nonce's transaction is not serialised (`transaction(serialised=False)`): it goes through
    while another replica holds the write lock, and the primary key alone refuses its replay."""
    from coordinator.storage import PostgresDatabase, Storage

    first, second = Storage(PostgresDatabase(postgres_schema_url)), Storage(PostgresDatabase(postgres_schema_url))
    try:
        with first.transaction():  # holds the write lock throughout
            with second.transaction(serialised=False):
                assert second.add_nonce("p0123456789abcdef", 7, 1.0)
            with second.transaction(serialised=False):
                assert not second.add_nonce("p0123456789abcdef", 7, 2.0)
            assert not first.add_nonce("p0123456789abcdef", 7, 3.0)
    finally:
        first.close()
        second.close()


def test_two_replicas_ticking_at_once_close_a_due_round_once(postgres_schema_url):
    """Two services on two connections (two replicas' worth) apply the rules to the same due round
    at the same instant, round after round. Under the write lock one closes it and the other finds
    it closed; without it both would close it, and the second's next round would collide."""
    from coordinator.service import CoordinatorService
    from coordinator.storage import open_storage
    from protocol.http import JoinRequest, peer_id_from_public_key
    from protocol.run_config import RunConfig
    from protocol.signing import PeerKey
    from tests.fixtures.coordinator import FakeClock

    clock, num_rounds, round_timeout_s = FakeClock(), 20, 10.0
    storages = [open_storage(postgres_schema_url) for _ in range(2)]
    services = [CoordinatorService(storage, clock=clock) for storage in storages]
    try:
        config = RunConfig(
            name="ticks",
            model={"preset": "tiny"},
            membership={"min_peers": 1, "heartbeat_timeout_s": 3600.0},
            deadline={"kind": "fixed", "round_timeout_s": round_timeout_s},
        )
        run_id = services[0].create_run(config)
        key = PeerKey.generate()
        services[1].join(run_id, peer_id_from_public_key(key.public_bytes), JoinRequest(public_key=key.public_hex))
        failures: list[BaseException] = []
        with ThreadPoolExecutor(max_workers=2) as pool:
            for _ in range(num_rounds):
                clock.advance(round_timeout_s + 1.0)  # the open round is due
                go = threading.Barrier(2)

                def tick(service: CoordinatorService, go: threading.Barrier = go) -> None:
                    go.wait(timeout=30)
                    try:
                        service.tick()
                    except Exception as e:  # collected: the assertion below names them
                        failures.append(e)

                list(pool.map(tick, services))
        rounds = storages[0].closed_rounds(run_id, limit=num_rounds + 10)
        current = storages[0].get_run(run_id).current_round
    finally:
        for storage in storages:
            storage.close()
    assert failures == []
    assert current == num_rounds
    assert sorted(r.round for r in rounds) == list(range(num_rounds))
