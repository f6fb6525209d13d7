"""The push of a packet nobody can dial (node/round/push.py `push_own`) goes on, pass after pass,
while its packet can still matter: a coordinator outage that makes every holder refuse delays it
and does not lose it, and it stops once the swarm has moved on or the node stops. The exchange is
the in-memory double (tests/doubles), whose holders take pushes once they accept them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node.round import push
from node.round.reports import RoundReport
from node.round.state import RoundState
from tests.doubles.memory_exchange import MemorySwarm

pytestmark = pytest.mark.timeout(30)

ROUND = 3


def session(swarm: MemorySwarm) -> SimpleNamespace:
    """What `push_own` reads of a session: the exchange, the peer id, the round state, the stop."""
    return SimpleNamespace(
        exchange=swarm.exchange("nat"),
        peer_id="nat",
        state=RoundState(params_round=ROUND),
        stopping=asyncio.Event(),
        config=SimpleNamespace(network=SimpleNamespace(fetch_timeout_s=1.0)),
        client=None,  # push_plan's refresh fails: the targets stay as planned
        reachable=False,
    )


def with_push_config(s: SimpleNamespace, push_packets: bool) -> SimpleNamespace:
    s.config.network.push_packets = push_packets
    s.spawn = asyncio.create_task
    return s


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(push, "PUSH_RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(push, "PUSH_RETRY_MAX_S", 0.1)


def test_a_push_refused_by_every_holder_goes_through_once_one_takes_it(fast_retries):
    async def main():
        swarm = MemorySwarm()
        s = session(swarm)
        await s.exchange.publish(ROUND, "nat", b"packet bytes")
        report = RoundReport(round=ROUND, train_loss=1.0, digest="", num_packets=0)
        pushing = asyncio.create_task(push.push_own(s, ROUND, [["/memory/holder"]], report))
        await asyncio.sleep(0.3)  # the holder refuses everything meanwhile (its coordinator is away)
        assert not pushing.done() and report.pushed_to is None
        swarm.exchange("holder").accept_pushes(lambda *_: True)
        await asyncio.wait_for(pushing, 5.0)
        assert report.pushed_to == "holder"
        ((_, holders),) = swarm.packets[(ROUND, "nat")].values()
        assert holders == {"nat", "holder"}

    asyncio.run(main())


@pytest.mark.parametrize("how", ["the swarm applied the next round", "the node stops"])
def test_a_push_nobody_takes_stops_once_the_packet_no_longer_matters(fast_retries, how):
    async def main():
        s = session(MemorySwarm())
        await s.exchange.publish(ROUND, "nat", b"packet bytes")
        report = RoundReport(round=ROUND, train_loss=1.0, digest="", num_packets=0)
        pushing = asyncio.create_task(push.push_own(s, ROUND, [["/memory/holder"]], report))
        await asyncio.sleep(0.2)
        assert not pushing.done()
        if how == "the node stops":
            s.stopping.set()
        else:
            s.state.params_round = ROUND + 2  # this node applied round + 1
        await asyncio.wait_for(pushing, 2.0)
        assert report.pushed_to is None

    asyncio.run(main())


@pytest.mark.parametrize("reachable", [False, True])
def test_a_restarted_node_nobody_can_dial_pushes_its_kept_packets_again(fast_retries, monkeypatch, reachable):
    """After a restart a node serves again the packets it kept on disk (node/round/loop.py
    `serve_kept_packets`). Nobody can dial it, so it pushes each again: the copies it pushed before
    may have died with their holders. A node peers can dial only serves them."""

    async def main():
        swarm = MemorySwarm()
        s = with_push_config(session(swarm), push_packets=True)
        s.reachable = reachable
        kept = [ROUND - 1, ROUND]
        for r in kept:
            await s.exchange.publish(r, "nat", f"packet of round {r}".encode())
        swarm.exchange("holder").accept_pushes(lambda *_: True)
        planned = []

        async def plan(s, round):
            planned.append(round)
            return [["/memory/holder"]]

        monkeypatch.setattr(push, "push_plan", plan)
        push.push_kept(s, kept)
        await asyncio.sleep(0.3)
        held_by = {r: next(iter(swarm.packets[(r, "nat")].values()))[1] for r in kept}
        if reachable:
            assert planned == [] and held_by == {r: {"nat"} for r in kept}
        else:
            assert planned == kept and held_by == {r: {"nat", "holder"} for r in kept}

    asyncio.run(main())
