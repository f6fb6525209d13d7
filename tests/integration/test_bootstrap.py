"""Bootstrap that cannot crash a node: real p2pd daemons and DHT nodes on 127.0.0.1, port 0.

A node restarted after a crash is handed the addresses of peers that died with it. Dead addresses
here are of three kinds: a p2pd that was started and shut down (its port closed), a made-up peer
id on a closed port, and a listener whose backlog is full, so that further connection attempts
are dropped without an answer (a host that went away). A live p2pd with no DHT node on it stands
for a daemon that outlived its node. A node whose p2pd was killed under it still shuts down in
seconds. Every process is stopped by its own handle; every test ends by checking that no p2pd
child of the test process survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time

import pytest
from hivemind.p2p import P2P, PeerID

from node.exchange.config import ExchangeConfig
from node.exchange.p2p import P2PExchange
from tests.integration.test_p2p_exchange import RUN_ID, p2pd_children, packet, pid_alive, sha

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

BOOTSTRAP_TIMEOUT_S = 1.0
START_BOUND_S = 10.0  # p2pd start-up on a loaded 2-core machine, plus the dial time-out
ALONE = "started a DHT of its own"
SHUTDOWN_BOUND_S = 6.0  # node/exchange/host.py bounds each step by 5 s; a dead daemon is not waited for


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def made_up_peer_id() -> str:
    """A well-formed libp2p peer id no daemon holds: the identity multihash of a random Ed25519 key."""
    return PeerID(b"\x00\x24\x08\x01\x12\x20" + os.urandom(32)).to_base58()


@contextlib.contextmanager
def unanswering_port():
    """A 127.0.0.1 port whose connection attempts get no answer: its listener never accepts and its
    backlog is full, so the kernel drops further SYNs (as for a host that is gone)."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        probe = stack.enter_context(socket.socket())
        probe.settimeout(0.3)
        with pytest.raises(TimeoutError):  # the backlog really is full
            probe.connect(("127.0.0.1", port))
        yield port


@contextlib.asynccontextmanager
async def cleanup():
    """An exit stack for exchanges and bare daemons; on exit, checks that no p2pd child survives."""
    pids: list[int] = []
    async with contextlib.AsyncExitStack() as stack:

        def own(x):
            pids.append(x.daemon_pid if isinstance(x, P2PExchange) else x._child.pid)
            stack.push_async_callback(x.shutdown)
            return x

        yield own
    assert not [pid for pid in pids if pid_alive(pid)], "a p2pd outlived its shutdown"
    assert not p2pd_children({os.getpid()}), "a p2pd child of the test process survived"


async def dead_address(own) -> str:
    """The address of a p2pd that was started and shut down: a real peer id, a closed port."""
    daemon = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    maddr = str((await daemon.get_visible_maddrs())[0])
    await own(daemon).shutdown()
    return maddr


async def create(initial_peers=()) -> tuple[P2PExchange, float]:
    start = time.monotonic()
    exchange = await P2PExchange.create(
        ExchangeConfig(run_id=RUN_ID, initial_peers=tuple(initial_peers), bootstrap_timeout_s=BOOTSTRAP_TIMEOUT_S)
    )
    return exchange, time.monotonic() - start


async def exchanges_a_packet(publisher: P2PExchange, fetcher: P2PExchange, round: int) -> bool:
    """`publisher` publishes; `fetcher` finds it through the DHT alone (no addresses given) and fetches it."""
    data = packet(round, 64 << 10)
    await publisher.publish(round, f"peer{round}", data)
    got = await fetcher.fetch(round, {f"peer{round}": sha(data)}, timeout_s=20)
    return got == {f"peer{round}": data}


def alone_lines(caplog) -> list[str]:
    """The warnings that a node started a DHT of its own."""
    return [r.getMessage() for r in caplog.records if ALONE in r.getMessage() and r.levelno == logging.WARNING]


def test_a_node_given_only_dead_bootstrap_peers_starts_its_own_dht_and_others_join_it(caplog):
    async def scenario():
        async with cleanup() as own:
            with unanswering_port() as silent_port:
                dead = [
                    await dead_address(own),
                    f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{made_up_peer_id()}",
                    f"/ip4/127.0.0.1/tcp/{silent_port}/p2p/{made_up_peer_id()}",
                ]
                with caplog.at_level("INFO", logger="node.exchange"):
                    first, took_s = await create(dead)
                own(first)
            assert took_s < START_BOUND_S, f"start with dead bootstrap peers took {took_s:.1f} s"
            (line,) = alone_lines(caplog)
            assert all(m in line for m in dead) and first.visible_maddrs[0] in line

            second, _ = await create(first.visible_maddrs)
            own(second)
            assert await exchanges_a_packet(first, second, 0)
            assert await exchanges_a_packet(second, first, 1)

    asyncio.run(scenario())


def test_dead_and_live_bootstrap_peers_join_the_live_ones_dht(caplog):
    async def scenario():
        async with cleanup() as own:
            live, _ = await create()
            own(live)
            with unanswering_port() as silent_port:
                dead = [await dead_address(own), f"/ip4/127.0.0.1/tcp/{silent_port}/p2p/{made_up_peer_id()}"]
                with caplog.at_level("INFO", logger="node.exchange"):
                    joined, took_s = await create([dead[0], *live.visible_maddrs, dead[1]])
                own(joined)
            assert took_s < START_BOUND_S, f"start with dead and live bootstrap peers took {took_s:.1f} s"
            assert not alone_lines(caplog)
            (skipped,) = [r.getMessage() for r in caplog.records if "skipped initial peers" in r.getMessage()]
            assert all(m in skipped for m in dead) and live.visible_maddrs[0] not in skipped
            assert await exchanges_a_packet(live, joined, 0)

    asyncio.run(scenario())


def test_a_bootstrap_daemon_without_a_dht_node_leaves_the_node_on_its_own_dht(caplog):
    """p2pd answers the dial but no DHT node answers the ping (a daemon that outlived its node):
    the node starts its own DHT on a fresh daemon, and others join it."""

    async def scenario():
        async with cleanup() as own:
            orphan = own(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False))
            orphan_maddrs = [str(m) for m in await orphan.get_visible_maddrs()]
            with caplog.at_level("INFO", logger="node.exchange"):
                first, took_s = await create(orphan_maddrs)
            own(first)
            assert took_s < START_BOUND_S, f"start took {took_s:.1f} s"
            (line,) = alone_lines(caplog)
            assert "no DHT node answered" in line and orphan_maddrs[0] in line

            second, _ = await create(first.visible_maddrs)
            own(second)
            assert await exchanges_a_packet(first, second, 0)

    asyncio.run(scenario())


def test_shutdown_after_p2pd_was_killed_under_the_node_is_bounded():
    """p2pd SIGKILLed (by the pid the Host holds) before and during a node's shutdown: hivemind's
    own shutdown would wait forever for the dead daemon's answer; the Host's ends in seconds."""

    async def scenario():
        async with cleanup() as own:
            settled, racing = own((await create())[0]), own((await create())[0])
            os.kill(settled.daemon_pid, signal.SIGKILL)
            await asyncio.sleep(0.5)  # the node has seen its daemon exit
            os.kill(racing.daemon_pid, signal.SIGKILL)  # ...and this one has not yet
            for exchange in (settled, racing):
                started = time.monotonic()
                await asyncio.wait_for(exchange.shutdown(), 30)
                took_s = time.monotonic() - started
                assert took_s < SHUTDOWN_BOUND_S, f"shutdown after p2pd was killed took {took_s:.1f} s"
                assert not pid_alive(exchange.daemon_pid)

    asyncio.run(scenario())
