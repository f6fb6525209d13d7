"""The DHT mender (node/round/rejoin.py) mends at once when the routing table empties or a step asks.

A node paused mid-minute woke with an empty routing table, and the mender slept out the rest of
its REJOIN_EVERY_S before it looked: the node's replay found no holder for 43 s (a flaky fault
test). The exchange and the coordinator here are stand-ins with the two things the mender reads
(the routing table, the live members); the clock is real, with the mender's tick made short.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from node.round import rejoin

pytestmark = pytest.mark.timeout(30)

TICK_S = 0.05  # REJOIN_ALONE_S for these tests
SETTLE_S = 20 * TICK_S  # long enough for the mender to act on what it sees, far below REJOIN_EVERY_S


class Table:
    """A routing table and its dials: `rejoin_dht` enters every dialled member."""

    def __init__(self, peers: set[str]):
        self.dht_peers = set(peers)
        self.dialled: list[list[str]] = []

    async def rejoin_dht(self, maddrs: list[str]) -> list[str]:
        self.dialled.append(sorted(maddrs))
        joined = [m.rpartition("/p2p/")[2] for m in maddrs]
        self.dht_peers.update(joined)
        return joined


class Members:
    """The coordinator's status: two live members besides the node."""

    def __init__(self):
        self.reads = 0

    async def status(self, history: int):
        self.reads += 1
        now = time.time()
        peers = [
            SimpleNamespace(
                peer_id=p,
                status="live",
                last_seen_at=now,
                heartbeat_interval_s=1.0,
                listen_multiaddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{p}"],
            )
            for p in ("b", "c")
        ]
        return SimpleNamespace(now=now, peers=peers)


async def _mending(table: Table):
    session = SimpleNamespace(exchange=table, client=Members(), peer_id="a", mend_dht=asyncio.Event())
    task = asyncio.create_task(rejoin.keep_in_swarm(session, heartbeat_timeout_s=10.0))
    return session, task


@pytest.fixture(autouse=True)
def _short_tick(monkeypatch):
    monkeypatch.setattr(rejoin, "REJOIN_ALONE_S", TICK_S)
    assert rejoin.REJOIN_EVERY_S >= 60 * SETTLE_S  # the minute cannot explain what these tests see


def test_a_table_emptied_mid_minute_is_mended_at_once():
    async def main():
        table = Table({"b", "c"})
        session, task = await _mending(table)
        try:
            await asyncio.sleep(SETTLE_S)
            assert session.client.reads == 0, "a full table costs nothing before the minute is up"
            table.dht_peers.clear()  # the node was paused: every peer timed out of its table
            await asyncio.sleep(SETTLE_S)
            assert table.dialled == [["/ip4/127.0.0.1/tcp/1/p2p/b", "/ip4/127.0.0.1/tcp/1/p2p/c"]]
            assert table.dht_peers == {"b", "c"}
        finally:
            task.cancel()

    asyncio.run(main())


def test_a_step_asking_gets_the_missing_members_dialled_now():
    async def main():
        table = Table({"b"})  # c is missing, but the table is not empty: the minute's pass would find it
        session, task = await _mending(table)
        try:
            await asyncio.sleep(SETTLE_S)
            assert table.dialled == [], "without a request, a table that is not empty waits for the minute"
            session.mend_dht.set()  # a replay found c's packet announced by nobody
            await asyncio.sleep(SETTLE_S)
            assert table.dialled == [["/ip4/127.0.0.1/tcp/1/p2p/c"]]
            assert not session.mend_dht.is_set(), "the request is taken, not left to repeat every tick"
            reads = session.client.reads
            await asyncio.sleep(SETTLE_S)
            assert session.client.reads == reads == 1
        finally:
            task.cancel()

    asyncio.run(main())
