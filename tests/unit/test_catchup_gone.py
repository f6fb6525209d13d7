"""Catch-up goes straight to a snapshot when a replayed round's packets are gone: the exchange's
holder lookup (here the in-memory exchange) finds no peer announcing them, so the replay stops at
once instead of waiting out a fetch time-out. A packet that is announced but not served (withheld)
is not known gone: that one is the fetch's to decide."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from node.round.catchup import packets_gone, replay
from node.round.steps import CatchUpNeeded
from protocol.http import ManifestEntry, RoundView
from tests.doubles.memory_exchange import MemorySwarm

pytestmark = pytest.mark.timeout(30)

PEER_A, PEER_B = "p" + "a" * 16, "p" + "b" * 16


class OneRoundClient:
    def __init__(self, view: RoundView):
        self.view = view

    async def round(self, round: int, **_) -> RoundView:
        return self.view


def test_replay_loads_a_snapshot_at_once_when_no_peer_holds_a_packet():
    async def main():
        swarm = MemorySwarm()
        a, b = swarm.exchange("a"), swarm.exchange("b")
        announced = [await a.publish(1, PEER_A, b"packet of a"), await b.publish(1, PEER_B, b"packet of b")]
        view = RoundView(
            run_id="run-x",
            round=1,
            state="closed",
            opened_at=0.0,
            deadline=1.0,
            closed_at=1.0,
            num_submitted=2,
            majority_digest=None,
            manifest=[
                ManifestEntry(
                    peer_id=x.peer_id, packet_digest=x.digest, packet_size_bytes=x.size_bytes, multiaddrs=x.multiaddrs
                )
                for x in announced
            ],
        )
        s = SimpleNamespace(
            exchange=a,
            config=SimpleNamespace(network=SimpleNamespace(fetch_timeout_s=30.0)),
            client=OneRoundClient(view),
            mend_dht=asyncio.Event(),
        )
        assert await packets_gone(s, 1, view) == []
        swarm.withhold(1, PEER_B)
        assert await packets_gone(s, 1, view) == [], "announced and not served: not known gone"
        await b.forget_before(2)  # its only holder forgot it
        assert await packets_gone(s, 1, view) == [PEER_B]
        started = time.monotonic()
        with pytest.raises(CatchUpNeeded, match=f"no peer holds the packets of {PEER_B}"):
            await replay(s, 1)
        assert time.monotonic() - started < 5.0, "no fetch time-out waited out"
        assert s.mend_dht.is_set(), "the DHT mender is asked to look at once (node/round/rejoin.py)"

    asyncio.run(main())
