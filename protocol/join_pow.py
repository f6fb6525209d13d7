"""Proof of work for joining a run: what a new key pays so that identities are not free.

An operator sets ``membership.join_pow_bits`` (protocol.run_config); 0 turns it off. The
coordinator answers ``GET /v1/runs/{run_id}/join-challenge`` with the bits and a salt that it
derives from a secret of its own and the current time period (``JOIN_POW_PERIOD_S``), so a proof
cannot be computed before the period starts, nor used for long after: the coordinator accepts
the salts of the current and the previous period. The joining node finds a nonce such that::

    sha256(b"locoswarm-join-pow-v1\\n" + run_id + "\\n" + public_key_hex + "\\n" + salt + "\\n" + nonce)

starts with ``bits`` zero bits (nonce in decimal), and sends ``pow_salt`` and ``pow_nonce`` with its
join (protocol.http.JoinRequest). The proof is bound to the run and to the key: it cannot be
reused for another identity. Checking costs one hash; finding costs 2**bits hashes on average
(about a second of one core in Python at 20 bits; every further bit doubles it). A key that is
already a member of the run rejoins without a proof.
"""

from __future__ import annotations

import hashlib

JOIN_POW_DOMAIN = b"locoswarm-join-pow-v1\n"
JOIN_POW_PERIOD_S = 600  # a salt is issued for this long, and accepted for one period more
MAX_JOIN_POW_BITS = 32


def pow_prefix(run_id: str, public_key_hex: str, salt: str) -> bytes:
    return JOIN_POW_DOMAIN + f"{run_id}\n{public_key_hex.lower()}\n{salt}\n".encode()


def meets(run_id: str, public_key_hex: str, salt: str, nonce: int, bits: int) -> bool:
    """Whether `nonce` is a proof of `bits` for this run, key and salt (one hash)."""
    digest = hashlib.sha256(pow_prefix(run_id, public_key_hex, salt) + str(nonce).encode()).digest()
    return int.from_bytes(digest, "big") >> (256 - bits) == 0 if bits else True


def solve(run_id: str, public_key_hex: str, salt: str, bits: int, start: int = 0) -> int:
    """The first nonce from `start` that is a proof of `bits` (CPU-bound: run it in a thread)."""
    if bits <= 0:
        return start
    limit = 1 << (256 - bits)
    prefix = hashlib.sha256(pow_prefix(run_id, public_key_hex, salt))
    nonce = start
    while True:
        attempt = prefix.copy()
        attempt.update(str(nonce).encode())
        if int.from_bytes(attempt.digest(), "big") < limit:
            return nonce
        nonce += 1
