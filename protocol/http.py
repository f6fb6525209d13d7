"""The coordinator's HTTP contract: request/response models, error codes, request signing.

One module for both sides: the coordinator validates requests with these models and the node
builds them, so the wire cannot drift. All paths are under ``/v1``.

Endpoints (``A`` = admin bearer token, ``S`` = signed by the peer key, ``-`` = public):

==========================================  ====  ===================  =====================
path                                        auth  request              response
==========================================  ====  ===================  =====================
POST /v1/runs                               A     RunConfig            RunCreated
GET  /v1/runs                               -                          RunList
GET  /v1/runs/{run_id}                      -                          RunInfo
POST /v1/runs/{run_id}/close                A                          RunInfo
GET  /v1/runs/{run_id}/join-challenge       -                          JoinChallenge
POST /v1/runs/{run_id}/join                 S*    JoinRequest          JoinResponse
POST /v1/runs/{run_id}/heartbeat            S     HeartbeatRequest     HeartbeatResponse
POST /v1/runs/{run_id}/leave                S     LeaveRequest         LeaveResponse
POST /v1/runs/{run_id}/rounds/{r}/submit    S     SubmitRequest        SubmitResponse
GET  /v1/runs/{run_id}/rounds/{r}?wait_s=W  -                          RoundView
POST /v1/runs/{run_id}/rounds/{r}/applied   S     AppliedRequest       AppliedResponse
POST /v1/runs/{run_id}/rounds/{r}/missing   S     MissingRequest       MissingResponse
POST /v1/runs/{run_id}/rounds/{r}/snapshot  S     SnapshotUploaded     SnapshotRecorded
GET  /v1/runs/{run_id}/status?history=N     -                          RunStatus
GET  /healthz, GET /readyz                  -                          (JSON; see below)
GET  /metrics, GET /?run=ID                 -     (Prometheus text, HTML page)
==========================================  ====  ===================  =====================

Signing (``S``): headers ``X-Locoswarm-Peer`` (peer id), ``X-Locoswarm-Nonce`` (decimal int,
nanoseconds since the epoch is what `sign_request` uses) and ``X-Locoswarm-Signature`` (hex
Ed25519 signature) over `canonical_request_bytes`::

    b"locoswarm-request-v1\\n" + METHOD + "\\n" + path + "\\n" + nonce + "\\n" + hex(sha256(body))

``path`` is the URL path without the query string. The domain prefix keeps a request signature
from ever being valid for a packet, which the same key signs. The server refuses an unknown peer,
a bad signature, a nonce more than ``NONCE_WINDOW_S`` from server time or already used by that
peer, and a header peer that differs from the peer the body speaks for. ``S*``: the join is signed
by the joining key itself; the header peer must equal ``peer_id_from_public_key(public_key)``.

Refusals are JSON ``{"error": code, "detail": text}`` with a 4xx status (see `ErrorBody`);
`ErrorCode` lists every code, with what it means and what a node does about it. A database failure
is the same body with status 503, code ``storage_unavailable`` and a ``Retry-After`` header: the
request changed nothing, and a retry succeeds once the database is usable again. ``/healthz`` says
only that the process answers (``{"status": "ok", "server_time": unix seconds}``: nodes check their
clock against it, since their DHT nodes refuse each other beyond 3 s); ``/readyz``
(``{"status": "ready"}``, or 503 ``storage_unavailable``) that it can read and write its database.

Rounds: round 0 opens once ``min_peers`` peers are live; round r closes at its deadline, or as soon
as every peer it waits for has submitted; closing fixes the manifest (exactly the accepted
submissions, sorted by peer id) and opens r+1 at once. A round waits for the live contributors:
peers with a packet in one of the last ``membership.max_missed_rounds`` manifests (a new peer is on
probation, waited for by nobody, until a packet of its is in a manifest; a peer flagged
``withheld_packet`` is not waited for), and for no peer that joined while it was open. While fewer
live members are contributors than ``membership.min_peers`` (round 0; a swarm still forming) it
waits for every live member.
Anyone may submit to the open round before its deadline. ``PeerView.standing`` says where each peer
stands, with the reason. ``JoinResponse.params.round`` is the round whose start the listed
parameters are: after applying round r's manifest a peer holds the parameters that start round
r+1. While no round has an agreed digest it is 0 with ``digest`` null: start from the seeded
initialisation (or replay the closed rounds from it).

Agreed digests: after applying a round each peer reports its parameter digest (``applied``). A
report is a vote only when its peer has a packet in the manifest version it applied (and, with
``membership.vote_after_rounds`` K, in K earlier manifests); others are kept (they are flagged when
they differ) but never count. One report per peer, round and version: the same one again is
idempotent, another is refused ``conflicting_report``. The majority of the votes is agreed once it
has at least two votes and more than half of the round's contributors, or once the next round has
closed (or the run ended) and it holds more than half of the votes cast (a lone vote included: a
round with one contributor is agreed when the next one closes). Until then it is provisional
(``provisional``). An agreed digest never changes; an amendment starts a new vote on the new
version. A closed round whose latest manifest is empty (nobody submitted, or every entry was
dropped) changes no parameter: its majority and agreed digest are its start's, round r-1's agreed
digest, as soon as that is agreed (none for round 0, whose start is the seeded initialisation).
Snapshots, checkpoints and flags trust ``agreed_digest`` only.

Joining: a key that is new to the run is rate-limited per source address and per run
(``membership.join_rate_*``; 429 ``rate_limited`` with ``Retry-After``), and with
``membership.join_pow_bits`` it shows a proof of work (protocol/join_pow.py; ``GET join-challenge``).

Amended manifests (amended, never forked): a closed round's manifest starts at
``manifest_version`` 1. A member that cannot fetch an entry within its fetch time-out reports it
(``POST rounds/{r}/missing``, ``peer_ids``: at most ``MAX_REFUSED`` peer ids, each an entry of that
round's manifest other than the reporter's own, for a round closed at most
``MISSING_REPORT_ROUNDS`` rounds before the open one; a repeated report changes nothing). A member
that restarted without its own packet of the round sets ``lost_own`` (``peer_ids`` may then be
empty; a report that names nothing and does not set it is refused ``invalid_request``, one that
names the reporter is refused too: ``lost_own`` is how an author speaks of its own entry; with no
entry of its own it is refused ``not_in_manifest``). The
coordinator drops a reported entry at once when its author said it lost it or is not live (gone,
left), unless a live contributor other than the author and the entry's reporters reported applying
the round (one that did holds a copy and serves it); else once every other live contributor of
the round (its manifest's peers, the entry's publisher excluded) has reported it, or once
``exchange.missing_grace_s`` has passed since its first report and no contributor but its
publisher and its reporters reported applying the round (the reporters catch up instead). Then
the round's ``manifest_version`` grows by one (entries due together go in one version), the entry
leaves ``manifest`` and enters ``dropped`` with the reason, and its publisher is flagged
``withheld_packet`` and not expected (for the early close) in later rounds until a packet of
its, in a later round's latest manifest, has been applied by another peer. A round the amendment
leaves empty is agreed on its start's digest (see "Agreed digests"). Rounds go on meanwhile:
an amendment never holds up a close. ``GET rounds/{r}?version_gt=V&wait_s=W`` answers once the
manifest version exceeds V. Applied reports carry the ``manifest_version`` applied; a round's
majority digest counts only reports of its latest version (null until one arrives after an
amendment: a new vote); ``AppliedResponse.manifest_version`` and ``amended`` (recent amended rounds) tell a
node that applied an older version to recompute from its kept round start, or to catch up
(node/round/amend.py).

Stuck peers: a node that cannot go on (it waits for packets nobody serves, for an amendment) sends
heartbeats with state ``stuck`` and a one-line ``detail`` (printable ASCII, at most
``MAX_DETAIL_CHARS``) saying what it waits for and from whom. The coordinator keeps the line per
peer (``PeerView.detail``) until a heartbeat without one, a submission or an applied report, and
``RunStatus.stuck`` shows the first live stuck peer's.

Connection reversal (a snapshot held only by nodes nobody can dial): a node loading a parameter
snapshot sends heartbeats with state ``loading_snapshot`` (`LOADING_SNAPSHOT`). The answer to a
heartbeat of a member whose ``reachable`` is false lists in ``dial_peers`` the listen multiaddrs
of at most ``MAX_DIAL_PEERS`` live members that are loading a snapshot now, not the caller, and
that nobody found undialable (most recently seen first). That member dials each: a libp2p
connection carries streams both ways, so the loader's ordinary snapshot fetch then opens its
stream over the connection the undialable holder opened (node/exchange/fetch.py).

A node's loop, in JSON (digests shortened)::

    POST join {"public_key": "9f3a..", "device": "cuda:H100", "listen_multiaddrs": ["/ip4/.."],
               "uplink_mbps": 100.0}                                  (uplink_mbps: optional)
      -> {"run_id": "run-1a2b3c4d5e", "peer_id": "p1c2d..", "peer_index": 3, "data_shard": 3,
          "num_shards": 1024, "config": {RunConfig, join_tokens []}, "run_state": "running",
          "current_round": 7, "params": {"round": 7, "digest": "ab12..",
          "holders": [{"peer_id": "p..", "multiaddrs": ["/ip4/.."]}]},
          "dht_bootstrap": ["/ip4/.."], "heartbeat_interval_s": 15.0}
    POST heartbeat {"round": 8, "state": "training", "bandwidth_mbps": 940.0}   (every interval)
      -> {"run_state": "running", "current_round": 8, "round_state": "open", "deadline": 1.7e9}
    POST rounds/8/submit {"packet_digest": sha256 hex, "packet_size_bytes": 812345,
                          "train_loss": 3.21, "compute_s": 41.0, "encode_s": 0.8}
      -> {"run_id": .., "round": 8, "peer_id": .., "num_submitted": 5, "deadline": 1.7e9,
          "mirror_put_url": null}      (a presigned PUT for exactly 812345 bytes with exchange.mirror)
         (a repeat with the same digest answers the same; another digest: 409)
    GET rounds/8?wait_s=30
      -> {"run_id": .., "round": 8, "state": "closed", "opened_at": .., "deadline": ..,
          "closed_at": .., "num_submitted": 6, "majority_digest": null,
          "manifest": [{"peer_id": .., "packet_digest": .., "packet_size_bytes": ..,
                        "multiaddrs": [..], "mirror_url": null}, ...]}   (manifest is [] until closed;
                                                mirror_url: a presigned GET with exchange.mirror)
    POST rounds/8/applied {"params_digest": hex, "refused": {"p9e..": "BadSignature: .."},
                           "manifest_version": 1, "val_loss": 3.05}     (default 1; val_loss: optional)
      -> {"round": 8, "majority_digest": hex, "agrees": true, "num_reports": 4, "manifest_version": 1,
          "amended": {"7": 2}}                        (recent rounds whose manifest was amended)
    POST rounds/8/missing {"peer_ids": ["p7c.."]}          (only when a packet cannot be fetched)
      -> {"round": 8, "manifest_version": 2, "dropped": {"p7c..": "reported missing by .."},
          "pending": []}

Snapshots in the packet mirror (``exchange.mirror.snapshot_every_rounds`` N > 0): in a round r with
r % N == 0, an applied report carries ``snapshot_bytes``, the size of the snapshot of round r+1's
start its node serves (protocol/snapshot.py). The answer to each of the first ``SNAPSHOT_UPLOADERS``
new votes of the latest manifest version that name the round's majority digest carries
``snapshot_put_url``, a presigned PUT of exactly that size; once the store took the snapshot its
node reports it (``POST rounds/{r}/snapshot`` with the snapshot digest and size; refused
``no_snapshot_url`` unless the answer to that peer's report handed it a URL of that size). The
newest such snapshot whose parameters are the round's agreed digest is offered to joiners and
peers catching up as ``MirroredSnapshot`` (``RunStatus.snapshot_mirror``,
``JoinResponse.params.mirror``), with a fresh presigned GET.

Contribution scores: an applied report may carry ``scores`` (peer id -> loss_delta, cosine; at
most ``MAX_SCORES``) of the updates in the manifest it applied. Once a round's votes are in (every
contributor reported, or the next round closed) the coordinator judges each contributor from its
contributors' scores (protocol/scoring.py) and refuses the submissions of a peer whose updates
kept hurting with ``excluded`` (403), shown in ``PeerView.excluded_reason`` and ``score``.

Submit ``multiaddrs`` defaults to the join's ``listen_multiaddrs``. A peer marked gone (silent
past ``heartbeat_timeout_s``) or that left gets ``peer_gone`` on every signed call and rejoins.

Requests forbid unknown fields (hostile input); responses ignore them, so a node keeps working
against a newer coordinator that adds fields.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from protocol.errors import BadSignature
from protocol.fields import (
    MAX_ADDRS,
    MAX_REFUSED,
    HexKey,
    Multiaddr,
    ParamsDigest,
    PeerId,
    RequestModel,
    ResponseModel,
    Seconds,
    Sha256Hex,
    ShortText,
)
from protocol.run_config import RunConfig
from protocol.signing import PeerKey, verify

API_PREFIX = "/v1"
PEER_HEADER = "X-Locoswarm-Peer"
NONCE_HEADER = "X-Locoswarm-Nonce"
SIGNATURE_HEADER = "X-Locoswarm-Signature"
NONCE_WINDOW_S = 300.0
SIGNING_DOMAIN = b"locoswarm-request-v1\n"
MAX_LONG_POLL_S = 60.0
MAX_DETAIL_CHARS = 200  # a heartbeat's `detail` line at most
LOADING_SNAPSHOT = "loading_snapshot"  # a heartbeat's state: members nobody can dial are asked to dial this one
MAX_DIAL_PEERS = 4  # peers listed in a heartbeat answer's `dial_peers`, and dialled per answer, at most
MAX_SAMPLE_CHARS = 280  # an applied report's text sample at most
# Any text but control characters (newline and tab allowed): the page shows it as text, never markup.
SampleText = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f]{1,%d}$" % MAX_SAMPLE_CHARS)]
MISSING_REPORT_ROUNDS = 4  # missing packets are reported for rounds closed this many rounds back at most
MAX_INNER_STEPS = 100_000  # a heartbeat's inner_step at most: H's own bound (run_config.InnerSection)
MAX_SCORES = 64  # peers one applied report scores at most (run_config.ScoringSection.max_peers_per_round's bound)
MAX_ABS_LOSS_DELTA = 1e6  # a reported score's loss delta at most, either sign (nodes clamp to it)
# An applied report's hash tree (protocol/digest.py) at most: 4096 leaves of 4 MiB is a 16 GiB body (a 4B
# model in fp32); a larger model's nodes send none, and its disputes name no chunk.
MAX_TREE_LEAVES = 4096
MAX_TREE_HEADER_BYTES = 1 << 16
SNAPSHOT_UPLOADERS = 2  # votes per round handed a snapshot PUT URL (one that dies leaves the other)


# ---------------------------------------------------------------------------------------------
# Runs


RunState = Literal["waiting", "running", "finished", "closed"]
RoundState = Literal["pending", "open", "closed"]
PeerStatus = Literal["live", "gone", "left"]


class RunCreated(ResponseModel):
    run_id: str


class RunInfo(ResponseModel):
    run_id: str
    name: str
    state: RunState = Field(description="waiting (for min_peers), running, finished, closed.")
    created_at: float
    closed_at: float | None
    current_round: int = Field(description="The open round, or the next to open.")
    config: RunConfig = Field(description="The run config with join tokens removed.")


class RunList(ResponseModel):
    runs: list[RunInfo]


# ---------------------------------------------------------------------------------------------
# Membership


class JoinRequest(RequestModel):
    public_key: HexKey = Field(description="Ed25519 public key, 32 bytes as hex.")
    join_token: ShortText | None = Field(None, description="Needed when join_policy is 'token'.")
    device: ShortText = Field("unknown", description="Accelerator description, for display.")
    listen_multiaddrs: list[Multiaddr] = Field(default_factory=list, max_length=MAX_ADDRS)
    bandwidth_mbps: float | None = Field(None, ge=0.0, le=1e7)
    uplink_mbps: float | None = Field(
        None,
        gt=0.0,
        le=1e7,
        description="The upload rate the peer's operator states for its link; peers "
        "lay out each packet's distribution tree with faster uplinks forwarding (node.exchange.topology.tree_parent).",
    )
    state_round: int | None = Field(
        None,
        ge=1,
        le=2**31,
        description="A returning peer's own state (its checkpoint): the round whose start "
        "it holds. If that is the open round and `state_digest` is the agreed digest for its start, the peer is "
        "expected in the open round at once (not from the next one, as a newcomer is).",
    )
    state_digest: ParamsDigest | None = Field(None, description="The parameter digest of that state.")
    pow_salt: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = Field(
        None,
        description="With `pow_nonce`: the salt of a join challenge (GET join-challenge) when the run asks "
        "new keys for proof of work (membership.join_pow_bits; protocol/join_pow.py).",
    )
    # 2**53: the largest integer every JSON reader holds exactly (a JavaScript number, a float).
    pow_nonce: int | None = Field(None, ge=0, le=2**53, description="The nonce that solves that challenge.")
    reachable: Literal[False] | None = Field(
        None,
        description="false: the node's operator says peers elsewhere cannot dial it (the coordinator then does not"
        " dial back); null: the coordinator dials back to find out (coordinator/reachability.py).",
    )


class PeerAddress(ResponseModel):
    peer_id: str
    multiaddrs: list[str]


class ParamsSource(ResponseModel):
    round: int = Field(description="The round these parameters start.")
    digest: str | None = Field(description="Agreed digest (never a provisional one); null: seeded initialisation.")
    holders: list[PeerAddress] = Field(description="Live peers that reported this digest.")
    mirror: MirroredSnapshot | None = Field(
        None, description="The newest agreed snapshot in the packet mirror (any round); null: none."
    )


class MirroredSnapshot(ResponseModel):
    """The newest agreed snapshot the packet mirror holds (see "Snapshots in the packet mirror")."""

    round: int = Field(description="The round whose start it is (it was uploaded after round - 1 was applied).")
    params_digest: str = Field(description="Its parameters' digest: round - 1's agreed digest.")
    snapshot_digest: str = Field(description="The snapshot digest its uploader reported (protocol/snapshot.py).")
    size_bytes: int = Field(description="Its length in bytes, as the PUT URL signed it.")
    url: str = Field(description="A presigned GET, valid at least half of mirror.url_ttl_s from when it was served.")


class JoinResponse(ResponseModel):
    run_id: str
    peer_id: str
    peer_index: int = Field(description="Stable per key, in order of first join.")
    data_shard: int
    num_shards: int
    config: RunConfig
    run_state: RunState
    current_round: int = Field(description="The open round, or the next to open.")
    params: ParamsSource
    dht_bootstrap: list[str]
    heartbeat_interval_s: float = Field(description="Suggested heartbeat period.")
    reachable: bool | None = Field(
        None,
        description="Whether the coordinator's dial-back to the node's listen ports from the address its join"
        " came from connected (null: it could not tell); false: peers elsewhere cannot dial it.",
    )


class JoinChallenge(ResponseModel):
    """What a new key solves before it joins a run that asks for proof of work (protocol/join_pow.py)."""

    run_id: str
    bits: int = Field(description="Leading zero bits the proof needs (membership.join_pow_bits); 0: no proof needed.")
    salt: str = Field(description="The current period's salt, 32 hex characters; empty when no proof is needed.")
    expires_at: float = Field(description="Unix time after which a proof with this salt is refused.")


class HeartbeatRequest(RequestModel):
    round: int = Field(ge=0, le=2**31, description="The round the peer is working on.")
    state: Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")] = Field(
        description="What the peer is doing: training, encoding, aggregating, catching_up..."
    )
    bandwidth_mbps: float | None = Field(None, ge=0.0, le=1e7)
    train_loss: float | None = Field(None, allow_inf_nan=False, ge=-1e9, le=1e9)
    listen_multiaddrs: list[Multiaddr] | None = Field(None, max_length=MAX_ADDRS)
    inner_step: int | None = Field(
        None, ge=0, le=MAX_INNER_STEPS, description="Inner steps done in `round` so far (null: not training)."
    )
    detail: Annotated[str, StringConstraints(pattern=r"^[\x20-\x7e]{1,%d}$" % MAX_DETAIL_CHARS)] | None = Field(
        None,
        description="With state 'stuck': one line saying what the peer waits for and from whom (printable "
        "ASCII); shown as the run's `stuck`. Null clears it.",
    )


class HeartbeatResponse(ResponseModel):
    run_state: RunState
    current_round: int
    round_state: RoundState
    deadline: float | None
    heartbeat_interval_s: float | None = Field(
        None,
        description="Seconds until the next heartbeat: longer in a bigger swarm, so the coordinator's load"
        " stays bounded (null: keep the period told at join).",
    )
    dial_peers: list[list[Multiaddr]] | None = Field(
        None,
        description="Only to a member nobody can dial: the listen multiaddrs (each ending in /p2p/<libp2p id>) of"
        " members loading a parameter snapshot now, one list per member, at most MAX_DIAL_PEERS. The member dials"
        " each, so that they can open their snapshot streams over its connection (null: none).",
    )


class LeaveRequest(RequestModel):
    reason: ShortText = "left"


class LeaveResponse(ResponseModel):
    peer_id: str
    status: PeerStatus


# ---------------------------------------------------------------------------------------------
# Rounds


class SubmitRequest(RequestModel):
    packet_digest: Sha256Hex = Field(description="sha256 of the packet bytes, hex.")
    packet_size_bytes: int = Field(ge=1, le=2**40)
    train_loss: float = Field(allow_inf_nan=False, ge=-1e9, le=1e9)
    compute_s: Seconds = 0.0
    encode_s: Seconds = 0.0
    multiaddrs: list[Multiaddr] | None = Field(
        None, max_length=MAX_ADDRS, description="Where to fetch the packet; default: join addrs."
    )
    peer_id: PeerId | None = Field(None, description="If given, must be the signing peer.")


class SubmitResponse(ResponseModel):
    run_id: str
    round: int
    peer_id: str
    num_submitted: int
    deadline: float
    mirror_put_url: str | None = Field(
        None,
        description="With a packet mirror (exchange.mirror): a presigned URL to PUT exactly the submitted"
        " packet_size_bytes into the store, valid at least half of mirror.url_ttl_s; null: no mirror.",
    )


class ManifestEntry(ResponseModel):
    peer_id: str
    packet_digest: str
    packet_size_bytes: int
    multiaddrs: list[str]
    public_key: str = Field("", description="The peer's Ed25519 key (hex), to verify its packet.")
    mirror_url: str | None = Field(
        None,
        description="With a packet mirror (exchange.mirror): a presigned URL to GET the packet from the store,"
        " one more holder, valid at least half of mirror.url_ttl_s from when it was served; null: no mirror.",
    )


class Pick(ResponseModel):
    """A submission to a bounded round as protocol/selection.py ranked it at the close."""

    picked: bool = Field(description="In the manifest.")
    proven: bool = Field(description="A packet in an earlier manifest, and credit once judged: the proven tier.")
    waited_rounds: int = Field(description="Rounds since its packet was last in a manifest (never: since it joined).")
    rank: int = Field(description="Its place in its tier, 1 first: waited longest, then the seeded hash.")
    tier_size: int = Field(description="Submissions in its tier.")
    tier_places: int = Field(description="Places the tier took in the manifest.")
    reason: str = Field(description='For a person: "not picked: proven rank 37 of 60, waited 2 rounds, ...".')


class RoundView(ResponseModel):
    run_id: str
    round: int
    state: RoundState = Field(description="pending (not opened yet), open or closed.")
    opened_at: float | None
    deadline: float | None
    closed_at: float | None
    num_submitted: int
    manifest: list[ManifestEntry] = Field(description="Sorted by peer_id; empty until closed.")
    submitted: list[ManifestEntry] = Field(
        default_factory=list,
        description="While open: the packets submitted so far, sorted by peer_id, so that peers can fetch "
        "them before the round closes (each enters the manifest when it closes); empty once closed.",
    )
    majority_digest: str | None = Field(
        description="The digest most votes name (votes: applied reports of the latest manifest version by the"
        " peers in it; see agreed_digest), agreed or provisional; null: no vote yet."
    )
    manifest_version: int = Field(
        1, description="1 when the round closes; one more at each amendment (entries dropped)."
    )
    dropped: dict[str, str] = Field(
        default_factory=dict, description="Entries amended out of the manifest, peer id -> why."
    )
    agreed_digest: str | None = Field(
        None,
        description="The round's agreed parameter digest: fixed once agreed (only a new manifest version"
        " starts a new vote); null while none is. The only digest a snapshot, a checkpoint or a flag trusts.",
    )
    provisional: bool = Field(False, description="A digest leads the votes (majority_digest) but is not agreed yet.")
    num_votes: int = Field(0, description="Votes cast on the latest manifest version.")
    picks: dict[str, Pick] = Field(
        default_factory=dict,
        description="Bounded rounds (outer.max_contributors): each submission, peer id -> its rank and"
        " whether the manifest took it; empty while open, and in an unbounded run.",
    )
    seed_round: int | None = Field(
        None,
        description="Bounded rounds: the round whose agreed digest seeded the pick (protocol/selection.py"
        " round_seed); null: none was agreed yet.",
    )


class PeerScoreReport(RequestModel):
    """One peer's update of the round, as the reporter scored it (node/training/scoring.py)."""

    loss_delta: float = Field(
        allow_inf_nan=False,
        ge=-MAX_ABS_LOSS_DELTA,
        le=MAX_ABS_LOSS_DELTA,
        description="Held-out loss (the reporter's data) after the update alone minus before; < 0 helps.",
    )
    cosine: float = Field(
        allow_inf_nan=False,
        ge=-1.0,
        le=1.0,
        description="Cosine with the reporter's own update of the round, on the coordinates this update holds.",
    )
    overlap: float = Field(
        0.0,
        allow_inf_nan=False,
        ge=0.0,
        le=1.0,
        description="The largest share of this"
        " update's entries (position and 2-bit code) that another packet of the round also holds (a copy: 1).",
    )
    overlap_with: list[PeerId] = Field(
        default_factory=list,
        max_length=8,
        description="The peers whose packets share scoring.copy_overlap of"
        " this update's entries (a copy of a copy shares all with both), else the one that shares the most.",
    )


