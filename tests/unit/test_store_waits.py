"""PacketStore's waits, and what it forgets. `awaited_push`: the root of an undialable
publisher's tree waits for the push rather than pull a second copy through the same uplink, but
not for a push that never starts or fails. `after_first_copies`: downloads hold back while this
node sends its own packet until one whole copy of it left, and only that long (at most the
caller's bound); each piece read waits. `forget_before` spares a node's own packets on request."""

import asyncio
import hashlib

import pytest

from node.exchange.store import Held, PacketStore
from protocol.stream import DigestMismatch

pytestmark = pytest.mark.timeout(20)

BODY = bytes(range(256)) * 64  # 16 KiB
DIGEST = hashlib.sha256(BODY).hexdigest()


async def _push(store: PacketStore, reader: asyncio.StreamReader, digest: str = DIGEST) -> bytes:
    return await store.receive(
        (3, "pub"), digest, len(BODY), reader, piece_bytes=1024, read_timeout_s=lambda: 5.0, source="pub", pushed=True
    )


def test_no_push_within_the_grace_returns_none_and_a_held_copy_returns_at_once():
    async def scenario():
        store = PacketStore()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await store.awaited_push(3, "pub", DIGEST, grace_s=0.2) is None
        assert loop.time() - started >= 0.2
        reader = asyncio.StreamReader()
        reader.feed_data(BODY)
        await _push(store, reader)
        assert await store.awaited_push(3, "pub", DIGEST, grace_s=0.0) == BODY

    asyncio.run(scenario())


def test_a_push_that_started_is_awaited_past_the_grace_until_it_verifies():
    async def scenario():
        store = PacketStore()
        reader = asyncio.StreamReader()
        waiting = asyncio.create_task(store.awaited_push(3, "pub", DIGEST, grace_s=0.1))
        pushing = asyncio.create_task(_push(store, reader))
        reader.feed_data(BODY[:1000])  # starts within the grace ...
        await asyncio.sleep(0.4)  # ... and trickles well past it
        assert not waiting.done()
        reader.feed_data(BODY[1000:])
        assert await waiting == BODY and await pushing == BODY

    asyncio.run(scenario())


def test_a_push_that_fails_returns_none_so_the_caller_fetches():
    async def scenario():
        store = PacketStore()
        reader = asyncio.StreamReader()
        waiting = asyncio.create_task(store.awaited_push(3, "pub", DIGEST, grace_s=5.0))
        pushing = asyncio.create_task(_push(store, reader))
        reader.feed_data(bytes(len(BODY)))  # the right length, the wrong bytes
        with pytest.raises(DigestMismatch):
            await pushing
        assert await asyncio.wait_for(waiting, 2.0) is None

    asyncio.run(scenario())


def test_downloads_hold_back_until_one_whole_copy_of_the_own_packet_left():
    async def scenario():
        store = PacketStore()
        loop = asyncio.get_running_loop()
        store.held[(3, "me")] = Held(DIGEST, BODY, own=True)
        assert await store.after_first_copies(5.0) == 0.0  # nothing being sent: no wait
        reader = asyncio.StreamReader()
        reader.feed_data(BODY)
        holds = []

        async def hold():
            holds.append(await store.after_first_copies(5.0))

        with store.sending_first_copy((3, "me")):
            receiving = asyncio.create_task(
                store.receive(
                    (3, "other"),
                    DIGEST,
                    len(BODY),
                    reader,
                    piece_bytes=1024,
                    read_timeout_s=lambda: 5.0,
                    source="x",
                    before_piece=hold,
                )
            )
            await asyncio.sleep(0.3)
            assert not receiving.done() and store.partial[(3, "other")].num_received == 0  # not a byte read
            started = loop.time()
            # Another stream of it (to a slow peer) goes on, but one whole copy left: downloads go on.
            with store.sending_first_copy((3, "me")):
                store.first_copy_out((3, "me"))
                assert await receiving == BODY and loop.time() - started < 1.0
        assert holds[0] >= 0.3 and all(h == 0.0 for h in holds[1:])
        store.held[(4, "me")] = Held(DIGEST, BODY, own=True)
        with store.sending_first_copy((4, "me")):  # a bound: the caller's, however long the send takes
            assert 0.1 <= await store.after_first_copies(0.1) < 1.0

    asyncio.run(scenario())


def test_a_first_copy_tells_its_watcher_when_it_begins_and_ends_and_holds_for_at_most_the_bound():
    """The fetcher's shares (node/exchange/pace.py) hear of each change, the hold's beginning
    included, and ask `first_copy_pending` with a bound: a copy sent for longer holds nothing."""

    async def scenario():
        store = PacketStore()
        changes = []
        store.on_first_copies_changed = lambda: changes.append(store.first_copy_pending(0.2))
        store.held[(3, "me")] = Held(DIGEST, BODY, own=True)
        with store.sending_first_copy((3, "me")):
            with store.sending_first_copy((3, "me")):  # a second stream: the hold keeps its start
                assert changes == [True, True]
            await asyncio.sleep(0.3)
            assert store.first_copy_pending() and not store.first_copy_pending(0.2)
            store.first_copy_out((3, "me"))
            assert changes == [True, True, True, False] and not store.first_copy_pending()
        assert changes == [True, True, True, False, False] and not store._sending_since

    asyncio.run(scenario())


def test_forget_before_keeps_the_named_publishers_packets_only():
    """A node forgets others' packets two rounds after applying them and its own only later
    (node/round/loop.py): `keep_publisher` spares that publisher's, a plain call drops them."""
    store = PacketStore()
    for key in [(1, "own"), (1, "other"), (2, "own"), (2, "other"), (3, "other")]:
        store.held[key] = Held(DIGEST, BODY)
    store.forget_before(3, keep_publisher="own")
    assert sorted(store.held) == [(1, "own"), (2, "own"), (3, "other")]
    store.forget_before(2)
    assert sorted(store.held) == [(2, "own"), (3, "other")]
