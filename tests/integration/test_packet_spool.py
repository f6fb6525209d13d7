"""Held packets kept in unnamed mapped files (node/exchange/spool.py), on real exchanges: they are
served and relayed like heap copies, leave no file behind, and give their disk space back once
forgotten. 127.0.0.1 only, port 0."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from node.exchange.p2p import P2PExchange
from tests.integration.test_p2p_exchange import packet, poll, sha, swarm

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]


def mapped_spool_files(directory: Path) -> int:
    """Mappings of this process backed by files in `directory` (unnamed ones show as deleted)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(directory) in line)


def test_spooled_packets_are_served_relayed_and_released(tmp_path):
    spool = tmp_path / "spool"

    async def scenario():
        async with swarm(*[P2PExchange] * 3, spool_dir=str(spool)) as (a, b, c):
            data = packet(7)
            await a.publish(0, "peer-a", data)
            manifest = {"peer-a": sha(data)}
            got = await b.fetch(0, manifest, holders_hint={"peer-a": a.visible_maddrs}, timeout_s=30)
            assert got == {"peer-a": data}  # a view of the mapped file, equal to the bytes
            held = b._store.held[(0, "peer-a")].data
            assert isinstance(held, memoryview) and held.readonly
            assert not any(spool.iterdir()), "a spooled packet left a named file"
            assert mapped_spool_files(spool) == 2  # a's own packet and b's copy

            # The publisher forgets it; c fetches from b, which serves its spooled copy onward.
            await a.forget_before(1)
            await b.wait_background()
            got = await c.fetch(0, manifest, holders_hint={"peer-a": b.visible_maddrs}, timeout_s=30)
            assert got == {"peer-a": data}
            assert b.traffic(0).uploaded_bytes == len(data)

            del got, held
            for x in (b, c):
                await x.forget_before(1)
            gc.collect()
            await poll(lambda: mapped_spool_files(spool) == 0, what="every spooled packet unmapped")

    asyncio.run(scenario())


def test_an_unusable_spool_directory_keeps_packets_in_memory(tmp_path, caplog):
    from node.exchange.spool import Spool

    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with caplog.at_level("WARNING"):
        spool = Spool(blocker / "spool")
    assert spool.directory is None and "packets stay in memory" in caplog.text
    kept = spool.keep(bytearray(b"abc"))
    assert kept == b"abc" and isinstance(kept, bytes)


def test_a_spool_that_stops_taking_writes_keeps_packets_in_memory_and_loses_none(tmp_path, caplog):
    from node.exchange.spool import Spool

    spool = Spool(tmp_path / "spool")
    assert isinstance(spool.keep(b"abc"), memoryview)
    (tmp_path / "spool").rmdir()  # cleaned away under the node: every new file fails, as on a full disk
    with caplog.at_level("WARNING"):
        kept = [spool.keep(bytes([i]) * 10) for i in range(3)]
    assert kept == [bytes([i]) * 10 for i in range(3)] and all(isinstance(k, bytes) for k in kept)
    assert caplog.text.count("keeping packets in memory") == 1  # warned once, not per packet
    (tmp_path / "spool").mkdir()
    assert isinstance(spool.keep(b"again"), memoryview)  # and back on disk once it can write


def test_a_spool_on_a_tmpfs_is_named_as_memory(tmp_path, caplog):
    from node.exchange.spool import Spool, file_system_type

    shm = Path("/dev/shm")
    if file_system_type(shm) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    directory = shm / f"locoswarm-spool-test-{tmp_path.name}"
    try:
        with caplog.at_level("WARNING"):
            Spool(directory)
        assert "is on a tmpfs, whose files are memory" in caplog.text
    finally:
        directory.rmdir()
    caplog.clear()
    with caplog.at_level("WARNING"):
        Spool(tmp_path / "spool")
    assert "whose files are memory" not in caplog.text or file_system_type(tmp_path) == "tmpfs"