class ParamsTree(RequestModel):
    """A parameter digest's hash tree (protocol/digest.py): the coordinator checks that it hashes to the
    reported digest, and compares the leaves of reports that differ to name the chunks they differ in."""

    header: str = Field(
        max_length=4 * MAX_TREE_HEADER_BYTES // 3 + 4,
        pattern=r"^[A-Za-z0-9+/]*={0,2}$",
        description="The canonical layout's header, base64.",
    )
    body_bytes: int = Field(ge=0, le=MAX_TREE_LEAVES * (4 << 20), description="The body's length in bytes.")
    leaves: str = Field(
        max_length=64 * MAX_TREE_LEAVES,
        pattern=r"^(?:[0-9a-f]{64})*$",
        description="The chunks' leaf hashes in order, each 64 lowercase hex characters.",
    )

    def tree(self):
        """The `protocol.digest.Tree`; ValueError when the fields do not make one."""
        import base64

        from protocol.digest import Tree

        leaves = bytes.fromhex(self.leaves)
        return Tree(
            base64.b64decode(self.header, validate=True),
            self.body_bytes,
            tuple(leaves[i : i + 32] for i in range(0, len(leaves), 32)),
        )

    def leaf_hex(self) -> list[str]:
        return [self.leaves[i : i + 64] for i in range(0, len(self.leaves), 64)]


