"""Rank 0's training objects of a multi-rank node: the `Training` and `OuterStep` protocols
(node/training/base.py), each call run by all the node's ranks (node/training/distributed.py).

    leader = Leader(RankGroup.spawn(2, "cpu"))
    training = RankedTraining.build(leader, run, device="cpu", data=path, shard_index=i, num_shards=n)
    Node(config, ranks=leader)   # builds it that way itself

The round loop (node/round/) uses it exactly as it uses a 1-rank node's PeerTraining: `model` and
`outer.start` are rank 0's host copy of the global model (an unsharded module, refreshed from the
ranks after every outer step), so digests, snapshots, amendments, catch-up and checkpoints read
and write whole tensors as they always did; every call that trains, encodes or applies is a
command to all ranks. The one-round-delayed outer step (overlap) and the DiLoCo baseline are not
offered on a multi-rank node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from locoswarm_kernels.sparse import SparseTensor
from node.errors import CannotStart
from node.training.base import ApplyResult, OuterState, Prepared
from node.training.distributed import KEPT_PREPARED, Leader
from node.training.inner import InnerResult
from node.training.model import build_model, model_config
from node.training.outer import decode_sparse
from node.training.params import flat_named_params
from node.training.round_start import RoundStart, StartPatch
from protocol.errors import ProtocolError
from protocol.run_config import InnerSection, OuterSection, RunConfig
from protocol.signing import PeerKey


class RankedOuter:
    """The SparseLoCo outer step of a multi-rank node, as the round loop sees it from rank 0."""

    refusable: tuple[type[Exception], ...] = (ProtocolError,)
    decode_workers = 1  # packets rank 0 decodes at once as they arrive (every rank decodes again to apply)

    def __init__(
        self, leader: Leader, global_model: Mapping[str, torch.nn.Parameter], cfg: OuterSection, max_packet_bytes: int
    ):
        self.leader, self.cfg, self.max_packet_bytes = leader, cfg, max_packet_bytes
        self.spec = leader.state.outer.spec
        self.layouts = self.spec.layouts()
        # Without overlap the parameters after an outer step are the global model: one host copy.
        self.params = self.start = dict(global_model)
        self._pending: dict[int, Prepared] = {}
        self._next_token = 0

    def begin_round(self) -> None:
        self.leader("begin")

    def deltas(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise ValueError("a multi-rank node's deltas stay on its ranks (no overlap)")

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
        if deltas is not None:
            raise ValueError("a multi-rank node encodes its ranks' own deltas (no overlap)")
        return self.leader(
            "encode", {"run_id": run_id, "round": round, "peer_id": peer_id, "base_digest": base_digest}, key=key
        )

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Every rank puts its rows of this node's unapplied packet back into its error buffer
        (ShardedSparseLoCo.return_unsent; node/training/base.py, `OuterStep.return_unsent`, states the contract)."""
        self.leader(
            "return_unsent",
            {
                "payload": bytes(payload),
                "public_key": bytes(public_key),
                "peer_id": peer_id,
                "run_id": run_id,
                "round": round,
            },
        )

    def decode(
        self, payload: bytes, public_key: Callable[[str], bytes], *, peer_id: str, run_id: str, round: int
    ) -> dict[str, SparseTensor]:
        """Verify and decode on rank 0 alone (as packets arrive; each rank decodes again to apply)."""
        return decode_sparse(
            payload,
            self.spec,
            self.cfg,
            public_key,
            max_packet_bytes=self.max_packet_bytes,
            peer_id=peer_id,
            run_id=run_id,
            round=round,
        )

    def prepare(
        self,
        payloads: Mapping[str, bytes],
        public_key: Callable[[str], bytes],
        *,
        run_id: str,
        round: int,
        decoded: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """Every rank verifies and decodes the payloads and aggregates its rows; kept until `commit`."""
        token, self._next_token = self._next_token, self._next_token + 1
        prepared = self.leader(
            "prepare",
            {
                "payloads": {peer: bytes(data) for peer, data in payloads.items()},
                "public_keys": {peer: bytes(public_key(peer)) for peer in payloads},
                "run_id": run_id,
                "round": round,
                "token": token,
            },
        )
        self._pending[token] = prepared
        for old in sorted(self._pending)[:-KEPT_PREPARED]:
            del self._pending[old]
        return prepared

    def commit(self, prepared: Prepared) -> ApplyResult:
        """The outer step on every rank's rows, then the host copy of the global model refreshed."""
        token = next((t for t, p in self._pending.items() if p is prepared), None)
        if token is None and prepared.aggregates is not None:
            raise ValueError("this aggregate was not prepared on the ranks (or is too old)")
        self._pending.pop(token, None)
        self.leader("commit", {"token": token if prepared.aggregates is not None else None})
        self.leader("gather", mirror=self.start)
        return prepared.result

    def keep_start(self, prepared: Prepared) -> RoundStart:
        """The host copy's coordinates the step moves (dense: the aggregates are rank 0's rows only)."""
        return RoundStart(StartPatch.before(self.start, prepared.aggregates))

    def restore_start(self, kept: RoundStart) -> None:
        with torch.no_grad():
            for name, p in self.start.items():
                p.copy_(kept.params.restored(name, p))
        self.reset_to_params()

    def reset_to_params(self) -> None:
        """Take the host copy (a loaded snapshot or checkpoint, a kept start) as every rank's start."""
        self.leader("load", mirror=self.start)

    def finish(self) -> None:
        """Nothing to do: without overlap the parameters are the global model."""

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # What the buffers held belongs to rounds this node missed: start over, as a 1-rank node does.
        self.leader("zero_errors")
        self.reset_to_params()

    def state_dict(self) -> OuterState:
        """Empty: a multi-rank node's checkpoint holds the global model only (node/training/distributed.py)."""
        return {}

    def load_state_dict(self, state: OuterState) -> None:
        """Nothing to take: the ranks' buffers start as they were built (zero)."""


@dataclass(slots=True)
class RankedTraining:
    """The `Training` protocol of a multi-rank node (rank 0)."""

    model: torch.nn.Module  # rank 0's host copy of the global model, unsharded
    optimizer: None  # sharded over the ranks; checkpoints hold the global model only
    inner: InnerSection
    outer: RankedOuter
    device: torch.device  # of `model`: the host
    seed: int
    inner_steps: int
    leader: Leader

    @classmethod
    def build(
        cls,
        leader: Leader,
        run: RunConfig,
        *,
        device: str,
        data: str | None,
        shard_index: int,
        num_shards: int,
        evaluate: bool,
    ) -> RankedTraining:
        """Build every rank's state (the node's data shard split by batch rows) and rank 0's copy."""
        if run.outer.strategy != "sparseloco" or run.outer.overlap:
            raise CannotStart("a multi-rank node (--ranks) runs the sparseloco strategy without overlap")
        if run.inner.batch_size % leader.group.world_size:
            raise CannotStart(
                f"the run's batch of {run.inner.batch_size} sequences does not split over "
                f"{leader.group.world_size} ranks: pick a --ranks that divides it"
            )
        leader.start(
            {
                "run": run.model_dump_json(),
                "data": data,
                "shard_index": shard_index,
                "num_shards": num_shards,
                "evaluate": evaluate,
                "device": device,
            }
        )
        model = build_model(model_config(run), run.model.seed)  # overwritten from the ranks just below
        global_model = flat_named_params(model)
        leader("gather", mirror=global_model)
        return cls(
            model=model,
            optimizer=None,
            inner=run.inner,
            outer=RankedOuter(leader, global_model, run.outer, run.exchange.max_packet_bytes),
            device=torch.device("cpu"),
            seed=run.model.seed,
            inner_steps=run.inner.steps,
            leader=leader,
        )

    def train_round(
        self,
        round: int,
        on_step: Callable[[int, float, float], None] | None = None,
        on_step_queued: Callable[[int], None] | None = None,
    ) -> InnerResult:
        return self.leader("train", {"round": round}, on_step=on_step, on_step_queued=on_step_queued)

    def evaluate_global(self, num_batches: int = 1) -> float | None:
        """The global model's held-out loss, every rank evaluating the same batches (FSDP2)."""
        return self.leader("evaluate", {"num_batches": num_batches})
