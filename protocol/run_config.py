"""The run configuration: everything that defines a training run, in sections, and its loader.

The operator writes it (deploy/run.toml is a commented sample), the coordinator stores it with the
run and hands it to every peer at join, and the node builds its model and optimizers from it: the
training reads the [inner] and [outer] sections as they are (node/training/inner.py, outer.py), so
their defaults, here, are the only ones. Each section is its own strict model, in the layout of the
TOML file:

    name, max_rounds    the run as a whole
    [model]             what is trained: size preset, seed, data and its sharding
    [inner]             the inner AdamW steps (H = inner.steps) and their schedule and batches
    [outer]             the outer step: algorithm, SGD settings, compression, overlap
    [exchange]          moving packets: their size bound, distribution trees, DHT bootstrap,
                        and [exchange.mirror], an object store that keeps a copy of each
                        packet and, every few rounds, of the agreed parameters
    [membership]        who may join, how many before round 0, when a silent peer is gone
    [deadline]          when a round closes: a tagged policy, "fixed" or "adaptive"
    [scoring]           contribution scores, and when a peer whose updates hurt is excluded

Unknown keys and out-of-range values are refused with the key's dotted name (`ConfigError`:
`inner.lr: Input should be greater than 0`). Before the sections the config was one flat table;
`FLAT_KEYS` says where each of its keys went, `RunConfig.from_stored` reads a config a coordinator
database stored in that shape, and a flat TOML file is refused naming each key's new place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag, model_validator

from protocol.config_file import ConfigError, load_config
from protocol.fields import Beta, Multiaddr, RequestModel, Sha256Hex

__all__ = [
    "AdaptiveDeadline",
    "ConfigError",
    "DEFAULT_MAX_ABS_VALUE",
    "DeadlinePolicy",
    "ExchangeSection",
    "FixedDeadline",
    "MAX_ABS_VALUE_LIMIT",
    "FLAT_KEYS",
    "InnerSection",
    "MembershipSection",
    "MirrorSection",
    "ModelSection",
    "OuterSection",
    "RunConfig",
    "ScoringSection",
    "load_run_config",
    "nest_flat",
]


class ModelSection(RequestModel):
    """What is trained: every peer builds the same model from the preset and the seed."""

    preset: Literal["tiny", "mini", "small", "512m", "1b"] = Field(description="Model size preset.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for initialisation and data order.")
    data: str | None = Field(None, max_length=1024, description="Dataset name or path.")
    num_data_shards: int = Field(
        1024, ge=1, le=1_000_000, description="Dataset shards; a peer reads peer_index % this."
    )
    vocab_size: int | None = Field(
        None,
        ge=2,
        le=2**24,
        description="Token ids the model embeds, replacing the preset's (256 or 32000): the tokenizer's"
        " vocabulary, as `locoswarm data prepare` prints it. Required with tokenizer_id.",
    )
    tokenizer_id: Sha256Hex | None = Field(
        None,
        description="sha256 of the canonical tokenizer.json the data is tokenized with (`locoswarm data"
        " prepare` prints it); a peer refuses shards made with another. Unset: byte-level text, or"
        " shards whose ids fit the vocabulary.",
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Start from these weights instead of the seeded initialisation: a safetensors file in"
        " the Hugging Face Llama layout, or a directory holding model.safetensors (and config.json). Every"
        " peer needs the same file at this path.",
    )
    init_sha256: Sha256Hex | None = Field(
        None,
        description="sha256 of init_from's safetensors file (`sha256sum model.safetensors`); required with"
        " init_from: a peer whose file differs refuses to start.",
    )

    @model_validator(mode="after")
    def _pairs(self) -> "ModelSection":
        if self.tokenizer_id is not None and self.vocab_size is None:
            raise ValueError("tokenizer_id needs vocab_size (both are printed by `locoswarm data prepare`)")
        if (self.init_from is None) != (self.init_sha256 is None):
            raise ValueError("init_from and init_sha256 go together (init_sha256: `sha256sum model.safetensors`)")
        return self


class InnerSection(RequestModel):
    """The inner optimizer: H local AdamW steps per round, on a schedule counted across rounds."""

    steps: int = Field(15, ge=1, le=100_000, description="H: inner AdamW steps per round.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Inner AdamW peak learning rate.")
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95), strict=False, description="Inner AdamW (beta1, beta2), each in [0, 1)."
    )
    weight_decay: float = Field(0.1, ge=0.0, le=10.0, description="Inner AdamW decay.")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Grad-norm clip; 0 disables.")
    warmup_steps: int = Field(100, ge=0, le=10_000_000, description="Linear warm-up steps.")
    total_steps: int = Field(10_000, ge=1, le=100_000_000, description="Inner steps of the cosine schedule.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of peak.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Sequences per inner step per peer.")
    seq_len: int = Field(1024, ge=8, le=131_072, description="Tokens per sequence.")


# The bound on a packet's values (outer.max_abs_value). Default: honest pseudo-gradients are
# parameter deltas over H steps: AdamW moves a coordinate by about lr a step, the error buffer
# holds at most 1 / (1 - beta) rounds of them, times the outer lr: 15 * 1e-3 * 20 * 1 = 0.3 at
# the defaults, far below 1e4 (which float16 still holds). Limit: at 1e30, a float32 sum over
# 3e8 peers and a float64 sum of squares over 1e200 elements stay finite.
DEFAULT_MAX_ABS_VALUE = 1e4
MAX_ABS_VALUE_LIMIT = 1e30

# The nodes' default `fetch_timeout_s` (node/config.py): how long a node waits on a round's packets
# before it reports them missing. The coordinator counts on it: a round held for the peers still
# fetching the previous one waits at most that long for them (coordinator/rules/rounds.py).
NODE_FETCH_TIMEOUT_S = 60.0


class OuterSection(RequestModel):
    """The outer step every peer takes on the round's aggregate, and the compression before it."""

    strategy: Literal["sparseloco", "diloco", "ddp"] = Field(
        "sparseloco", description="Outer algorithm: SparseLoCo or a baseline."
    )
    lr: float = Field(1.0, gt=0.0, le=10.0, description="Outer SGD learning rate.")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="Outer SGD momentum.")
    nesterov: bool = Field(False, description="Nesterov outer momentum (DiLoCo baseline).")
    top_k: int = Field(64, ge=1, le=4096, description="Values kept per 4096-element chunk.")
    chunk_size: int = Field(64, ge=1, le=1024, description="Tile side for 2-D tensors.")
    error_decay: float = Field(0.95, ge=0.0, le=1.0, description="Error-feedback decay beta.")
    aggregation: Literal["median_clip", "mean"] = Field(
        "median_clip",
        description='How a round\'s decoded packets combine (SparseLoCo): "median_clip" scales each'
        " peer's tensor down to the round's median norm of that tensor, then takes the scatter-mean"
        ' (bounds a poisoning peer); "mean" is the paper\'s plain scatter-mean.',
    )
    max_abs_value: float = Field(
        DEFAULT_MAX_ABS_VALUE,
        gt=0.0,
        le=MAX_ABS_VALUE_LIMIT,
        description="Largest magnitude a packet may carry: its shifts, table entries and decoded values"
        " (DiLoCo: every dense element). A packet over it is refused. Honest values are parameter"
        " deltas over H steps, about H * inner lr * outer lr / (1 - error_decay) at most (0.3 at the"
        " defaults).",
    )
    overlap: bool = Field(
        False, description="One-round-delayed outer step: train round r+1 while round r's packets move."
    )
    max_contributors: int = Field(
        0,
        ge=0,
        le=4096,
        description="M, bounded rounds: a round's manifest takes at most M packets, picked by"
        " protocol/selection.py (proven members in rotation, a few places for newcomers), and the round"
        " may close once its picks are settled; a peer left out keeps its packet's values in its error"
        " buffer. Each node then receives at most M packets a round, however many peers there are."
        " 0: unbounded, every submission is in the manifest.",
    )

    @model_validator(mode="before")
    @classmethod
    def _clip_flag(cls, data: Any) -> Any:
        """Configs written before `aggregation` (stored ones, older TOML files) carry the boolean
        `clip_to_median_norm`: true means "median_clip", false the plain "mean" such a run was
        created with (a stored run keeps its aggregation)."""
        if not isinstance(data, dict) or "clip_to_median_norm" not in data:
            return data
        data = dict(data)
        flag = data.pop("clip_to_median_norm")
        if not isinstance(flag, bool):
            raise ValueError("clip_to_median_norm (now aggregation) must be true or false")
        implied = "median_clip" if flag else "mean"
        if data.setdefault("aggregation", implied) != implied:
            raise ValueError(
                f"clip_to_median_norm = {str(flag).lower()} contradicts aggregation ="
                f" {data['aggregation']!r}; give aggregation only"
            )
        return data


