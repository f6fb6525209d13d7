"""Parameter snapshots over real hivemind DHT nodes and p2pd daemons (127.0.0.1, port 0).

A snapshot many times larger than the exchange's packet limit is streamed from a checkpoint file
and from live tensors, checked chunk by chunk against the agreed digest and written straight into
the fetcher's tensors. Faults: a holder process (with its p2pd) killed with SIGKILL mid-stream;
a holder whose tensors move on mid-stream (the next outer step); a holder that sends a wrong
chunk or a wrong prologue (a subclass of the real exchange, as in test_p2p_exchange.py). In each
case the fetch goes on at the next holder from the first chunk not yet verified and ends with
the agreed bytes. A snapshot stream holds a slot of its own, never the upload slot packets wait
for. Every test stops what it started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from hivemind.p2p import PeerID

from node.exchange.p2p import P2PExchange
from node.training.checkpoint import save_checkpoint
from node.training.params import param_digest
from node.training.snapshot import Snapshot, SnapshotSink
from protocol.dht_records import PARAMS_ID
from protocol.digest import CHUNK_BYTES
from protocol.stream import PROTOCOL_NAME, RESPONSE_HEADER, STATUS_OK, PacketRequest, encode_request
from tests.fixtures.coordinator import REPO_ROOT
from tests.integration.snapshot_holder import Toy, momentum_of, toy_snapshot
from tests.integration.test_p2p_exchange import RUN_ID, FirstHolder, poll, swarm

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

ROUND = 3
MAX_PACKET_BYTES = 1 << 20  # the snapshot (20.6 MB) is about 20 times larger


def fresh_sink(params_digest: str) -> tuple[Toy, dict[str, torch.Tensor], SnapshotSink]:
    target = Toy(None)
    state = {f"outer_momentum.{n}": torch.zeros_like(p) for n, p in target.named_parameters()}
    return target, state, SnapshotSink(dict(target.named_parameters()), state, params_digest)


def assert_loaded(target: Toy, state: dict, source: Toy, momentum: dict) -> None:
    for name, p in source.named_parameters():
        assert torch.equal(dict(target.named_parameters())[name], p), name
        assert torch.equal(state[f"outer_momentum.{name}"], momentum[f"outer_momentum.{name}"]), name


async def announced(fetcher: P2PExchange, count: int):
    async def enough():
        holders = await fetcher.params_holders(ROUND)
        return holders if len(holders) >= count else None

    return await poll(enough, timeout_s=20, what=f"{count} snapshot holders")


def resumed_at(sink: SnapshotSink, second: P2PExchange) -> int:
    """The stream offset the second holder was asked from (it sent the rest)."""
    return sink.total_bytes - second.traffic(ROUND).uploaded_bytes


class MovingOnExchange(P2PExchange):
    """Serves a snapshot of live tensors, and takes "the next outer step" on them after 3 units."""

    tensors: list[torch.Tensor]
    units_served = 0

    def _payload_for(self, round, publisher, data):
        if publisher == PARAMS_ID:
            self.units_served += 1
            if self.units_served == 3:
                with torch.no_grad():
                    for t in self.tensors:
                        t.add_(1.0)
        return data


class WrongUnitExchange(P2PExchange):
    """Serves its snapshot with one byte flipped in the unit numbered `bad_unit` (0: the prologue)."""

    bad_unit = 2
    units_served = 0

    def _payload_for(self, round, publisher, data):
        if publisher != PARAMS_ID:
            return data
        self.units_served += 1
        if self.units_served - 1 != self.bad_unit:
            return data
        corrupted = bytearray(data)
        corrupted[len(corrupted) // 2] ^= 0xFF
        return bytes(corrupted)


def test_a_snapshot_many_times_the_packet_limit_streams_from_a_checkpoint_into_the_model(tmp_path):
    async def scenario():
        source = Toy(1)
        momentum = momentum_of(source, 0.5)
        saved = {name.removeprefix("outer_momentum."): m for name, m in momentum.items()}
        digest = save_checkpoint(tmp_path / "ckpt", ROUND, source, outer_momentum=saved)
        assert digest == param_digest(source)
        async with swarm(P2PExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES) as (holder, fetcher):
            snapshot = Snapshot.from_checkpoint(tmp_path / "ckpt")
            assert snapshot.size_bytes > 16 * MAX_PACKET_BYTES and snapshot.durable and snapshot.round == ROUND
            ann = await holder.publish_params(ROUND, snapshot)
            assert (await announced(fetcher, 1))[0].digest == ann.digest == snapshot.digest

            target, state, sink = fresh_sink(digest)
            tracemalloc.start()
            try:
                assert await fetcher.fetch_params(ROUND, snapshot.digest, sink, timeout_s=30)
                _, peak_bytes = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert_loaded(target, state, source, momentum)
            assert param_digest(target) == digest
            moved = fetcher.traffic(ROUND).downloaded_bytes, holder.traffic(ROUND).uploaded_bytes
            assert moved == (snapshot.size_bytes, snapshot.size_bytes)
            # Server and fetcher share this process: one unit buffered on each side, plus stream buffers.
            assert peak_bytes < 4 * CHUNK_BYTES, peak_bytes

            # A newer checkpoint replaces the files: the snapshot served keeps its own (open) files.
            save_checkpoint(tmp_path / "ckpt", ROUND + 1, Toy(2), outer_momentum=saved)
            target, state, sink = fresh_sink(digest)
            assert await fetcher.fetch_params(ROUND, snapshot.digest, sink, timeout_s=30)
            assert_loaded(target, state, source, momentum)

    asyncio.run(scenario())


def test_a_holder_killed_mid_stream_is_followed_by_another_from_the_first_unverified_chunk():
    """The first holder is a process of its own; it is killed (SIGKILL, with its p2pd) once the
    fetcher verified the prologue and a chunk from it. The second holder sends only the rest."""

    async def scenario():
        source, snapshot = toy_snapshot()
        momentum = momentum_of(source, -2.0)
        async with swarm(P2PExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES) as (fetcher, second):
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration.snapshot_holder",
                    RUN_ID,
                    str(ROUND),
                    fetcher.visible_maddrs[0],
                    "--unit-delay-s",
                    "0.3",
                ],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 40)
                assert line.startswith("ready "), line
                first_id = line.split()[1]
                await second.publish_params(ROUND, snapshot)
                holders = await announced(fetcher, 2)
                assert {h.digest for h in holders} == {snapshot.digest}
                fetcher._fetcher.rng = FirstHolder(first_id)

                target, state, sink = fresh_sink(param_digest(source))
                fetch = asyncio.create_task(fetcher.fetch_params(ROUND, snapshot.digest, sink, timeout_s=40))
                await poll(lambda: sink.offset > sink.layout.prologue_bytes, what="a chunk from the first holder")
                os.killpg(process.pid, signal.SIGKILL)
                assert await fetch
            finally:
                with_group_gone(process)
            assert_loaded(target, state, source, momentum)
            offset = resumed_at(sink, second)
            assert sink.layout.prologue_bytes < offset < sink.total_bytes
            assert sink.layout.unit_at(offset).start == offset  # a unit boundary: nothing verified is fetched twice

    asyncio.run(scenario())


def with_group_gone(process: subprocess.Popen) -> None:
    """Kill the holder's process group (it and its p2pd) if still there, and reap the holder."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)
    process.stdout.close()
    for _ in range(100):  # p2pd, reparented, is reaped by init
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError("a process of the killed holder's group survived")


