"""An in-memory packet exchange: the `Exchange` protocol without a network, for unit tests.

    swarm = MemorySwarm()
    node = Node(config, client=client, exchange=swarm.exchange("a"))

Every `MemoryExchange` of one `MemorySwarm` sees what the others published, as if each fetch
found a holder at once. Bytes are checked against the wanted digest like the real exchange's;
`withhold(round, publisher)` makes a packet that nobody serves to others (their fetch waits out
its time-out and leaves it out; the publisher still has its own copy, and it stays announced, as
a peer that submits and never serves would leave it), so tests can drive the missing-packet
reports, amended manifests and the round loop's catch-up. A packet every holder forgot
(`forget_before`) is announced by nobody: a replay sees it gone without fetching.

The packet mirror is `MemorySwarm.mirrored`, bytes by URL: a fetch given `mirrors` takes a packet
no peer serves from there, with the real fetcher's checks (the manifest's size, the digest).

Snapshots are kept as each holder's `Snapshot` source (no bytes copied) and moved unit by unit
into the fetcher's `SnapshotSink`, with the same checks as over the network: a source whose
tensors moved on (StaleSnapshot) or bytes that do not verify send the fetch on to the next holder,
from the sink's offset.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from node.exchange.base import MirrorCopy, Reachability, Traffic
from node.exchange.config import ExchangeConfig
from protocol.dht_records import PARAMS_ID, Announcement
from protocol.errors import ProtocolError

if TYPE_CHECKING:
    from node.training.snapshot import Snapshot, SnapshotSink

# A suspect's packet is given up once its stall time-out passed with no copy arriving (node/exchange/fetch.py).
SUSPECT_GIVEN_UP_S = next(f.default for f in fields(ExchangeConfig) if f.name == "stall_timeout_s")


@dataclass(slots=True)
class MemorySwarm:
    """What every exchange of the swarm holds: packets and snapshots by (round, publisher)."""

    packets: dict[tuple[int, str], dict[str, tuple[bytes, set[str]]]] = field(default_factory=dict)
    withheld: set[tuple[int, str]] = field(default_factory=set)
    accepting: set[str] = field(default_factory=set)  # holders that take pushed packets
    unannounced: set[tuple[int, str]] = field(default_factory=set)  # published, not announced yet
    snapshots: dict[int, dict[str, Snapshot]] = field(default_factory=dict)  # round -> holder -> its snapshot
    mirrored: dict[str, bytes] = field(default_factory=dict)  # the packet mirror: bytes by URL

    def exchange(self, holder: str) -> "MemoryExchange":
        return MemoryExchange(self, holder)

    def withhold(self, round: int, publisher: str) -> None:
        """Nobody serves `publisher`'s packet of `round` to another holder (it submits the digest
        and never serves the bytes)."""
        self.withheld.add((round, publisher))

    def _store(self, round: int, publisher: str, data: bytes, holder: str) -> Announcement:
        digest = hashlib.sha256(data).hexdigest()
        copies = self.packets.setdefault((round, publisher), {})
        copies.setdefault(digest, (data, set()))[1].add(holder)
        return Announcement(
            peer_id=publisher,
            round=round,
            digest=digest,
            size_bytes=len(data),
            multiaddrs=[f"/memory/{holder}"],
            holder=holder,
        )

    def _holders(self, round: int, publisher: str) -> list[Announcement]:
        if publisher == PARAMS_ID:
            return [
                Announcement(
                    peer_id=PARAMS_ID,
                    round=round,
                    digest=snap.digest,
                    size_bytes=snap.size_bytes,
                    multiaddrs=[f"/memory/{h}"],
                    holder=h,
                )
                for h, snap in sorted(self.snapshots.get(round, {}).items())
            ]
        return [
            Announcement(
                peer_id=publisher,
                round=round,
                digest=digest,
                size_bytes=len(data),
                multiaddrs=[f"/memory/{h}"],
                holder=h,
            )
            for digest, (data, holders) in self.packets.get((round, publisher), {}).items()
            for h in sorted(holders)
        ]


class MemoryExchange:
    def __init__(self, swarm: MemorySwarm, holder: str):
        self.swarm, self.holder = swarm, holder
        self._traffic: dict[int, Traffic] = {}
        self.dial_requests: list[list[list[str]]] = []  # each `dial_peers` call's targets
        self.members: Collection[str] | None = None  # as `set_members` last named them
        self.suspected: dict[int, set[str]] = {}  # round -> the suspects its fetches were told of

    @property
    def visible_maddrs(self) -> list[str]:
        return [f"/memory/{self.holder}"]

    def traffic(self, round: int) -> Traffic:
        return self._traffic.setdefault(round, Traffic())

    async def publish(self, round: int, peer_id: str, data: bytes, announce: bool = True) -> Announcement:
        if not announce:
            self.swarm.unannounced.add((round, peer_id))
        return self.swarm._store(round, peer_id, data, self.holder)

    async def announce(self, round: int, peer_id: str) -> None:
        if not any(self.holder in h for _, h in self.swarm.packets.get((round, peer_id), {}).values()):
            raise KeyError(f"no packet of {peer_id} for round {round} published here")
        self.swarm.unannounced.discard((round, peer_id))

    async def announcements(self, round: int) -> dict[str, Announcement]:
        return {
            publisher: holders[0]
            for (r, publisher) in self.swarm.packets
            if r == round
            and publisher != PARAMS_ID
            and (r, publisher) not in self.swarm.unannounced
            and (holders := self.swarm._holders(r, publisher))
        }

    async def holders(self, round: int, publisher: str) -> list[Announcement]:
        return self.swarm._holders(round, publisher)

    async def fetch(
        self,
        round: int,
        wanted: dict[str, str],
        holders_hint: dict[str, list[str]] | None = None,
        timeout_s: float = 60,
        parents: dict[str, list[str]] | None = None,
        mirrors: dict[str, MirrorCopy] | None = None,
        pushed_here: Collection[str] = (),
        suspects: Collection[str] = (),
    ) -> dict[str, bytes]:
        got, start = {}, time.monotonic()
        self.suspected.setdefault(round, set()).update(suspects)
        for publisher, digest in wanted.items():
            copy = self.swarm.packets.get((round, publisher), {}).get(digest)
            served = copy is not None and bool(copy[1])
            if served and (round, publisher) in self.swarm.withheld and self.holder not in copy[1]:
                served = False
            if not served:
                mirror = (mirrors or {}).get(publisher)
                data = self.swarm.mirrored.get(mirror.url) if mirror is not None else None
                if data is None or len(data) != mirror.size_bytes or hashlib.sha256(data).hexdigest() != digest:
                    continue
                self.swarm._store(round, publisher, data, self.holder)  # kept and served on, as a peer's copy
                copy = self.swarm.packets[(round, publisher)][digest]
            data, holders = copy
            holders.add(self.holder)  # a verified copy, served on
            traffic = self.traffic(round)
            traffic.downloaded_bytes += len(data)
            traffic.num_fetched += 1
            got[publisher] = data
        if set(wanted) - set(got) - set(suspects):  # what nobody serves costs the whole time-out, as on a network
            await asyncio.sleep(timeout_s)
        elif len(got) < len(wanted):  # a suspect's costs a stall time-out (ExchangeConfig's default)
            await asyncio.sleep(min(timeout_s, SUSPECT_GIVEN_UP_S))
        await asyncio.sleep(0)
        self.traffic(round).fetch_spans.append((start, time.monotonic()))
        return got

    async def push(self, round: int, publisher: str, targets: list[list[str]], timeout_s: float = 30.0) -> str | None:
        """The first target ("/memory/<holder>") holds a copy, served as a fetched one would be."""
        copies = self.swarm.packets.get((round, publisher), {})
        own = [digest for digest, (_, holders) in copies.items() if self.holder in holders]
        if not own:
            raise KeyError(f"no packet of {publisher} for round {round} published here")
        for maddrs in targets:
            for maddr in maddrs:
                holder = maddr.removeprefix("/memory/")
                if holder != self.holder and holder in self.swarm.accepting:
                    copies[own[0]][1].add(holder)
                    self.traffic(round).uploaded_bytes += len(copies[own[0]][0])
                    return holder
        return None

    def accept_pushes(self, accept) -> None:
        (self.swarm.accepting.add if accept is not None else self.swarm.accepting.discard)(self.holder)

    def set_members(self, holder_ids: Collection[str] | None) -> None:
        self.members = holder_ids  # in memory there are no streams to serve as children

    async def publish_params(self, round: int, snapshot: Snapshot) -> Announcement:
        self.swarm.snapshots.setdefault(round, {})[self.holder] = snapshot
        return Announcement(
            peer_id=PARAMS_ID,
            round=round,
            digest=snapshot.digest,
            size_bytes=snapshot.size_bytes,
            multiaddrs=self.visible_maddrs,
            holder=self.holder,
        )

    async def params_holders(self, round: int) -> list[Announcement]:
        return self.swarm._holders(round, PARAMS_ID)

    async def fetch_params(self, round: int, digest: str, sink: SnapshotSink, timeout_s: float = 120.0) -> bool:
        from node.training.snapshot import StaleSnapshot

        sink.expect(digest)
        for holder, snapshot in sorted(self.swarm.snapshots.get(round, {}).items()):
            if snapshot.digest != digest or holder == self.holder:
                continue
            try:
                await asyncio.to_thread(_copy_units, snapshot, sink, self.traffic(round))
            except (StaleSnapshot, ProtocolError):
                continue
            self.traffic(round).num_fetched += 1
            return True
        return sink.done

    async def forget_before(self, round: int, keep_publisher: str | None = None) -> None:
        for (r, publisher), copies in self.swarm.packets.items():
            if r < round and publisher != keep_publisher:
                for _, holders in copies.values():
                    holders.discard(self.holder)
        for r, by_holder in self.swarm.snapshots.items():
            if r < round and keep_publisher is None:
                by_holder.pop(self.holder, None)

    async def dial_peers(self, targets: list[list[str]]) -> list[str]:
        """In memory every exchange reaches every other: nothing to dial; the lists are kept."""
        self.dial_requests.append(targets)
        return []

    async def reachability_check(self) -> Reachability:
        return Reachability(
            maddrs=self.visible_maddrs,
            public_maddrs=[],
            relayed=False,
            loopback_only=True,
            reachable=True,
            advice="in memory: every exchange of its swarm reaches it",
        )

    async def shutdown(self) -> None:
        await self.forget_before(2**62)


def _copy_units(snapshot: Snapshot, sink: SnapshotSink, traffic: Traffic) -> None:
    """Move a snapshot into a sink unit by unit, from the sink's offset (what a stream would carry)."""
    while not sink.done:
        unit = sink.next_unit()
        start, data = snapshot.read_unit(unit.start)
        sink.accept(data[unit.start - start :])
        traffic.downloaded_bytes += unit.end - unit.start
