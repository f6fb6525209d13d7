"""Packet bytes at a rate: a node's downloads, and its uploads, each under nine tenths of its stated link.

    shares = Shares(paced_rate(downlink_mbps))
    download = object()                       # one download's key, over all its streams
    request = dataclasses.replace(request, rate=shares.next_share(download))  # asked for at its share
    shares.join(download, writer, request.rate)  # once its bytes come: every stream told its new share
    shares.received(download, num_bytes)      # after each piece: the split follows the rates measured
    shares.leave(download)                    # once its streams stopped: the others told once
    pacer = Pacer(request.rate)               # the holder's side (serve.py): before each piece,
    await pacer.wait(); pacer.spent(len(piece))

The holder sends each stream at the rate its fetcher asked for (protocol/stream.py, "Rates"), so
the fetcher's link never carries more than its shares: its download queue stays empty, and the
requests for its own packet and the acknowledgements of its uploads cross it at once. A fetcher
that paces its reads instead (`Pacer` on the fetcher's side, kept for holders that ignore rates)
slows the sender only once p2pd's and the kernel's buffers for the stream are full, hundreds of
kB later: longer than a few-MB packet's transfer.

Shares are max-min fair between the downloads receiving now. A fast fetcher's downloads come from
holders of every speed: a slow publisher's first copy, a parent forwarding a copy while it
arrives, a fast peer's own packet. An even split would leave a slow holder's unused part of the
link idle; `Shares` measures each download and gives what a slow one leaves to the others. (In
the network lab this did not move the transfer figure beyond the runs' spread: there the fast
peers' packets are bound by their forwarders' uplinks, tools/netlab/README.md.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

from node.exchange.base import Traffic
from protocol.stream import MAX_RATE, MIN_RATE, encode_rate

PACED_SHARE = 0.9  # of a stated downlink, what packet downloads may take together
PACED_PIECE_BYTES = 64 << 10  # reads of a paced download
PACED_WRITE_BYTES = 16 << 10  # a holder's writes to a paced stream: a small burst at the fetcher's queue
PACED_UPLINK_MBPS = 20.0  # a stated uplink under this is paced (`Uplink`); a faster one is not


def paced_rate(link_mbps: float) -> float:
    """What paced packet bytes may take of a stated link (Mbps), in bytes/s: PACED_SHARE of it."""
    return link_mbps * 1e6 / 8 * PACED_SHARE


class Pacer:
    """Bytes at `rate` per second at most, over bursts of `burst_s`: each piece's bytes are owed
    (`spent`), and the next piece waits until they are paid (`wait`). The rate may change at any
    time (`set_rate`): what is still owed is paid at the new one, so a stream held at the floor
    rate goes on at once when its share comes back, not a floor-priced piece later."""

    def __init__(self, rate: float, burst_s: float = 0.05, clock: Callable[[], float] | None = None):
        self.rate, self.burst_s = rate, burst_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._paid_until = -math.inf  # when what was sent or read so far is paid for
        self._repriced: asyncio.Event | None = None  # set when the rate changes under a waiting piece

    def spent(self, num_bytes: int) -> None:
        self._paid_until = max(self._paid_until, self._clock() - self.burst_s) + num_bytes / self.rate

    def set_rate(self, rate: float) -> None:
        """Pace at `rate` from now on, what is still owed included."""
        now = self._clock()
        if self._paid_until > now:
            self._paid_until = now + (self._paid_until - now) * self.rate / rate
        self.rate = rate
        if self._repriced is not None:
            self._repriced.set()

    async def wait(self) -> float:
        """Wait until what was spent is paid for; the seconds waited."""
        waited = 0.0
        while (delay := self._paid_until - self._clock()) > 0:
            self._repriced = repriced = asyncio.Event()
            started = self._clock()
            try:
                await asyncio.wait_for(repriced.wait(), delay)
            except asyncio.TimeoutError:
                return waited + delay
            finally:
                self._repriced = None
            waited += self._clock() - started
        return waited


class Uplink:
    """A node's uploads together at `rate` bytes/s (PACED_SHARE of its stated uplink): each piece a
    served, forwarded or pushed stream writes takes its turn here first, oldest first, so the link's
    own queue stays short. Unpaced, a slow node's upload filled its queue (100 ms deep in the
    network lab) and every request and acknowledgement of its downloads waited behind it: a
    10 Mbps host's download stalled for 0.6 s while it sent its packet (tools/netlab/README.md).

        uplink = Uplink.stated(uplink_mbps)   # None for a fast or unstated uplink: not paced
        await uplink.take(len(piece)); writer.write(piece)
    """

    def __init__(self, rate: float, clock: Callable[[], float] | None = None):
        self._pacer = Pacer(rate, clock=clock)
        self._turn = asyncio.Lock()

    @classmethod
    def stated(cls, uplink_mbps: float | None) -> "Uplink | None":
        """The pacer for a stated uplink under PACED_UPLINK_MBPS; None (not paced) for a faster one
        or none stated: at 100 Mbps a piece's turn is 1.5 ms, finer than a busy event loop keeps."""
        return cls(paced_rate(uplink_mbps)) if uplink_mbps and uplink_mbps < PACED_UPLINK_MBPS else None

    async def take(self, num_bytes: int) -> None:
        """Wait for this piece's turn on the link; its bytes are owed from now."""
        async with self._turn:
            await self._pacer.wait()
            self._pacer.spent(num_bytes)


