"""Who is calling: admin bearer tokens, signed peer requests, and a per-peer rate limit.

Peer requests carry an Ed25519 signature over method, path, nonce and body hash (the scheme is
`protocol.http.canonical_request_bytes`). Checks run cheapest-first and write nothing until the
signature verifies, so a forged request can neither burn a peer's nonces nor drain its rate
budget: header shape -> public key -> signature -> rate limit -> nonce window and replay.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Mapping

from coordinator import errors
from coordinator.service import CoordinatorService
from protocol.errors import BadSignature
from protocol.http import NONCE_HEADER, PEER_HEADER, SIGNATURE_HEADER, peer_id_from_public_key, verify_request

_PEER_ID = re.compile(r"^p[0-9a-f]{16}$")
_NONCE = re.compile(r"^[0-9]{1,19}$")
_SIGNATURE = re.compile(r"^[0-9a-f]{128}$")
MAX_NONCE = 2**63 - 1  # stored as BIGINT


class TokenBucket:
    """Per-key token buckets: `rate_per_s` sustained, `burst` at once. In memory on purpose: a
    restart forgetting the buckets only forgives a few requests."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 100_000):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, updated_at)

    def take(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, updated_at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - updated_at) * self.rate_per_s)
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._buckets.clear()  # bounded memory; resetting forgives, it never refuses
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True


class Authenticator:
    def __init__(
        self,
        service: CoordinatorService,
        admin_token: str,
        rate_per_s: float = 20.0,
        burst: float = 60.0,
    ):
        if len(admin_token) < 16:
            raise ValueError("the admin token must have at least 16 characters")
        self.service = service
        self._admin_token = admin_token.encode()
        self.rate_limit = TokenBucket(rate_per_s, burst)
        # Peer id -> public key, as stored at its first join. An id is derived from its key, so the
        # stored key never changes: every signed request after the first skips the lookup.
        self._keys: dict[str, bytes] = {}
        self.max_cached_keys = 100_000

    def require_admin(self, authorization: str | None) -> None:
        if not authorization or not authorization.startswith("Bearer "):
            raise errors.AdminRequired("this call needs 'Authorization: Bearer <admin token>'")
        offered = authorization.removeprefix("Bearer ").strip().encode()
        if not hmac.compare_digest(offered, self._admin_token):
            raise errors.BadAdminToken("wrong admin token")

    def is_admin(self, authorization: str | bytes | None) -> bool:
        """Whether an Authorization header value carries the admin token (no refusal raised)."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        try:
            self.require_admin(authorization)
        except (errors.Unauthenticated, errors.Forbidden):
            return False
        return True

    def verify_peer(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        public_key: bytes | None = None,
    ) -> str:
        """The id of the peer that signed this request, or a typed refusal. `public_key` is given
        for a join, where the body introduces the key; otherwise the stored key is used."""
        peer_id = headers.get(PEER_HEADER)
        nonce_text = headers.get(NONCE_HEADER)
        signature_hex = headers.get(SIGNATURE_HEADER)
        if peer_id is None or nonce_text is None or signature_hex is None:
            raise errors.Unsigned(f"peer calls need {PEER_HEADER}, {NONCE_HEADER} and {SIGNATURE_HEADER} headers")
        if not _PEER_ID.match(peer_id):
            raise errors.Unsigned(f"{PEER_HEADER} is not a peer id")
        if not _NONCE.match(nonce_text) or int(nonce_text) > MAX_NONCE:
            raise errors.Unsigned(f"{NONCE_HEADER} must be a non-negative 63-bit integer")
        if not _SIGNATURE.match(signature_hex):
            raise errors.BadRequestSignature(f"{SIGNATURE_HEADER} must be 64 bytes in hex")
        if public_key is None:
            public_key = self._keys.get(peer_id) or self._stored_key(peer_id)
        elif peer_id_from_public_key(public_key) != peer_id:
            raise errors.PeerMismatch(f"{PEER_HEADER} is not the id of the key being joined")
        nonce = int(nonce_text)
        try:
            verify_request(public_key, method, path, body, nonce, signature_hex)
        except BadSignature as e:
            raise errors.BadRequestSignature(f"signature does not verify for {peer_id}") from e
        if not self.rate_limit.take(peer_id):
            raise errors.RateLimited(f"peer {peer_id} is over {self.rate_limit.rate_per_s:g} req/s")
        self.service.record_nonce(peer_id, nonce)
        return peer_id

    def _stored_key(self, peer_id: str) -> bytes:
        public_key = self.service.views.public_key_of(peer_id)
        if public_key is None:
            raise errors.UnknownPeer(f"peer {peer_id} has never joined")
        if len(self._keys) >= self.max_cached_keys:
            self._keys.clear()  # bounded memory; a miss only costs a lookup
        self._keys[peer_id] = public_key
        return public_key
