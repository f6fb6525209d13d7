"""Connection reversal on the node's side: what a node nobody can dial dials when a heartbeat answer
lists peers loading a snapshot (node/exchange/reachability.py `peers_to_dial`, node/round/session.py
`Session.heartbeat`). The coordinator's side is tests/unit/test_coordinator_membership.py; the
transfer over the reversed connection, on real p2pd, tests/integration/test_snapshot_reversal.py."""

from __future__ import annotations

import asyncio

import base58
import pytest

from node.exchange.reachability import MAX_DIAL_ADDRS, peers_to_dial
from node.round.session import Session
from protocol.http import MAX_DIAL_PEERS, HeartbeatResponse
from protocol.run_config import RunConfig
from protocol.signing import PeerKey
from tests.doubles.memory_exchange import MemorySwarm
from tests.doubles.session import node_session

pytestmark = pytest.mark.timeout(30)


def peer(i: int) -> str:
    """A well-formed libp2p id (an identity multihash of an Ed25519 key), different for each i."""
    return base58.b58encode(bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + i.to_bytes(32, "big")).decode()


OWN = peer(2**64)


def addrs(i: int, count: int = 1) -> list[str]:
    return [f"/ip4/10.0.{i % 250}.{port % 250}/tcp/{4000 + port}/p2p/{peer(i)}" for port in range(count)]


def test_a_hostile_list_never_makes_more_than_the_cap_of_dials():
    """However many peers and addresses the list names, at most MAX_DIAL_PEERS peers are dialled,
    each at most MAX_DIAL_ADDRS addresses; never this node itself; malformed ones are skipped."""
    hostile = [addrs(i, 50) for i in range(500)]
    picked = peers_to_dial(hostile, OWN, MAX_DIAL_PEERS)
    assert list(picked) == [peer(i) for i in range(MAX_DIAL_PEERS)]
    assert all(m == addrs(i, MAX_DIAL_ADDRS) for i, m in enumerate(picked.values()))

    own = [f"/ip4/10.9.9.9/tcp/4001/p2p/{OWN}"]
    mixed = [own, ["not a multiaddr", "/ip4/1.2.3.4/tcp/1"], [*addrs(1), *addrs(2), *addrs(3), *addrs(4), *addrs(5)]]
    picked = peers_to_dial(mixed, OWN, MAX_DIAL_PEERS)
    # Only the first MAX_DIAL_PEERS lists and their first MAX_DIAL_ADDRS addresses are read.
    assert picked == {peer(i): addrs(i) for i in range(1, 1 + MAX_DIAL_ADDRS)}
    assert peers_to_dial([], OWN, MAX_DIAL_PEERS) == {} and peers_to_dial([own], OWN, MAX_DIAL_PEERS) == {}


class Answers:
    """A coordinator client whose heartbeats answer with the lists a test hands it."""

    def __init__(self, *dial_peers: list[list[str]] | None):
        self.dial_peers = list(dial_peers)

    async def heartbeat(self, round: int, state: str, **_fields) -> HeartbeatResponse:
        return HeartbeatResponse(
            run_state="running",
            current_round=round,
            round_state="open",
            deadline=None,
            heartbeat_interval_s=15.0,
            dial_peers=self.dial_peers.pop(0),
        )


class SlowDials:
    """An exchange whose dials hang until the test lets them finish."""

    def __init__(self):
        self.calls: list[list[list[str]]] = []
        self.release = asyncio.Event()

    async def dial_peers(self, targets: list[list[str]]) -> list[str]:
        self.calls.append(targets)
        await self.release.wait()
        return []


def session(client, exchange, tmp_path) -> Session:
    return node_session(
        tmp_path,
        RunConfig.model_validate({"name": "reversal", "model": {"preset": "tiny"}}),
        client=client,
        exchange=exchange,
        training=None,  # a heartbeat trains nothing
        key=PeerKey.generate(),
        clock=lambda: 0.0,
        reachable=False,
    )


def test_a_heartbeat_answer_that_lists_peers_has_them_dialled_in_the_background_one_dial_at_a_time(tmp_path):
    async def scenario():
        first, second, third = [addrs(1)], [addrs(2)], [addrs(3)]
        exchange = SlowDials()
        s = session(Answers(None, first, second, third), exchange, tmp_path)
        await s.heartbeat()
        await asyncio.sleep(0)
        assert exchange.calls == []  # nothing listed: nothing dialled

        await s.heartbeat()  # returns while the dial hangs
        await asyncio.sleep(0)
        assert exchange.calls == [first]
        await s.heartbeat()  # the first still dials: no second one beside it
        await asyncio.sleep(0)
        assert exchange.calls == [first]

        exchange.release.set()
        await asyncio.wait_for(s.dialing, 5)
        await s.heartbeat()
        await asyncio.sleep(0)
        assert exchange.calls == [first, third]

    asyncio.run(scenario())


def test_the_memory_exchange_takes_dial_lists(tmp_path):
    """The in-memory exchange has nothing to dial; it keeps what it was asked (the round loop's tests)."""

    async def scenario():
        exchange = MemorySwarm().exchange("nat")
        s = session(Answers([addrs(1)]), exchange, tmp_path)
        await s.heartbeat()
        await asyncio.wait_for(s.dialing, 5)
        assert exchange.dial_requests == [[addrs(1)]]

    asyncio.run(scenario())
