"""A volunteer node's configuration: `NodeConfig`, in sections, from a TOML file with command-line overrides.

    config = load_node_config(Path("node.toml"), overrides={"training.device": "cuda:1"})
    print(format_node_config(config))          # the resolved config, printed at start-up

The file's layout is the model's (deploy/node.toml is a commented sample):

    coordinator, run_id, join_token, key_path    which run to join, and as whom (the top level)
    [training]      the device, its threads and ranks, the data, how long, evaluation
    [memory]        speed traded for memory: outer-state placement, micro-batches, recomputation
    [network]       the packet exchange (node/exchange/config.py takes these), the uplink, the fetch budget
    [checkpoints]   where and how often this node saves its state
    [debug]         the progress bar, injected faults

It loads through the run config's loader (protocol/config_file.py): the defaults, then the file,
then the command line (`overrides`, dotted keys, as `config_overrides` in node/cli/config_flags.py
makes them from the flags; None means "not given"), every value checked after merging, and every
message naming the dotted key:

    node.toml: training.threds: unknown key (did you mean training.threads?)
    node.toml: training.threads: Input should be greater than or equal to 0

A file written before the sections (every key at the top level) still loads: each key that moved
(`FLAT_KEYS`, `outer_state_device` renamed `memory.state_placement` on the way) is read at its
new place, with one warning line naming it; the same key at both places is refused.

Decisions: paths expand `~`; `device = "auto"` (the default) picks `cuda` when torch sees a GPU,
else `cpu`; TOML has no null, so an optional field is "unset" by leaving it out; every field's
name is unique across the sections (its flag is made from it); the printed config hides the join
token.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from protocol.config_file import ConfigError, read_config_file, validate_config, with_overrides
from protocol.run_config import NODE_FETCH_TIMEOUT_S

log = logging.getLogger(__name__)

AUTO_DEVICE = "auto"
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")


def _expanded_path(value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError(f"must be a path (a string), got {value!r}")
    return Path(value).expanduser()


ExpandedPath = Annotated[Path, BeforeValidator(_expanded_path)]
# Multiaddrs are checked for their shape only; the libp2p daemon parses them.
Multiaddrs = Annotated[tuple[str, ...], Field(strict=False)]  # TOML arrays and argparse lists


class Section(BaseModel):
    """A table of node.toml: strict types, no unknown keys, frozen."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class TrainingSection(Section):
    """What this node trains with: the device, its threads and ranks, the data, for how long."""

    device: str = Field(
        AUTO_DEVICE,
        validate_default=True,
        description="auto (cuda when torch sees a GPU, else cpu), cpu, mps, cuda or cuda:N.",
    )
    data: str | None = Field(
        None, description="Text file, directory or .bin token shards; unset: the run's, else the stdlib sources."
    )
    threads: int = Field(0, ge=0, le=1024, description="torch CPU threads; 0: torch's default.")
    ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="torch.distributed ranks this node runs as (FSDP2 inside, one GPU each, or gloo on the CPU): "
        "one peer, one packet (node/training/distributed.py); under torchrun its WORLD_SIZE instead.",
    )
    max_rounds: int | None = Field(
        None, ge=1, le=100_000_000, description="Leave after this many rounds (demos, tests)."
    )
    eval_every_rounds: int = Field(
        5,
        ge=0,
        le=1_000_000,
        json_schema_extra={"flag": "--eval-every"},
        description="Evaluate the model after every this many applied rounds (rounds 0, N, 2N...) on a fixed "
        "held-out batch and report the validation loss to the coordinator; 0: never.",
    )
    compile_model: bool = Field(False, description="torch.compile each transformer block (first step slower).")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"must be auto, cpu, mps, cuda or cuda:N, got {value!r}")
        return _auto_device() if value == AUTO_DEVICE else value


class MemorySection(Section):
    """Speed traded for memory: where the outer state lives, micro-batches, recomputation."""

    state_placement: Literal["host", "device"] = Field(
        "host",
        description="Where the round start, error buffer and aggregate live when training on CUDA: pinned "
        "host memory (host; the GPU keeps what the inner steps need) or the GPU (device). Same memory on a CPU.",
    )
    micro_batch_size: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Sequences per forward/backward pass; their gradients accumulate into "
        "the run's per-step batch (same maths, less activation memory); 0: the whole batch at once.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block in the backward pass instead of keeping its "
        "activations (about a third more compute; a 1B model on a 24 GB GPU needs it).",
    )
    loss_chunk_tokens: int = Field(
        2048,
        ge=1,
        le=1 << 24,
        description="Tokens per piece of the cross-entropy: fp32 logits for at most this many tokens exist at once.",
    )


