"""What the node does when the coordinator refuses a call: one table, `ACTIONS`, from code to action.

    except Refused as e:                       # node/round/coordinator_client.py
        if e.action is Action.DROP_PACKET: ...  # e.code: a `Code` (a plain string for a code unknown here)

The coordinator refuses with a 4xx status and a code of `protocol.http.ErrorCode` (its error
classes, coordinator/errors.py, carry the same codes). `Code` is that list as an enum, checked at
import to hold exactly its codes, and `ACTIONS` names, for every code, what the node does:

    RETRY        the client calls again: after a pause (429 rate_limited, 5xx: never raised as
                 `Refused`), or with a fresh proof of work (join_proof_required, three tries)
    REJOIN       join again with the same key, then repeat the call (Session.signed): peer_gone
    CATCH_UP     this node's state is suspect or too old: it loads the swarm's agreed state
                 (conflicting_report, round_too_old)
    DROP_PACKET  a submission refused: the round goes on without this node's packet, the node
                 applies it all the same, and its update stays in the error buffer (late,
                 stale_round, round_not_open, excluded, conflicting_submission)
    RUN_OVER     the run ended: a submission is dropped, the round loop ends cleanly, a join is
                 refused with a line (run_closed, round_not_found)
    STOP         the call fails and the node stops with one line (`STOP_LINES`, else the code and
                 detail): a set-up to fix (join_refused, stale_nonce, run_not_found), a version
                 mismatch or a bug (invalid_request, not_member, ...)

A code this node does not know (a newer coordinator's) is a STOP. Three calls decide alone, on any
refusal: a report of packets it could not fetch that is refused leaves the node catching up
(amend.py, catchup.py), a join challenge answered `not_found` comes from a coordinator older
than proofs of work, which asks for none (coordinator_client.py), and a refused report of a
snapshot uploaded to the packet mirror is logged (snapshots.py: the mirror only helps).
"""

from __future__ import annotations

import enum
from typing import get_args

from protocol.http import ErrorCode


class Code(str, enum.Enum):
    """`protocol.http.ErrorCode`, member by member (what each means: the comments there). A `str`:
    it compares equal to, and prints as, its code (enum.StrEnum is Python 3.11+; this runs on 3.10)."""

    def __str__(self) -> str:
        return self.value

    BAD_REQUEST = "bad_request"
    MALFORMED_JSON = "malformed_json"
    UNAUTHENTICATED = "unauthenticated"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_PEER = "unknown_peer"
    STALE_NONCE = "stale_nonce"
    REPLAYED_NONCE = "replayed_nonce"
    ADMIN_REQUIRED = "admin_required"
    FORBIDDEN = "forbidden"
    BAD_ADMIN_TOKEN = "bad_admin_token"
    PEER_MISMATCH = "peer_mismatch"
    JOIN_REFUSED = "join_refused"
    JOIN_PROOF_REQUIRED = "join_proof_required"
    BAD_JOIN_PROOF = "bad_join_proof"
    NOT_MEMBER = "not_member"
    EXCLUDED = "excluded"
    NOT_FOUND = "not_found"
    RUN_NOT_FOUND = "run_not_found"
    ROUND_NOT_FOUND = "round_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    STALE_ROUND = "stale_round"
    FUTURE_ROUND = "future_round"
    LATE = "late"
    ROUND_NOT_OPEN = "round_not_open"
    ROUND_NOT_CLOSED = "round_not_closed"
    CONFLICTING_SUBMISSION = "conflicting_submission"
    CONFLICTING_REPORT = "conflicting_report"
    NOT_IN_MANIFEST = "not_in_manifest"
    ROUND_TOO_OLD = "round_too_old"
    UNKNOWN_MANIFEST_VERSION = "unknown_manifest_version"
    NO_SNAPSHOT_URL = "no_snapshot_url"
    PEER_GONE = "peer_gone"
    RUN_CLOSED = "run_closed"
    BODY_TOO_LARGE = "body_too_large"
    INVALID_REQUEST = "invalid_request"
    PACKET_TOO_LARGE = "packet_too_large"
    INVALID_CONFIG = "invalid_config"
    RATE_LIMITED = "rate_limited"
    HTTP_ERROR = "http_error"
    INTERNAL = "internal"
    STORAGE_UNAVAILABLE = "storage_unavailable"


class Action(enum.Enum):
    """What the node does about a refusal (see the module docstring)."""

    RETRY = "retry"
    REJOIN = "rejoin"
    CATCH_UP = "catch up"
    DROP_PACKET = "drop the packet"
    RUN_OVER = "run over"
    STOP = "stop"


