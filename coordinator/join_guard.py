"""What a new key must get past to join a run: the join rate limits and the proof of work.

Identities are free (a key is 32 random bytes), so the coordinator prices new ones: per run, new
keys are rate-limited per source address and for the whole run (token buckets: a burst, then a
sustained rate per minute, both from ``membership``), and an operator may ask each for a proof of
work (``membership.join_pow_bits``, protocol/join_pow.py). Only keys that are not members of the
run yet pay; a member rejoins freely (its own requests are rate-limited per peer by
coordinator/auth.py).

The buckets live in memory: a restart forgets them, which only forgives a burst. The proof's salt
is derived from a per-run secret kept in the database (``runs.join_secret``) and the period
number, so it survives restarts, changes every ``JOIN_POW_PERIOD_S`` and cannot be computed by
anyone else ahead of time. Checking a proof costs two HMACs and one hash.
"""

from __future__ import annotations

import hashlib
import hmac
import math

from coordinator import errors
from protocol.join_pow import JOIN_POW_PERIOD_S, meets
from protocol.run_config import MembershipSection

MAX_BUCKETS = 100_000  # source addresses remembered per coordinator; beyond it, all are forgotten


class Buckets:
    """Token buckets by key, each with its own rate and burst (a run's config), on a given clock."""

    def __init__(self, max_keys: int = MAX_BUCKETS):
        self.max_keys = max_keys
        self._buckets: dict[tuple, tuple[float, float]] = {}  # key -> (tokens, updated_at)

    def wait_s(self, key: tuple, rate_per_s: float, burst: float, now: float) -> float:
        """0 when `key` has a token now (it is left untaken), else seconds until it has one."""
        tokens = self._tokens(key, rate_per_s, burst, now)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / rate_per_s

    def take(self, key: tuple, rate_per_s: float, burst: float, now: float) -> None:
        tokens = self._tokens(key, rate_per_s, burst, now)
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._buckets.clear()  # bounded memory; forgetting forgives, it never refuses
        self._buckets[key] = (tokens - 1.0, now)

    def _tokens(self, key: tuple, rate_per_s: float, burst: float, now: float) -> float:
        tokens, updated_at = self._buckets.get(key, (burst, now))
        return min(burst, tokens + max(0.0, now - updated_at) * rate_per_s)


class JoinGuard:
    """The rate limits and the proof of work for new keys; one per service."""

    def __init__(self) -> None:
        self.buckets = Buckets()

    def admit(self, run_id: str, membership: MembershipSection, source: str | None, now: float) -> None:
        """Take a token from the run's bucket and the source address's, or refuse with
        `RateLimited` (nothing taken) and the seconds until both have one."""
        limits = [(("run", run_id), membership.join_rate_per_min / 60.0, membership.join_burst, "the run")]
        if source is not None:
            limits.append(
                (
                    ("address", run_id, source),
                    membership.join_rate_per_address_per_min / 60.0,
                    membership.join_burst_per_address,
                    f"address {source}",
                )
            )
        waits = [(self.buckets.wait_s(key, rate, burst, now), what) for key, rate, burst, what in limits]
        wait_s, what = max(waits)
        if wait_s > 0:
            raise errors.RateLimited(
                f"too many new keys joining from {what}; retry in {wait_s:.1f} s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )
        for key, rate, burst, _ in limits:
            self.buckets.take(key, rate, burst, now)


def period_of(now: float) -> int:
    return int(now // JOIN_POW_PERIOD_S)


def salt_of(secret: str, run_id: str, period: int) -> str:
    """The proof-of-work salt of a run for a period: 16 bytes of HMAC-SHA256, hex."""
    return hmac.new(bytes.fromhex(secret), f"{run_id}\n{period}".encode(), hashlib.sha256).hexdigest()[:32]


def check_proof(
    secret: str, run_id: str, public_key_hex: str, bits: int, salt: str | None, nonce: int | None, now: float
) -> None:
    """Refuse a join without a valid proof: `JoinProofRequired` when none came or its salt is not
    the current or the previous period's; `BadJoinProof` when it does not solve the challenge."""
    if bits == 0:
        return
    if salt is None or nonce is None:
        raise errors.JoinProofRequired(
            f"this run asks new keys for a proof of work of {bits} bits: GET join-challenge, solve it, join again"
        )
    period = period_of(now)
    if not any(hmac.compare_digest(salt, salt_of(secret, run_id, p)) for p in (period, period - 1)):
        raise errors.JoinProofRequired("the join challenge's salt expired or was not issued here: fetch a fresh one")
    if not meets(run_id, public_key_hex, salt, nonce, bits):
        raise errors.BadJoinProof(f"the nonce does not give {bits} leading zero bits for this run, key and salt")
