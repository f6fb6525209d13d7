"""A snapshot held only by a node nobody can dial still reaches a joiner: connection reversal on
real p2pd daemons (127.0.0.1, port 0) and the real coordinator (uvicorn in a thread, SQLite).

The holder announces only an address where nothing listens (a port bound and closed), and joined
saying nobody can dial it; the joiner runs its DHT in client mode, so no DHT traffic ever makes the
holder open a connection to it. First the joiner's fetch of the holder's snapshot fails: it cannot
dial the only holder. Then the joiner's heartbeat says `loading_snapshot`, the holder's next
heartbeat (the node's own `Session.heartbeat`) is answered with the joiner's addresses, the holder
dials it, and the joiner's ordinary fetch opens its stream over that connection and loads every
verified unit. Without connection reversal the second fetch fails as the first did.

The same through a real NAT (tools/netlab, "Hosts behind NAT"; needs root, `ip netns` and nft,
skipped otherwise): the holder behind a router namespace that masquerades its connections out and
lets nothing in, the joiner and a bootstrap peer on the lab's segment, each in a process of its
own (tests/integration/reversal_peer.py); the holder dials the joiner with `dial_peers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from node.exchange.config import ExchangeConfig
from node.exchange.p2p import P2PExchange
from node.round.coordinator_client import CoordinatorClient
from node.round.state import Doing
from node.training.params import param_digest
from protocol.run_config import RunConfig
from protocol.signing import PeerKey
from tests.doubles.session import node_session
from tests.fixtures.coordinator import ADMIN_HEADERS, REPO_ROOT, coordinator_in_thread, run_config
from tests.integration.netlab_leftovers import left_behind
from tests.integration.snapshot_holder import momentum_of, toy_snapshot
from tests.integration.test_p2p_exchange import p2pd_children, pid_alive
from tests.integration.test_snapshot_stream import ROUND, announced, assert_loaded, fresh_sink
from tools.netlab.nat import firewall_available
from tools.netlab.topology import LinkSpec, Topology, lab_available

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

RUN = {"membership.min_peers": 10, "membership.heartbeat_timeout_s": 30.0}  # no round opens: only membership
EXCHANGE = {"run_id": "", "max_packet_bytes": 1 << 20, "connect_timeout_s": 2.0}


def dead_address() -> str:
    """A loopback TCP address where nothing listens: dials to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def exchanges(run_id: str):
    """A bootstrap peer, a holder nobody can dial, a joiner in DHT client mode; all shut down after."""
    config = EXCHANGE | {"run_id": run_id}
    started: list[P2PExchange] = []
    try:
        started.append(await P2PExchange.create(ExchangeConfig(**config)))
        bootstrap = tuple(started[0].visible_maddrs)
        holder = await P2PExchange.create(
            ExchangeConfig(**config, initial_peers=bootstrap, announce_maddrs=(dead_address(),))
        )
        started.append(holder)
        started.append(await P2PExchange.create(ExchangeConfig(**config, initial_peers=bootstrap, client_mode=True)))
        pids = [x.daemon_pid for x in started]
        yield started[1], started[2]
    finally:
        await asyncio.gather(*(x.shutdown() for x in started), return_exceptions=True)
    assert not [pid for pid in pids if pid_alive(pid)], "a p2pd outlived its exchange's shutdown"
    assert not p2pd_children({os.getpid()}), "a p2pd child of the test process survived"


def holder_session(url: str, run_id: str, peer_id: str, client: CoordinatorClient, exchange: P2PExchange, tmp_path):
    """The holder's session as its round loop holds it, as far as a heartbeat needs."""
    return node_session(
        tmp_path,
        RunConfig.model_validate(run_config(RUN)),
        client=client,
        exchange=exchange,
        training=None,  # a heartbeat trains nothing
        run_id=run_id,
        peer_id=peer_id,
        key=client.key,
        coordinator=url,
        clock=lambda: 0.0,
        reachable=False,
    )


