"""The packet exchange a volunteer node uses in its round loop, independent of the transport.

A round's packets move in two layers (README.md, "Architecture"):

- announcements, small records in a DHT that say "peer P published a packet with this digest and
  size for round r; fetch it from these multiaddrs", and "holder H verified a copy of P's packet";
- the packet bytes themselves, served by the publisher and by every peer that fetched and verified
  a copy (swarming), so that the publisher does not upload N-1 copies alone.

The round loop (node/round/loop.py) uses the `Exchange` protocol and nothing else:

    announcement = await exchange.publish(r, my_peer_id, packet_bytes)
    ...coordinator closes round r and lists {peer_id: digest} in its manifest...
    packets = await exchange.fetch(r, manifest, hints, timeout_s=60, parents=parents, mirrors=mirrors)  # a subset
    exchange.traffic(r).downloaded_bytes, exchange.traffic(r).fetching_s()             # for its report
    await exchange.publish_params(r + 1, snapshot)        # a node.training.snapshot.Snapshot, served unit by unit
    ok = await exchange.fetch_params(r, digest, sink)     # a peer catching up: verified units into its model
    await exchange.forget_before(r - keep_rounds)

With a packet mirror (the run's `exchange.mirror`: an object store the coordinator signs URLs
for), `mirrors` names, per packet, a presigned GET URL and the size the manifest announces: one
more holder, asked once the peers have not delivered within `mirror_after_s` (ExchangeConfig),
with the same checks as a peer's bytes (node/exchange/fetch.py). A publisher uploads its packet
there itself, after its submission (node/exchange/mirror.py).

`fetch` never returns bytes whose sha256 differs from the digest asked for, and never hangs: a
packet that no holder serves in time is left out of the result, and the caller decides (the
manifest is fixed, so a missing packet means this peer skips the round and catches up: README.md,
"A round").

Parameter snapshots are never bytes in memory: a `Snapshot` reads each unit (the prologue, or a
4 MiB chunk) from a checkpoint file or the round-start tensors as it is served, and a
`SnapshotSink` checks each unit against the snapshot's hash tree (whose root is the agreed
parameter digest) and writes it into the model (protocol/snapshot.py, node/training/snapshot.py).

`node.exchange.p2p.P2PExchange` implements it over hivemind; `tests.doubles.memory_exchange`, an
in-memory one written against this protocol (with `Traffic` from here), stands in for it in unit
tests. This module imports no transport.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from protocol.dht_records import Announcement

if TYPE_CHECKING:
    from node.training.snapshot import Snapshot, SnapshotSink


@dataclass(frozen=True, slots=True)
class Reachability:
    """Whether peers on other networks can dial this node, and what to do if not
    (node/exchange/reachability.py assesses a libp2p node's addresses)."""

    maddrs: list[str]  # what this node announces
    public_maddrs: list[str]  # the subset on globally routable IPs
    relayed: bool  # announces a /p2p-circuit address
    loopback_only: bool
    reachable: bool  # can a peer on another network plausibly dial us
    advice: str


@dataclass(frozen=True, slots=True)
class MirrorCopy:
    """Where the packet mirror keeps a packet: a presigned GET URL, and the size its manifest entry
    announces (the only length accepted from the store)."""

    url: str
    size_bytes: int


@dataclass(slots=True)
class Traffic:
    """Stream payload bytes this node moved for one round (failed transfers included)."""

    downloaded_bytes: int = 0
    uploaded_bytes: int = 0
    num_fetched: int = 0  # verified packets obtained from others
    num_served: int = 0  # complete packets sent to others
    fetch_spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each packet fetched

    def fetching_s(self) -> float:
        """Wall time during which at least one of the round's packets was being fetched (lookups,
        dials and transfers included): the time the download link had work."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self.fetch_spans):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total


class Exchange(Protocol):
    """What the round loop needs from a packet exchange (see the module docstring)."""

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) others dial: sent to the coordinator when joining."""
        ...

    async def publish(self, round: int, peer_id: str, data: bytes, announce: bool = True) -> Announcement:
        """Keep `data` locally, serve it, and announce it for `round` under `peer_id` (in the
        background); with `announce` False, not yet: `announce` does it later."""
        ...

    async def announce(self, round: int, peer_id: str) -> None:
        """Announce the packet published here for `round` under `peer_id` (in the background).
        The round loop announces its own packet only once the coordinator accepted its digest (or
        its answer was lost), so a key that copies packets (node/faults.py, `copy`) learns of one
        only after its original was submitted: copy detection judges the later of two submissions
        the copy (protocol/scoring.py), and a copier is then always the later. A refused packet is
        never announced: judges hold no original to find its copy by."""
        ...

    async def announcements(self, round: int) -> dict[str, Announcement]:
        """The publishers' announcements for `round` found in the DHT, by publisher peer id."""
        ...

    async def holders(self, round: int, publisher: str) -> list[Announcement]:
        """Peers that announced a verified copy of `publisher`'s packet for `round`."""
        ...

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
        """Bytes for each `wanted` peer id whose sha256 equals the wanted digest; missing ones are left out.

        `holders_hint` maps a publisher's peer id to holder multiaddrs to try besides the DHT's;
        `parents` maps it to the multiaddrs of this node's parent in the packet's distribution
        tree (node.exchange.topology.tree_parent), asked first; `mirrors` maps it to its copy in
        the packet mirror, asked when the peers have not delivered within `mirror_after_s`;
        `pushed_here` names publishers nobody can dial that push their packet to this node (the
        root of its tree): their push is awaited first (`push_grace_s` to start), not raced by a
        second copy pulled through the same uplink. `suspects` names publishers a packet of which
        was dropped as unfetchable (the coordinator's `withheld_packet` flag): from `stall_timeout_s`
        into its fetch on, theirs is given up as soon as no copy of it is arriving, rather than at
        the time-out.
        """
        ...

    def traffic(self, round: int) -> Traffic:
        """This node's transfers for `round` so far (a live object: it grows while packets move)."""
        ...

    async def push(self, round: int, publisher: str, targets: list[list[str]], timeout_s: float = 30.0) -> str | None:
        """Hand the packet this node published for `round` to the first of `targets` (each a
        peer's multiaddrs ending in /p2p/<libp2p id>, in order) that takes and verifies it, over a
        stream this node opens (node/exchange/push.py); the libp2p id of that holder, or None
        when every one refused or failed. For a node nobody can dial."""
        ...

    def accept_pushes(self, accept) -> None:
        """Take packets other nodes push, when `accept(round, publisher, digest)` (async) confirms
        the digest is the one the publisher submitted; None refuses every push."""
        ...

    def set_members(self, holder_ids: Collection[str] | None) -> None:
        """The libp2p ids (base58) of the run's live members: only they are served as children in
        the packets' trees (node/exchange/serve.py); None: anyone may be."""
        ...

    async def publish_params(self, round: int, snapshot: Snapshot) -> Announcement:
        """Serve and announce a snapshot of the parameters that start `round` (replacing any
        other this node served for `round`); announced under `snapshot.digest`."""
        ...

    async def params_holders(self, round: int) -> list[Announcement]:
        """Every announced snapshot of the parameters that start `round` (digests may differ)."""
        ...

    async def fetch_params(self, round: int, digest: str, sink: SnapshotSink, timeout_s: float = 120.0) -> bool:
        """Receive the snapshot for `round` named `digest` into `sink`, verified unit by unit, from
        any holders (the next one resumes where one failed); True once all of it is in. False
        leaves the sink where it stopped: its targets may hold part of the snapshot."""
        ...

    async def dial_peers(self, targets: list[list[str]]) -> list[str]:
        """Open a connection to each of the peers at `targets` (each a peer's multiaddrs ending in
        /p2p/<libp2p id>), at most `protocol.http.MAX_DIAL_PEERS`, never this node; the ids that
        answered. For a node nobody can dial whose snapshot they are loading: a connection carries
        streams both ways, so their fetches reach it over the connection it opened."""
        ...

    async def forget_before(self, round: int, keep_publisher: str | None = None) -> None:
        """Stop serving, and drop, packets and traffic counts of rounds before `round`; with
        `keep_publisher`, that publisher's packets stay (a node's own, kept longer)."""
        ...

    async def reachability_check(self) -> Reachability:
        """Refresh the addresses this node announces and say whether peers elsewhere can dial them."""
        ...

    async def shutdown(self) -> None:
        """Stop serving and release the transport (idempotent)."""
        ...
