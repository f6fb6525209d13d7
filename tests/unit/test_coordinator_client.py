"""The node's coordinator client against a coordinator that goes away and comes back: the real
coordinator app under uvicorn on 127.0.0.1, stopped and started again on the same port. A call
waits for as long as the outage lasts (one log line a minute; here every 50 ms), and a call
with its own budget gives up after it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import uvicorn

import node.round.coordinator_client as client_module
from node.round.coordinator_client import (
    CoordinatorClient,
    CoordinatorUnavailable,
    CoordinatorUnreachable,
    Refused,
    format_duration,
)
from node.round.refusals import Action, Code
from protocol.signing import PeerKey


class Coordinator:
    """The coordinator app served by uvicorn in this event loop; `stop()` closes its port."""

    def __init__(self, tmp_path: Path, port: int = 0):
        from coordinator.app import create_app
        from coordinator.storage import open_storage

        self.storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
        self.app = create_app(self.storage, "client-test-admin-token-0123456789", tick_s=None)
        self.port = port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:  # readiness: uvicorn has bound its socket
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._server.should_exit = True
            await self._task

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fast_backoff(monkeypatch):
    """Retries every few milliseconds and an outage line every 50 ms, so an outage takes a
    moment; the behaviour under test is the same."""
    monkeypatch.setattr(client_module, "RETRY_DELAY_MAX_S", 0.02)
    monkeypatch.setattr(client_module, "OUTAGE_LOG_EVERY_S", 0.05)


@pytest.mark.timeout(60)
def test_a_call_waits_out_an_outage_and_carries_on(tmp_path, fast_backoff, caplog):
    async def main():
        coordinator = Coordinator(tmp_path)
        await coordinator.start()
        client = CoordinatorClient(coordinator.url, PeerKey.from_seed(b"client"))
        try:
            assert (await client.runs()).runs == []
            await coordinator.stop()
            waiting = asyncio.create_task(client.runs())
            await asyncio.sleep(0.5)  # the outage: the call keeps retrying
            assert not waiting.done() and client.unreachable_for_s > 0.3
            await coordinator.start()  # the same port, the same database
            assert (await asyncio.wait_for(waiting, 30)).runs == []
            assert client.unreachable_for_s is None
        finally:
            await client.close()
            await coordinator.stop()
            coordinator.storage.close()

    with caplog.at_level(logging.WARNING, logger="node.round.coordinator_client"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("coordinator http://127.0.0.1:") and "unreachable (ConnectError" in lines[0]
    assert lines[-1].startswith("coordinator reachable again after")
    periodic = [line for line in lines if line.startswith("coordinator unreachable for ")]
    assert 2 <= len(periodic) <= 15  # about one per period, not one per retry


@pytest.mark.timeout(60)
def test_calls_waiting_out_an_outage_retry_as_soon_as_one_call_gets_through(tmp_path, monkeypatch):
    """A node's report, deep in its backoff when the coordinator comes back, must not wait out the
    rest of it while the node's heartbeats already get through (the faults test's node then missed
    the next round). Jitter held at its top: the report's sleeps are 0.3, 0.6, 1.2, 2.4, then 4.8 s."""
    monkeypatch.setattr(client_module.random, "random", lambda: 1.0)

    async def main():
        coordinator = Coordinator(tmp_path)
        await coordinator.start()
        client = CoordinatorClient(coordinator.url, PeerKey.from_seed(b"client"))
        try:
            assert (await client.runs()).runs == []
            await coordinator.stop()
            loop = asyncio.get_running_loop()
            started = loop.time()
            report = asyncio.create_task(client.runs())
            await asyncio.sleep(5.0)  # the report now sleeps until about 9.3 s
            await coordinator.start()  # the same port, the same database
            assert not report.done()
            assert (await client.runs()).runs == []  # a heartbeat, say, gets through
            answered = loop.time()
            assert (await asyncio.wait_for(report, 30)).runs == []
            assert loop.time() - answered < 1.0, f"the report waited {loop.time() - answered:.1f} s more"
            assert loop.time() - started < 7.0
        finally:
            await client.close()
            await coordinator.stop()
            coordinator.storage.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_call_with_its_own_budget_gives_up_and_a_refusal_is_final(tmp_path, fast_backoff):
    async def main():
        coordinator = Coordinator(tmp_path)
        await coordinator.start()
        client = CoordinatorClient(coordinator.url, PeerKey.from_seed(b"client"))
        client.run_id = "run-nonexistent"
        try:
            with pytest.raises(Refused) as refused:  # an answer, final: no retry
                await client.leave()
            assert refused.value.code is Code.UNKNOWN_PEER and refused.value.action is Action.STOP
            assert client.unreachable_for_s is None
            await coordinator.stop()
            with pytest.raises(CoordinatorUnavailable, match="gave up after 3 s"):
                await client.leave()  # leaving waits 3 s at most
            assert client.unreachable_for_s is not None
        finally:
            await client.close()
            await coordinator.stop()
            coordinator.storage.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_coordinator_never_reached_is_a_wrong_address_said_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "FIRST_CONTACT_S", 0.5)

    async def main():
        coordinator = Coordinator(tmp_path)
        await coordinator.start()
        await coordinator.stop()  # a port nothing listens on
        client = CoordinatorClient(coordinator.url, PeerKey.from_seed(b"client"))
        try:
            with pytest.raises(CoordinatorUnreachable, match="check the address, or run `locoswarm doctor"):
                await client.runs()
        finally:
            await client.close()
            coordinator.storage.close()

    asyncio.run(main())


def test_format_duration():
    assert [format_duration(s) for s in (0, 42, 200, 3900)] == ["0s", "42s", "3m20s", "1h05m"]


@pytest.mark.timeout(60)
def test_a_node_that_stops_gives_up_waiting_out_an_outage(tmp_path):
    """Ctrl+C (or SIGTERM) during an outage: the call waiting it out tries once more and gives up,
    where it waited for as long as the outage lasted (a node whose coordinator was gone ignored
    SIGTERM for minutes)."""

    async def main():
        coordinator = Coordinator(tmp_path)
        await coordinator.start()
        client = CoordinatorClient(coordinator.url, PeerKey.from_seed(b"client"))
        try:
            assert (await client.runs()).runs == []
            await coordinator.stop()
            waiting = asyncio.create_task(client.runs())
            await asyncio.sleep(3.0)  # deep in its backoff: its next try is over a second away
            loop = asyncio.get_running_loop()
            asked = loop.time()
            client.stop_retrying()
            with pytest.raises(CoordinatorUnavailable, match="this node is stopping"):
                await asyncio.wait_for(waiting, 10)
            assert loop.time() - asked < 0.5
        finally:
            await client.close()
            await coordinator.stop()
            coordinator.storage.close()

    asyncio.run(main())