class NetworkSection(Section):
    """Where libp2p listens and what it announces, NAT, this link's upload rate, how long a round's
    packets may take to arrive, and where the packets this node holds are kept."""

    # ExchangeConfig.from_network (node/exchange/config.py) takes every field whose name it shares.

    host_maddrs: Multiaddrs = Field(
        ("/ip4/127.0.0.1/tcp/0",),
        min_length=1,
        description="Where the libp2p daemon listens; a node others should reach: /ip4/0.0.0.0/tcp/PORT.",
    )
    announce_maddrs: Multiaddrs = Field((), description="Addresses to advertise instead (port forwarding).")
    initial_peers: Multiaddrs = Field((), description="DHT bootstrap; unset: the run's exchange.dht_bootstrap.")
    client_mode: bool = Field(False, description="Join the DHT without serving it (behind NAT).")
    behind_nat: bool = Field(
        False,
        description="Peers elsewhere cannot dial this node (a NAT or firewall, no port forwarded): it pushes its"
        " packets to reachable peers. Unset: the coordinator dials back at join to find out.",
    )
    push_packets: bool = Field(
        True,
        json_schema_extra={"flag": "--push"},
        description="Behind NAT: push this node's packets to reachable peers (--no-push: peers fetch them only over"
        " connections this node opened, or from the run's packet mirror).",
    )
    use_auto_relay: bool = Field(
        False, json_schema_extra={"flag": "--auto-relay"}, description="Behind NAT: be reachable through a relay."
    )
    relay: bool = Field(
        False,
        description="Offer libp2p circuit relay service to nodes behind NAT (a node peers can dial; "
        "`locoswarm node relay` runs one that does not train).",
    )
    relay_via: Multiaddrs = Field(
        (),
        json_schema_extra={"flag_repeats": True, "metavar": "MULTIADDR"},
        description="Behind NAT: be reachable through this relay (its full multiaddr, ending in /p2p/<id>; "
        "repeatable): the node keeps a connection to it and announces the address through it.",
    )
    uplink_mbps: float | None = Field(
        None,
        ge=1.0,
        le=1e7,
        allow_inf_nan=False,
        description="This link's upload rate in Mbps (a speed test's figure), stated at join: faster uplinks "
        "forward more of each packet's copies, and one under 20 Mbps carries this node's uploads together at nine "
        "tenths of it (the requests and acknowledgements of its downloads cross it at once); unset: counted as fast. "
        "At least 1: under 1 Mbps a node would send its packet for minutes (a figure in Gbps given as Mbps is the "
        "likely mistake).",
    )
    downlink_mbps: float | None = Field(
        None,
        ge=1.0,
        le=1e7,
        allow_inf_nan=False,
        description="This link's download rate in Mbps (a speed test's figure): packet downloads together take at "
        "most nine tenths of it, each holder sending at its share, so that the download queue stays empty (the requests "
        "for this node's own packet and the acknowledgements its uploads need cross it); unset: not paced. At least 1: "
        "a node would fetch no faster than stated, and a round's packets at under 1 Mbps take minutes (a figure in "
        "Gbps, or kB/s, given as Mbps is the likely mistake).",
    )
    fetch_timeout_s: float = Field(
        NODE_FETCH_TIMEOUT_S,
        gt=0.0,
        le=86_400.0,
        json_schema_extra={"flag": "--fetch-timeout"},
        description="Seconds, per round, to fetch the manifest's packets.",
    )
    stripes: int = Field(
        4,
        ge=1,
        le=8,
        description="A packet of a few MB is fetched over up to this many streams side by side: one stream carries "
        "one yamux window (256 KiB) per round trip until its window grows, 52 Mbps over 40 ms; more for long "
        "round trips, 1: one stream (a node that states an uplink_mbps or downlink_mbps under 20 uses one).",
    )
    packet_spool_dir: ExpandedPath | None = Field(
        None,
        description="A directory on disk where the packets this node holds and serves are kept, in unnamed "
        "files mapped into memory, instead of in the heap (node/exchange/spool.py); unset: the cache directory's "
        "spool/ (LOCOSWARM_CACHE, else ~/.cache/locoswarm). Not a tmpfs: its pages are memory.",
    )
    packets_in_memory: bool = Field(False, description="Keep held packets in the heap instead (no spool).")

    @field_validator("host_maddrs", "announce_maddrs", "initial_peers", "relay_via")
    @classmethod
    def _are_multiaddrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in value if not m.startswith("/") or " " in m]
        if bad:
            raise ValueError(f"not multiaddrs (like /ip4/0.0.0.0/tcp/31337): {bad}")
        return value

    @field_validator("relay_via", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        """`--relay-via A,B` as well as `--relay-via A --relay-via B` (a multiaddr has no comma)."""
        if isinstance(value, str):
            value = (value,)
        if isinstance(value, list | tuple):
            return tuple(part for item in value for part in str(item).split(",") if part)
        return value

    @model_validator(mode="after")
    def _relay_roles(self) -> NetworkSection:
        if self.relay and self.relay_via:
            raise ValueError("relay (offer relay service) and relay_via (use a relay) exclude each other")
        if bad := [m for m in self.relay_via if "/p2p/" not in m or "/p2p-circuit" in m]:
            raise ValueError(f"relay_via: a relay's address ends in /p2p/<its libp2p id>, not relayed itself: {bad}")
        return self


class CheckpointsSection(Section):
    """Where and how often this node saves its state, to resume from after a restart."""

    checkpoint_dir: ExpandedPath | None = Field(
        None,
        description="Save the round-start parameters and this node's state here, and resume from them "
        "on start when the swarm agrees; unset: none.",
    )
    checkpoint_every_rounds: int = Field(
        1,
        ge=1,
        le=1_000_000,
        json_schema_extra={"flag": "--checkpoint-every"},
        description="Write a checkpoint after every this many applied rounds.",
    )


class DebugSection(Section):
    """What the node shows while it trains, and faults to inject for tests and demos."""

    progress: bool = Field(True, description="A progress bar for the inner steps on stderr (off: log lines only).")
    inject: tuple[str, ...] = Field(
        (),
        strict=False,
        json_schema_extra={"flag_repeats": True, "metavar": "FAULT"},
        description="A fault to inject, for tests and demos (node/faults.py; repeatable): crash@round=3,"
        "phase=training, slow-upload@delay_s=5, corrupt-packet@round=1, poison@factor=1000, stale-submit@round=2, "
        "lie@from_round=3.",
    )


class NodeConfig(Section):
    """One volunteer node's settings: which run it joins and as whom, and in sections what hardware
    and network it brings."""

    coordinator: str = Field(description="Base URL of the coordinator, http://host:port.")
    run_id: str | None = Field(
        None,
        pattern=r"^[^/\x00-\x1f\x7f]{1,256}$",
        json_schema_extra={"flag": "--run"},
        description="Run to join; unset: the coordinator's only running (or waiting) run.",
    )
    join_token: str | None = Field(
        None,
        min_length=8,
        max_length=256,
        json_schema_extra={"flag": "--token"},
        description="Join token, for runs with membership.join_policy 'token'.",
    )
    key_path: ExpandedPath = Field(
        Path("~/.locoswarm/peer.key"),
        validate_default=True,
        json_schema_extra={"flag": "--key"},
        description="Ed25519 identity file, created if absent.",
    )
    training: TrainingSection = Field(default_factory=TrainingSection, description=TrainingSection.__doc__)
    memory: MemorySection = Field(default_factory=MemorySection, description=MemorySection.__doc__)
    network: NetworkSection = Field(default_factory=NetworkSection, description=NetworkSection.__doc__)
    checkpoints: CheckpointsSection = Field(default_factory=CheckpointsSection, description=CheckpointsSection.__doc__)
    debug: DebugSection = Field(default_factory=DebugSection, description=DebugSection.__doc__)

    @field_validator("coordinator")
    @classmethod
    def _is_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value


SECTIONS: tuple[str, ...] = tuple(
    name
    for name, field in NodeConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, Section)
)
# Where each key of a file written before the sections went: the fields kept their names in their
# section, but for one renamed on the way.
FLAT_KEYS: dict[str, str] = {
    **{
        name: f"{section}.{name}"
        for section in SECTIONS
        for name in NodeConfig.model_fields[section].annotation.model_fields
    },
    "outer_state_device": "memory.state_placement",
}


