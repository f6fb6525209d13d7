"""DHT announcements of the packets this node holds, and lookups of who holds what.

    announcer = Announcer(dht, config, holder_id, maddrs, spawn)
    await announcer.announce_packet(key, announcer.record(digest, size), peer_id, round)
    announcer.announce_holder(round, publisher, digest, size)      # batched with others verified now
    announced, extra = await announcer.lookup(keys, round, deadline)  # one get_many for a fetch

Records follow the schema in protocol/dht_records.py (packets key per round, holders key per
publisher), written with `DHTNode.store(key, value, expiration, subkey=...)` and read with
`latest=True` (`sufficient_expiration_time=inf`), so that the subkeys held by every node near the
key are merged; a plain get stops at the first non-expired copy, which may be this node's own
partial dictionary. A fetch reads the packets key and every wanted publisher's holders key in one
batched `get_many`, and copies verified together are announced in one `store_many`: on a busy
host each DHT traversal costs tens of milliseconds of every node's CPU. Records read are hostile:
one that does not parse is logged and skipped, costing its writer, not the round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from node.exchange.config import ExchangeConfig
from protocol.dht_records import PARAMS_ID, Announcement, holders_key, make_record, packets_key, parse_record
from protocol.errors import ProtocolError

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task]  # runs a coroutine in the background


class AnnounceFailed(RuntimeError):
    """No DHT node accepted this node's announcement."""


class Announcer:
    """Writes this node's records and reads others', for one run."""

    def __init__(self, dht: DHTNode, config: ExchangeConfig, holder_id: str, maddrs: list[str], spawn: Spawn):
        self.config = config
        self.holder_id = holder_id  # this node's libp2p id: its subkey in holders records
        self.maddrs = maddrs  # the addresses records name (refreshed by a reachability check)
        self._dht, self._spawn = dht, spawn
        self._pending_holders: list[tuple[str, dict]] = []  # holders records not yet stored
        self._flusher: asyncio.Task | None = None

    def record(self, digest: str, size_bytes: int) -> dict:
        """The DHT value for this node's copy of a packet."""
        return make_record(digest, size_bytes, self.maddrs, self.holder_id)

    def announcement(self, peer_id: str, round: int, digest: str, size_bytes: int) -> Announcement:
        """What `record` says, as a reader would parse it."""
        return Announcement(peer_id, round, digest, size_bytes, list(self.maddrs), self.holder_id)

    # -- writing ----------------------------------------------------------------------------------

    async def announce_packet(self, key: str, record: dict, peer_id: str, round: int) -> None:
        """Store a publisher's record under the round's packets key; a failure is only logged."""
        try:
            stored = await self._dht.store(key, record, get_dht_time() + self.config.announce_ttl_s, subkey=peer_id)
        except Exception as e:  # the packet is still held and served; only DHT readers miss it
            stored = False
            log.debug("announcing %s's packet failed: %r", peer_id, e)
        if not stored:
            log.warning(
                "round %d: no DHT node stored the announcement of %s's packet; peers reach it through "
                "the coordinator's manifest",
                round,
                peer_id,
            )

    async def announce_params(self, round: int, record: dict) -> None:
        """Store this node's parameter-snapshot record; raises AnnounceFailed if no node took it."""
        key = holders_key(self.config.run_id, round, PARAMS_ID)
        if not await self._dht.store(key, record, get_dht_time() + self.config.announce_ttl_s, subkey=self.holder_id):
            raise AnnounceFailed(f"no DHT node stored the parameter snapshot for round {round}")

    def announce_holder(self, round: int, publisher: str, digest: str, size_bytes: int) -> None:
        """Queue a holders record; packets verified together are announced in one DHT store."""
        key = holders_key(self.config.run_id, round, publisher)
        self._pending_holders.append((key, self.record(digest, size_bytes)))
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush_holders())

    async def _flush_holders(self) -> None:
        while self._pending_holders:
            # A short pause batches the packets that finish together: one DHT traversal, not one each.
            await asyncio.sleep(self.config.holder_batch_s)
            batch, self._pending_holders = self._pending_holders, []
            keys, records = [k for k, _ in batch], [r for _, r in batch]
            try:
                await self._dht.store_many(
                    keys, records, get_dht_time() + self.config.announce_ttl_s, subkeys=[self.holder_id] * len(batch)
                )
            except Exception as e:  # swarming is an optimisation: a failed announcement costs only load spread
                log.info("announcing %d held packets failed: %r", len(batch), e)

    # -- reading ----------------------------------------------------------------------------------

    async def announcements(self, round: int) -> dict[str, Announcement]:
        """The publishers' records for `round`, by publisher peer id."""
        return {a.peer_id: a for a in await self._read(packets_key(self.config.run_id, round), round, None)}

    async def holders(self, round: int, publisher: str) -> list[Announcement]:
        """Extra holders that announced a verified copy of `publisher`'s packet for `round`."""
        return await self._read(holders_key(self.config.run_id, round, publisher), round, publisher)

    async def lookup(self, keys: dict[str | None, str], round: int, deadline: float):
        """The round's announcements by publisher, and each wanted publisher's extra holders, in
        one DHT search; `keys` maps None to the packets key and each publisher to its holders key."""
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(
                self._dht.get_many(list(keys.values()), sufficient_expiration_time=float("inf")),
                timeout=max(0.0, deadline - loop.time()),
            )
        except Exception as e:  # a failed lookup leaves the hinted holders, not an error
            log.warning("round %d: reading the DHT failed (%r); trying hinted holders only", round, e)
            found = {}
        announced = {a.peer_id: a for a in self._parse_found(keys[None], found.get(keys[None]), round, None)}
        extra = {p: self._parse_found(k, found.get(k), round, p) for p, k in keys.items() if p is not None}
        return announced, extra

    async def _read(self, key: str, round: int, publisher: str | None) -> list[Announcement]:
        return self._parse_found(key, await self._dht.get(key, latest=True), round, publisher)

    def _parse_found(self, key: str, found, round: int, publisher: str | None) -> list[Announcement]:
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        # A snapshot's size is its model's (the fetcher sizes it from its own layout), not a packet's.
        limit = None if publisher == PARAMS_ID else self.config.max_packet_bytes
        for subkey, entry in found.value.items():
            try:
                out.append(parse_record(publisher or subkey, round, entry.value, limit))
            except ProtocolError as e:  # one bad record costs its writer, not the round
                log.warning("skipping DHT record %s[%r]: %s", key, subkey, e)
        return out