class AppliedRequest(RequestModel):
    params_digest: ParamsDigest
    refused: dict[PeerId, ShortText] = Field(
        default_factory=dict,
        max_length=MAX_REFUSED,
        description="Manifest packets this peer left out, peer id -> reason (shown on the status page).",
        # Keys are peer ids and nothing else: said in the schema, not only by the validator.
        json_schema_extra={"additionalProperties": False},
    )
    manifest_version: int = Field(1, ge=1, le=2**31, description="The manifest version this peer applied.")
    val_loss: float | None = Field(
        None,
        allow_inf_nan=False,
        ge=0.0,
        le=1e9,
        description="Loss of the model after the round on fixed held-out batches, when this peer evaluated it "
        "(every eval_every_rounds rounds, node/config.py); null: not evaluated this round.",
    )
    scores: dict[PeerId, PeerScoreReport] = Field(
        default_factory=dict,
        max_length=MAX_SCORES,
        description="Contribution scores of the manifest's updates (protocol/scoring.py), peer id -> score; counted"
        " only from a report that is a vote, never for the reporter itself. Empty: not scored.",
        json_schema_extra={"additionalProperties": False},  # as `refused`: peer ids are the only keys
    )
    sample: SampleText | None = Field(
        None,
        description="A short text the model wrote after the round, sent with `val_loss` (at most "
        "MAX_SAMPLE_CHARS characters, no control characters but newline and tab); shown on the status page.",
    )
    tree: ParamsTree | None = Field(
        None,
        description="The hash tree of `params_digest` (it must hash to it): when reports differ, the "
        "coordinator names the chunks they differ in. Null for a model over MAX_TREE_LEAVES chunks.",
    )
    snapshot_bytes: int | None = Field(
        None,
        ge=1,
        le=2**44,
        description="In a round whose snapshot goes to the packet mirror: the size of the snapshot of the next"
        " round's start this peer serves, which a `snapshot_put_url` would sign; null: none.",
    )

    @model_validator(mode="after")
    def _tree_hashes_to_digest(self) -> "AppliedRequest":
        if self.tree is not None:
            try:
                root = self.tree.tree().hex
            except ValueError as e:
                raise ValueError(f"tree: {e}") from None
            if root != self.params_digest:
                raise ValueError(f"tree: its root is {root[:16]}..., not params_digest")
        return self


