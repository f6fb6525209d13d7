"""The packets this node holds and serves: whole verified copies, copies still arriving,
parameter snapshots, traffic.

    store.held[(round, publisher)] = Held(digest, data, own=True)   # published here
    store.notify_copy()                                             # wakes requests waiting for it
    copy = await store.copy_for(round, publisher, digest, wait_s)   # what a request is served from
    with store.wanting(round, publisher, digest): ...               # while this node fetches it
    data = await store.receive((round, publisher), digest, length, reader, ...)  # a fetched or pushed body

A copy is either `Held` (whole, verified, served from memory) or `Partial` (arriving now, served
onward piece by piece as it arrives: cut-through). Both keep who confirmed a verified copy
(`sent_to`) and who is being sent one (`receiving`): a busy holder names those peers. A request
for a packet this node has no copy of yet may wait for one: this node's children in a packet's
tree ask at about the moment it learns of the packet itself (see `copy_for`). Rounds before the
ones still needed are forgotten with `forget_before`, with their traffic counts.

A parameter snapshot is held as a `HeldSnapshot` under the publisher id "params": not bytes, but
a source that reads each unit as it is served (node/training/snapshot.py), from the round-start
tensors or from a checkpoint file. The newest snapshot read from a checkpoint (`durable`) outlives
`forget_before`: it is this node's durable state, served until a newer checkpoint replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node.exchange.base import Traffic
from node.exchange.spool import Spool
from protocol.stream import DigestMismatch

if TYPE_CHECKING:
    from node.training.snapshot import Snapshot

WANT_GRACE_S = 1.0  # how long a request for a packet this node does not have waits for it to want it


@dataclass(slots=True)
class Held:
    digest: str
    data: bytes | memoryview  # `PacketStore.spool.keep`'s copy
    sent_to: list[str] = field(default_factory=list)  # libp2p ids of peers that confirmed all of it
    receiving: list[str] = field(default_factory=list)  # libp2p ids of peers being sent it now
    own: bool = False  # published by this node
    pushed: bool = False  # pushed here by its publisher (node/exchange/push.py)
    first_out: bool = False  # own: one whole copy of it has left this node (served or pushed)
    written_to: dict[str, int] = field(default_factory=dict)  # own, before first_out: bytes written to each peer


@dataclass(slots=True)
class HeldSnapshot:
    """A parameter snapshot served unit by unit from its source (never held whole)."""

    digest: str  # the snapshot digest (protocol/snapshot.py)
    source: Snapshot
    sent_to: list[str] = field(default_factory=list)
    receiving: list[str] = field(default_factory=list)
    own: bool = False


@dataclass(slots=True)
class Part:
    """Bytes [start, end) of a packet, received from `start` on (a stripe, or the whole packet)."""

    start: int
    end: int
    data: bytearray = field(default_factory=bytearray)  # grown as bytes arrive

    @property
    def received_to(self) -> int:
        return self.start + len(self.data)


@dataclass(slots=True)
class Partial:
    """A packet still arriving, served onward as it arrives (cut-through).

    It arrives as one part, or as stripes side by side (protocol/stream.py), each received from
    its start: `received_to(pos)` is how far the bytes from `pos` on arrived without a gap. The
    last byte of every range served onward is held back until the whole packet hashed to its
    digest, so a copy that fails here ends those streams short (the receivers try another holder)
    instead of handing them bad bytes that would get this honest peer banned.
    """

    digest: str
    length: int
    parts: list[Part] = field(default_factory=list)  # adjacent, in order, covering [0, length)
    sent_to: list[str] = field(default_factory=list)  # shared with the Held that replaces it
    receiving: list[str] = field(default_factory=list)
    verified: bool = False
    failed: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # replaced at every notify

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = [Part(0, self.length)]

    @property
    def num_received(self) -> int:
        return sum(len(part.data) for part in self.parts)

    def received_to(self, pos: int) -> int:
        """The end of the bytes from `pos` on that arrived without a gap."""
        for part in self.parts:
            if pos >= part.end:
                continue
            if part.received_to < part.end:
                return max(pos, part.received_to)
            pos = part.end
        return pos

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), which must have arrived."""
        return b"".join(
            part.data[max(start, part.start) - part.start : min(end, part.end) - part.start]
            for part in self.parts
            if part.start < end and start < part.end
        )

    def servable(self, start: int = 0, end: int | None = None) -> int:
        """How far the range [start, end) may go onward now (the whole packet by default)."""
        end = self.length if end is None else end
        upto = min(self.received_to(start), end)
        return upto if self.verified or upto < end else end - 1

    def notify(self) -> None:
        self.arrived.set()
        self.arrived = asyncio.Event()


