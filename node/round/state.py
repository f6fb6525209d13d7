"""A node's round state, and the one place it changes: which round its parameters start, and what
the node is doing (docs/design-round.md, "A round's state has one owner", draws the machine).

    state = RoundState.at_join(swarm_has_params=joined.params.digest is not None)
    state.begin(r)                    # at round r, waiting for it to open
    state.training()                  # its H inner steps; then doing(ENCODING), doing(SUBMITTING)...
    state.applied(r, tree)            # r's outer step: the parameters start r + 1, digest tree.hex
    state.loaded(r, digest, tree)     # a checkpoint or snapshot: the parameters start r
    state.params_unknown()            # they may follow no agreed state: the loop catches up

`params_round` is the round whose start the parameters are, as far as the swarm is concerned:
every honest peer holding `params_round` = r holds the same bits, whose digest is `digest` (None:
unknown, the round loop catches up before it trains). `digest` is the global model after the last
applied round, `tree` its hash tree where this node computed or verified one. `amendments`: the
last applied round kept for an amended manifest's recompute (node/round/amend.py), and the manifest
versions the parameters follow. `activity` is what the heartbeats say.

Every write of `params_round`, `digest`, `tree` and the activity's `round`, `state` and `detail` is
a method here (a unit test reads the other modules for assignments); the figures a heartbeat
carries (`inner_step`, `last_loss`, `bandwidth_mbps`) are written where they are measured.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from node.training.round_start import RoundStart
from protocol.digest import Tree
from protocol.http import LOADING_SNAPSHOT, MISSING_REPORT_ROUNDS


class Doing(str, Enum):
    """What the node is doing: the `state` of its heartbeats, shown on the status page (a `str`
    that prints as its value, as node/round/refusals.py's `Code`)."""

    def __str__(self) -> str:
        return self.value

    JOINING = "joining"  # joined; building its model and loading its data
    WAITING = "waiting"  # for its round to open, or for the round's manifest
    TRAINING = "training"  # the round's H inner steps
    ENCODING = "encoding"  # folding the update into the error feedback and encoding the packet
    SUBMITTING = "submitting"  # publishing the packet and submitting its digest
    TRANSFERRING = "transferring"  # fetching the manifest's packets not in hand yet
    AGGREGATING = "aggregating"  # decoding, aggregating, the outer step and its report
    AWAITING_AMENDMENT = "awaiting_amendment"  # reported packets it cannot fetch; waiting for a manifest without them
    CATCHING_UP = "catching_up"  # replaying closed rounds, or between attempts to load a snapshot
    # fetching a snapshot from peers: the coordinator asks members nobody can dial to dial this node
    LOADING_SNAPSHOT = LOADING_SNAPSHOT
    STUCK = "stuck"  # catching up, waiting for packets nobody serves (`detail` says which, from whom)
    SERVING = "serving"  # its last round applied: serving its packet until the live peers applied it


@dataclass(slots=True)
class Activity:
    """What the node tells the coordinator in its heartbeats (and the status page shows)."""

    round: int = 0
    state: Doing = Doing.JOINING
    inner_step: int | None = None  # inner steps done in `round` (set from the training thread)
    last_loss: float | None = None
    bandwidth_mbps: float | None = None  # measured on the last round's packet downloads
    detail: str | None = None  # with state "stuck": what the node waits for, and from whom (one line)


@dataclass(frozen=True, slots=True)
class Recomputed:
    """A round this node applied again because its manifest was amended."""

    round: int
    from_version: int
    to_version: int
    digest: str  # of the global model after the amended round


@dataclass(slots=True)
class KeptRound:
    """The last round this node applied, as needed to apply an amended version of it instead."""

    round: int
    manifest_version: int  # the version applied
    start: RoundStart | None  # the round start before its outer step (None with overlap: nothing to put back)
    payloads: dict[str, bytes]  # the applied manifest's packets, by publisher ({} with overlap)
    public_keys: dict[str, bytes]
    latest: asyncio.Task | None = None  # a read of the round's view, started by amend.watch_kept


@dataclass(slots=True)
class Amendments:
    """A session's kept round, the manifest versions of the rounds its parameters follow, and the
    recomputes it made (tests and reports read them)."""

    kept: KeptRound | None = None
    applied_versions: dict[int, int] = field(default_factory=dict)  # round -> manifest version applied
    recomputed: list[Recomputed] = field(default_factory=list)

    def keep(self, kept: KeptRound) -> None:
        """`kept` is the round about to be applied: it replaces the one kept before, and the versions
        of rounds the coordinator no longer amends are dropped."""
        self.forget()
        self.applied_versions[kept.round] = kept.manifest_version
        for old in [r for r in self.applied_versions if r < kept.round - MISSING_REPORT_ROUNDS - 2]:
            del self.applied_versions[old]
        self.kept = kept

    def forget(self) -> None:
        """The kept round cannot be recomputed any more (a later round was applied on top)."""
        if self.kept is not None and self.kept.latest is not None:
            self.kept.latest.cancel()
        self.kept = None

    def reset(self) -> None:
        """The parameters follow none of the rounds applied here (a snapshot was loaded)."""
        self.forget()
        self.applied_versions.clear()

    def outdated(self, amended: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Rounds the parameters follow at an older manifest version than the latest (from the
        coordinator's recent `amended` rounds): round -> (version applied, latest version)."""
        return {
            r: (self.applied_versions[r], v)
            for r, v in sorted(amended.items())
            if r in self.applied_versions and self.applied_versions[r] < v
        }


@dataclass(slots=True)
class RoundState:
    """Which round the parameters start and what the node is doing; every change is a method."""

    params_round: int | None = 0  # the round whose start the parameters are (None: unknown)
    digest: str = ""  # of the global model after the last applied round
    tree: Tree | None = None  # the hash tree of `digest` where this node computed or verified one
    activity: Activity = field(default_factory=Activity)
    amendments: Amendments = field(default_factory=Amendments)

    @classmethod
    def at_join(cls, swarm_has_params: bool) -> RoundState:
        """A new session: the seeded initialisation starts round 0 of a run whose swarm holds no
        parameters yet; otherwise they are unknown until a resume or a catch-up."""
        return cls(params_round=None if swarm_has_params else 0)

    # --- the parameters ---------------------------------------------------------------------

    def applied(self, round: int, tree: Tree) -> None:
        """`round`'s outer step is taken: the parameters start `round` + 1 (with overlap: the global
        model does; the parameters run a round ahead of it)."""
        self.params_round, self.tree, self.digest = round + 1, tree, tree.hex

    def recomputed(self, kept: KeptRound, manifest_version: int, tree: Tree) -> Recomputed:
        """The kept round was applied again at `manifest_version` (amend.recompute); the round the
        parameters start stays, their digest is `tree`'s."""
        done = Recomputed(kept.round, kept.manifest_version, manifest_version, tree.hex)
        kept.manifest_version = self.amendments.applied_versions[kept.round] = manifest_version
        self.tree, self.digest = tree, tree.hex
        self.amendments.recomputed.append(done)
        return done

    def trained(self, round: int) -> None:
        """`round` is trained and its packet sent: the parameters start `round` + 1 (with overlap
        `round`'s aggregate is still to land on them; without, `applied` said so already)."""
        self.params_round = round + 1

    def loaded(self, round: int, digest: str, tree: Tree | None) -> None:
        """The parameters are the agreed start of `round`, from a checkpoint (`tree` None) or a
        snapshot: they follow none of the rounds applied in this session."""
        self.amendments.reset()
        self.params_round, self.digest, self.tree = round, digest, tree

    def seeded(self) -> None:
        """Nothing was ever trained into the run: the seeded initialisation starts round 0."""
        self.params_round = 0

    def params_unknown(self) -> None:
        """The parameters may not be an agreed state (a round this node cannot reproduce, a snapshot
        partly written): the round loop catches up before it trains."""
        self.params_round = None

    # --- what the node is doing -------------------------------------------------------------

    def begin(self, round: int) -> None:
        """The node is at `round`, waiting for it to open."""
        self.activity.round, self.activity.state, self.activity.inner_step = round, Doing.WAITING, 0

    def training(self) -> None:
        """The round's inner steps start."""
        self.activity.state, self.activity.inner_step = Doing.TRAINING, 0

    def doing(self, what: Doing) -> None:
        """Any other step of the round (encoding, submitting, transferring, aggregating...)."""
        self.activity.state = what

    def stuck(self, detail: str) -> None:
        """Catching up, waiting for packets nobody serves; `detail` names them (one line)."""
        self.activity.state, self.activity.detail = Doing.STUCK, detail

    def clear_detail(self) -> None:
        """The catch-up ended: the heartbeats stop naming what it waited for."""
        self.activity.detail = None