class AppliedResponse(ResponseModel):
    round: int
    majority_digest: str | None = Field(
        description="The digest most votes on the latest manifest version name (agreed or provisional); null"
        " while none came since an amendment."
    )
    agrees: bool = Field(
        description="This report is of the latest version and its digest is the majority (agreed or provisional)."
    )
    num_reports: int = Field(description="Reports of the latest manifest version (votes or not).")
    agreed_digest: str | None = Field(None, description="The round's agreed digest; null while none is (RoundView).")
    provisional: bool = Field(False, description="The majority digest is not agreed yet.")
    num_votes: int = Field(0, description="Votes on the latest version: reports of the peers in its manifest.")
    vote: bool = Field(False, description="Whether this report is a vote (its peer has a packet in that manifest).")
    manifest_version: int = Field(
        1, description="The round's latest manifest version: above the one reported, recompute from the start."
    )
    amended: dict[int, int] = Field(
        default_factory=dict,
        description="Rounds up to MISSING_REPORT_ROUNDS + 1 back from the open one whose manifest was amended,"
        " round -> latest version: a node that applied an older version of one of them recomputes or catches up.",
    )
    snapshot_put_url: str | None = Field(
        None,
        description="A presigned URL to PUT exactly the report's snapshot_bytes of the snapshot of round + 1's"
        " start into the packet mirror, then report it (POST rounds/{r}/snapshot); null: not this peer's to upload.",
    )


