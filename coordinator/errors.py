"""Typed refusals of the coordinator, each with its HTTP status and machine-readable code.

The service raises these; the HTTP layer turns every one into ``{"error": code, "detail": text}``
with the class's status, and answers what it refuses itself (malformed JSON, unknown routes and
methods, a body over the limit, an unhandled error) with these classes too. Nodes branch on the code
(e.g. ``late`` -> skip the round, ``peer_gone`` -> rejoin), so every code is a member of
`protocol.http.ErrorCode`, the contract, and never changes meaning; a class whose code is not
one fails at import.
"""

from __future__ import annotations

from typing import get_args

from protocol.http import ErrorCode


class CoordinatorError(Exception):
    """A request was refused. Subclasses fix `status` and `code`."""

    status = 400
    code: ErrorCode = "bad_request"
    retry_after_s: int | None = None  # sent as Retry-After when set

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.code not in get_args(ErrorCode):
            raise TypeError(f"{cls.__name__}.code {cls.code!r} is not in protocol.http.ErrorCode")


class BadRequest(CoordinatorError):
    """The request cannot be read: its framing, or (`MalformedJson`) its body."""


class MalformedJson(BadRequest):
    code = "malformed_json"


class Unauthenticated(CoordinatorError):
    status = 401
    code = "unauthenticated"


class Unsigned(Unauthenticated):
    code = "unsigned"


class BadRequestSignature(Unauthenticated):
    code = "bad_signature"


class UnknownPeer(Unauthenticated):
    code = "unknown_peer"


class StaleNonce(Unauthenticated):
    code = "stale_nonce"


class ReplayedNonce(Unauthenticated):
    code = "replayed_nonce"


class AdminRequired(Unauthenticated):
    code = "admin_required"


class Forbidden(CoordinatorError):
    status = 403
    code = "forbidden"


class BadAdminToken(Forbidden):
    code = "bad_admin_token"


class Excluded(Forbidden):
    """A submission of a peer excluded by contribution scoring (protocol/scoring.py)."""

    code = "excluded"


class PeerMismatch(Forbidden):
    code = "peer_mismatch"


class JoinRefused(Forbidden):
    code = "join_refused"


class NotMember(Forbidden):
    code = "not_member"


class JoinProofRequired(Forbidden):
    """The run asks new keys for proof of work and none came, or its challenge expired."""

    code = "join_proof_required"


class BadJoinProof(Forbidden):
    code = "bad_join_proof"


class NotFound(CoordinatorError):
    status = 404
    code = "not_found"


class RunNotFound(NotFound):
    code = "run_not_found"


class RoundNotFound(NotFound):
    code = "round_not_found"


class Conflict(CoordinatorError):
    status = 409
    code = "conflict"


class StaleRoundRefused(Conflict):
    code = "stale_round"


class FutureRound(Conflict):
    code = "future_round"


class Late(Conflict):
    code = "late"


class RoundNotOpen(Conflict):
    code = "round_not_open"


class RoundNotClosed(Conflict):
    code = "round_not_closed"


class ConflictingSubmission(Conflict):
    code = "conflicting_submission"


class ConflictingReport(Conflict):
    """A peer's applied report for a round and manifest version is immutable."""

    code = "conflicting_report"


class NotInManifest(Conflict):
    code = "not_in_manifest"


class RoundTooOld(Conflict):
    code = "round_too_old"


class UnknownManifestVersion(Conflict):
    code = "unknown_manifest_version"


class NoSnapshotUrl(Conflict):
    """A snapshot upload report the coordinator handed no URL for (that round, that size)."""

    code = "no_snapshot_url"


class PeerGone(Conflict):
    code = "peer_gone"


class RunClosed(Conflict):
    code = "run_closed"


class BodyTooLarge(CoordinatorError):
    status = 413
    code = "body_too_large"


class InvalidRequest(CoordinatorError):
    status = 422
    code = "invalid_request"


class PacketTooLarge(InvalidRequest):
    code = "packet_too_large"


class InvalidConfig(InvalidRequest):
    code = "invalid_config"


class RateLimited(CoordinatorError):
    status = 429
    code = "rate_limited"

    def __init__(self, detail: str, retry_after_s: int | None = None):
        super().__init__(detail)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s  # when the caller may try again, sent as Retry-After


class MethodNotAllowed(CoordinatorError):
    status = 405
    code = "method_not_allowed"


class HttpError(CoordinatorError):
    """Another error status raised by the HTTP framework; the answer keeps that status."""

    code = "http_error"


class Internal(CoordinatorError):
    """Not a refusal: an unhandled error (a bug), answered without its details."""

    status = 500
    code = "internal"


class StorageUnavailable(CoordinatorError):
    """Not a refusal: the database failed the operation (disk full, read-only, locked, connection
    lost). Its transaction was rolled back, so nothing half-done is kept; the caller retries after
    `retry_after_s`. `coordinator.storage` raises it for every failure of the database engine."""

    status = 503
    code = "storage_unavailable"
    retry_after_s = 5


class StorageError(Exception):
    """The database cannot be opened or used; not a refusal of the request."""
