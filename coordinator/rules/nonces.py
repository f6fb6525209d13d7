"""Nonces of signed requests: each is used once, and only near the coordinator's time.

A peer's request carries a nonce, its Unix time in nanoseconds (protocol/http.py): one outside
``NONCE_WINDOW_S`` of the coordinator's clock is refused ``stale_nonce`` (a clock to fix), one this
peer already used ``replayed_nonce``. Used nonces are stored, so a replay is refused across
restarts too, and forgotten once twice the window has passed (no request can carry them then).
"""

from __future__ import annotations

from coordinator import errors
from coordinator.storage import Storage
from protocol.http import NONCE_WINDOW_S

PRUNE_INTERVAL_S = 30.0  # how often the tick forgets old nonces


def record(storage: Storage, peer_id: str, nonce: int, now: float) -> None:
    """Store a nonce as used by `peer_id`, or refuse it. Call inside a transaction."""
    if not storage.add_nonce(peer_id, nonce, now):
        raise errors.ReplayedNonce("this nonce was already used by this peer")


def check_window(nonce: int, now: float) -> None:
    """Refuse a nonce outside the time window (before anything is written)."""
    if abs(nonce / 1e9 - now) > NONCE_WINDOW_S:
        raise errors.StaleNonce(
            f"nonce is {nonce / 1e9 - now:+.0f} s from server time"
            f" (window +-{NONCE_WINDOW_S:g} s); check the peer's clock"
        )


def prune(storage: Storage, now: float) -> None:
    """Forget the nonces no request can carry any more."""
    storage.prune_nonces(now - 2 * NONCE_WINDOW_S)