class MirrorSection(RequestModel):
    """An S3-compatible object store that keeps a copy of every packet, and every few rounds of the
    agreed parameters (docs/DESIGN.md, "The packet mirror"). Public facts only: the coordinator signs with credentials from its own
    environment (the AWS variables or boto3's credential chain), never from here, and hands
    peers presigned URLs."""

    endpoint_url: Annotated[str, StringConstraints(pattern=r"^https?://", max_length=1024)] | None = Field(
        None, description="The store's endpoint (https://...); null: AWS S3 in `region`."
    )
    bucket: Annotated[str, StringConstraints(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+$")] = Field(
        description="Bucket the packets are written to (it must exist)."
    )
    prefix: Annotated[str, StringConstraints(max_length=512, pattern=r"^[A-Za-z0-9!_.*'()/-]*$")] = Field(
        "", description="Key prefix of every packet object, e.g. 'packets/'; a lifecycle rule on it expires them."
    )
    snapshot_prefix: Annotated[str, StringConstraints(max_length=512, pattern=r"^[A-Za-z0-9!_.*'()/-]*$")] = Field(
        "snapshots/",
        description="Key prefix of every snapshot object (snapshot_every_rounds), apart from the packets' so that"
        " a lifecycle rule of its own keeps them longer.",
    )
    region: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")] = Field(
        "us-east-1", description="The store's region (signatures name it)."
    )
    url_ttl_s: float = Field(
        900.0,
        ge=60.0,
        le=7 * 86400.0,
        description="Lifetime of the presigned URLs handed to peers; a URL is never handed out older than half"
        " of it. S3 allows at most 7 days.",
    )
    snapshot_every_rounds: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description="After each round r with r % N == 0 the agreed parameters that start round r + 1 are"
        " written to the store too (by up to two of the peers that voted for them), so a joiner loads them"
        " when no peer serves them; 0: no snapshots in the store.",
    )

    def snapshot_after(self, round: int) -> bool:
        """Whether the snapshot of round `round` + 1's start goes to the store."""
        return self.snapshot_every_rounds > 0 and round % self.snapshot_every_rounds == 0


