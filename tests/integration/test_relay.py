"""Circuit relays on real p2pd daemons, 127.0.0.1, port 0: a relay (`locoswarm node relay`, a
child process), a host reachable only through it (`relay_via`), and a host that dials that one.

The relayed host announces a port nobody listens on (besides its circuit address), so that the
dialler, which learns its addresses from libp2p's identify over the relayed connection, has no
direct path to upgrade to: every byte goes through the relay, as the tests check. One test starts
a relay's p2pd alone, to read its environment from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from pathlib import Path

import pytest

from node.cli.relay import LISTENING
from node.exchange.config import ExchangeConfig
from node.exchange.host import Host, dial_addresses, start_daemon
from node.exchange.reachability import is_relayed

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = "/locoswarm-test/relay-count/1"
RESERVATION_TIMEOUT_S = 30.0  # the relayed host's p2pd reserves a slot at the relay within this
DEFAULT_LIMIT_BYTES = 128 << 10  # libp2p's relay v2 default per relayed connection, each way


@contextlib.asynccontextmanager
async def relay_process(*args: str):
    """`locoswarm node relay` with `args` (by default on 127.0.0.1, port 0); yields the first
    address it prints, stops it with SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "locoswarm",
        "node",
        "relay",
        *(args or ("--host-maddrs", "/ip4/127.0.0.1/tcp/0")),
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith(LISTENING), f"the relay printed {line!r}"
        yield line.removeprefix(LISTENING).strip()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, "the relay stops cleanly on SIGTERM"


@contextlib.asynccontextmanager
async def relayed_pair(relay_maddr: str):
    """(relayed, dialler): hosts whose only path between them is the relay."""
    relayed = await Host.start(
        ExchangeConfig(run_id="relay-test", relay_via=(relay_maddr,), announce_maddrs=("/ip4/127.0.0.1/tcp/9",))
    )
    try:
        dialler = await Host.start(ExchangeConfig(run_id="relay-test"))
        try:
            yield relayed, dialler
        finally:
            await dialler.shutdown()
    finally:
        await relayed.shutdown()


async def count_bytes(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read an 8-byte length, then that many bytes (or to EOF); answer how many arrived."""
    want, got = int.from_bytes(await reader.readexactly(8), "big"), 0
    while got < want and (chunk := await reader.read(1 << 16)):
        got += len(chunk)
    writer.write(got.to_bytes(8, "big"))
    await writer.drain()
    writer.close()


async def connect_through_relay(dialler: Host, relayed: Host) -> None:
    """Dial the relayed host's announced (circuit) addresses until its reservation is in place."""
    from hivemind.p2p import PeerID

    maddrs = await relayed.visible_maddrs()
    assert maddrs and all(is_relayed(m) for m in maddrs), maddrs
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESERVATION_TIMEOUT_S
    while True:
        try:
            await dialler.connect(PeerID.from_base58(relayed.holder_id), dial_addresses(relayed.holder_id, maddrs))
            return
        except Exception as e:  # NO_RESERVATION (204) until the relayed host's p2pd reserved a slot
            if loop.time() > deadline:
                raise AssertionError(f"no circuit to the relayed host within {RESERVATION_TIMEOUT_S:g} s: {e!r}") from e
            await asyncio.sleep(0.5)


async def send_through(dialler: Host, relayed: Host, num_bytes: int) -> int | None:
    """Bytes the relayed host says arrived of `num_bytes` sent to it; None: the stream was cut."""
    from hivemind.p2p import PeerID

    reader, writer = await dialler.open_stream(PeerID.from_base58(relayed.holder_id), PROTOCOL)
    try:
        writer.write(num_bytes.to_bytes(8, "big"))
        writer.write(bytes(num_bytes))
        await asyncio.wait_for(writer.drain(), 20)
        return int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 20), "big")
    except (ConnectionError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()


async def remote_addresses(host: Host, peer_id: str) -> list[str]:
    """The remote address of each of `host`'s connections to `peer_id` (p2pd lists one per connection)."""
    return [
        str(a)
        for info in await host.p2p._client.list_peers()
        if info.peer_id.to_base58() == peer_id
        for a in info.addrs
    ]


def test_a_host_behind_a_relay_is_dialled_through_it_and_bytes_move():
    async def scenario():
        async with relay_process() as relay_maddr, relayed_pair(relay_maddr) as (relayed, dialler):
            assert await relayed.visible_maddrs() == [f"{relay_maddr}/p2p-circuit/p2p/{relayed.holder_id}"]
            await relayed.serve(count_bytes, PROTOCOL)
            await connect_through_relay(dialler, relayed)
            assert await send_through(dialler, relayed, 64 << 10) == 64 << 10
            via = await remote_addresses(dialler, relayed.holder_id)
            assert via and all(is_relayed(a) for a in via), f"a direct connection to the relayed host: {via}"

    asyncio.run(scenario())


def test_a_relay_behind_port_forwarding_checks_itself_at_its_listen_address_and_prints_the_announced_one():
    """A relay that announces an address this machine does not have (a public IP forwarded to it;
    here TEST-NET-3, which nobody routes) checks itself through its listen address, 127.0.0.1
    and the port it was given, instead of dying on it: it prints the announced address."""
    with socket.socket() as s:  # a free port: the relay behind port forwarding listens on a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    announced = f"/ip4/203.0.113.5/tcp/{port}"

    async def scenario():
        async with relay_process("--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--announce-maddrs", announced) as m:
            assert m.startswith(f"{announced}/p2p/"), m

    asyncio.run(scenario())


def test_a_relays_p2pd_runs_go_code_on_one_thread_and_is_the_child_hivemind_holds():
    """`env` execs p2pd in its own process: the pid hivemind holds (and stops) is p2pd's, and it
    has GOMAXPROCS=1 and no garbage collection at start-up, which make its configured relay
    register after its default one."""

    async def scenario():
        p2p = await start_daemon(ExchangeConfig(run_id="relay-test", relay=True), idle_timeout_s=0)
        try:
            pid = p2p._child.pid
            assert Path(f"/proc/{pid}/exe").resolve().name == "p2pd"
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert {b"GOMAXPROCS=1", b"GOGC=off", b"GOMEMLIMIT=512MiB"} <= set(environ)
        finally:
            await p2p.shutdown()
        assert p2p._child.returncode is not None, "hivemind's shutdown stopped p2pd itself"

    asyncio.run(scenario())


def test_a_relay_forced_public_carries_more_than_libp2ps_default_128_kib():
    """The relay's own limits (p2pd's -relayDataLimit, 4 GiB) answer, not libp2p's default of 128
    KiB per relayed connection, which p2pd's second relay service applies when it registers last
    (node/exchange/host.py): 1 MiB moves over one relayed connection."""

    async def scenario():
        async with relay_process() as relay_maddr, relayed_pair(relay_maddr) as (relayed, dialler):
            await relayed.serve(count_bytes, PROTOCOL)
            await connect_through_relay(dialler, relayed)
            assert await send_through(dialler, relayed, 8 * DEFAULT_LIMIT_BYTES) == 8 * DEFAULT_LIMIT_BYTES
            via = await remote_addresses(dialler, relayed.holder_id)
            assert via and all(is_relayed(a) for a in via), f"a direct connection to the relayed host: {via}"

    asyncio.run(scenario())
