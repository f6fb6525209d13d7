"""Pacing (node/exchange/pace.py): `Pacer` keeps bytes to its rate with a burst allowance, on a
clock the test sets; `Shares` splits a downlink's rate max-min fairly between the downloads
receiving (on a clock the test sets) and writes each stream its new share as a rate frame, read
here from the far end of real socket pairs."""

import asyncio
import socket

import pytest

from node.exchange.pace import HELD_FRACTION, PACED_UPLINK_MBPS, Pacer, Shares, Uplink
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


def test_a_rate_raised_while_a_piece_waits_reprices_what_is_owed_and_wakes_it():
    """A holder's stream held at the floor rate owes half a second for one piece; its share comes
    back 50 ms into the wait, and the piece goes at once at the new rate, not at the old price."""

    async def scenario():
        loop = asyncio.get_running_loop()
        pacer = Pacer(32_000.0, burst_s=0.0)
        pacer.spent(16_000)  # 0.5 s at the floor
        loop.call_later(0.05, pacer.set_rate, 3_200_000.0)  # the rest: 0.45 s at 32 kB/s, 4.5 ms now
        started = loop.time()
        waited = await pacer.wait()
        assert 0.04 < loop.time() - started < 0.2 and abs(waited - (loop.time() - started)) < 0.01
        pacer.set_rate(32_000.0)  # nothing owed: nothing to reprice
        assert await pacer.wait() == 0.0

    asyncio.run(scenario())


def test_an_uplinks_pieces_take_turns_and_together_keep_to_its_rate():
    """Two streams writing through one `Uplink`: their pieces take turns, oldest first, and all of
    them take no less than the rate allows after one burst (a lower bound: load only slows it)."""

    async def scenario():
        loop = asyncio.get_running_loop()
        uplink = Uplink(100_000.0)  # bytes/s
        order: list[str] = []

        async def stream(name: str) -> None:
            for _ in range(10):
                await uplink.take(2_000)
                order.append(name)

        started = loop.time()
        await asyncio.gather(stream("a"), stream("b"))
        elapsed = loop.time() - started
        # Within the first burst nothing waits; from b's first turn on they alternate until a is done.
        tail = order[order.index("b") :]
        assert tail[: 2 * tail.count("a")] == ["b", "a"] * tail.count("a"), order
        assert elapsed >= (20 * 2_000) / 100_000.0 - 0.05 - 2_000 / 100_000.0, elapsed

    asyncio.run(scenario())


def test_only_a_slow_stated_uplink_is_paced():
    assert Uplink.stated(None) is None and Uplink.stated(0.0) is None
    assert Uplink.stated(8.0)._pacer.rate == 8e6 / 8 * 0.9
    assert Uplink.stated(PACED_UPLINK_MBPS) is None and Uplink.stated(100.0) is None


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
        d0, d1, d2 = "d0", "d1", "d2"  # three downloads, one stream each
        assert shares.next_share(d0) == 900_000
        shares.join(d0, w0, shares.next_share(d0))  # asked for what it is given: nothing to tell
        assert await _told(r0) == []
        shares.join(d1, w1, shares.next_share(d1))
        shares.join(d2, w2, shares.next_share(d2))
        assert (await _told(r0), await _told(r1), await _told(r2)) == ([450_000, 300_000], [300_000], [])
        shares.leave(d1)
        shares.leave(d1)  # twice: nothing more
        assert (await _told(r0), await _told(r1), await _told(r2)) == ([450_000], [], [450_000])
        w2.close()
        shares.leave(d0)
        assert await _told(r2) == []  # a closed stream is not written to
        for writer in (w0, w1):
            writer.close()

    asyncio.run(scenario())


def test_held_downloads_share_half_the_rate_less_the_first_copies_while_this_nodes_first_copy_goes():
    """While this node sends its first copy, the downloads that are no packet's first copy share
    HELD_FRACTION of the rate less what first copies take; a first copy keeps its share, and the
    split is as before once the copy is out."""

    async def scenario():
        shares = Shares(900_000.0)
        sending = [False]
        shares.held = lambda: sending[0]
        (w0, r0), (w1, r1), (w2, r2) = [await _stream() for _ in range(3)]
        shares.join("a", w0, shares.next_share("a"))
        shares.join("b", w1, shares.next_share("b"))
        assert (await _told(r0), await _told(r1)) == ([450_000], [])
        sending[0] = True
        shares.refresh()
        assert (await _told(r0), await _told(r1)) == ([225_000], [225_000])  # half the rate between them
        assert shares.next_share("another") == 150_000  # a download starting meanwhile: a third of it
        shares.join("first", w2, shares.next_share("first", holdable=False), holdable=False)
        # The first copy takes the whole rate (it alone is not held): the held ones the floor.
        assert (await _told(r0), await _told(r1), await _told(r2)) == ([MIN_RATE], [MIN_RATE], [])
        sending[0] = False
        shares.refresh()
        assert [await _told(r) for r in (r0, r1, r2)] == [[300_000], [300_000], [300_000]]
        for writer in (w0, w1, w2):
            writer.close()

    asyncio.run(scenario())


