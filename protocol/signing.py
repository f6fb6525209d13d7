"""Ed25519 peer identities: key generation, signing and verification.

A peer's identity is its Ed25519 key pair. Public keys travel as 32 raw bytes (hex in JSON);
signatures are 64 raw bytes. `verify` raises `BadSignature` instead of returning a flag, so a
forgotten check cannot pass silently.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import BadSignature

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class PeerKey:
    """An Ed25519 private key with the operations a peer needs."""

    __slots__ = ("_private", "public_bytes")

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public_bytes: bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls) -> "PeerKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "PeerKey":
        """A deterministic key from 32 seed bytes (tests and reproducible demos)."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    @classmethod
    def load_or_create(cls, path: Path) -> "PeerKey":
        """The key stored at `path` (raw 32-byte seed), created with mode 0600 if absent."""
        path = Path(path)
        if path.exists():
            return cls(Ed25519PrivateKey.from_private_bytes(path.read_bytes()))
        key = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = key._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        path.touch(mode=0o600)
        path.write_bytes(raw)
        return key

    @property
    def public_hex(self) -> str:
        return self.public_bytes.hex()

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


def verify(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise `BadSignature` unless `signature` is `public_key`'s signature of `message`."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise BadSignature("public key or signature has the wrong length")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as e:
        raise BadSignature("signature does not verify") from e
