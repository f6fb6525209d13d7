"""Pacing (node/exchange/pace.py): `Pacer` keeps bytes to its rate with a burst allowance, on a
clock the test sets; `Shares` splits a downlink's rate between the streams receiving and writes
each its new share as a rate frame, read here from the far end of real socket pairs."""

import asyncio
import socket

import pytest

from node.exchange.pace import Pacer, Shares
from protocol.stream import MIN_RATE, RATE, RATE_FRAME


def test_reads_wait_until_their_bytes_are_paid_at_the_rate_after_a_burst():
    now = [100.0]
    pacer = Pacer(1000.0, burst_s=0.05, clock=lambda: now[0])

    async def scenario():
        assert await pacer.wait() == 0.0  # nothing read yet
        pacer.spent(50)  # within the burst: 0.05 s of the rate
        assert await pacer.wait() == 0.0
        pacer.spent(1000)  # one second's worth more, from two downloads alike
        assert abs(pacer._paid_until - 101.0) < 1e-9
        now[0] = 100.5  # half of it paid
        pacer.spent(0)
        assert abs(pacer._paid_until - 101.0) < 1e-9
        now[0] = 200.0  # idle long past: only a burst's worth of credit, never more
        pacer.spent(100)
        assert abs(pacer._paid_until - (200.0 - 0.05 + 0.1)) < 1e-9

    asyncio.run(scenario())


def test_wait_sleeps_for_the_debt():
    async def scenario():
        loop = asyncio.get_running_loop()
        pacer = Pacer(10_000.0, burst_s=0.0)
        pacer.spent(1000)  # 0.1 s at the rate
        started = loop.time()
        waited = await pacer.wait()
        assert 0.05 < waited <= 0.1 + 1e-6 and loop.time() - started >= waited - 1e-3
        assert await pacer.wait() == 0.0

    asyncio.run(scenario())


_KEPT: list = []  # the ends a test does not use, alive until its loop ends


async def _stream() -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
    """A stream's writing end, and the reader at its far end."""
    near, far = socket.socketpair()
    near_reader, writer = await asyncio.open_connection(sock=near)
    reader, far_writer = await asyncio.open_connection(sock=far)
    _KEPT.extend((near_reader, far_writer))
    return writer, reader


async def _told(reader: asyncio.StreamReader) -> list[int]:
    """The rates written to a stream so far."""
    rates = []
    while True:
        try:
            frame = await asyncio.wait_for(reader.readexactly(RATE_FRAME.size), 0.2)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):  # nothing more yet, or closed
            return rates
        tag, rate = RATE_FRAME.unpack(frame)
        assert tag == RATE
        rates.append(rate)


def test_shares_split_the_rate_evenly_and_each_stream_is_told_its_new_share():
    async def scenario():
        shares = Shares(900_000.0)
        (w0, r0), (w1, r1), (w2, r2) = [await _stream() for _ in range(3)]
        assert shares.next_share() == 900_000
        shares.join(w0, shares.next_share())  # asked for what it is given: nothing to tell
        assert await _told(r0) == []
        shares.join(w1, shares.next_share())
        shares.join(w2, shares.next_share())
        assert (await _told(r0), await _told(r1), await _told(r2)) == ([450_000, 300_000], [300_000], [])
        shares.leave(w1)
        shares.leave(w1)  # twice: nothing more
        assert (await _told(r0), await _told(r1), await _told(r2)) == ([450_000], [], [450_000])
        w2.close()
        shares.leave(w0)
        assert await _told(r2) == []  # a closed stream is not written to
        for writer in (w0, w1):
            writer.close()

    asyncio.run(scenario())


def test_a_download_that_ends_leaves_with_all_its_streams_and_the_others_are_told_once():
    async def scenario():
        shares = Shares(900_000.0)
        streams = [await _stream() for _ in range(4)]
        for writer, _ in streams:
            shares.join(writer, shares.next_share())
        told = [await _told(reader) for _, reader in streams]
        assert told[-1] == [] and all(rates[-1] == 225_000 for rates in told[:-1])
        shares.leave(*(writer for writer, _ in streams[:3]))  # one download's three stripes
        assert [await _told(reader) for _, reader in streams] == [[], [], [], [900_000]]
        for writer, _ in streams:
            writer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("rate", [1.0, MIN_RATE * 2.5])
def test_a_share_never_falls_under_the_protocols_floor(rate):
    async def scenario():
        shares = Shares(rate)
        streams = [await _stream() for _ in range(4)]
        asked = []
        for writer, _ in streams:
            asked.append(shares.next_share())
            shares.join(writer, asked[-1])
        assert shares.next_share() == MIN_RATE and min(asked) == MIN_RATE
        told = [await _told(reader) for _, reader in streams]
        assert all(rate >= MIN_RATE for rates in told for rate in rates)
        assert all((rates or [ask])[-1] == MIN_RATE for rates, ask in zip(told, asked))
        for writer, _ in streams:
            writer.close()

    asyncio.run(scenario())
