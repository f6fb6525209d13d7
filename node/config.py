"""A volunteer node's configuration: `NodeConfig`, from a TOML file with command-line overrides.

    config = load_node_config(Path("node.toml"), overrides={"device": "cuda:1"})
    print(format_node_config(config))          # the resolved config, printed at start-up

The file's keys are the fields of `NodeConfig`, at the top level (deploy/node.toml is a commented
sample). It loads through the run config's loader (protocol/config_file.py): the defaults, then
the file, then the command line (`overrides`, already mapped to field names; None means "not
given"), every value checked after merging, and every message naming the key:

    node.toml: threds: unknown key (known keys: coordinator, run_id, ...)
    node.toml: threads: Input should be greater than or equal to 0

Decisions: paths expand `~`; `device = "auto"` (the default) picks `cuda` when torch sees a GPU,
else `cpu`; TOML has no null, so an optional field is "unset" by leaving it out; the printed
config hides the join token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from protocol.config_file import ConfigError, read_config_file, validate_config, with_overrides

AUTO_DEVICE = "auto"
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")


def _expanded_path(value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError(f"must be a path (a string), got {value!r}")
    return Path(value).expanduser()


ExpandedPath = Annotated[Path, BeforeValidator(_expanded_path)]
# Multiaddrs are checked for their shape only; the libp2p daemon parses them.
Multiaddrs = Annotated[tuple[str, ...], Field(strict=False)]  # TOML arrays and argparse lists


class NodeConfig(BaseModel):
    """One volunteer node's settings: where to join, what hardware and network it brings."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    coordinator: str = Field(description="Base URL of the coordinator, http://host:port.")
    run_id: str | None = Field(
        None, pattern=r"^[^/\x00-\x1f\x7f]{1,256}$",
        description="Run to join; unset: the coordinator's only running (or waiting) run.")
    join_token: str | None = Field(
        None, min_length=8, max_length=256, description="Join token, for runs with membership.join_policy 'token'.")
    device: str = Field(
        AUTO_DEVICE, validate_default=True,
        description="auto (cuda when torch sees a GPU, else cpu), cpu, mps, cuda or cuda:N.")
    data: str | None = Field(None, description="Corpus path; unset: the run's, else the stdlib sources.")
    key_path: ExpandedPath = Field(
        Path("~/.locoswarm/peer.key"), validate_default=True,
        description="Ed25519 identity file, created if absent.")
    host_maddrs: Multiaddrs = Field(
        ("/ip4/127.0.0.1/tcp/0",), min_length=1, description="Where the libp2p daemon listens.")
    announce_maddrs: Multiaddrs = Field((), description="Addresses to advertise (port forwarding).")
    initial_peers: Multiaddrs = Field((), description="DHT bootstrap; unset: the run's exchange.dht_bootstrap.")
    client_mode: bool = Field(False, description="Join the DHT without serving it (behind NAT).")
    use_auto_relay: bool = Field(False, description="Behind NAT: be reachable through a relay.")
    threads: int = Field(0, ge=0, le=1024, description="torch CPU threads; 0: torch's default.")
    ranks: int = Field(
        1, ge=1, le=64,
        description="torch.distributed ranks this node runs as (FSDP2 inside, one GPU each, or gloo on the CPU): "
        "one peer, one packet (node/training/distributed.py); under torchrun its WORLD_SIZE instead.")
    uplink_mbps: float | None = Field(
        None, gt=0.0, le=1e7,
        description="This link's upload rate, stated at join: faster uplinks forward more; unset: fast.")
    max_rounds: int | None = Field(
        None, ge=1, le=100_000_000, description="Leave after this many rounds (demos, tests).")
    fetch_timeout_s: float = Field(
        60.0, gt=0.0, le=86_400.0, description="Seconds, per round, to fetch the manifest's packets.")
    checkpoint_dir: ExpandedPath | None = Field(
        None, description="Save the round-start parameters and this node's state here, and resume from them "
        "on start when the swarm agrees; unset: none.")
    checkpoint_every_rounds: int = Field(
        1, ge=1, le=1_000_000, description="Write a checkpoint after every this many applied rounds.")
    progress: bool = Field(True, description="A progress bar for the inner steps on stderr.")
    eval_every_rounds: int = Field(
        5, ge=0, le=1_000_000,
        description="Evaluate the model after every this many applied rounds (rounds 0, N, 2N...) on a fixed "
        "held-out batch and report the validation loss to the coordinator; 0: never.")
    outer_state_device: Literal["host", "device"] = Field(
        "host", description="Where the round start, error buffer and aggregate live when training on CUDA: pinned "
        "host memory (host; the GPU keeps what the inner steps need) or the GPU (device). Same memory on a CPU.")
    micro_batch_size: int = Field(
        0, ge=0, le=1_000_000, description="Sequences per forward/backward pass; their gradients accumulate into "
        "the run's per-step batch (same maths, less activation memory); 0: the whole batch at once.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block in the backward pass instead of keeping its "
        "activations (about a third more compute; a 1B model on a 24 GB GPU needs it).")
    compile_model: bool = Field(False, description="torch.compile each transformer block (first step slower).")
    loss_chunk_tokens: int = Field(
        2048, ge=1, le=1 << 24, description="Tokens per piece of the cross-entropy: fp32 logits for at most this "
        "many tokens exist at once.")
    packet_spool_dir: ExpandedPath | None = Field(
        None, description="A directory on disk where the packets this node holds and serves are kept, in unnamed "
        "files mapped into memory, instead of in the heap (node/exchange/spool.py); unset: the cache directory's "
        "spool/ (LOCOSWARM_CACHE, else ~/.cache/locoswarm). Not a tmpfs: its pages are memory.")
    packets_in_memory: bool = Field(False, description="Keep held packets in the heap instead (no spool).")
    inject: tuple[str, ...] = Field(
        (), strict=False,
        description="Faults to inject, for tests and demos (node/faults.py): 'crash@round=3'.")

    @field_validator("coordinator")
    @classmethod
    def _is_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value

    @field_validator("host_maddrs", "announce_maddrs", "initial_peers")
    @classmethod
    def _are_multiaddrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in value if not m.startswith("/") or " " in m]
        if bad:
            raise ValueError(f"not multiaddrs (like /ip4/0.0.0.0/tcp/31337): {bad}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"must be auto, cpu, mps, cuda or cuda:N, got {value!r}")
        return _auto_device() if value == AUTO_DEVICE else value


def _auto_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def load_node_config(path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> NodeConfig:
    """Defaults, then the file at `path` (if any), then `overrides` whose value is not None."""
    where = str(path) if path is not None else "command line"
    values = with_overrides(read_config_file(path) if path is not None else {}, overrides)
    for name, field in NodeConfig.model_fields.items():
        if field.is_required() and name not in values:
            raise ConfigError(f"{where}: {name}: required (set it in the config file or pass "
                              f"--{name.replace('_', '-')})")
    return validate_config(NodeConfig, values, where=where)


def node_config_dict(config: NodeConfig) -> dict[str, Any]:
    """The config as JSON-ready values, the join token hidden (logs get shared in bug reports)."""
    out = config.model_dump(mode="json")
    if out["join_token"] is not None:
        out["join_token"] = "<hidden>"
    return out


def format_node_config(config: NodeConfig) -> str:
    return "node config: " + json.dumps(node_config_dict(config))
