"""Building blocks of the wire's JSON models: strict request and lenient response bases, and the
constrained string and number types that both the run config and the HTTP models use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

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