def test_a_holder_whose_tensors_move_on_stops_serving_them_and_the_fetch_resumes_elsewhere():
    """After 3 units the first holder's tensors change (its next outer step): the unit it reads no
    longer matches the snapshot, so it ends the stream short rather than send it, and drops the
    snapshot; nobody is banned, and the second holder sends the rest."""

    async def scenario():
        source = Toy(1)
        momentum = momentum_of(source, -2.0)
        async with swarm(P2PExchange, MovingOnExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES) as peers:
            fetcher, first, second = peers
            for holder in (first, second):
                model, snapshot = toy_snapshot()
                await holder.publish_params(ROUND, snapshot)
                if holder is first:
                    first.tensors = list(model.parameters())
            holders = await announced(fetcher, 2)
            fetcher._fetcher.rng = FirstHolder(first.holder_id)

            target, state, sink = fresh_sink(param_digest(source))
            assert await fetcher.fetch_params(ROUND, holders[0].digest, sink, timeout_s=40)
            assert_loaded(target, state, source, momentum)
            offset = resumed_at(sink, second)
            assert sink.layout.prologue_bytes < offset < sink.total_bytes
            assert sink.layout.unit_at(offset).start == offset
            assert (ROUND, PARAMS_ID) not in first._store.held  # a new request gets "not held"

    asyncio.run(scenario())