class PacketStore:
    """This node's copies by (round, publisher), the packets it is fetching, and per-round traffic."""

    def __init__(self, spool: Spool | None = None):
        self.spool = spool or Spool(None)  # where whole packets' bytes are kept (node/exchange/spool.py)
        self.held: dict[tuple[int, str], Held | HeldSnapshot] = {}
        self.partial: dict[tuple[int, str], Partial] = {}  # packets arriving now, served as they arrive
        self._wanted: Counter[tuple[int, str, str]] = Counter()  # (round, publisher, digest) being fetched
        self._copy_added = asyncio.Event()  # replaced each time a copy (whole or arriving) is added
        # Own packets whose first copy is going out: how many streams send each, since when.
        self._sending_first: Counter[tuple[int, str]] = Counter()
        self._sending_since: dict[tuple[int, str], float] = {}
        self._first_copies_sent = asyncio.Event()  # replaced at each change of what is being sent
        self.on_first_copies_changed: Callable[[], None] | None = None  # the fetcher's `Shares.refresh`
        self._traffic: dict[int, Traffic] = {}

    def traffic(self, round: int) -> Traffic:
        return self._traffic.setdefault(round, Traffic())

    @contextlib.contextmanager
    def sending_first_copy(self, key: tuple[int, str]) -> Iterator[None]:
        """While a stream sends this node's own packet `key` (serve.py, or a push): until one whole
        copy of it left (`first_copy_out`), downloads that are not a packet's first copy hold back
        (`first_copy_pending`, `after_first_copies`)."""
        if not self._sending_first[key]:
            self._sending_since[key] = asyncio.get_running_loop().time()
        self._sending_first[key] += 1
        self._first_copies_changed()
        try:
            yield
        finally:
            self._sending_first[key] -= 1
            if not self._sending_first[key]:
                del self._sending_first[key], self._sending_since[key]
            self._first_copies_changed()

    def first_copy_out(self, key: tuple[int, str]) -> None:
        """One whole copy of this node's own packet `key` left it: downloads go on."""
        if isinstance(held := self.held.get(key), Held):
            held.first_out = True
        self._first_copies_changed()

    def _first_copies_changed(self) -> None:
        self._first_copies_sent.set()
        self._first_copies_sent = asyncio.Event()
        if self.on_first_copies_changed is not None:
            self.on_first_copies_changed()

    def first_copy_pending(self, for_at_most_s: float = math.inf) -> bool:
        """Whether this node sends its own packet's first copy now, begun less than
        `for_at_most_s` ago."""
        now = asyncio.get_running_loop().time() if for_at_most_s < math.inf else 0.0
        return any(
            isinstance(h := self.held.get(key), Held) and not h.first_out and now - since < for_at_most_s
            for key, since in self._sending_since.items()
        )

    async def after_first_copies(self, max_s: float) -> float:
        """Wait, at most `max_s`, while this node sends its own packet before one whole copy of it
        left; the seconds waited. Every peer waits for that copy, and a link whose download side
        is full delays the acknowledgements its upload needs (a home router's queue, or the
        lab's): a publisher fetching at full rate sent its first copy at a quarter of its uplink
        in the lab. A download that is itself a packet's first copy (from its publisher) must not
        call this: were that peer sending its own first copy here meanwhile, each copy would wait
        for the other's reads, and both for `max_s` (node/exchange/fetch.py)."""
        if not self.first_copy_pending():
            return 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        while self.first_copy_pending() and (left := started + max_s - loop.time()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._first_copies_sent.wait(), left)
        return loop.time() - started

    def notify_copy(self) -> None:
        """Wake the requests waiting in `copy_for`: a copy (whole or arriving) was added."""
        self._copy_added.set()
        self._copy_added = asyncio.Event()

    @contextlib.contextmanager
    def wanting(self, round: int, publisher: str, digest: str) -> Iterator[None]:
        """Marks the packet as being fetched here: a tree child asking for it waits for our copy."""
        key = (round, publisher, digest)
        self._wanted[key] += 1
        try:
            yield
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]

    async def copy_for(
        self, round: int, publisher: str, digest: str, wait_s: float
    ) -> Held | HeldSnapshot | Partial | None:
        """This node's copy of the packet, whole or arriving. If none yet, a tree child may have
        asked before our own copy started: waits up to `wait_s` for one while this node fetches
        the packet, and up to WANT_GRACE_S for it to start fetching (it learns of packets from
        the coordinator at about the moment its children do)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline, grace = now + wait_s, now + min(wait_s, WANT_GRACE_S)
        while True:
            for copy in (self.held.get((round, publisher)), self.partial.get((round, publisher))):
                if copy is not None and copy.digest == digest:
                    return copy
            # Not wanted here yet: wait only the grace for this node to start fetching it.
            until = deadline if (round, publisher, digest) in self._wanted else grace
            if loop.time() >= until:
                return None
            try:
                await asyncio.wait_for(self._copy_added.wait(), until - loop.time())
            except asyncio.TimeoutError:
                pass

    async def receive(
        self,
        key: tuple[int, str],
        digest: str,
        length: int,
        reader: asyncio.StreamReader,
        *,
        piece_bytes: int,
        read_timeout_s: Callable[[], float],
        source: str,
        pushed: bool = False,
        on_piece: Callable[[int], None] | None = None,
        before_piece: Callable[[], Awaitable[object]] | None = None,
        stripes: Sequence[tuple[int, int]] = (),
        open_stripe: Callable[[int], Awaitable[asyncio.StreamReader]] | None = None,
    ) -> bytes:
        """The `length` bytes of a packet body, verified against `digest` and held from then on;
        the fetcher's download and a push's body alike (fetch.py, push.py).

        The body comes from `reader`, or in `stripes` (their [start, end) bounds, adjacent and in
        order) side by side: `reader` carries the first, and `open_stripe(i)` gives the reader of
        stripe i. The sha256 runs over the bytes from the start as they arrive without a gap.
        Grown as bytes arrive, not allocated from the claimed length: a hostile sender announcing
        256 MB costs us only what it actually sends before it is dropped. Peers may be served from
        it while it grows (a `Partial`), unless another copy of the same packet already arriving
        offers that. Each read waits `read_timeout_s()`; `on_piece(bytes so far)` may raise to
        drop a sender (the fetcher's rate floor); `before_piece()` is awaited before each read (the
        fetcher's hold while this node sends its first copy). `source` names the sender in a
        DigestMismatch. The first stripe to fail ends the others."""
        partial = Partial(digest, length, [Part(start, end) for start, end in stripes])
        if key not in self.partial:
            self.partial[key] = partial
            self.notify_copy()
        hasher, hashed, traffic = hashlib.sha256(), 0, self.traffic(key[0])

        async def read_part(i: int, part: Part, stream: asyncio.StreamReader | None) -> None:
            nonlocal hashed
            if stream is None:
                stream = await open_stripe(i)
            while part.received_to < part.end:
                if before_piece is not None:
                    await before_piece()
                piece = await asyncio.wait_for(
                    stream.read(min(piece_bytes, part.end - part.received_to)), read_timeout_s()
                )
                if not piece:
                    raise asyncio.IncompleteReadError(b"", part.end - part.start)
                part.data += piece
                traffic.downloaded_bytes += len(piece)
                if (upto := partial.received_to(hashed)) > hashed:
                    hasher.update(partial.read(hashed, upto))
                    hashed = upto
                partial.notify()
                if on_piece is not None:
                    on_piece(partial.num_received)

        try:
            await all_or_first_error(
                [read_part(i, part, reader if i == 0 else None) for i, part in enumerate(partial.parts)]
            )
            if hasher.hexdigest() != digest:
                raise DigestMismatch(
                    f"bytes from {source} hash to {hasher.hexdigest()[:16]}..., wanted {digest[:16]}..."
                )
            whole = partial.parts[0].data if len(partial.parts) == 1 else partial.read(0, length)
            data = await asyncio.to_thread(self.spool.keep, whole)
            if (held := self.held.get(key)) is None or held.digest != digest:
                self.held[key] = Held(digest, data, partial.sent_to, partial.receiving, pushed=pushed)
            partial.verified = True
        except BaseException:
            partial.failed = True
            raise
        finally:
            partial.notify()
            if self.partial.get(key) is partial:
                del self.partial[key]
            if pushed:
                self.notify_copy()  # a fetch waiting in `pushed_copy`
        return data

    async def pushed_copy(self, round: int, publisher: str, digest: str) -> bytes:
        """The bytes of the packet once its publisher pushed it here and they verified (waits as
        long as the caller lets it: a fetch races its search against this)."""
        while True:
            held = self.held.get((round, publisher))
            if isinstance(held, Held) and held.pushed and held.digest == digest:
                return held.data
            await self._copy_added.wait()

    async def awaited_push(self, round: int, publisher: str, digest: str, grace_s: float) -> bytes | None:
        """The packet, verified, once a push of it here completes: waits while a copy of it
        arrives and, before one starts, up to `grace_s`; None when none started by then, or the
        one arriving failed (the caller then fetches it)."""
        loop = asyncio.get_running_loop()
        until, key, seen = loop.time() + grace_s, (round, publisher), None
        while True:
            held = self.held.get(key)
            if isinstance(held, Held) and held.digest == digest:
                return held.data
            arriving = self.partial.get(key)
            if (seen is not None and arriving is not seen) or (arriving is None and loop.time() >= until):
                return None  # the copy that arrived failed, or none started in time
            seen = arriving
            wakes = [asyncio.ensure_future(self._copy_added.wait())]
            if arriving is not None:
                wakes.append(asyncio.ensure_future(arriving.arrived.wait()))
            try:
                timeout = None if arriving is not None else until - loop.time()
                await asyncio.wait(wakes, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wake in wakes:
                    wake.cancel()

    def hold_snapshot(self, key: tuple[int, str], snapshot: HeldSnapshot) -> None:
        """Serve `snapshot` under `key` from now on, in place of any other there; a durable one
        replaces the previous durable one, which is closed."""
        replaced = self.held.get(key)
        self.held[key] = snapshot
        if snapshot.source.durable:
            durable = [k for k, c in self.held.items() if k != key and isinstance(c, HeldSnapshot) and c.source.durable]
            for k in durable:
                self.drop(k)
        if isinstance(replaced, HeldSnapshot) and replaced.source is not snapshot.source:
            replaced.source.close()
        self.notify_copy()

    def drop(self, key: tuple[int, str]) -> None:
        copy = self.held.pop(key, None)
        if isinstance(copy, HeldSnapshot):
            copy.source.close()

    def forget_before(self, round: int, keep_publisher: str | None = None) -> None:
        """Drop the copies of rounds before `round` (except the durable snapshot, and with
        `keep_publisher` that publisher's packets), and those rounds' traffic counts."""
        for key in [k for k, c in self.held.items() if k[0] < round and k[1] != keep_publisher]:
            copy = self.held[key]
            if not (isinstance(copy, HeldSnapshot) and copy.source.durable):
                self.drop(key)
        for r in [r for r in self._traffic if r < round and keep_publisher is None]:
            del self._traffic[r]

    def clear(self) -> None:
        for key in list(self.held):
            self.drop(key)


async def all_or_first_error(coros: list[Coroutine]) -> list:
    """Run `coros` side by side until all finished; their results, in order. The first to raise
    cancels the others, which are waited for, and its exception is raised."""
    if len(coros) <= 1:
        return [await c for c in coros]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