class MissingRequest(RequestModel):
    peer_ids: list[PeerId] = Field(
        default_factory=list,
        max_length=MAX_REFUSED,
        description="Entries of the round's manifest whose packets this peer could not fetch in time.",
    )
    lost_own: bool = Field(
        False,
        description="This peer no longer holds its own packet of the round (it restarted without it): "
        "its entry is dropped at once, unless a live contributor that applied the round (and reported nothing "
        "missing of it) serves a copy. `peer_ids` may then be empty.",
    )

    @model_validator(mode="after")
    def _reports_something(self) -> "MissingRequest":
        if not self.peer_ids and not self.lost_own:
            raise ValueError("name at least one entry in peer_ids, or set lost_own")
        return self


class SnapshotUploaded(RequestModel):
    """The snapshot of round r+1's start this peer PUT to the `snapshot_put_url` its round-r report got."""

    snapshot_digest: Sha256Hex = Field(description="Its snapshot digest (protocol/snapshot.py), hex.")
    size_bytes: int = Field(ge=1, le=2**44, description="Its length: the report's snapshot_bytes.")


class SnapshotRecorded(ResponseModel):
    round: int
    recorded: bool = Field(description="True: recorded now or before (a repeat changes nothing).")


class MissingResponse(ResponseModel):
    round: int
    manifest_version: int = Field(description="The round's latest manifest version.")
    dropped: dict[str, str] = Field(description="Every entry amended out of the round so far, peer id -> why.")
    pending: list[str] = Field(description="Entries reported missing (by anyone) and not dropped yet.")