class ExchangeSection(RequestModel):
    """How packets move between peers."""

    max_packet_bytes: int = Field(64 * 2**20, ge=1024, le=2**34, description="Largest packet a peer may announce.")
    tree_fanout: int = Field(
        2,
        ge=1,
        le=64,
        description="Copies each peer forwards of a packet in its distribution tree: 1 is a chain (the"
        " fastest on even links; a slow peer slows every peer after it), 2 a binary tree.",
    )
    dht_bootstrap: list[Multiaddr] = Field(
        default_factory=list, max_length=64, description="Multiaddrs of DHT bootstrap peers."
    )
    missing_grace_s: float = Field(
        30.0,
        ge=0.5,
        le=3600.0,
        description="Seconds after a closed round's manifest entry is first reported unfetchable until the"
        " coordinator drops it (a new manifest version); sooner once every other contributor reported it."
        " Keep it below the nodes' fetch_timeout_s (default 60), which is how long they wait for the amendment.",
    )
    mirror: MirrorSection | None = Field(
        None,
        description="An object store every packet is also written to, which fetchers use as one more holder"
        " (peers behind NAT); null: none.",
    )


class MembershipSection(RequestModel):
    """Who may join, and what the coordinator waits for and tolerates."""

    min_peers: int = Field(1, ge=1, le=100_000, description="Peers needed before round 0 opens.")
    heartbeat_timeout_s: float = Field(
        60.0,
        ge=1.0,
        le=86400.0,
        description="Silence after which a peer is marked gone (longer in a swarm big enough that"
        " max_heartbeats_per_s stretches the heartbeat period: four periods).",
    )
    max_heartbeats_per_s: float = Field(
        100.0,
        gt=0.0,
        le=1e6,
        description="The most heartbeats per second the run asks of all its peers together: with N live peers"
        " each beats every max(heartbeat_timeout_s / 4, N / max_heartbeats_per_s) seconds.",
    )
    state_wait_s: float = Field(
        300.0,
        ge=0.0,
        le=30 * 86400.0,
        description="After every peer stopped: how long, from the first return, the run waits for a peer holding "
        "the open round's start before going back to the newest agreed state a returning peer holds.",
    )
    join_policy: Literal["open", "token"] = Field("open", description="Whether joining needs one of `join_tokens`.")
    join_tokens: list[Annotated[str, StringConstraints(min_length=8, max_length=256)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Join tokens (or 'sha256:<hex>' of one); stored hashed, never returned.",
    )
    join_pow_bits: int = Field(
        0,
        ge=0,
        le=32,
        description="Proof of work a new key shows to join (protocol/join_pow.py): leading zero bits of a hash"
        " bound to the run, the key and a salt the coordinator changes every 10 minutes; 0: none. About a"
        " second of one core at 20; each bit more doubles it. Members rejoin without one.",
    )
    join_rate_per_address_per_min: float = Field(
        6.0,
        gt=0.0,
        le=1e6,
        description="New keys one source address may join per minute, sustained (beyond the burst);"
        " over it the join is answered 429 rate_limited with Retry-After.",
    )
    join_burst_per_address: int = Field(
        10, ge=1, le=1_000_000, description="New keys one source address may join at once."
    )
    join_rate_per_min: float = Field(
        120.0, gt=0.0, le=1e6, description="New keys the whole run takes per minute, sustained (beyond the burst)."
    )
    join_burst: int = Field(200, ge=1, le=1_000_000, description="New keys the whole run takes at once.")
    max_missed_rounds: int = Field(
        3,
        ge=1,
        le=100_000,
        description="A contributor with no packet in this many consecutive closed rounds is no longer waited"
        " for by the early close (it stays a member; its next packet in a manifest makes it waited for again)."
        " 1: only the previous round's contributors are waited for.",
    )
    vote_after_rounds: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Earlier rounds whose manifests must hold a peer's packet before its applied reports vote"
        " on a round's agreed digest; 0: its packet in that round's manifest suffices.",
    )


