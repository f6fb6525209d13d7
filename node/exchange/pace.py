"""Packet bytes at a rate: a node's downloads together under nine tenths of its stated downlink.

    shares = Shares(downlink_bytes_per_s * PACED_SHARE)
    request = dataclasses.replace(request, rate=shares.next_share())   # asked for at its share
    shares.join(writer, request.rate)   # once its bytes come: every stream receiving is told its new share
    shares.leave(*writers)              # once a download's streams stopped: told once, not per stream
    pacer = Pacer(request.rate)              # the holder's side (serve.py): before each piece,
    await pacer.wait(); pacer.spent(len(piece))

The holder sends each stream at the rate its fetcher asked for (protocol/stream.py, "Rates"), so
the fetcher's link never carries more than its shares: its download queue stays empty, and the
requests for its own packet and the acknowledgements of its uploads cross it at once. A fetcher
that paces its reads instead (`Pacer` on the fetcher's side, kept for holders that ignore rates)
slows the sender only once p2pd's and the kernel's buffers for the stream are full, hundreds of
kB later: longer than a few-MB packet's transfer.

Shares are even between the streams receiving now. A holder slower than its share leaves part of
the link unused until a stream starts or ends; the packet trees give a slow fetcher fast parents
(node/exchange/topology.py), so that is the exception.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from protocol.stream import MAX_RATE, MIN_RATE, encode_rate

PACED_SHARE = 0.9  # of a stated downlink, what packet downloads may take together
PACED_PIECE_BYTES = 64 << 10  # reads of a paced download
PACED_WRITE_BYTES = 16 << 10  # a holder's writes to a paced stream: a small burst at the fetcher's queue


class Pacer:
    """Bytes at `rate` per second at most, over bursts of `burst_s`: each piece's bytes are owed
    (`spent`), and the next piece waits until they are paid (`wait`). `rate` may change at any
    time; what is owed is paid at the rate in force when it was spent."""

    def __init__(self, rate: float, burst_s: float = 0.05, clock: Callable[[], float] | None = None):
        self.rate, self.burst_s = rate, burst_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._paid_until = -math.inf  # when what was sent or read so far is paid for

    def spent(self, num_bytes: int) -> None:
        self._paid_until = max(self._paid_until, self._clock() - self.burst_s) + num_bytes / self.rate

    async def wait(self) -> float:
        """Wait until what was spent is paid for; the seconds waited."""
        delay = self._paid_until - self._clock()
        if delay <= 0:
            return 0.0
        await asyncio.sleep(delay)
        return delay


class Shares:
    """A downlink's paced rate (bytes/s) split evenly between the streams receiving now; each is
    told its share in a rate frame whenever the split changes."""

    def __init__(self, rate: float):
        self.rate = rate
        self._told: dict[asyncio.StreamWriter, int] = {}  # stream -> the share it was last told

    def next_share(self) -> int:
        """The share of a stream that starts now (asked for in its request)."""
        return self._share(len(self._told) + 1)

    def join(self, writer: asyncio.StreamWriter, told: int) -> None:
        """`writer`'s stream receives from now on, asked for at `told` bytes/s."""
        self._told[writer] = told
        self._tell()

    def leave(self, *writers: asyncio.StreamWriter) -> None:
        """These streams receive no more (a download's, together): the others are told their new
        share once, not once per stream that left."""
        if [w for w in writers if self._told.pop(w, None) is not None]:
            self._tell()

    def _share(self, num_streams: int) -> int:
        return int(min(MAX_RATE, max(MIN_RATE, self.rate / num_streams)))

    def _tell(self) -> None:
        share = self._share(max(1, len(self._told)))
        for writer, told in self._told.items():
            if told != share and not writer.is_closing():
                writer.write(encode_rate(share))  # five bytes: no drain, the stream's buffer takes them
                self._told[writer] = share