# ---------------------------------------------------------------------------------------------
# Status (page, CLI, monitors)


class CurrentRound(ResponseModel):
    round: int
    state: RoundState
    opened_at: float | None
    deadline: float | None
    num_submitted: int
    num_expected: int = Field(
        description="Live peers the round waits for before it closes early (PeerView.waited_for)."
    )


class PeerScoreView(ResponseModel):
    """A peer's running contribution score (protocol/scoring.py's Standing)."""

    num_rounds: int = Field(description="Rounds with a verdict on its update.")
    num_hurt: int = Field(description="Of them, rounds in which a majority of its judges found it hurting.")
    recent_hurt: list[int] = Field(description="Hurting rounds among the latest scoring.window_rounds verdicts.")
    loss_delta: float | None = Field(description="Running median held-out loss delta (nats; < 0 helps).")
    cosine: float | None = Field(description="Running median cosine with the rounds' aggregates.")
    num_useful: int = Field(0, description="Rounds in which more than half of its judges' weight found it useful.")
    last_verdict: Literal["useful", "not_useful", "copy", "hurt"] | None = Field(
        None, description="Its latest verdict."
    )


class PeerView(ResponseModel):
    peer_id: str
    peer_index: int
    data_shard: int
    status: PeerStatus
    reason: str | None = Field(description="Why it is gone or left.")
    activity: str
    device: str
    bandwidth_mbps: float | None = Field(description="Measured on its last round's packet downloads.")
    uplink_mbps: float | None = Field(None, description="Its upload rate, as its operator stated it at join.")
    reachable: bool | None = Field(
        None, description="Whether peers elsewhere can dial it, as its latest join found (null: not known)."
    )
    last_loss: float | None
    last_seen_at: float
    heartbeat_interval_s: float | None = Field(
        None, description="The heartbeat period it was last told (null: none yet): expect a sign of life that often."
    )
    lag_rounds: int | None = Field(description="Current round minus the peer's latest round.")
    inner_step: int | None = Field(
        None, description="Inner steps done in the round it last reported working on (null: not reported)."
    )
    flags: list[str] = Field(
        description="'params_mismatch' when its digest differs from the round's agreed one; 'straggler' when the last "
        "closed round was cut off at its deadline without this live peer's packet; 'withheld_packet' when "
        "a packet of its was dropped from a manifest as unfetchable (it is not waited for until peers "
        "apply a later packet of its)."
    )
    mismatch_round: int | None
    listen_multiaddrs: list[str]
    standing: Literal["probation", "contributor", "not_waited"] = Field(
        "probation",
        description="'probation': none of its packets is in a manifest yet; 'contributor': it is;"
        " 'not_waited': it contributed once, but its recent rounds do not count (see standing_reason).",
    )
    standing_reason: str | None = Field(None, description="Why its standing is what it is, for a person.")
    waited_for: bool = Field(False, description="Whether the open round waits for its packet before closing early.")
    last_contributed_round: int | None = Field(
        None, description="The latest round whose manifest holds a packet of its (null: none)."
    )
    excluded: bool = Field(
        False,
        description="Its submissions are refused ('excluded'): its updates kept hurting, or it reported a"
        " digest the peers of credit did not compute (protocol/scoring.py).",
    )
    excluded_reason: str | None = Field(None, description="Why, with the verdicts that decided it; null: not excluded.")
    excluded_until_round: int | None = Field(
        None, description="The first round it may submit to again; null while excluded: for the rest of the run."
    )
    score: PeerScoreView | None = Field(None, description="Its running contribution score; null: never judged.")
    detail: str | None = Field(None, description="Its last heartbeat's `detail` (what it is stuck on); null: none.")
    credit: int = Field(
        0,
        description="Standing earned by useful work (protocol/scoring.py, rule 5): its weight as a judge of"
        " updates and as a voter on digests; new keys have none.",
    )
    credit_reason: str = Field("", description="Why its credit is what it is, for a person.")


