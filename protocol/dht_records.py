"""The DHT record schema of the packet exchange: keys, subkeys, values, and their strict parsing.

A round's packets move in two layers: announcements, small records in a DHT that say "peer P
published a packet with this digest and size for round r; fetch it from these multiaddrs" (and
"holder H verified a copy of P's packet"), and the bytes themselves over libp2p streams
(protocol/stream.py). Any DHT client, in this project or not, reads and writes these records.
Schema, for run id RUN and round R (an int written in decimal):

    key    "locoswarm/RUN/round/R/packets"
    subkey the publisher's peer id (the project's peer id, as in the coordinator's manifest)
    value  {"digest": sha256 hex of the packet, 64 lowercase hex chars,
            "size":   packet length in bytes, int >= 1,
            "maddrs": [libp2p multiaddr strings, each ending in /p2p/<libp2p peer id>],
            "holder": libp2p peer id (base58) of the node serving the bytes}

    key    "locoswarm/RUN/round/R/holders/PUBLISHER"   (PUBLISHER = a publisher's peer id)
    subkey the extra holder's libp2p peer id (base58)
    value  the same map as above, describing the holder's verified copy

    key    "locoswarm/RUN/round/R/holders/params"
    subkey a holder's libp2p peer id (base58)
    value  the same map, for a snapshot of the parameters that start round R, served to peers
           catching up: "digest" is the snapshot digest and "size" the stream's length, laid out
           as protocol/snapshot.py says (the parameters, plus "outer_momentum.<name>" for DiLoCo;
           a reader sizes it from its own model, and no packet limit applies to it)

Values are msgpack maps of a few hundred bytes (hivemind's DHT serializes them with msgpack), with
exactly these four keys; they expire a few rounds after publication (see `ExchangeConfig` in
node/exchange/config.py). Readers treat records as hostile: `parse_record` checks types, lengths and
counts and raises `protocol.errors.MalformedPacket` (or `OversizedPacket`) on anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from protocol.errors import MalformedPacket, OversizedPacket

KEY_PREFIX = "locoswarm"
# Reserved publisher id for parameter snapshots (peers catching up fetch them like packets).
PARAMS_ID = "params"
RECORD_KEYS = frozenset({"digest", "size", "maddrs", "holder"})
MAX_MADDRS = 16  # a node listens on a handful of addresses; more is noise or an attack
MAX_MADDR_CHARS = 512
MAX_ID_CHARS = 256  # peer ids: project ids and base58 libp2p ids are far shorter
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
# Run ids and peer ids go inside DHT keys separated by "/": forbid the separator and control chars.
_KEY_PART = re.compile(r"[^/\x00-\x1f\x7f]{1,256}")


@dataclass(frozen=True, slots=True)
class Announcement:
    """One copy of one peer's packet for one round, and where to fetch it."""

    peer_id: str  # the publisher (project peer id, as in the manifest)
    round: int
    digest: str  # sha256 hex of the packet bytes
    size_bytes: int
    multiaddrs: list[str]  # where to fetch: libp2p multiaddrs of the holder, with /p2p/<id>
    holder: str = ""  # libp2p peer id (base58) of the node serving this copy


def _key_part(value: str, what: str) -> str:
    if not isinstance(value, str) or not _KEY_PART.fullmatch(value):
        raise ValueError(f"{what} {value!r} cannot be part of a DHT key (1-256 chars, no '/' or control chars)")
    return value


def packets_key(run_id: str, round: int) -> str:
    """DHT key under which every publisher of `round` announces (subkey: publisher peer id)."""
    if not isinstance(round, int) or isinstance(round, bool) or round < 0:
        raise ValueError(f"round must be a non-negative int, got {round!r}")
    return f"{KEY_PREFIX}/{_key_part(run_id, 'run id')}/round/{round}/packets"


def holders_key(run_id: str, round: int, publisher_peer_id: str) -> str:
    """DHT key under which extra holders of one publisher's packet announce (subkey: libp2p id)."""
    return f"{packets_key(run_id, round).removesuffix('/packets')}/holders/{_key_part(publisher_peer_id, 'peer id')}"


def make_record(digest: str, size_bytes: int, maddrs: list[str], holder: str) -> dict[str, Any]:
    """The DHT value for one copy of a packet (checked like a received one, so bad input fails here)."""
    record = {"digest": digest, "size": size_bytes, "maddrs": list(maddrs), "holder": holder}
    try:
        _check_record(record, max_size_bytes=None)
    except (MalformedPacket, OversizedPacket) as e:
        raise ValueError(str(e)) from None
    return record


def parse_record(
    publisher_peer_id: str,
    round: int,
    value: Any,
    max_size_bytes: int | None = None,
) -> Announcement:
    """An `Announcement` from a DHT value of either key; raises MalformedPacket or OversizedPacket."""
    if not isinstance(publisher_peer_id, str) or not 0 < len(publisher_peer_id) <= MAX_ID_CHARS:
        raise MalformedPacket("subkey is not a peer id string")
    _check_record(value, max_size_bytes)
    return Announcement(
        publisher_peer_id, round, value["digest"], value["size"], list(value["maddrs"]), value["holder"]
    )


def _check_record(value: Any, max_size_bytes: int | None) -> None:
    if not isinstance(value, dict) or set(value) != RECORD_KEYS:
        raise MalformedPacket("announcement is not a map with exactly the keys digest, size, maddrs, holder")
    digest, size, maddrs, holder = value["digest"], value["size"], value["maddrs"], value["holder"]
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        raise MalformedPacket("announcement digest is not 64 lowercase hex characters")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise MalformedPacket("announcement size is not a positive int")
    if max_size_bytes is not None and size > max_size_bytes:
        raise OversizedPacket(f"announced packet of {size} bytes exceeds the limit of {max_size_bytes}")
    if not isinstance(maddrs, (list, tuple)) or len(maddrs) > MAX_MADDRS:
        raise MalformedPacket(f"announcement maddrs is not a list of at most {MAX_MADDRS}")
    if not all(isinstance(m, str) and m.startswith("/") and 0 < len(m) <= MAX_MADDR_CHARS for m in maddrs):
        raise MalformedPacket("announcement maddrs holds a value that is not a multiaddr string")
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_ID_CHARS:
        raise MalformedPacket("announcement holder is not a peer id string")


__all__ = [
    "Announcement",
    "packets_key",
    "holders_key",
    "make_record",
    "parse_record",
]