# Every code, in protocol.http.ErrorCode's order.
ACTIONS: dict[Code, Action] = {
    # 400, 401: the request or its signature; the node's own bug, its key or its clock
    Code.BAD_REQUEST: Action.STOP,
    Code.MALFORMED_JSON: Action.STOP,
    Code.UNAUTHENTICATED: Action.STOP,
    Code.UNSIGNED: Action.STOP,
    Code.BAD_SIGNATURE: Action.STOP,
    Code.UNKNOWN_PEER: Action.STOP,
    Code.STALE_NONCE: Action.STOP,  # this machine's clock: STOP_LINES says so
    Code.REPLAYED_NONCE: Action.STOP,
    Code.ADMIN_REQUIRED: Action.STOP,  # nodes make no admin calls
    # 403
    Code.FORBIDDEN: Action.STOP,
    Code.BAD_ADMIN_TOKEN: Action.STOP,
    Code.PEER_MISMATCH: Action.STOP,
    Code.JOIN_REFUSED: Action.STOP,  # no or a wrong join token: STOP_LINES says which flag
    Code.JOIN_PROOF_REQUIRED: Action.RETRY,  # with a fresh challenge solved (CoordinatorClient.join)
    Code.BAD_JOIN_PROOF: Action.STOP,
    Code.NOT_MEMBER: Action.STOP,
    Code.EXCLUDED: Action.DROP_PACKET,  # its updates kept hurting: it applies rounds and trains on
    # 404, 405
    Code.NOT_FOUND: Action.STOP,  # a version mismatch (but for the join challenge: see above)
    Code.RUN_NOT_FOUND: Action.STOP,
    Code.ROUND_NOT_FOUND: Action.RUN_OVER,  # the run ended before the round opened
    Code.METHOD_NOT_ALLOWED: Action.STOP,
    # 409: the run's state
    Code.CONFLICT: Action.STOP,
    Code.STALE_ROUND: Action.DROP_PACKET,
    Code.FUTURE_ROUND: Action.STOP,
    Code.LATE: Action.DROP_PACKET,
    Code.ROUND_NOT_OPEN: Action.DROP_PACKET,
    Code.ROUND_NOT_CLOSED: Action.STOP,
    Code.CONFLICTING_SUBMISSION: Action.DROP_PACKET,  # the round keeps the first packet
    Code.CONFLICTING_REPORT: Action.CATCH_UP,  # it reported another digest before: one of them is wrong
    Code.NOT_IN_MANIFEST: Action.STOP,
    Code.ROUND_TOO_OLD: Action.CATCH_UP,
    Code.UNKNOWN_MANIFEST_VERSION: Action.STOP,
    Code.NO_SNAPSHOT_URL: Action.STOP,  # its only caller (snapshots.py) logs it: the mirror only helps
    Code.PEER_GONE: Action.REJOIN,
    Code.RUN_CLOSED: Action.RUN_OVER,
    # 413, 422: a body the coordinator will not take
    Code.BODY_TOO_LARGE: Action.STOP,
    Code.INVALID_REQUEST: Action.STOP,
    Code.PACKET_TOO_LARGE: Action.STOP,
    Code.INVALID_CONFIG: Action.STOP,
    # 429, 5xx: retried by the client with backoff, for as long as the call's budget allows
    Code.RATE_LIMITED: Action.RETRY,
    Code.HTTP_ERROR: Action.STOP,
    Code.INTERNAL: Action.RETRY,
    Code.STORAGE_UNAVAILABLE: Action.RETRY,
}

# The line a volunteer reads when one of these stops the node (node/cli/join.py fills in the
# fields); any other refusal reads "the coordinator at URL refused: STATUS CODE: DETAIL".
STOP_LINES: dict[Code, str] = {
    Code.RUN_NOT_FOUND: "{run} does not exist on {coordinator}: {runs_hint}",
    Code.RUN_CLOSED: "{detail}: nothing to join; {runs_hint}",
    Code.JOIN_REFUSED: "{run} refused this node: {detail}; pass the join token from the run's operator with --token T",
    Code.STALE_NONCE: "the coordinator refused this node's clock: {detail}",
    # A URL with a path (/v1, a status page's) reaches the coordinator, but none of its routes.
    Code.NOT_FOUND: "{coordinator} has no such route ({detail}): give the coordinator's base URL, http://host:port"
    " without /v1 or a page's path; otherwise this node and the coordinator run different versions"
    " (`locoswarm version` on both)",
}


def code_of(wire: str) -> Code | str:
    """The `Code` of a refusal's code as it came on the wire; a code unknown here stays the string."""
    try:
        return Code(wire)
    except ValueError:
        return wire


def action_of(code: Code | str) -> Action:
    """What the node does about `code`; a code unknown here stops it."""
    return ACTIONS[code] if isinstance(code, Code) else Action.STOP


# Checked at import, as every wire type's decoder is: a code added to the protocol needs its row here.
_drift = {code.value for code in Code} ^ set(get_args(ErrorCode)) | {code.value for code in set(Code) - set(ACTIONS)}
if _drift:
    raise ImportError(f"node.round.refusals: Code, ACTIONS and protocol.http.ErrorCode differ in {sorted(_drift)}")
