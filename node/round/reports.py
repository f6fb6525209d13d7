"""What a node records about each round it took part in: phase times, packets, bytes.

One `RoundReport` per round the node trained; the list is what `Node.run` returns and what
`locoswarm node join --report FILE` writes as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RoundTimes:
    compute_s: float = 0.0
    encode_s: float = 0.0
    wait_s: float = 0.0
    transfer_s: float = 0.0
    aggregate_s: float = 0.0
    hidden_wait_s: float = 0.0  # with overlap: waiting for the previous round's manifest, behind compute
    hidden_transfer_s: float = 0.0  # with overlap: fetching the previous round's packets, behind compute
    hidden_aggregate_s: float = 0.0  # with overlap: verifying and aggregating them, behind compute
    hidden_encode_s: float = 0.0  # with overlap: encoding and sending this round's packet, behind compute


@dataclass(slots=True)
class RoundReport:
    round: int
    train_loss: float
    digest: str
    num_packets: int
    refused: dict[str, str] = field(default_factory=dict)
    times: RoundTimes = field(default_factory=RoundTimes)
    submitted: bool = True
    kept_packet: bool = False  # its packet was the one kept on disk before a restart (not trained again)
    caught_up: bool = False  # the node caught up (node/round/catchup.py) just before this round
    packet_bytes: int = 0
    pushed_to: str | None = None  # the libp2p id of the peer that took its packet by push (nobody can dial it)
    downloaded_bytes: int = 0  # stream bytes this node fetched for the round it applied
    fetching_s: float = 0.0  # wall time with one of that round's fetches in progress (early ones included)
    uploaded_bytes: int = 0  # stream bytes it served to others for its own round
    started_at: float = 0.0  # unix time the round's inner steps began
    submitted_at: float = 0.0  # unix time the coordinator accepted its packet (0: not submitted)
    ended_at: float = 0.0  # unix time its outer step (or, with overlap, the previous round's) was applied
    applied_round: int = -1  # the round whose aggregate this report's digest follows (r, or r-1 with overlap)
    manifest_version: int = 1  # of applied_round's manifest; above 1 when it was amended and applied again
    # this node's contribution scores of applied_round's updates, peer id -> {"loss_delta", "cosine"}
    # (node/training/scoring.py; sent with the applied report); empty: not scored
    scores: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CatchUpReport:
    """How a node that fell behind got back to the start of the open round."""

    from_round: int | None  # the round whose start the parameters were (None: unknown)
    to_round: int  # the open round it then trained
    method: str  # "replay" (closed rounds' manifests applied), "snapshot" (peers' parameters; then
    #              "snapshot+replay" if rounds had closed since), "none" (already there, or round 0)