def test_a_snapshot_held_only_by_a_node_nobody_can_dial_reaches_a_joiner(tmp_path):
    with coordinator_in_thread(tmp_path / "coordinator.db") as url:
        created = httpx.post(f"{url}/v1/runs", json=run_config(RUN), headers=ADMIN_HEADERS, timeout=10)
        assert created.status_code == 200, created.text
        run_id = created.json()["run_id"]

        async def scenario():
            keys = PeerKey.generate(), PeerKey.generate()
            clients = [CoordinatorClient(url, key, retry_for_s=10.0) for key in keys]
            try:
                async with exchanges(run_id) as (holder, joiner):
                    await reversal(url, run_id, clients, holder, joiner, tmp_path)
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        asyncio.run(scenario())


async def reversal(url, run_id, clients, holder: P2PExchange, joiner: P2PExchange, tmp_path):
    holder_client, joiner_client = clients
    held = await holder_client.join(
        run_id, join_token=None, device="cpu", multiaddrs=holder.visible_maddrs, reachable=False
    )
    joined = await joiner_client.join(run_id, join_token=None, device="cpu", multiaddrs=joiner.visible_maddrs)
    assert (held.reachable, joined.reachable) == (False, True)  # the coordinator dialled the joiner back

    source, snapshot = toy_snapshot()
    await holder.publish_params(ROUND, snapshot)
    assert [h.holder for h in await announced(joiner, 1)] == [holder.holder_id]

    target, state, sink = fresh_sink(param_digest(source))
    assert not await joiner.fetch_params(ROUND, snapshot.digest, sink, timeout_s=4)
    assert sink.offset == 0, "the joiner cannot dial the only holder"

    answer = await joiner_client.heartbeat(ROUND, str(Doing.LOADING_SNAPSHOT))
    assert answer.dial_peers is None  # a node others can dial is asked to dial nobody
    s = holder_session(url, run_id, held.peer_id, holder_client, holder, tmp_path)
    s.state.begin(ROUND)
    await s.heartbeat()  # answered with the joiner's addresses: dialled in the background
    reached = await asyncio.wait_for(s.dialing, 10) if s.dialing is not None else []

    assert await joiner.fetch_params(ROUND, snapshot.digest, sink, timeout_s=10), "still undialable"
    assert reached == [joiner.holder_id]
    assert_loaded(target, state, source, momentum_of(source, -2.0))
    assert joiner.traffic(ROUND).downloaded_bytes == holder.traffic(ROUND).uploaded_bytes == snapshot.size_bytes


def test_through_a_real_nat_the_holder_dials_the_joiner_and_the_snapshot_arrives(tmp_path):
    for ok, reason in (lab_available(), firewall_available()):
        if not ok:
            pytest.skip(reason)
    lab = Topology(3, LinkSpec(rate_mbps=0), nat_hosts=[2])  # h0 bootstrap, h1 joiner, h2 behind NAT
    peers: list[subprocess.Popen] = []
    try:
        lab.up()
        probe = lab.probe_nat(2, prober=1)
        assert probe["inbound_blocked"] and probe["outbound_masqueraded"], probe
        for host, role in ((0, "bootstrap"), (2, "holder"), (1, "joiner")):
            command = [sys.executable, "-m", "tests.integration.reversal_peer", role, str(tmp_path), lab.hosts[host].ip]
            peers.append(subprocess.Popen([*lab.exec_args(host), *command], cwd=REPO_ROOT, start_new_session=True))
        for peer in peers:
            peer.wait(timeout=100)
        assert [p.returncode for p in peers] == [0, 0, 0]
    finally:
        (tmp_path / "done").touch()
        for peer in peers:
            if peer.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(peer.pid, signal.SIGKILL)  # the peer and its p2pd
                peer.wait()
        assert lab.down() == []
    assert left_behind(lab.prefix) == []
    result = json.loads((tmp_path / "result").read_text())
    assert result["before"] == [False, 0], "the joiner dialled the holder behind the NAT"
    assert result["after"][0] and result["after"][1] == result["after"][2], result
    assert result["dialed"] == [result["joiner"]]
    assert result["loaded_digest"] == result["digest"]
