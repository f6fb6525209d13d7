"""The packet exchange a volunteer node uses in its round loop, independent of the transport.

A round's packets move in two layers (DESIGN.md, "Bytes on the wire" and "A round"):

- announcements, small records in a DHT that say "peer P published a packet with this digest and
  size for round r; fetch it from these multiaddrs", and "holder H verified a copy of P's packet";
- the packet bytes themselves, served by the publisher and by every peer that fetched and verified
  a copy (swarming), so that the publisher does not upload N-1 copies alone.

The round loop uses the `Exchange` protocol:

    announcement = await exchange.publish(r, my_peer_id, packet_bytes)
    ...coordinator closes round r and lists {peer_id: digest} in its manifest...
    packets = await exchange.fetch(r, manifest, timeout_s=60)   # a subset of the manifest
    await exchange.forget_before(r - keep_rounds)

`fetch` never returns bytes whose sha256 differs from the digest asked for, and never hangs: a
packet that no holder serves in time is left out of the result, and the caller decides (DESIGN.md:
the manifest is fixed, so a missing packet means this peer skips the round and catches up).
"""

from __future__ import annotations

from typing import Protocol

from protocol.dht_records import Announcement


class Exchange(Protocol):
    """What the round loop needs from a packet exchange (see the module docstring)."""

    async def publish(self, round: int, peer_id: str, data: bytes) -> Announcement:
        """Keep `data` locally, serve it, and announce it for `round` under `peer_id` (in the background)."""
        ...

    async def announcements(self, round: int) -> dict[str, Announcement]:
        """The publishers' announcements for `round` found in the DHT, by publisher peer id."""
        ...

    async def fetch(
        self, round: int, wanted: dict[str, str], holders_hint: dict[str, list[str]] | None = None,
        timeout_s: float = 60,
    ) -> dict[str, bytes]:
        """Bytes for each `wanted` peer id whose sha256 equals the wanted digest; missing ones are left out.

        `holders_hint` maps a publisher's peer id to holder multiaddrs to try besides the DHT's.
        """
        ...

    async def forget_before(self, round: int) -> None:
        """Stop serving, and drop, packets of rounds before `round`."""
        ...

    async def shutdown(self) -> None:
        ...