async def write_pieces(
    writer: asyncio.StreamWriter,
    payload: memoryview,
    traffic: Traffic,
    *,
    chunk_bytes: int,
    stall_timeout_s: float,
    pacer: Pacer | None = None,
    uplink: Uplink | None = None,
) -> None:
    """`payload` to a stream (served, forwarded or pushed), in pieces of `chunk_bytes`, or paced ones
    of PACED_WRITE_BYTES: at the fetcher's rate (`pacer`) and in turn on the stated uplink (`uplink`).
    Each piece counts in `traffic` once it drained."""
    step = chunk_bytes if pacer is None and uplink is None else PACED_WRITE_BYTES
    for offset in range(0, len(payload), step):
        piece = payload[offset : offset + step]
        if pacer is not None:
            await pacer.wait()
        if uplink is not None:
            await uplink.take(len(piece))
        writer.write(piece)
        await asyncio.wait_for(writer.drain(), stall_timeout_s)
        if pacer is not None:
            pacer.spent(len(piece))
        traffic.uploaded_bytes += len(piece)


class Shares:
    """A downlink's paced rate (bytes/s) split max-min fairly between the downloads receiving now,
    and each download's share evenly between its streams; a stream is told its share in a rate
    frame whenever it changes by more than `TELL_CHANGE`.

    While this node sends its own packet's first copy (`held`: the packet store's
    `first_copy_pending`), the downloads but those of a packet's first copy from its publisher
    (`holdable` False) are held: together they take at most HELD_FRACTION of the rate, less what
    the first copies take, so that the link's download queue stays short for the upload's
    acknowledgements within a round trip; `refresh` tells the streams when the hold begins or ends.
    Pausing the reads alone does not quiet the link: a holder goes on sending until the stream's
    window is full, 256 KiB or 0.2 s of a 10 Mbps link per stream. A first copy is never held: two
    publishers sending each other theirs would each wait for the other.

    A download whose holder sends under `BOUND_FRACTION` of its share over a whole `window_s`
    (a slow publisher, or a parent still receiving the copy it forwards) is bound by its holder:
    the others split what it leaves unused, and it is told twice what it measured (at most an even
    share), so a holder that speeds up grows into its share within a few windows. A bound
    download that speeds up past its measure costs the link at most that measure for one window,
    until the next split. Downloads not yet measured count as unbound."""

    def __init__(self, rate: float, window_s: float = 0.25, clock: Callable[[], float] | None = None):
        self.rate, self.window_s = rate, window_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._downloads: dict[object, _Download] = {}
        self.held: Callable[[], bool] = lambda: False  # are the holdable downloads held now?

    def next_share(self, download: object, holdable: bool = True) -> int:
        """The share a stream of `download` that starts now asks for (`holdable`: see the class)."""
        known = self._downloads.get(download)
        share = self._split({download: known or _Download(self._clock(), holdable)})[download]
        return _per_stream(share, len(known.told) + 1 if known else 1)

    def join(self, download: object, writer: asyncio.StreamWriter, told: int, holdable: bool = True) -> None:
        """`writer`, a stream of `download`, receives from now on, asked for at `told` bytes/s."""
        self._downloads.setdefault(download, _Download(self._clock(), holdable)).told[writer] = told
        self._tell()

    def refresh(self) -> None:
        """What `held` says changed: every stream is told its share again where it changed."""
        self._tell()

    def received(self, download: object, num_bytes: int) -> None:
        """`download` has `num_bytes` in all so far. Once its window is whole, its rate is measured
        and the split made again; so are those of the others that read nothing for two windows
        (stalled: a download is measured at its own reads, where its count is exact)."""
        if (known := self._downloads.get(download)) is None:
            return
        known.num_bytes = num_bytes
        now = self._clock()
        stalled = [d for d in self._downloads.values() if now - d.window_start >= 2 * self.window_s]
        if now - known.window_start >= self.window_s or stalled:
            for d in (known, *stalled):  # measuring twice at one `now` does nothing the second time
                d.measure(now, self.window_s)
            self._tell()

    def leave(self, download: object) -> None:
        """`download`'s streams receive no more: the others are told their new shares once."""
        if self._downloads.pop(download, None) is not None:
            self._tell()

    def _split(self, extra: dict[object, _Download] | None = None) -> dict[object, float]:
        """Each download's share, bytes/s (with `extra`, a download about to start, counted)."""
        downloads = {**self._downloads, **(extra or {})}
        if not self.held():
            return self._water_fill(downloads, self.rate)
        held = {k: d for k, d in downloads.items() if d.holdable}
        shares = self._water_fill({k: d for k, d in downloads.items() if k not in held}, self.rate)
        room = max(0.0, self.rate * HELD_FRACTION - sum(shares.values()))  # 0: each told the floor
        return shares | self._water_fill(held, room)

    def _water_fill(self, downloads: dict[object, _Download], rate: float) -> dict[object, float]:
        if not downloads:
            return {}
        # Water-filling: the downloads bound under what an even split of the rest would give them
        # keep what they measured; the others share what is left evenly.
        bound = sorted((k for k, d in downloads.items() if d.bound), key=lambda k: downloads[k].measured)
        left, free = rate, len(downloads)
        held: dict[object, float] = {}
        for key in bound:
            if (measured := downloads[key].measured) >= left / free:
                break
            held[key] = measured
            left, free = left - measured, free - 1
        if not free:  # all held by their holders: nobody to leave the rest to
            return {k: rate / len(downloads) for k in downloads}
        return {k: min(2 * held[k], rate / len(downloads)) if k in held else left / free for k in downloads}

    def _tell(self) -> None:
        for key, share in self._split().items():
            download = self._downloads[key]
            per_stream = _per_stream(share, len(download.told))
            for writer, told in download.told.items():
                if abs(per_stream - told) > told * TELL_CHANGE and not writer.is_closing():
                    writer.write(encode_rate(per_stream))  # five bytes: no drain, the stream's buffer takes them
                    download.told[writer] = per_stream
            download.told_in_window = min(download.told_in_window, sum(download.told.values()))


