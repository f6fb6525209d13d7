"""The coordinator's rows: one dataclass per table, its fields in the table's column order.

Rows are plain values; what they mean is the rules' business (coordinator/rules/). A `SELECT *`
is read straight into its row type by position where the backend can (coordinator/storage/
database.py), so a column added to a table is added at the end of its dataclass too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


@dataclass(slots=True)
class RunRow:
    run_id: str
    name: str
    config_json: str
    join_token_hashes: str  # JSON list of sha256 hex strings
    state: str  # waiting | running | finished | closed
    created_at: float
    closed_at: float | None
    current_round: int  # the open round, or the next to open
    paused_since: float | None = None  # no live peer since then (coordinator/recovery.py)
    state_wait_since: float | None = None  # while paused: when the first peer came back
    rewinds: str | None = None  # JSON list of {at, from_round, to_round, reason}
    join_secret: str = ""  # hex; the join proof-of-work salts derive from it ('' until first needed)
    pruned_before: int = 0  # rounds before it keep only their round row and manifest (rules/retention.py)


@dataclass(slots=True)
class PeerRow:
    run_id: str
    peer_id: str
    public_key: str
    peer_index: int
    status: str  # live | gone | left
    reason: str | None
    activity: str
    device: str
    listen_multiaddrs: str  # JSON list
    bandwidth_mbps: float | None
    last_loss: float | None
    joined_at: float  # its latest join: a restarted node serves what it kept from then on
    last_seen_at: float
    member_since_round: int  # first round it is expected to submit to
    progress_round: int | None  # latest round it reported working on
    uplink_mbps: float | None = None  # stated by its operator at join
    withheld_round: int | None = None  # latest round whose packet of its was dropped as unfetchable
    inner_step: int | None = None  # inner steps done in progress_round, per its last heartbeat
    state_round: int | None = None  # the round start it said at its latest join that it holds
    state_digest: str | None = None  # and that state's parameter digest
    last_contributed_round: int | None = None  # latest round whose manifest holds its packet (None: probation)
    standing: str | None = None  # JSON of protocol.scoring.Standing (None: never judged)
    excluded_round: int | None = None  # while an exclusion is in force: the round whose verdict decided it
    detail: str | None = None  # what its last heartbeat said it is stuck on (None: nothing)
    credit: int = 0  # its standing's credit (protocol/scoring.py, rule 5): its weight as judge and voter
    reachable: bool | None = None  # can peers elsewhere dial it (its latest join's dial-back; None: not known)
    heartbeat_period_s: float | None = None  # the heartbeat period it was last told (None: none yet)


@dataclass(slots=True)
class RoundRow:
    run_id: str
    round: int
    opened_at: float
    deadline: float
    closed_at: float | None
    majority_digest: str | None  # the digest most votes on the latest manifest version name
    manifest_version: int = 1  # one more per amendment of the closed round's manifest
    agreed_digest: str | None = None  # fixed once set, until an amendment starts a new vote
    num_votes: int = 0  # votes on the latest manifest version
    scored: int = 0  # 1: its contribution verdicts were taken (protocol/scoring.py)
    dispute: str | None = None  # JSON of the dispute over its digest, as decided (None: none)
    seed_round: int | None = None  # bounded: the round whose agreed digest seeded its pick (None: none)


@dataclass(slots=True)
class SubmissionRow:
    run_id: str
    round: int
    peer_id: str
    packet_digest: str
    packet_size_bytes: int
    train_loss: float
    compute_s: float
    encode_s: float
    multiaddrs: str  # JSON list
    submitted_at: float


@dataclass(slots=True)
class AppliedRow:
    run_id: str
    round: int
    peer_id: str
    params_digest: str
    reported_at: float
    refused: str | None = None  # JSON {peer id: reason} of the packets it left out
    manifest_version: int = 1  # the version of the round's manifest it applied
    vote: int = 0  # 1: it counts towards the agreed digest (its peer has a packet in that version)
    val_loss: float | None = None  # the model's held-out loss after the round, when the peer evaluated it
    scores: str | None = None  # JSON {peer id: [loss_delta, cosine]}: its contribution scores (None: none)
    sample: str | None = None  # a text the model wrote after the round, sent with val_loss (None: none)
    leaves: str | None = None  # hex leaf hashes of params_digest's tree (None: sent none)
    snapshot_bytes: int | None = None  # the size its answer signed a snapshot PUT URL for (None: none)
    snapshot_digest: str | None = None  # the snapshot its peer reported uploading there (None: not yet)


@dataclass(slots=True)
class MissingReportRow:
    """`reporter_id` could not fetch `peer_id`'s packet of a closed round."""

    run_id: str
    round: int
    peer_id: str
    reporter_id: str
    reported_at: float


@dataclass(slots=True)
class DroppedRow:
    """A manifest entry amended out of a closed round, from `manifest_version` on."""

    run_id: str
    round: int
    peer_id: str
    reason: str
    manifest_version: int
    dropped_at: float


@dataclass(slots=True)
class SelectionRow:
    """A submission to a bounded round, as protocol/selection.py ranked it when the round closed."""

    run_id: str
    round: int
    peer_id: str
    proven: int  # 1: a packet in an earlier manifest, and credit once judged
    waited_rounds: int  # rounds since its packet was last in a manifest (never: since it joined)
    rank: int  # in its tier, 1 first
    tier_size: int
    tier_places: int
    picked: int  # 1: in the manifest


@dataclass(slots=True)
class MemberRow:
    """A live member of round r, with the facts the standing rule weighs (coordinator/rules/
    standing.py); not a table, a query's answer."""

    peer_id: str
    submitted: bool  # it submitted to round r
    contributor: bool  # a manifest holds a packet of its, in one of the window's rounds before r
    judged: bool  # contribution scoring gave it a standing (False: never judged)
    credit: int
    withheld_round: int | None
    excluded_round: int | None


@dataclass(slots=True)
class RoundStats:
    round: int
    num_contributors: int
    mean_loss: float | None
    packet_bytes: int = 0  # the submitted packets' sizes, summed


@functools.cache  # row types are fixed classes; every statement asks
def columns(row_type: type) -> tuple[str, ...]:
    """A row type's field names, which are its table's column names in order."""
    return tuple(f.name for f in dataclasses.fields(row_type))