def test_a_snapshot_every_holder_moved_on_from_is_given_up_long_before_the_time_out():
    """Both holders announced the snapshot, then dropped it (their next outer step, as after a
    whole-swarm restart when a fresh node asks for the round the others just left): each answers
    "not held". The fetch stops after two passes with a DHT re-read between them instead of asking
    until its 40 s time-out, so the node's catch-up can look for the newer snapshot."""

    async def scenario():
        async with swarm(P2PExchange, P2PExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES) as peers:
            fetcher, *holders = peers
            for holder in holders:
                await holder.publish_params(ROUND, toy_snapshot()[1])
            records = await announced(fetcher, 2)
            for holder in holders:
                del holder._store.held[(ROUND, PARAMS_ID)]  # moved on: the record stays in the DHT
            _, _, sink = fresh_sink(records[0].digest)
            started = time.monotonic()
            assert not await fetcher.fetch_params(ROUND, records[0].digest, sink, timeout_s=40)
            elapsed = time.monotonic() - started
            assert elapsed < 10, f"gave up after {elapsed:.1f} s"
            assert sink.offset == 0 and sink.written_bytes == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("bad_unit", [0, 2], ids=["wrong-prologue", "wrong-chunk"])
def test_a_holder_sending_wrong_bytes_is_refused_and_the_next_one_used(bad_unit, caplog):
    async def scenario():
        source = Toy(1)
        momentum = momentum_of(source, -2.0)
        async with swarm(P2PExchange, WrongUnitExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES) as peers:
            fetcher, hostile, honest = peers
            hostile.bad_unit = bad_unit
            for holder in (hostile, honest):
                await holder.publish_params(ROUND, toy_snapshot()[1])
            holders = await announced(fetcher, 2)
            fetcher._fetcher.rng = FirstHolder(hostile.holder_id)

            target, state, sink = fresh_sink(param_digest(source))
            assert await fetcher.fetch_params(ROUND, holders[0].digest, sink, timeout_s=40)
            assert_loaded(target, state, source, momentum)
            assert f"holder {hostile.holder_id} of params's packet banned" in caplog.text
            from_honest = honest.traffic(ROUND).uploaded_bytes
            if bad_unit == 0:  # refused on the prologue, before any body byte: all of it from the honest one
                assert from_honest == sink.total_bytes
            else:  # the prologue and the first chunk from the hostile one, the rest from the honest one
                assert from_honest == sink.total_bytes - sink.layout.prologue_bytes - CHUNK_BYTES

    asyncio.run(scenario())


async def _open(requester: P2PExchange, holder: P2PExchange, publisher: str, digest: str, round: int):
    """A raw request to `holder` (not queued); the response status, and the stream to close."""
    _, reader, writer = await requester._host.p2p.call_binary_stream_handler(
        PeerID.from_base58(holder.holder_id), PROTOCOL_NAME
    )
    writer.write(encode_request(PacketRequest(run=RUN_ID, round=round, publisher=publisher, digest=digest)))
    status, _ = RESPONSE_HEADER.unpack(await asyncio.wait_for(reader.readexactly(RESPONSE_HEADER.size), 10))
    return status, writer


def test_a_snapshot_stream_never_takes_the_upload_slot_packets_wait_for():
    """The holder has one upload slot. A snapshot download that reads nothing after its header
    (a slow link: the holder's writes block) holds a snapshot slot, not that one: a request for a
    packet another peer already confirmed (no seed stream for it) is served at once, not answered busy."""

    async def scenario():
        async with swarm(P2PExchange, P2PExchange, P2PExchange, max_packet_bytes=MAX_PACKET_BYTES, max_uploads=1) as (
            holder,
            slow,
            fetcher,
        ):
            await holder.publish_params(ROUND, toy_snapshot()[1])
            (ann,) = await announced(slow, 1)
            data = os.urandom(64 << 10)
            packet_ann = await holder.publish(ROUND, "pub", data)
            assert await slow.fetch(
                ROUND, {"pub": packet_ann.digest}, {"pub": packet_ann.multiaddrs}, timeout_s=10
            ) == {"pub": data}
            await poll(lambda: holder._server.num_uploads == 0, what="the confirmed packet's slot freed")

            status, snapshot_stream = await _open(slow, holder, PARAMS_ID, ann.digest, ROUND)
            assert status == STATUS_OK
            server = holder._server
            assert (server.snapshot_uploads.num_taken, server.num_uploads) == (1, 0)
            status, packet_stream = await _open(fetcher, holder, "pub", packet_ann.digest, ROUND)
            assert status == STATUS_OK, "the packet was answered busy behind a snapshot stream"
            packet_stream.close()
            snapshot_stream.close()

    asyncio.run(scenario())