HELD_FRACTION = 0.5  # of the paced rate, what held downloads take together while a first copy goes
TELL_CHANGE = 1 / 16  # a stream is told a new share that differs from its last by more than this
BOUND_FRACTION = 0.8  # a download measured under this part of its share is bound by its holder


@dataclasses.dataclass
class _Download:
    """One download's streams (each with the share it was last told), and its rate measured over
    the last whole window (None: not yet measured)."""

    window_start: float
    holdable: bool = True  # False: a packet's first copy, from its publisher
    told: dict[asyncio.StreamWriter, int] = dataclasses.field(default_factory=dict)
    num_bytes: int = 0
    window_bytes: int = 0  # `num_bytes` at the window's start
    told_in_window: float = math.inf  # the least share its streams held together in this window
    measured: float | None = None  # over the last whole window
    measured_against: float = math.inf  # the least share held in that window

    @property
    def bound(self) -> bool:
        """Measured under BOUND_FRACTION of the least share it held while measured."""
        return self.measured is not None and self.measured < BOUND_FRACTION * self.measured_against

    def measure(self, now: float, window_s: float) -> None:
        """Close the window if it is whole: its rate, and the share it was measured against."""
        if now - self.window_start < window_s:
            return
        self.measured = (self.num_bytes - self.window_bytes) / (now - self.window_start)
        self.measured_against = min(self.told_in_window, sum(self.told.values()))
        self.window_start, self.window_bytes = now, self.num_bytes
        self.told_in_window = sum(self.told.values())


def _per_stream(share: float, num_streams: int) -> int:
    return int(min(MAX_RATE, max(MIN_RATE, share / max(1, num_streams))))
