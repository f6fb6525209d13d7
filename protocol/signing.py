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
PRIVATE_KEY_BYTES = 32  # the seed a key file holds
SIGNATURE_BYTES = 64


class KeyFileError(Exception):
    """A key path that neither holds a peer key nor can take a new one: `str(error)` says why and the fix."""


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
        """The key stored at `path` (raw 32-byte seed), created with mode 0600 if absent.
        `KeyFileError` says what is wrong with a path that holds no key and cannot take one."""
        path = Path(path)
        try:
            if path.is_dir():
                raise KeyFileError(
                    f"the key path {path} is a directory: pass a file's path, such as {path / 'peer.key'}"
                )
            if path.exists():
                raw = path.read_bytes()
                if len(raw) != PRIVATE_KEY_BYTES:
                    raise KeyFileError(
                        f"{path} is not a peer key (an Ed25519 private key, {PRIVATE_KEY_BYTES} raw bytes; this file"
                        f" has {len(raw)}): pass the right file, or move this one away and a new key is made"
                        " (a new key joins as a new peer)"
                    )
                return cls(Ed25519PrivateKey.from_private_bytes(raw))
            key = cls.generate()
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = key._private.private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
            )
            path.touch(mode=0o600)
            path.write_bytes(raw)
            return key
        except OSError as e:  # unreadable, or a parent that cannot be written
            raise KeyFileError(f"the key {path}: {e.strerror or e}") from e

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