class ScoringSection(RequestModel):
    """Contribution scoring (protocol/scoring.py): each node scores every peer's update of a round on
    a held-out batch of its own data; the coordinator turns the contributors' scores into a standing
    per peer and refuses the packets of a peer whose updates keep hurting."""

    enabled: bool = Field(True, description="Nodes score updates and the coordinator excludes harmful peers.")
    batch_sequences: int = Field(
        4,
        ge=1,
        le=1024,
        description="Sequences (of inner.seq_len tokens) in the batch a node scores updates on: one forward pass"
        " for the round's start and one per scored peer.",
    )
    max_peers_per_round: int = Field(
        16,
        ge=1,
        le=64,
        description="Peers of a manifest one node scores per round (a pick that rotates with the round and the"
        " node): with R contributors each peer is judged by about this many others, at any R.",
    )
    max_loss_delta: float = Field(
        0.0,
        ge=-1e3,
        le=1e3,
        allow_inf_nan=False,
        description="A node judges an update hurting when the held-out loss after it alone, applied to the round's"
        " start, rose by more than 20 times (this, in nats, plus loss_tolerance times the gain of the typical update"
        " it scored, minus their median loss delta), or when the update's cosine with the node's own update is"
        " below min_cosine. A node whose typical update did not lower the loss judges by the cosine alone"
        " (protocol/scoring.py).",
    )
    loss_tolerance: float = Field(
        0.5,
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        description="See max_loss_delta: a sign-flipped update raises the loss by about the typical gain (1.0);"
        " honest ones lower it, or raise it by a small part of it at worst.",
    )
    min_cosine: float = Field(
        -0.4,
        ge=-1.0,
        le=1.0,
        allow_inf_nan=False,
        description="See max_loss_delta: the cosine of an update with the judging node's own update of the round,"
        " on the coordinates the update holds. Honest ones stay above it (measured down to -0.25 late in a"
        " run), sign-flipped ones far below (-0.64..-0.95); -1 turns this test off.",
    )
    min_reporters: int = Field(
        2,
        ge=1,
        le=64,
        description="Contributors (other than the peer) whose scores a round's verdict on a peer needs; with fewer"
        " the round gives none. A verdict is hurting when more than half of them judge it so.",
    )
    window_rounds: int = Field(4, ge=1, le=1000, description="Latest rounds with a verdict that the standing counts.")
    exclude_after_rounds: int = Field(
        2,
        ge=1,
        le=1000,
        description="Hurting verdicts within window_rounds that exclude a peer (one bad round never does at 2).",
    )
    exclusion_rounds: int = Field(
        0,
        ge=0,
        le=100_000_000,
        description="Rounds an excluded peer's submissions are refused ('excluded'); 0: for the rest of the run.",
    )
    useful_cosine: float = Field(
        0.1,
        ge=-1.0,
        le=1.0,
        allow_inf_nan=False,
        description="A judge finds an update useful when its cosine with the judge's own update is at least this"
        " and it does not hurt. Useful verdicts earn credit, the weight of a peer's judgements and digest votes"
        " (protocol/scoring.py, rule 5): an empty update scores 0, noise about 0, honest updates +0.3..+0.9.",
    )
    useful_gain: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="A judge also finds an update useful (when it does not hurt) when it lowered the judge's"
        " held-out loss by at least this fraction of the most any update it scored lowered it: a judge whose own"
        " update is empty has no cosine to go by.",
    )
    copy_overlap: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="An update that shares this share of its entries (position and 2-bit code) with a packet"
        " submitted before it in the round is a copy of that packet: never useful (a re-signed copy shares all of"
        " them; honest updates early in a run share up to about half their positions, fewer entries).",
    )
    max_credit: int = Field(
        8,
        ge=1,
        le=1_000_000,
        description="Credit a peer can earn at most (one per useful round; halved by a round neither useful nor"
        " hurting, lost by a hurting one or a wrong digest).",
    )

    @model_validator(mode="after")
    def _window(self) -> "ScoringSection":
        if self.exclude_after_rounds > self.window_rounds:
            raise ValueError("exclude_after_rounds cannot exceed window_rounds")
        return self