def test_a_downloads_share_is_split_between_its_stripes_and_the_others_are_told_once_when_it_ends():
    async def scenario():
        shares = Shares(900_000.0)
        streams = [await _stream() for _ in range(4)]
        for writer, _ in streams[:3]:  # one download's three stripes
            shares.join("striped", writer, shares.next_share("striped"))
        assert shares.next_share("striped") == 225_000  # a fourth stripe's
        assert shares.next_share("other") == 450_000
        shares.join("other", streams[3][0], 450_000)
        told = [await _told(reader) for _, reader in streams]
        assert told == [[450_000, 300_000, 150_000], [300_000, 150_000], [150_000], []]
        shares.leave("striped")
        assert [await _told(reader) for _, reader in streams] == [[], [], [], [900_000]]
        for writer, _ in streams:
            writer.close()

    asyncio.run(scenario())


def test_a_download_its_holder_keeps_under_its_share_leaves_the_rest_to_the_others():
    """Max-min: a holder sending under 4/5 of its share over a whole window is held at what it
    measured (told twice that, at most an even share), the others split the rest; once it keeps
    up, the split is even again, and a new download asks for an even part of what is free."""

    async def scenario():
        now = [0.0]
        shares = Shares(900_000.0, window_s=0.25, clock=lambda: now[0])
        (ws, rs), (wf, rf) = await _stream(), await _stream()
        shares.join("slow", ws, shares.next_share("slow"))
        shares.join("fast", wf, shares.next_share("fast"))
        assert (await _told(rs), await _told(rf)) == ([450_000], [])
        now[0] = 0.1
        shares.received("slow", 10_000)  # no whole window yet: nothing measured, nothing told
        assert (await _told(rs), await _told(rf)) == ([], [])
        now[0] = 0.25
        shares.received("fast", 112_500)  # 450 kB/s: its share
        shares.received("slow", 25_000)  # 100 kB/s of 450
        assert (await _told(rs), await _told(rf)) == ([200_000], [800_000])
        assert shares.next_share("new") == 400_000  # (900 - 100) / 2
        now[0] = 0.5
        shares.received("fast", 312_500)
        shares.received("slow", 75_000)  # 200 kB/s: it keeps up with what it was told
        assert (await _told(rs), await _told(rf)) == ([450_000], [450_000])
        now[0] = 0.75
        shares.received("slow", 75_000)  # stalled (a parent waiting for its copy): the floor
        assert (await _told(rs), await _told(rf)) == ([MIN_RATE], [900_000])
        shares.leave("fast")
        assert await _told(rs) == [900_000]  # alone: not held at a rate measured with others
        for writer in (ws, wf):
            writer.close()

    asyncio.run(scenario())


def test_small_changes_of_a_share_are_not_told():
    async def scenario():
        now = [0.0]
        shares = Shares(900_000.0, window_s=0.25, clock=lambda: now[0])
        streams = [await _stream() for _ in range(3)]
        for i, (writer, _) in enumerate(streams):
            shares.join(i, writer, shares.next_share(i))
        [await _told(reader) for _, reader in streams]
        now[0] = 0.25
        shares.received(0, 15_000)  # 60 kB/s of 300: held
        shares.received(1, 75_000)
        shares.received(2, 75_000)
        assert [await _told(reader) for _, reader in streams] == [[120_000], [420_000], [420_000]]
        now[0] = 0.5
        shares.received(0, 29_500)  # 58 kB/s: 116 kB/s for it, 421 for the others, within 1/16
        assert [await _told(reader) for _, reader in streams] == [[], [], []]
        for writer, _ in streams:
            writer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("rate", [1.0, MIN_RATE * 2.5])
def test_a_share_never_falls_under_the_protocols_floor(rate):
    async def scenario():
        shares = Shares(rate)
        streams = [await _stream() for _ in range(4)]
        asked = []
        for i, (writer, _) in enumerate(streams):
            asked.append(shares.next_share(i))
            shares.join(i, writer, asked[-1])
        assert shares.next_share("next") == MIN_RATE and min(asked) == MIN_RATE
        told = [await _told(reader) for _, reader in streams]
        assert all(rate >= MIN_RATE for rates in told for rate in rates)
        assert all((rates or [ask])[-1] == MIN_RATE for rates, ask in zip(told, asked))
        for writer, _ in streams:
            writer.close()

    asyncio.run(scenario())


def test_a_first_copy_that_outlasts_the_bound_gives_the_held_downloads_their_share_back_unasked():
    """A fetcher's hold (node/exchange/fetch.py) lasts at most half the stall time-out: a first
    copy whose receiver stops reading ends it then, with nothing else happening, and the held
    download is told its whole share again."""
    from types import SimpleNamespace

    from node.exchange.config import ExchangeConfig
    from node.exchange.fetch import PacketFetcher
    from node.exchange.store import Held, PacketStore

    async def scenario():
        store = PacketStore()
        config = ExchangeConfig(run_id="run", downlink_mbps=8.0, stall_timeout_s=1.0)
        fetcher = PacketFetcher(config, SimpleNamespace(holder_id="me"), store, None, None)
        shares = fetcher._shares
        writer, reader = await _stream()
        shares.join("forwarded", writer, shares.next_share("forwarded"))
        whole = int(shares.rate)
        store.held[(3, "me")] = Held("digest", b"packet", own=True)
        with store.sending_first_copy((3, "me")):  # never written out: the receiver stalled
            assert await _told(reader) == [int(whole * HELD_FRACTION)]
            await asyncio.sleep(0.6)  # past the bound of 0.5 s (`_told` took 0.2 s of it)
            assert await _told(reader) == [whole]
        writer.close()

    asyncio.run(scenario())
