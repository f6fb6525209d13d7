"""The coordinator's HTTP contract: run configuration, request/response models, request signing.

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
POST /v1/runs/{run_id}/join                 S*    JoinRequest          JoinResponse
POST /v1/runs/{run_id}/heartbeat            S     HeartbeatRequest     HeartbeatResponse
POST /v1/runs/{run_id}/leave                S     LeaveRequest         LeaveResponse
POST /v1/runs/{run_id}/rounds/{r}/submit    S     SubmitRequest        SubmitResponse
GET  /v1/runs/{run_id}/rounds/{r}?wait_s=W  -                          RoundView
POST /v1/runs/{run_id}/rounds/{r}/applied   S     AppliedRequest       AppliedResponse
GET  /v1/runs/{run_id}/status?history=N     -                          RunStatus
GET  /healthz, GET /metrics, GET /?run=ID   -     (JSON, Prometheus text, HTML page)
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
codes a node must handle: ``stale_round``/``future_round``/``late``/``round_not_open``/
``conflicting_submission``/``peer_gone``/``run_closed`` (409), ``rate_limited`` (429).

Rounds: round 0 opens once ``min_peers`` peers are live; round r closes at its deadline, or as soon
as every live peer that was a member when r opened has submitted; closing fixes the manifest
(exactly the accepted submissions, sorted by peer id) and opens r+1 at once. A peer that joins
while r is open is expected from r+1 on, but may still submit to r before its deadline.
``JoinResponse.params.round`` is the round whose start the listed parameters are: after applying
round r's manifest a peer holds the parameters that start round r+1. While no round has an applied
digest it is 0 with ``digest`` null: start from the seeded initialisation.

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
      -> {"run_id": .., "round": 8, "peer_id": .., "num_submitted": 5, "deadline": 1.7e9}
         (a repeat with the same digest answers the same; another digest: 409)
    GET rounds/8?wait_s=30
      -> {"run_id": .., "round": 8, "state": "closed", "opened_at": .., "deadline": ..,
          "closed_at": .., "num_submitted": 6, "majority_digest": null,
          "manifest": [{"peer_id": .., "packet_digest": .., "packet_size_bytes": ..,
                        "multiaddrs": [..]}, ...]}      (manifest is [] until closed)
    POST rounds/8/applied {"params_digest": hex, "refused": {"p9e..": "BadSignature: .."}}
      -> {"round": 8, "majority_digest": hex, "agrees": true, "num_reports": 4}

Submit ``multiaddrs`` defaults to the join's ``listen_multiaddrs``. A peer marked gone (silent
past ``heartbeat_timeout_s``) or that left gets ``peer_gone`` on every signed call and rejoins.

Requests forbid unknown fields (hostile input); responses ignore them, so a node keeps working
against a newer coordinator that adds fields.
"""

from __future__ import annotations

import hashlib
import time
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag, ValidationError

from protocol.errors import BadSignature
from protocol.signing import PeerKey, verify

API_PREFIX = "/v1"
PEER_HEADER = "X-Locoswarm-Peer"
NONCE_HEADER = "X-Locoswarm-Nonce"
SIGNATURE_HEADER = "X-Locoswarm-Signature"
NONCE_WINDOW_S = 300.0
SIGNING_DOMAIN = b"locoswarm-request-v1\n"
MAX_LONG_POLL_S = 60.0

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# Parameter digests are whatever hash the node uses; only their shape is checked here.
ParamsDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,128}$")]
PeerId = Annotated[str, StringConstraints(pattern=r"^p[0-9a-f]{16}$")]
RunId = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$")]
Multiaddr = Annotated[str, StringConstraints(pattern=r"^/[\x21-\x7e]{1,255}$")]
ShortText = Annotated[str, StringConstraints(max_length=256)]
Seconds = Annotated[float, Field(ge=0.0, le=1e12)]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
MAX_ADDRS = 16
MAX_REFUSED = 64


class RequestModel(BaseModel):
    """Input from the network: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ResponseModel(BaseModel):
    """Output to the network: unknown fields ignored so older readers keep working."""

    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------
# Run configuration


class FixedDeadline(RequestModel):
    """Each round gets a fixed time from its opening; it closes earlier when all expected peers
    submitted. A tagged model so an adaptive policy can be added beside it later."""

    kind: Literal["fixed"] = Field("fixed", description="Deadline policy tag.")
    round_timeout_s: float = Field(
        120.0, gt=0.0, le=86400.0, description="Seconds from a round's opening to its deadline."
    )


class AdaptiveDeadline(RequestModel):
    """Each round's deadline follows the swarm: a quantile of how long peers took to submit in
    the last rounds (from the round's opening: fetching and applying the previous round, then
    training and encoding), times a margin, within bounds. Stragglers past it are cut off."""

    kind: Literal["adaptive"] = Field("adaptive", description="Deadline policy tag.")
    initial_s: float = Field(120.0, gt=0.0, le=86400.0, description="Timeout until there is history.")
    quantile: float = Field(0.9, gt=0.0, le=1.0, description="Quantile of recent submission times.")
    margin: float = Field(1.5, ge=1.0, le=100.0, description="Multiplier on that quantile.")
    min_s: float = Field(5.0, gt=0.0, le=86400.0, description="Lower bound of a round's timeout.")
    max_s: float = Field(3600.0, gt=0.0, le=86400.0, description="Upper bound of a round's timeout.")
    window_rounds: int = Field(5, ge=1, le=1000, description="Closed rounds the quantile looks at.")


def _deadline_kind(value) -> str:
    """The policy's tag; a policy without one is the fixed timeout (older configs)."""
    if isinstance(value, dict):
        return value.get("kind", "fixed")
    return getattr(value, "kind", "fixed")