class FixedDeadline(RequestModel):
    """Each round gets a fixed time from its opening; it closes earlier when all expected peers
    submitted."""

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


DeadlinePolicy = Annotated[
    Annotated[FixedDeadline, Tag("fixed")] | Annotated[AdaptiveDeadline, Tag("adaptive")],
    Discriminator(_deadline_kind),
]
# pydantic names a tagged union's tag in an error's path ("deadline.fixed.round_timeout_s"); the
# messages leave it out.
_UNIONS = {"deadline": ("fixed", "adaptive")}


class RunConfig(RequestModel):
    """Everything that defines a training run. Loaded from TOML (`load_run_config`) or JSON."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Human-readable run name.")
    max_rounds: int | None = Field(None, ge=1, le=100_000_000, description="The run finishes after this many rounds.")
    model: ModelSection = Field(description="What is trained: preset, seed, data.")
    inner: InnerSection = Field(default_factory=InnerSection, description="Inner AdamW steps.")
    outer: OuterSection = Field(default_factory=OuterSection, description="Outer step and compression.")
    exchange: ExchangeSection = Field(default_factory=ExchangeSection, description="Packet exchange.")
    membership: MembershipSection = Field(default_factory=MembershipSection, description="Joining and liveness.")
    deadline: DeadlinePolicy = Field(default_factory=FixedDeadline, description="When a round's deadline falls.")
    scoring: ScoringSection = Field(
        default_factory=ScoringSection, description="Contribution scores and the exclusion of harmful peers."
    )

    def redacted(self) -> "RunConfig":
        """The config as shown to anyone: join tokens removed."""
        membership = self.membership.model_copy(update={"join_tokens": []})
        return self.model_copy(update={"membership": membership})

    @classmethod
    def from_stored(cls, json_text: str) -> "RunConfig":
        """A config as a coordinator database stored it: one written before the sections (a flat
        table) is nested first (`nest_flat`)."""
        document = json.loads(json_text)
        if isinstance(document, dict) and any(key in FLAT_KEYS for key in document):
            return cls.model_validate(nest_flat(document))
        return cls.model_validate_json(json_text)


# Where each key of the flat config (before the sections) went; `name` and `max_rounds` stayed.
FLAT_KEYS: dict[str, str] = {
    "preset": "model.preset",
    "seed": "model.seed",
    "data": "model.data",
    "num_data_shards": "model.num_data_shards",
    "inner_steps": "inner.steps",
    "inner_lr": "inner.lr",
    "inner_betas": "inner.betas",
    "inner_weight_decay": "inner.weight_decay",
    "grad_clip": "inner.grad_clip",
    "warmup_steps": "inner.warmup_steps",
    "total_steps": "inner.total_steps",
    "min_lr_ratio": "inner.min_lr_ratio",
    "batch_size": "inner.batch_size",
    "seq_len": "inner.seq_len",
    "strategy": "outer.strategy",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "nesterov": "outer.nesterov",
    "top_k": "outer.top_k",
    "chunk_size": "outer.chunk_size",
    "error_decay": "outer.error_decay",
    "clip_to_median_norm": "outer.clip_to_median_norm",
    "overlap": "outer.overlap",
    "max_packet_bytes": "exchange.max_packet_bytes",
    "tree_fanout": "exchange.tree_fanout",
    "dht_bootstrap": "exchange.dht_bootstrap",
    "min_peers": "membership.min_peers",
    "heartbeat_timeout_s": "membership.heartbeat_timeout_s",
    "join_policy": "membership.join_policy",
    "join_tokens": "membership.join_tokens",
    "deadline_policy": "deadline",
}


def nest_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config table (the layout before the sections) in sections; other keys stay put."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *sections, leaf = FLAT_KEYS.get(key, key).split(".")
        table = nested
        for section in sections:
            table = table.setdefault(section, {})
        table[leaf] = value
    return nested


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a TOML (or JSON, by suffix) run config file; `overrides` by dotted key
    ("inner.lr") replace the file's values."""
    return load_config(RunConfig, Path(path), overrides, renamed=FLAT_KEYS, unions=_UNIONS)
