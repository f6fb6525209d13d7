"""What the round loop asks of a node's training: the `OuterStep` and `Training` protocols.

The round loop (node/round/), the simulator (tools/sim/engine.py) and the fault injector use a
node's training through these and nothing else:

    result = training.train_round(r, on_step)           # H inner steps (Training)
    payload = training.outer.make_payload(...)           # fold the delta into the error feedback, encode
    prepared = outer.prepare(payloads, public_key, ...)  # verify, decode, aggregate: no parameter moves
    kept = outer.keep_start(prepared)                    # what an amended manifest's recompute needs
    applied = outer.commit(prepared)                     # the outer step: `start` is the next global model
    outer.restore_start(kept); outer.commit(amended)     # the manifest was amended: the step again

Implementations: `SparseLoCoOuter` and `DiLoCoOuter` (node/training/outer.py) hold the whole model
in one process, with `PeerTraining` (peer.py); a multi-rank node's rank 0 holds `RankedOuter` and
`RankedTraining` (ranked.py), whose every call commands `ShardedSparseLoCo` (sharded_outer.py) on
each rank. Decoding is node/training/decode.py's (`decode_or_refusal`, `decode_all`, `EarlyDecodes`).

Every honest peer applies the same packets to the same `start` and holds the same bits after
`commit`: `start` (G_r) is the global model, the same on every peer; a packet that fails to
verify or decode raises one of `refusable`, and is left out by every peer alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from node.training.inner import InnerResult
from node.training.round_start import RoundStart
from protocol.run_config import OuterSection
from protocol.signing import PeerKey


@dataclass(slots=True)
class ApplyResult:
    """What one outer step used and what it refused."""

    accepted: list[str]  # peer ids whose payloads made the aggregate, sorted
    refused: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    # peer id -> {tensor name -> median-clip factor}, only the factors < 1 (peers scaled down)
    scales: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(slots=True)
class Prepared:
    """A round's verified aggregate, computed off the critical path, not yet applied."""

    result: ApplyResult
    aggregates: dict[str, torch.Tensor] | None  # name -> aggregate; None when no payload was usable
    # peer id -> name -> its decoded update (SparseTensor, or DiLoCo's dense delta), for contribution
    # scoring (node/training/scoring.py); sparse, so small beside the aggregates
    updates: dict[str, Mapping[str, Any]] = field(default_factory=dict)


# A checkpoint's sections of an outer step's own state, by the names `save_checkpoint` takes them.
OuterState = Mapping[str, Mapping[str, torch.Tensor]]


class OuterStep(Protocol):
    """The outer step of a node: its round bookkeeping, its packets, its state."""

    cfg: OuterSection  # the run's [outer] section
    start: Mapping[str, torch.Tensor]  # G_r, the global model that starts the round (fp32)
    refusable: tuple[type[Exception], ...]  # what `decode` raises for a hostile or broken payload
    decode_workers: int  # payloads decoded at once (node/training/decode.py)

    # --- the round

    def begin_round(self) -> None:
        """Mark the start of this peer's inner steps (without overlap also the global model)."""

    def deltas(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This peer's update since its round began, by tensor: local start minus parameters."""

    def make_payload(
        self,
        *,
        run_id: str,
        round: int,
        peer_id: str,
        base_digest: str,
        key: PeerKey,
        deltas: Mapping[str, torch.Tensor] | None = None,
    ) -> bytes:
        """The round's signed packet: this round's update (`deltas`, or the parameters' since the
        round began) folded into the error feedback, and what leaves it."""

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Put back into this node's outer state what its own packet of `round` carried, because the
        swarm did not apply it (refused as late, amended out of the manifest, not picked).

        DESIGN.md, "A packet that misses its round keeps its mass": when the packet is not applied the
        node adds those values back, so they are sent later instead of lost. For SparseLoCo the packet's
        decoded values go back into the error buffers, which then hold what they held once the round's
        delta was folded in and before compression (to one float32 rounding per sent element).

        The caller may call it only for a packet made by `make_payload` from this object's current
        buffers, in this process; at most once per packet (a second call would add the values twice);
        and not after the buffers were reset (`load_snapshot_state`), whose zeroed buffers never held
        them. `payload`, `public_key`, `peer_id`, `run_id` and `round` are what the packet was made and
        signed with. A packet that does not decode raises `ProtocolError` (or a subclass) and leaves
        the state as it was; no reference to `payload` is kept.

        When: adding the values back before the next round's fold or after it differs only by the
        decay beta, which that fold applies to them in the first case and not in the second. The node
        calls it once the manifest it applies the round with is known and leaves the packet out, or an
        amendment of the applied round takes it out (node/round/steps.py, `return_if_unsent`), and so
        only once the packet can no longer be applied. Without overlap that is before the next round's
        fold; with overlap (the round applied one round late) or for an amendment, after one or more
        folds, whose decay the returned values then skip."""

    # --- the aggregate and the step

    def decode(
        self, payload: bytes, public_key: Callable[[str], bytes] | bytes, *, peer_id: str, run_id: str, round: int
    ) -> Mapping[str, Any]:
        """Verify and decode one peer's payload into what `prepare` aggregates; raises one of
        `refusable`. Pure: may run in a worker thread as each packet arrives."""

    def prepare(
        self,
        payloads: Mapping[str, bytes],
        public_key: Callable[[str], bytes],
        *,
        run_id: str,
        round: int,
        decoded: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """Verify, decode and aggregate the round's payloads; touches no parameter (runs beside
        training). `decoded`: what `decode` already made of some payloads, or raised for them."""

    def commit(self, prepared: Prepared) -> ApplyResult:
        """The outer step: the parameters and `start` become the next global model."""

    def keep_start(self, prepared: Prepared) -> RoundStart:
        """What `restore_start` needs to undo `commit(prepared)`; taken just before that commit."""

    def restore_start(self, kept: RoundStart) -> None:
        """The parameters and outer state as `keep_start` found them; they are the global model again."""

    # --- the parameters as the global model

    def reset_to_params(self) -> None:
        """Take the current parameters as the global model (after a snapshot load or a resume)."""

    def finish(self) -> None:
        """Set the parameters to the global model (end of an overlapped run, before evaluation)."""

    # --- state beside the parameters

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """Outer state every peer shares, served with parameter snapshots (none for SparseLoCo)."""

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """After loading a parameter snapshot: take its shared state and restart the round here."""

    def state_dict(self) -> OuterState:
        """This node's own outer state, as a checkpoint holds it: {"error_buffers": ...} (SparseLoCo),
        {"outer_momentum": ...} (DiLoCo), {} where a checkpoint keeps none (a multi-rank node)."""

    def load_state_dict(self, state: OuterState) -> None:
        """Take a checkpoint's outer state (`state_dict`'s sections); what `state` lacks starts at zero."""


class Training(Protocol):
    """A node's training for a run: its model, inner optimizer and outer step (`Session.training`)."""

    model: torch.nn.Module  # the global model's module (a multi-rank node: rank 0's host copy)
    optimizer: torch.optim.Optimizer | None  # the inner AdamW (None: sharded over the ranks)
    outer: OuterStep
    device: torch.device  # of `model`
    inner_steps: int  # H

    def train_round(
        self,
        round: int,
        on_step: Callable[[int, float, float], None] | None = None,
        on_step_queued: Callable[[int], None] | None = None,
    ) -> InnerResult:
        """Round `round`'s H inner steps (global steps round*H ...)."""

    def evaluate_global(self, num_batches: int = 1) -> float | None:
        """The global model's loss on held-out batches; None without them."""