def _auto_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def load_node_config(path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> NodeConfig:
    """Defaults, then the file at `path` (if any; flat keys moved into their sections), then
    `overrides` (dotted keys) whose value is not None."""
    where = str(path) if path is not None else "command line"
    values = with_overrides(_nest_flat(read_config_file(path), where) if path is not None else {}, overrides)
    for name, field in NodeConfig.model_fields.items():
        if field.is_required() and name not in values:
            raise ConfigError(
                f"{where}: {name}: required (set it in the config file or pass --{name.replace('_', '-')})"
            )
    return validate_config(NodeConfig, values, where=where, renamed=FLAT_KEYS)


def _nest_flat(values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` with each top-level key that moved into a section (`FLAT_KEYS`) at its new place,
    logging one warning line per key; a key given at both places is refused."""
    nested = dict(values)
    for old, new in FLAT_KEYS.items():
        if old not in nested:
            continue
        section, leaf = new.split(".")
        table = nested.setdefault(section, {})
        if not isinstance(table, dict):  # `training = 3`: left for the validation to name both keys
            continue
        if leaf in table:
            raise ConfigError(f"{where}: {old} and {new} both given: keep {new}")
        nested[section] = {**table, leaf: nested.pop(old)}
        log.warning("%s: %s is now %s (read as that; move it into [%s])", where, old, new, section)
    return nested


def node_config_dict(config: NodeConfig) -> dict[str, Any]:
    """The config as JSON-ready values, the join token hidden (logs get shared in bug reports)."""
    out = config.model_dump(mode="json")
    if out["join_token"] is not None:
        out["join_token"] = "<hidden>"
    return out


def format_node_config(config: NodeConfig) -> str:
    return "node config: " + json.dumps(node_config_dict(config))
