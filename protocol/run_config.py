"""The run configuration: everything that defines a training run, and its TOML/JSON loader.

The operator writes it (deploy/run.toml is a commented sample), the coordinator stores it with the
run and hands it to every peer at join, and the node builds its model and optimizers from it.
Unknown keys and out-of-range values are refused with the key's name (`ConfigError`).
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag, ValidationError

from protocol.fields import Beta, Multiaddr, RequestModel



class FixedDeadline(RequestModel):
    """Each round gets a fixed time from its opening; it closes earlier when all expected peers
    submitted. A tagged model so an adaptive policy can be added beside it later."""

    kind: Literal["fixed"] = Field("fixed", description="Deadline policy tag.")
    round_timeout_s: float = Field(
        120.0, gt=0.0, le=86400.0, description="Seconds from a round's opening to its deadline."
    )


class AdaptiveDeadline(RequestModel):
    """Each round's deadline follows the swarm: a quantile of how long peers took to submit in
    the last rounds (from the round's opening: fetching and applying the previous round, then
    training and encoding), times a margin, within bounds. Stragglers past it are cut off."""

    kind: Literal["adaptive"] = Field("adaptive", description="Deadline policy tag.")
    initial_s: float = Field(120.0, gt=0.0, le=86400.0, description="Timeout until there is history.")
    quantile: float = Field(0.9, gt=0.0, le=1.0, description="Quantile of recent submission times.")
    margin: float = Field(1.5, ge=1.0, le=100.0, description="Multiplier on that quantile.")
    min_s: float = Field(5.0, gt=0.0, le=86400.0, description="Lower bound of a round's timeout.")
    max_s: float = Field(3600.0, gt=0.0, le=86400.0, description="Upper bound of a round's timeout.")
    window_rounds: int = Field(5, ge=1, le=1000, description="Closed rounds the quantile looks at.")


def _deadline_kind(value) -> str:
    """The policy's tag; a policy without one is the fixed timeout (older configs)."""
    if isinstance(value, dict):
        return value.get("kind", "fixed")
    return getattr(value, "kind", "fixed")


_DEADLINE_TAGS = ("fixed", "adaptive")
DeadlinePolicy = Annotated[
    Annotated[FixedDeadline, Tag("fixed")] | Annotated[AdaptiveDeadline, Tag("adaptive")],
    Discriminator(_deadline_kind),
]


class RunConfig(RequestModel):
    """Everything that defines a training run. Loaded from TOML (`load_run_config`) or JSON."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Human-readable run name."
    )
    preset: Literal["tiny", "mini", "small", "512m", "1b"] = Field(description="Model size preset.")
    strategy: Literal["sparseloco", "diloco", "ddp"] = Field(
        "sparseloco", description="Outer algorithm: SparseLoCo or a baseline."
    )
    inner_steps: int = Field(15, ge=1, le=100_000, description="H: inner AdamW steps per round.")
    inner_lr: float = Field(1e-3, gt=0.0, le=1.0, description="Inner AdamW peak learning rate.")
    inner_betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95), strict=False, description="Inner AdamW (beta1, beta2), each in [0, 1)."
    )
    inner_weight_decay: float = Field(0.1, ge=0.0, le=10.0, description="Inner AdamW decay.")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Grad-norm clip; 0 disables.")
    warmup_steps: int = Field(100, ge=0, le=10_000_000, description="Linear warm-up steps.")
    total_steps: int = Field(
        10_000, ge=1, le=100_000_000, description="Inner steps of the cosine schedule."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of peak.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Sequences per inner step per peer.")
    seq_len: int = Field(1024, ge=8, le=131_072, description="Tokens per sequence.")
    outer_lr: float = Field(1.0, gt=0.0, le=10.0, description="Outer SGD learning rate.")
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0, description="Outer SGD momentum.")
    nesterov: bool = Field(False, description="Nesterov outer momentum (DiLoCo baseline).")
    top_k: int = Field(64, ge=1, le=4096, description="Values kept per 4096-element chunk.")
    chunk_size: int = Field(64, ge=1, le=1024, description="Tile side for 2-D tensors.")
    error_decay: float = Field(0.95, ge=0.0, le=1.0, description="Error-feedback decay beta.")
    clip_to_median_norm: bool = Field(
        False,
        description="Scale down each peer's decoded update whose norm exceeds the round's median"
        " (bounds a poisoning peer; SparseLoCo only).",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for initialisation and data order.")
    max_packet_bytes: int = Field(
        64 * 2**20, ge=1024, le=2**34, description="Largest packet a peer may announce."
    )
    deadline_policy: DeadlinePolicy = Field(
        default_factory=FixedDeadline, description="When a round's deadline falls."
    )
    overlap: bool = Field(
        False, description="One-round-delayed outer step: train round r+1 while round r's packets move."
    )
    tree_fanout: int = Field(
        2, ge=1, le=64,
        description="Copies each peer forwards of a packet in its distribution tree: 1 is a chain (the"
        " fastest on even links; a slow peer slows every peer after it), 2 a binary tree.",
    )
    min_peers: int = Field(1, ge=1, le=100_000, description="Peers needed before round 0 opens.")
    max_rounds: int | None = Field(
        None, ge=1, le=100_000_000, description="The run finishes after this many rounds."
    )
    heartbeat_timeout_s: float = Field(
        60.0, ge=1.0, le=86400.0, description="Silence after which a peer is marked gone."
    )
    num_data_shards: int = Field(
        1024, ge=1, le=1_000_000, description="Dataset shards; a peer reads peer_index % this."
    )
    dht_bootstrap: list[Multiaddr] = Field(
        default_factory=list, max_length=64, description="Multiaddrs of DHT bootstrap peers."
    )
    join_policy: Literal["open", "token"] = Field(
        "open", description="Whether joining needs one of `join_tokens`."
    )
    join_tokens: list[Annotated[str, StringConstraints(min_length=8, max_length=256)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Join tokens (or 'sha256:<hex>' of one); stored hashed, never returned.",
    )
    data: str | None = Field(None, max_length=1024, description="Dataset name or path.")

    def redacted(self) -> "RunConfig":
        """The config as shown to anyone: join tokens removed."""
        return self.model_copy(update={"join_tokens": []})


class ConfigError(ValueError):
    """A run config file could not be read or does not validate; the message names the key."""


def load_run_config(path: Path) -> RunConfig:
    """Read and validate a TOML (or JSON, by suffix) run config file."""
    path = Path(path)
    try:
        raw_text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    try:
        if path.suffix == ".json":
            return RunConfig.model_validate_json(raw_text)
        return RunConfig.model_validate(tomllib.loads(raw_text))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe_validation_error(e)}") from e


def describe_validation_error(error: ValidationError) -> str:
    """One line naming each bad key: 'inner_lr: Input should be greater than 0'."""
    parts = []
    for item in error.errors():
        loc = item["loc"]
        # Drop the tag pydantic puts after a tagged union's field name ("deadline_policy.fixed.x").
        loc = [p for i, p in enumerate(loc) if not (i and loc[i - 1] == "deadline_policy" and p in _DEADLINE_TAGS)]
        key = ".".join(str(p) for p in loc) or "(top level)"
        parts.append(f"{key}: {item['msg']}")
    return "; ".join(parts)