class DisputeSide(ResponseModel):
    digest: str
    peers: list[str] = Field(description="The contributors whose votes named it.")
    credit: int = Field(description="Their credit, summed (as at the decision, for a decided dispute).")
    chunks: list[int] | None = Field(
        description="Chunks of the hash tree whose leaves differ from the agreed (or leading) digest's, at most 16;"
        " null when a side sent no tree."
    )


class Dispute(ResponseModel):
    """Votes on a round's latest manifest that name more than one digest (coordinator/disputes.py)."""

    sides: list[DisputeSide] = Field(description="The agreed (or leading) digest first.")
    decided: bool = Field(description="A digest was agreed: the verdict is final.")
    excluded: list[str] = Field(default_factory=list, description="Contributors excluded for a wrong digest.")
    verdict: str = Field(description="What the recomputation found, for a person.")


class RoundSummary(ResponseModel):
    round: int
    opened_at: float
    closed_at: float
    round_time_s: float
    num_contributors: int
    mean_loss: float | None
    majority_digest: str | None
    num_applied: int
    agreed_digest: str | None = Field(None, description="As in RoundView: fixed once agreed; null while none is.")
    provisional: bool = Field(False, description="The majority digest is not agreed yet.")
    num_votes: int = Field(0, description="Votes cast on the latest manifest version.")
    dispute: Dispute | None = Field(None, description="When the votes name more than one digest; null: none.")
    refused: dict[str, str] = Field(
        default_factory=dict,
        description="Manifest packets that peers left out, peer id -> reason (first report).",
    )
    tokens: int = Field(
        0, description="Tokens trained into the round: contributors x H x batch_size x seq_len of the run config."
    )
    packet_bytes: int = Field(0, description="Sizes of the packets submitted to the round, summed.")
    val_loss: float | None = Field(
        None,
        description="Validation loss of the model after the round: the mean of the peers' reports whose "
        "digest is the agreed one, else the majority's (peers evaluate every few rounds); null: none this round.",
    )
    compression_ratio: float | None = Field(
        None,
        description="How many times smaller the round's packets were than its updates sent dense: "
        "4 bytes x the model's parameters (protocol/model_sizes.py) x packets, over packet_bytes; null: no packet.",
    )
    num_picked: int | None = Field(
        None,
        description="Bounded rounds (outer.max_contributors): the submissions its manifest took"
        " (num_contributors counts them all); null: unbounded.",
    )
    not_picked: dict[str, str] = Field(
        default_factory=dict,
        description="Bounded rounds: the submissions left out, peer id -> why (RoundView.picks has them all).",
    )


class HeldState(ResponseModel):
    peer_id: str
    state_round: int | None = Field(description="The round start it said at join that it holds (its checkpoint).")
    agreed: bool = Field(description="Whether that state's digest is the run's agreed digest for that round start.")


class Recovery(ResponseModel):
    """A paused run: every peer stopped; it waits for a peer holding its state (coordinator/recovery.py)."""

    paused_since: float = Field(description="When the run lost its last live peer, unix seconds.")
    waiting_since: float | None = Field(description="When the first peer came back; null while none has.")
    round: int = Field(description="The open round; the run needs the agreed parameters that start it.")
    needed_digest: ParamsDigest | None = Field(description="Their digest; null for round 0 (the seeded start).")
    newest_held_round: int | None = Field(description="The newest agreed round start a live peer holds.")
    rewind_at: float | None = Field(
        description="When the run goes back to `newest_held_round` unless a peer holding round `round`'s start "
        "returns first; null when no live peer holds an agreed state."
    )
    held: list[HeldState] = Field(description="What each live peer holds.")
    last_holders: list[str] = Field(description="Peers that reported applying the needed state.")
    message: str = Field(description="The same, in one sentence.")


class Rewind(ResponseModel):
    at: float
    from_round: int
    to_round: int
    reason: str


class Sample(ResponseModel):
    round: int = Field(description="The round after which the model wrote it.")
    peer_id: str
    text: str = Field(description="The prompt and the model's continuation (text: escape it where it is shown).")


class RunStatus(ResponseModel):
    now: float
    run: RunInfo
    current_round: CurrentRound | None
    peers: list[PeerView]
    history: list[RoundSummary] = Field(description="Closed rounds, oldest first.")
    recovery: Recovery | None = Field(None, description="Set while the run is paused for want of live peers.")
    rewinds: list[Rewind] = Field(
        default_factory=list, description="Times the run went back to an older agreed state nobody newer held."
    )
    sample: Sample | None = Field(
        None, description="The newest text sample a peer sent with its validation loss; null: none yet."
    )
    snapshot_mirror: MirroredSnapshot | None = Field(
        None, description="The newest agreed snapshot in the packet mirror; null: none (or no mirror)."
    )
    stuck: str | None = Field(
        None,
        description="'stuck: <peer id>: <its detail>' for the first live peer (by id) whose last heartbeat "
        "said 'stuck' with a detail (catching up on a round whose packets nobody serves, say), ' (N peers)' after "
        "it when several did; null otherwise.",
    )


class Health(ResponseModel):
    status: Literal["ok"]
    server_time: float | None = Field(
        None,
        description="The coordinator's clock, unix seconds: nodes measure their clock's offset against it "
        "(the round trip's midpoint; node/cli/doctor.py). Null from coordinators older than the field.",
    )


# ---------------------------------------------------------------------------------------------
# Refusals