_DEADLINE_TAGS = ("fixed", "adaptive")
DeadlinePolicy = Annotated[
    Annotated[FixedDeadline, Tag("fixed")] | Annotated[AdaptiveDeadline, Tag("adaptive")],
    Discriminator(_deadline_kind),
]


class RunConfig(RequestModel):
    """Everything that defines a training run. Loaded from TOML (`load_run_config`) or JSON."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Human-readable run name."
    )
    preset: Literal["tiny", "mini", "small", "512m", "1b"] = Field(description="Model size preset.")
    strategy: Literal["sparseloco", "diloco", "ddp"] = Field(
        "sparseloco", description="Outer algorithm: SparseLoCo or a baseline."
    )
    inner_steps: int = Field(15, ge=1, le=100_000, description="H: inner AdamW steps per round.")
    inner_lr: float = Field(1e-3, gt=0.0, le=1.0, description="Inner AdamW peak learning rate.")
    inner_betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95), strict=False, description="Inner AdamW (beta1, beta2), each in [0, 1)."
    )
    inner_weight_decay: float = Field(0.1, ge=0.0, le=10.0, description="Inner AdamW decay.")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Grad-norm clip; 0 disables.")
    warmup_steps: int = Field(100, ge=0, le=10_000_000, description="Linear warm-up steps.")
    total_steps: int = Field(
        10_000, ge=1, le=100_000_000, description="Inner steps of the cosine schedule."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of peak.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Sequences per inner step per peer.")
    seq_len: int = Field(1024, ge=8, le=131_072, description="Tokens per sequence.")
    outer_lr: float = Field(1.0, gt=0.0, le=10.0, description="Outer SGD learning rate.")
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0, description="Outer SGD momentum.")
    nesterov: bool = Field(False, description="Nesterov outer momentum (DiLoCo baseline).")
    top_k: int = Field(64, ge=1, le=4096, description="Values kept per 4096-element chunk.")
    chunk_size: int = Field(64, ge=1, le=1024, description="Tile side for 2-D tensors.")
    error_decay: float = Field(0.95, ge=0.0, le=1.0, description="Error-feedback decay beta.")
    clip_to_median_norm: bool = Field(
        False,
        description="Scale down each peer's decoded update whose norm exceeds the round's median"
        " (bounds a poisoning peer; SparseLoCo only).",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for initialisation and data order.")
    max_packet_bytes: int = Field(
        64 * 2**20, ge=1024, le=2**34, description="Largest packet a peer may announce."
    )
    deadline_policy: DeadlinePolicy = Field(
        default_factory=FixedDeadline, description="When a round's deadline falls."
    )
    overlap: bool = Field(
        False, description="One-round-delayed outer step: train round r+1 while round r's packets move."
    )
    tree_fanout: int = Field(
        2, ge=1, le=64,
        description="Copies each peer forwards of a packet in its distribution tree: 1 is a chain (the"
        " fastest on even links; a slow peer slows every peer after it), 2 a binary tree.",
    )
    min_peers: int = Field(1, ge=1, le=100_000, description="Peers needed before round 0 opens.")
    max_rounds: int | None = Field(
        None, ge=1, le=100_000_000, description="The run finishes after this many rounds."
    )
    heartbeat_timeout_s: float = Field(
        60.0, ge=1.0, le=86400.0, description="Silence after which a peer is marked gone."
    )
    num_data_shards: int = Field(
        1024, ge=1, le=1_000_000, description="Dataset shards; a peer reads peer_index % this."
    )
    dht_bootstrap: list[Multiaddr] = Field(
        default_factory=list, max_length=64, description="Multiaddrs of DHT bootstrap peers."
    )
    join_policy: Literal["open", "token"] = Field(
        "open", description="Whether joining needs one of `join_tokens`."
    )
    join_tokens: list[Annotated[str, StringConstraints(min_length=8, max_length=256)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Join tokens (or 'sha256:<hex>' of one); stored hashed, never returned.",
    )
    data: str | None = Field(None, max_length=1024, description="Dataset name or path.")

    def redacted(self) -> "RunConfig":
        """The config as shown to anyone: join tokens removed."""
        return self.model_copy(update={"join_tokens": []})


class ConfigError(ValueError):
    """A run config file could not be read or does not validate; the message names the key."""


def load_run_config(path: Path) -> RunConfig:
    """Read and validate a TOML (or JSON, by suffix) run config file."""
    path = Path(path)
    try:
        raw_text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    try:
        if path.suffix == ".json":
            return RunConfig.model_validate_json(raw_text)
        return RunConfig.model_validate(tomllib.loads(raw_text))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe_validation_error(e)}") from e


def describe_validation_error(error: ValidationError) -> str:
    """One line naming each bad key: 'inner_lr: Input should be greater than 0'."""
    parts = []
    for item in error.errors():
        loc = item["loc"]
        # Drop the tag pydantic puts after a tagged union's field name ("deadline_policy.fixed.x").
        loc = [p for i, p in enumerate(loc) if not (i and loc[i - 1] == "deadline_policy" and p in _DEADLINE_TAGS)]
        key = ".".join(str(p) for p in loc) or "(top level)"
        parts.append(f"{key}: {item['msg']}")
    return "; ".join(parts)


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
        None, gt=0.0, le=1e7, description="The upload rate the peer's operator states for its link; peers "
        "lay out each packet's distribution tree with faster uplinks forwarding (node.exchange.tree_parent).")


class PeerAddress(ResponseModel):
    peer_id: str
    multiaddrs: list[str]


class ParamsSource(ResponseModel):
    round: int = Field(description="The round these parameters start.")
    digest: str | None = Field(description="Majority digest; null: seeded initialisation.")
    holders: list[PeerAddress] = Field(description="Live peers that reported this digest.")


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


class HeartbeatRequest(RequestModel):
    round: int = Field(ge=0, le=2**31, description="The round the peer is working on.")
    state: Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")] = Field(
        description="What the peer is doing: training, encoding, aggregating, catching_up..."
    )
    bandwidth_mbps: float | None = Field(None, ge=0.0, le=1e7)
    train_loss: float | None = Field(None, allow_inf_nan=False, ge=-1e9, le=1e9)
    listen_multiaddrs: list[Multiaddr] | None = Field(None, max_length=MAX_ADDRS)


class HeartbeatResponse(ResponseModel):
    run_state: RunState
    current_round: int
    round_state: RoundState
    deadline: float | None


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


class ManifestEntry(ResponseModel):
    peer_id: str
    packet_digest: str
    packet_size_bytes: int
    multiaddrs: list[str]
    public_key: str = Field("", description="The peer's Ed25519 key (hex), to verify its packet.")


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
    majority_digest: str | None = Field(description="Most reported params digest after apply.")


class AppliedRequest(RequestModel):
    params_digest: ParamsDigest
    refused: dict[PeerId, ShortText] = Field(
        default_factory=dict,
        max_length=MAX_REFUSED,
        description="Manifest packets this peer left out, peer id -> reason (shown on the status page).",
    )


class AppliedResponse(ResponseModel):
    round: int
    majority_digest: str
    agrees: bool
    num_reports: int


# ---------------------------------------------------------------------------------------------
# Status (page, CLI, monitors)


class CurrentRound(ResponseModel):
    round: int
    state: RoundState
    opened_at: float | None
    deadline: float | None
    num_submitted: int
    num_expected: int = Field(description="Live peers that were members when it opened.")


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
    last_loss: float | None
    last_seen_at: float
    lag_rounds: int | None = Field(description="Current round minus the peer's latest round.")
    flags: list[str] = Field(
        description="'params_mismatch' when its digest lost the majority; 'straggler' when the last "
        "closed round was cut off at its deadline without this live peer's packet."
    )
    mismatch_round: int | None
    listen_multiaddrs: list[str]


class RoundSummary(ResponseModel):
    round: int
    opened_at: float
    closed_at: float
    round_time_s: float
    num_contributors: int
    mean_loss: float | None
    majority_digest: str | None
    num_applied: int
    refused: dict[str, str] = Field(
        default_factory=dict,
        description="Manifest packets that peers left out, peer id -> reason (first report).",
    )


class RunStatus(ResponseModel):
    now: float
    run: RunInfo
    current_round: CurrentRound | None
    peers: list[PeerView]
    history: list[RoundSummary] = Field(description="Closed rounds, oldest first.")


class Health(ResponseModel):
    status: Literal["ok"]


class ErrorBody(ResponseModel):
    error: str = Field(description="Machine-readable code, e.g. 'stale_round'.")
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


def sign_request(
    key: PeerKey, method: str, path: str, body: bytes, nonce: int | None = None
) -> dict[str, str]:
    """Headers that authenticate one request; a fresh nanosecond-clock nonce unless given."""
    if nonce is None:
        nonce = time.time_ns()
    signature = key.sign(canonical_request_bytes(method, path, nonce, body))
    return {
        PEER_HEADER: peer_id_from_public_key(key.public_bytes),
        NONCE_HEADER: str(nonce),
        SIGNATURE_HEADER: signature.hex(),
    }


def verify_request(
    public_key: bytes, method: str, path: str, body: bytes, nonce: int, signature_hex: str
) -> None:
    """Raise `BadSignature` unless the signature covers this exact request."""
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError as e:
        raise BadSignature("signature is not hex") from e
    verify(public_key, canonical_request_bytes(method, path, nonce, body), signature)
