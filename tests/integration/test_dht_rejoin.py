"""A DHT split into islands is mended, and a held snapshot stays announced: real p2pd daemons and
DHT nodes on 127.0.0.1, port 0.

Nodes restarted together each start a DHT of their own (every address they were given is dead):
here three exchanges started with no initial peers stand for them. A snapshot one of them serves
is invisible to the others until `rejoin_dht` is handed the others' addresses (what the node's
rejoin task takes from the coordinator's live members, node/round/rejoin.py); then it is found and
fetched. A snapshot record outlives its `announce_ttl_s` while the snapshot is held, and expires
once it is not. Every test ends with no p2pd child of the test process left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from node.exchange.config import ExchangeConfig
from node.exchange.p2p import P2PExchange
from node.training.params import param_digest
from tests.integration.snapshot_holder import momentum_of, toy_snapshot
from tests.integration.test_p2p_exchange import RUN_ID, p2pd_children, pid_alive, poll
from tests.integration.test_snapshot_stream import assert_loaded, fresh_sink

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

ROUND = 4
TTL_S = 3.0


@contextlib.asynccontextmanager
async def islands(count: int, **config):
    """`count` exchanges, each a DHT of its own; all shut down after, and their p2pd checked gone."""
    exchanges = await asyncio.gather(
        *(P2PExchange.create(ExchangeConfig(run_id=RUN_ID, bootstrap_timeout_s=2.0, **config)) for _ in range(count))
    )
    pids = [x.daemon_pid for x in exchanges]
    try:
        yield exchanges
    finally:
        await asyncio.gather(*(x.shutdown() for x in exchanges), return_exceptions=True)
    assert not [pid for pid in pids if pid_alive(pid)], "a p2pd outlived its exchange's shutdown"
    assert not p2pd_children({os.getpid()}), "a p2pd child of the test process survived"


def test_islands_merge_through_rejoin_and_a_snapshot_held_on_one_is_found_from_another():
    async def scenario():
        async with islands(3) as (holder, other, fresh):
            assert not (holder.dht_peers | other.dht_peers | fresh.dht_peers), "each started a DHT of its own"
            source, snapshot = toy_snapshot()
            await holder.publish_params(ROUND, snapshot)
            assert await fresh.params_holders(ROUND) == [], "an island cannot see another's records"

            # As after a whole-swarm restart: each learns the live members' addresses from the
            # coordinator; the fresh node's and the holder's passes run at the same moment.
            joined = await asyncio.gather(
                fresh.rejoin_dht([*holder.visible_maddrs, *other.visible_maddrs]),
                holder.rejoin_dht(fresh.visible_maddrs),
            )
            # Two nodes dialling each other at the same moment can lose one side's dial or ping (a
            # clean-clone CI run saw fresh's pass join only `other`): a pass skips what did not
            # answer, and the rejoin task's next pass tries again, as here.
            again = await fresh.rejoin_dht([*holder.visible_maddrs, *other.visible_maddrs])
            assert other.holder_id in joined[0]
            assert holder.holder_id in {*joined[0], *again} or fresh.holder_id in joined[1]
            assert holder.holder_id in fresh.dht_peers
            assert fresh.holder_id in holder.dht_peers and fresh.holder_id in other.dht_peers
            assert await fresh.rejoin_dht(holder.visible_maddrs) == [], "members already known are not dialled"

            (found,) = await poll(lambda: fresh.params_holders(ROUND), timeout_s=10, what="the snapshot holder")
            assert found.holder == holder.holder_id and found.digest == snapshot.digest
            target, state, sink = fresh_sink(param_digest(source))
            assert await fresh.fetch_params(ROUND, snapshot.digest, sink, timeout_s=30)
            assert_loaded(target, state, source, momentum_of(source, -2.0))  # toy_snapshot's momentum

    asyncio.run(scenario())


def test_dead_addresses_given_to_rejoin_are_skipped_within_the_dial_timeout():
    async def scenario():
        async with islands(2) as (alone, live):
            gone = await P2PExchange.create(ExchangeConfig(run_id=RUN_ID))
            dead = gone.visible_maddrs
            await gone.shutdown()
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await alone.rejoin_dht([*dead, *live.visible_maddrs]) == [live.holder_id]
            assert loop.time() - started < 2.0 + 3.0  # bootstrap_timeout_s, plus the lookup
            assert alone.dht_peers == {live.holder_id}

    asyncio.run(scenario())


def test_a_held_snapshot_is_announced_again_past_its_ttl_and_lapses_once_dropped():
    async def scenario():
        async with islands(2, announce_ttl_s=TTL_S) as (holder, reader):
            await reader.rejoin_dht(holder.visible_maddrs)
            _, snapshot = toy_snapshot()
            await holder.publish_params(ROUND, snapshot)
            await poll(lambda: reader.params_holders(ROUND), timeout_s=5, what="the first announcement")
            await asyncio.sleep(2.5 * TTL_S)  # the first record expired 1.5 TTLs ago
            (found,) = await reader.params_holders(ROUND)
            assert found.holder == holder.holder_id and found.digest == snapshot.digest

            await holder.forget_before(ROUND + 1)  # a snapshot from tensors is forgotten with its round
            await poll(lambda: _none(reader), timeout_s=2.5 * TTL_S, what="the record lapsing once not held")

    asyncio.run(scenario())


async def _none(reader: P2PExchange) -> bool:
    return await reader.params_holders(ROUND) == []