# Every code the coordinator answers with, by HTTP status; codes never change meaning. "Stops":
# the node client raises `Refused` for a final 4xx, and unless the round loop decides on the code
# the node ends with that error (its heartbeat task only logs refusals and keeps beating).
ErrorCode = Literal[
    # 400
    "bad_request",  # the request cannot be framed (Content-Length not a number). Stops: a client bug.
    "malformed_json",  # the body is not valid JSON. Stops: a client bug.
    # 401: who is calling is not established
    "unauthenticated",  # the 401 family's general code. Stops.
    "unsigned",  # signature headers missing, or peer id or nonce malformed. Stops: a client bug.
    "bad_signature",  # the Ed25519 signature does not cover this request. Stops: a wrong key or a proxy.
    "unknown_peer",  # the signing peer never joined any run, so no key to check. Stops (a node joins first).
    "stale_nonce",  # the nonce is over NONCE_WINDOW_S from the coordinator's clock. Stops: fix the clock.
    "replayed_nonce",  # this peer already used this nonce. Stops (a fresh nanosecond nonce per attempt).
    "admin_required",  # an admin call without 'Authorization: Bearer'. Nodes make none; operators add it.
    # 403: known caller, not allowed
    "forbidden",  # the 403 family's general code. Stops.
    "bad_admin_token",  # wrong admin token. Nodes make no admin calls; the operator checks the token.
    "peer_mismatch",  # the signer differs from the peer the body names (join key, submit peer_id). Stops.
    "join_refused",  # the run needs a join token, and none or a wrong one came. Stops: pass a valid token.
    "join_proof_required",  # the run asks new keys for proof of work; none came, or its salt expired. The node
    # client fetches a fresh challenge (GET join-challenge), solves it and joins again.
    "bad_join_proof",  # the proof of work does not solve the challenge. Stops: a client bug.
    "not_member",  # the signer never joined this run. Stops (a node joins before any other signed call).
    "excluded",  # submit by a peer whose updates kept hurting (PeerView.excluded_reason). The node
    # applies the round without its packet and trains on (its submissions are refused until excluded_until_round).
    # 404
    "not_found",  # no such route (or the 404 family's general code). Stops: a version mismatch.
    "run_not_found",  # no run with this id. Stops: a wrong run id.
    "round_not_found",  # the round never opened: the run ended first. A node waiting for it stops cleanly.
    # 405
    "method_not_allowed",  # the route exists, not with this method. Stops: a version mismatch.
    # 409: the run's state refuses the call
    "conflict",  # the 409 family's general code. Stops.
    "stale_round",  # submit to a round closed earlier (not just at its deadline). The node skips its packet.
    "future_round",  # submit to a round that has not opened. Stops (a node submits to the open round only).
    "late",  # submit past the round's deadline. The node skips its packet and applies the round.
    "round_not_open",  # submit while round 0 waits for min_peers. The node skips its packet.
    "round_not_closed",  # an applied report for a round with no manifest yet. Stops (reports follow it).
    "conflicting_submission",  # this peer already submitted another digest to the round (it caught up and
    #                            trained the round again). Goes on: the round keeps the first packet.
    "conflicting_report",  # this peer already reported another digest for this round and manifest version
    # (reports are immutable). The node's state is suspect: it catches up from the agreed state.
    "not_in_manifest",  # a missing report names a peer (or, lost_own, the reporter) with no entry in that round's
    # manifest. Stops: a bug.
    "round_too_old",  # a missing report for a round closed over MISSING_REPORT_ROUNDS ago. The node catches up.
    "unknown_manifest_version",  # an applied report names a version the round never had. Stops: a bug.
    "no_snapshot_url",  # a snapshot upload report from a peer handed no snapshot URL for that round, or of
    # another size. The node logs it (the mirror only helps); a bug.
    "peer_gone",  # the peer was marked gone (silent past the timeout) or left. The node rejoins, retries.
    "run_closed",  # the run is finished or closed: no joins or submissions. A node waiting for a round stops.
    # 413
    "body_too_large",  # the body is over the coordinator's limit, refused unread. Stops: a client bug.
    # 422: well-formed, but not a valid request
    "invalid_request",  # the body, path or query fails validation. Stops: a version mismatch or a bug.
    "packet_too_large",  # packet_size_bytes over the run's max_packet_bytes. Stops.
    "invalid_config",  # a run config the coordinator refuses (admin call). The operator fixes the config.
    # 429
    "rate_limited",  # the peer is over its request rate, or (join) its address or the run is over its rate of
    # new keys. The node client retries with backoff, waiting at least the Retry-After header's seconds.
    # other statuses
    "http_error",  # another status the HTTP framework raised. Stops if 4xx.
    "internal",  # 500: a coordinator bug (see its log). The node client retries with backoff, as on 5xx.
    # 503: the request changed nothing; its answer carries Retry-After
    "storage_unavailable",  # the coordinator's database failed (disk full, read-only, connection lost). Retry later.
]


class ErrorBody(ResponseModel):
    error: ErrorCode = Field(description="Machine-readable code, e.g. 'stale_round'.")
    detail: str


# ---------------------------------------------------------------------------------------------
# Request signing


def peer_id_from_public_key(public_key: bytes) -> str:
    """A stable id for a key: a peer that rejoins with its key keeps its id and data shard."""
    return "p" + hashlib.sha256(public_key).hexdigest()[:16]


def canonical_request_bytes(method: str, path: str, nonce: int, body: bytes) -> bytes:
    """The bytes a request signature covers (see the module docstring)."""
    body_hash = hashlib.sha256(body).hexdigest()
    return SIGNING_DOMAIN + f"{method.upper()}\n{path}\n{nonce}\n{body_hash}".encode()


def sign_request(key: PeerKey, method: str, path: str, body: bytes, nonce: int | None = None) -> dict[str, str]:
    """Headers that authenticate one request; a fresh nanosecond-clock nonce unless given."""
    if nonce is None:
        nonce = time.time_ns()
    signature = key.sign(canonical_request_bytes(method, path, nonce, body))
    return {
        PEER_HEADER: peer_id_from_public_key(key.public_bytes),
        NONCE_HEADER: str(nonce),
        SIGNATURE_HEADER: signature.hex(),
    }


def verify_request(public_key: bytes, method: str, path: str, body: bytes, nonce: int, signature_hex: str) -> None:
    """Raise `BadSignature` unless the signature covers this exact request."""
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError as e:
        raise BadSignature("signature is not hex") from e
    verify(public_key, canonical_request_bytes(method, path, nonce, body), signature)
