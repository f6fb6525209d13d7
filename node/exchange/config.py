"""How a node's packet exchange joins the swarm and moves packets: `ExchangeConfig`.

    config = ExchangeConfig.from_network(node.network, run_id=run_id, initial_peers=bootstrap,
                                         max_packet_bytes=run.exchange.max_packet_bytes, cache_dir=cache)
    exchange = await P2PExchange.create(config)                  # node/exchange/p2p.py
    ExchangeConfig(run_id="r1", initial_peers=(bootstrap,))      # tests and benchmarks: the defaults

Every part of the exchange (host.py, announce.py, serve.py, fetch.py, p2p.py) reads its settings
from here, and this module imports none of them. The settings a volunteer chooses (where to
listen, what to announce, NAT) are the fields of NodeConfig's network section (node/config.py);
`from_network` takes every one of them whose name is also a field here, so a setting is written
once. The other fields are tuning with defaults that nodes do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.dht_records import packets_key
from protocol.packet import DEFAULT_MAX_PACKET_BYTES
from protocol.stream import MAX_STRIPES

STRIPED_LINK_MBPS = 20.0  # a stated uplink or downlink under this fetches over one stream

if TYPE_CHECKING:
    from node.config import NetworkSection


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeConfig:
    """How a node joins the swarm and moves packets."""

    run_id: str  # DHT keys are scoped by run
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where p2pd listens; a public node: /ip4/0.0.0.0/tcp/PORT
    announce_maddrs: tuple[str, ...] = ()  # addresses to advertise instead (explicit ports): behind port forwarding
    initial_peers: tuple[str, ...] = ()  # bootstrap multiaddrs with /p2p/<id>; empty starts a new swarm
    use_relay: bool = True  # may reach peers through libp2p circuit relays
    use_auto_relay: bool = False  # behind NAT: find a relay and become reachable through it
    # offer relay service with p2pd's limits (4 GiB, 30 min per relayed connection) rather than
    # libp2p's default (128 KiB, 2 min): forces public reachability and runs p2pd's Go code on one
    # thread (node/exchange/host.py)
    relay: bool = False
    # behind NAT: be reachable through these relays (multiaddrs ending in /p2p/<relay id>): keep a
    # connection and a reservation at each, and announce only the addresses through them
    relay_via: tuple[str, ...] = ()
    client_mode: bool = False  # join the DHT without serving DHT requests
    nat_port_map: bool | None = None  # UPnP/NAT-PMP; None = on unless every host address is loopback
    announce_ttl_s: float = 600.0  # DHT records expire this long after publication (a few rounds)
    max_parallel_fetches: int = 3  # packets transferred at once, over all fetch() calls
    max_uploads: int = 2  # packet streams served at once; further requests are answered busy, or queue
    # snapshot streams served at once, on slots of their own: a snapshot (the model's size) never
    # holds an upload slot that the round's packets wait for
    max_snapshot_uploads: int = 1
    max_push_streams: int = 4  # packets pushed to this node at once by nodes nobody can dial (node/exchange/push.py)
    max_push_bytes: int = 256 << 20  # pushed packets held at most, in bytes; further pushes are refused "full"
    # the root of an undialable publisher's tree waits this long for its push to start before it
    # fetches the packet as any other (and waits for a push arriving, however long it takes)
    push_grace_s: float = 2.0
    busy_pause_s: float = 0.05  # with every known holder busy, ask again after this (doubling to 0.4 s)
    chunk_bytes: int = 512 << 10  # stream write size
    # a packet of a few MB is fetched in up to this many stripes, one stream each, side by side: a
    # stream carries one yamux window (256 KiB) per round trip until its window grows
    # (protocol/stream.py); 1: one stream. A node that stated an uplink or a downlink under
    # STRIPED_LINK_MBPS fetches over one stream (`fetch_stripes`).
    stripes: int = 4
    uplink_mbps: float | None = None  # this node's link as its operator stated it (None: fast)
    # this link's download rate as its operator stated it: packet downloads together take at most
    # 90 % of it, each holder sending at its share (node/exchange/pace.py); None: not paced
    downlink_mbps: float | None = None
    # refuse larger packets before buffering them (a snapshot's size is its model's: protocol/snapshot.py)
    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES
    connect_timeout_s: float = 10.0  # dial, open the stream and receive the response header
    stall_timeout_s: float = 10.0  # a holder silent this long mid-transfer is dropped
    # ...and one that sends less than this on average for stall_timeout_s while its stream is the
    # only download in progress here (a trickle that never falls silent would otherwise hold the
    # fetch until the round's time-out; with other downloads beside it, a slow stream may just be
    # sharing the link)
    min_rate_bytes_per_s: float = 16 << 10
    request_timeout_s: float = 5.0  # a server waits this long for a request
    holder_refresh_s: float = 1.0  # with every holder failed, re-read the DHT for new holders this often
    # with a packet mirror (the run's exchange.mirror): ask the store for a packet the peers have not
    # delivered within this (sooner once every holder asked failed); its bytes are checked as a
    # peer's (fetch.py)
    mirror_after_s: float = 3.0
    holder_batch_s: float = 0.05  # verified copies are announced together after this pause
    startup_timeout_s: float = 30.0  # p2pd start-up
    # each initial peer must answer a dial within this, all tried at once; those that do not are
    # skipped, and with none answering the node starts a DHT of its own (node/exchange/host.py)
    bootstrap_timeout_s: float = 5.0
    dht_wait_timeout_s: float = 3.0  # one DHT RPC
    # keep held packets in unnamed files here, mapped, instead of in the heap (node/exchange/spool.py);
    # None: in the heap
    spool_dir: str | None = None

    def __post_init__(self):
        packets_key(self.run_id, 0)  # raises ValueError for a run id that cannot be part of a key
        if not self.host_maddrs:
            raise ValueError("host_maddrs must name at least one address to listen on")
        if (
            min(
                self.max_parallel_fetches,
                self.max_uploads,
                self.max_snapshot_uploads,
                self.max_push_streams,
                self.max_push_bytes,
                self.chunk_bytes,
                self.max_packet_bytes,
            )
            < 1
        ):
            raise ValueError(
                "max_parallel_fetches, max_uploads, max_snapshot_uploads, max_push_streams, max_push_bytes,"
                " chunk_bytes and max_packet_bytes must be positive"
            )
        if (
            min(
                self.announce_ttl_s,
                self.connect_timeout_s,
                self.stall_timeout_s,
                self.request_timeout_s,
                self.bootstrap_timeout_s,
            )
            <= 0
        ):
            raise ValueError("time-outs and the announcement lifetime must be positive")
        if self.relay and self.relay_via:
            raise ValueError("a node offers relay service (relay) or uses relays (relay_via), not both")
        if bad := [m for m in self.relay_via if "/p2p/" not in m or "/p2p-circuit" in m]:
            raise ValueError(f"a relay's address ends in /p2p/<its libp2p id> and is not relayed itself: {bad}")
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise ValueError(f"stripes must be 1 to {MAX_STRIPES}, not {self.stripes}")
        if self.mirror_after_s < 0:
            raise ValueError("mirror_after_s must be >= 0 (0: ask the mirror at once)")
        if self.min_rate_bytes_per_s < 0:
            raise ValueError("min_rate_bytes_per_s must be >= 0 (0: no floor)")

    @property
    def fetch_stripes(self) -> int:
        """The stripes this node asks for: one where either stated rate of its link is under
        STRIPED_LINK_MBPS, which one stream's window per round trip fills up to a 100 ms round trip
        (tools/netlab/stripes.py: 4 stripes took as long as one at 10 Mbps), where more streams
        would only add bytes in flight to the download queue that the requests for this node's own
        packet cross (and, paced, hold more streams at the protocol's floor rate than the link's
        share pays for: 12 streams at `MIN_RATE` ask 393 kB/s of a 2 Mbps link)."""
        stated = [r for r in (self.uplink_mbps, self.downlink_mbps) if r is not None]
        return 1 if stated and min(stated) < STRIPED_LINK_MBPS else self.stripes

    @classmethod
    def from_network(
        cls,
        network: NetworkSection,
        *,
        run_id: str,
        initial_peers: tuple[str, ...],
        max_packet_bytes: int,
        cache_dir: Path,
    ) -> ExchangeConfig:
        """A node's exchange: every field of its network section that is also a field here, then
        the run's values. `initial_peers` replaces the section's (the node resolved them: its own,
        else the run's bootstrap and live members); the held packets are spooled in the section's
        `packet_spool_dir`, else `cache_dir`/spool, or kept in the heap with `packets_in_memory`."""
        chosen = {f.name: getattr(network, f.name) for f in fields(cls) if f.name in type(network).model_fields}
        spool_dir = None if network.packets_in_memory else str(network.packet_spool_dir or Path(cache_dir) / "spool")
        return cls(
            **chosen
            | {
                "run_id": run_id,
                "initial_peers": tuple(initial_peers),
                "max_packet_bytes": max_packet_bytes,
                "spool_dir": spool_dir,
            }
        )
