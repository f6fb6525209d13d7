"""A packet arriving in stripes (PacketStore.receive with `stripes`): bytes land in their own
stripe whatever order they come in, the digest runs over the gap-free prefix, a range goes onward
as it arrives without its last byte until the copy verified, and one failing stripe ends all."""

import asyncio
import hashlib

import pytest

from node.exchange.store import PacketStore, Part, Partial
from protocol.stream import DigestMismatch

pytestmark = pytest.mark.timeout(20)

BODY = bytes(range(256)) * 48  # 12 KiB
DIGEST = hashlib.sha256(BODY).hexdigest()
BOUNDS = [(0, 4096), (4096, 8192), (8192, len(BODY))]
KEY = (3, "pub")


def test_a_partial_in_parts_reads_and_serves_only_what_arrived_without_a_gap():
    partial = Partial(DIGEST, 100, [Part(0, 40), Part(40, 70), Part(70, 100)])
    partial.parts[1].data += BODY[40:70]  # the middle stripe whole, the first not begun
    partial.parts[2].data += BODY[70:80]
    assert partial.received_to(0) == 0 and partial.received_to(40) == 80 and partial.received_to(75) == 80
    assert partial.read(50, 75) == BODY[50:75]
    assert partial.servable(40, 70) == 69  # the range is all there: its last byte waits for the digest
    assert partial.servable(40, 100) == 80 and partial.servable(0, 40) == 0
    partial.parts[0].data += BODY[:40]
    assert partial.received_to(0) == 80 and partial.servable() == 80
    partial.parts[2].data += BODY[80:100]
    assert partial.servable() == 99  # the whole packet, less its last byte
    partial.verified = True
    assert partial.servable() == 100 and partial.servable(40, 70) == 70
    assert Partial(DIGEST, 10).parts == [Part(0, 10)]  # one part unless told otherwise


def _readers() -> list[asyncio.StreamReader]:
    return [asyncio.StreamReader() for _ in BOUNDS]


async def _receive(store: PacketStore, readers: list[asyncio.StreamReader], digest: str = DIGEST) -> bytes:
    async def open_stripe(i: int) -> asyncio.StreamReader:
        return readers[i]

    return await store.receive(
        KEY,
        digest,
        len(BODY),
        readers[0],
        piece_bytes=1024,
        read_timeout_s=lambda: 5.0,
        source="holder",
        stripes=BOUNDS,
        open_stripe=open_stripe,
    )


def test_stripes_arriving_out_of_order_are_held_whole_and_served_onward_as_they_come():
    async def scenario():
        store = PacketStore()
        readers = _readers()
        receiving = asyncio.create_task(_receive(store, readers))
        for i in (2, 1):  # the last stripes first
            readers[i].feed_data(BODY[BOUNDS[i][0] : BOUNDS[i][1]])
            readers[i].feed_eof()
        while KEY not in store.partial:
            await asyncio.sleep(0.01)
        partial = store.partial[KEY]
        while partial.num_received < len(BODY) - 4096:
            await asyncio.sleep(0.01)
        assert partial.servable(4096, len(BODY)) == len(BODY) - 1 and partial.servable() == 0
        readers[0].feed_data(BODY[:4096])
        assert await receiving == BODY
        assert store.held[KEY].data == BODY and partial.verified and KEY not in store.partial
        assert store.traffic(3).downloaded_bytes == len(BODY)

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["short", "corrupt"])
def test_one_stripe_failing_fails_the_copy_and_ends_the_others(fault):
    async def scenario():
        store = PacketStore()
        readers = _readers()
        readers[0].feed_data(BODY[:4096])
        if fault == "short":
            readers[1].feed_data(BODY[4096:5000])
            readers[1].feed_eof()
        else:
            bad = bytearray(BODY[4096:8192])
            bad[7] ^= 1
            readers[1].feed_data(bytes(bad))
            readers[2].feed_data(BODY[8192:])
        error = asyncio.IncompleteReadError if fault == "short" else DigestMismatch
        with pytest.raises(error):
            await _receive(store, readers)  # stripe 2 never ends when stripe 1 is cut: cancelled
        assert KEY not in store.held and KEY not in store.partial

    asyncio.run(scenario())
