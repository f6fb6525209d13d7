"""The project's exception hierarchy for bytes and requests that come from other peers.

Everything a peer sends is hostile until checked. Decoders raise one of these typed errors (never
a bare ValueError, IndexError or a crash) so that the boundary that decides -- skip a peer's
packet, refuse a request -- can catch `ProtocolError` and log the reason.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: input from a peer was refused."""


class TruncatedPacket(ProtocolError):
    """The bytes end before the layout says they should."""


class OversizedPacket(ProtocolError):
    """The packet, or a count or size inside it, exceeds the limit."""


class BadMagic(ProtocolError):
    """The bytes do not start with the packet magic."""


class UnsupportedVersion(ProtocolError):
    """The packet's wire version is not one this build decodes."""


class MalformedPacket(ProtocolError):
    """The structure does not parse or its fields have the wrong types or counts."""


class ShapeMismatch(ProtocolError):
    """A tensor section does not match the model's tensor names, shapes or chunking."""


class IndexOutOfRange(ProtocolError):
    """A decoded index falls outside its chunk."""


class NonFiniteValue(ProtocolError):
    """A quantization table, a shift or a decoded value is NaN or infinite (or overflows its dtype)."""


class ValueOutOfRange(ProtocolError):
    """A value is finite but larger in magnitude than the run allows (`outer.max_abs_value`): a
    shift, a table entry, or a decoded value (shift + entry), or a dense delta's element."""


class BadSignature(ProtocolError):
    """The signature does not verify with the claimed peer's public key."""


class WrongRound(ProtocolError):
    """The packet or request names another run or round than the one expected."""
