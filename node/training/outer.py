"""The outer step: how a round's pseudo-gradients become the next shared parameters.

One interface, two strategies that run over any exchange (the in-process simulator, the real
network): each round a peer snapshots theta at the round start, runs H inner steps, turns
`delta = theta_start - theta_local` into a payload, and, once it has the round's payloads from
every peer in the manifest, applies the same aggregate to the same start. Every peer therefore
holds bit-identical parameters after every round; `param_digest` checks it.

- `sparseloco` (arXiv 2508.15706): error feedback `e = beta e + outer_lr delta`, per-chunk Top-k
  and 2-bit codes (locoswarm_kernels.sparse), a signed packet (protocol.packet), scatter-mean over the
  peers that sent each coordinate, plain SGD `theta = theta_start - outer_lr * aggregate`.
  By default (`aggregation = "median_clip"`, as production SparseLoCo) each peer's tensor is first
  scaled down to the round's median norm of that tensor, so one peer's update weighs at most as
  much as a typical one; `"mean"` is the paper's plain scatter-mean. A peer's own packet that the
  swarm did not apply goes back into its error buffers (`return_unsent`), to be sent later.
- `diloco` (arXiv 2311.08105): the dense delta (safetensors bytes), mean over peers, SGD with
  Nesterov momentum (torch.optim.SGD's formula) on the outer learning rate.

Every payload is bounded before it is aggregated: a value (decoded, or a dense element) larger than
`max_abs_value` or not finite refuses the whole payload, so no aggregate can be NaN or infinite.

The third baseline, `ddp` (gradients averaged every inner step), has no outer step and lives in
the simulator only.

Placement (`state_placement`, a node option): the parameters and the inner optimizer live on the
training device; the outer state (round start, error buffers, aggregates, DiLoCo's momentum) stays
fp32 and lives in pinned host memory when training on CUDA ("host", the default) or beside the
parameters ("device"). The aggregate is the exception without overlap: it exists only between the
inner steps, when the gradients' memory on the training device is free, so it is made there (with
overlap it is made beside training, in the state's memory). Copies between the two are non-blocking, and work that is heavy per element
(error feedback and Top-k) is staged to the training device one tensor at a time; every method
waits for its copies before it returns, so host readers (digest, checkpoint, snapshot) see them.
On the CPU both placements are the same memory and the same code path.

Determinism: payloads are aggregated in peer-id order, each peer's values added once per element
in float32, median-clip norms are float64 sums in a fixed order (locoswarm_kernels.sparse.SparseTensor.squared_norm),
and the outer step is computed as separate IEEE operations, so the result does not depend on arrival
order, device or thread count. A payload that fails to decode is left out with its reason;
since decoding is deterministic, every honest peer leaves out the same payloads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from locoswarm_kernels.chunking import num_workers, pool_map
from locoswarm_kernels.sparse import (
    PacketSelections,
    aggregate_packets,
    error_feedback_step,
    packet_clip_scales,
    restore_sent,
)
from protocol.errors import MalformedPacket, NonFiniteValue, ProtocolError, ShapeMismatch, ValueOutOfRange
from protocol.packet import DEFAULT_MAX_PACKET_BYTES, ModelSpec, decode_packet, encode_packet
from protocol.run_config import DEFAULT_MAX_ABS_VALUE, MAX_ABS_VALUE_LIMIT
from protocol.signing import PeerKey

log = logging.getLogger(__name__)

STRATEGIES = ("sparseloco", "diloco")
AGGREGATIONS = ("median_clip", "mean")
STATE_PLACEMENTS = ("host", "device")


def state_device_for(param_device: torch.device | str, placement: str) -> tuple[torch.device, bool]:
    """Where the outer state of parameters on `param_device` lives under `placement`, and whether
    it is pinned: "host" puts it in CPU memory (pinned for CUDA, so copies can be non-blocking),
    "device" beside the parameters. Pure: it answers for CUDA on a machine without one."""
    if placement not in STATE_PLACEMENTS:
        raise ValueError(f"outer state placement must be one of {STATE_PLACEMENTS}, got {placement!r}")
    param_device = torch.device(param_device)
    if placement == "device" or param_device.type in ("cpu", "meta"):
        return param_device, False
    return torch.device("cpu"), param_device.type == "cuda"


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    strategy: str = "sparseloco"  # "sparseloco" or "diloco"
    outer_lr: float = 1.0  # SparseLoCo 1.0; DiLoCo 0.7
    outer_momentum: float = 0.0  # DiLoCo 0.9 (Nesterov)
    nesterov: bool = False  # Nesterov form of the outer momentum
    top_k: int = 64  # values kept per 4096-element chunk: 64 -> 1.56 %, 128 -> 3.125 %
    chunk_size: int = 64  # tile side for 2-D tensors, chunk length for 1-D ones
    error_decay: float = 0.95  # beta of the error-feedback buffer (1.0 = no decay, 0 = no memory)
    divide_by_peers: bool = False  # 1/R instead of the mean over contributors of each coordinate
    aggregation: str = "median_clip"  # "median_clip": per tensor, peers above the round's median norm scaled to it
    max_abs_value: float = DEFAULT_MAX_ABS_VALUE  # payloads holding a larger (or non-finite) value are refused
    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES  # larger payloads are refused unread
    overlap: bool = False  # one-round-delayed outer step: train round r+1 while round r's packets move

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not 0.0 <= self.error_decay <= 1.0 or self.outer_lr <= 0 or not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError("error_decay must lie in [0, 1], outer_lr > 0, outer_momentum in [0, 1)")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not 0 < self.max_abs_value <= MAX_ABS_VALUE_LIMIT:
            raise ValueError(f"max_abs_value must lie in (0, {MAX_ABS_VALUE_LIMIT:g}]")


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


class OuterStep:
    """Round bookkeeping shared by the strategies: the global parameters, the local round start,
    and the outer update.

    `start` is the global model G_r, identical on every peer; `local_start` is where this peer's
    inner steps of the round began. Without overlap both are G_r, and after the outer step the
    parameters become G_{r+1}. With overlap (a one-round-delayed outer step), a peer sends
    delta_r and starts round r+1 at once from its local parameters; the aggregate of round r-1,
    applied then, moves G and shifts the local parameters by the same amount, so that the local
    model is G_r - delta_r: the global model plus its own update still in flight.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], cfg: OuterConfig, state_placement: str = "host"):
        self.params = dict(params)
        self.cfg = cfg
        self.param_device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self.state_device, self.state_pinned = state_device_for(self.param_device, state_placement)
        self.aggregate_device = self.state_device if cfg.overlap else self.param_device
        self.start = {name: self._state_copy(p) for name, p in self.params.items()}
        # Without overlap the local round start is always the global one: one buffer serves both.
        self.local_start = {name: self._state_copy(p) for name, p in self.params.items()} if cfg.overlap else self.start
        self._copies_done()

    def _state_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in the outer state's memory (queued, non-blocking)."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.state_device, pin_memory=self.state_pinned)
        return out.copy_(tensor.detach(), non_blocking=True)

    def _state_zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=torch.float32, device=self.state_device, pin_memory=self.state_pinned)

    def _to_params(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the training device (itself when it is there already)."""
        return tensor.to(self.param_device, non_blocking=True)

    def _copies_done(self) -> None:
        """Wait for the non-blocking copies into host memory, before any host code reads it."""
        if self.param_device.type == "cuda" and self.state_device != self.param_device:
            torch.cuda.current_stream(self.param_device).synchronize()

    # The payload errors `decode` raises for a hostile or broken payload (it is refused, not fatal).
    refusable: tuple[type[Exception], ...] = (ProtocolError,)

    def decode(
        self, payload: bytes, public_key: Callable[[str], bytes], *, peer_id: str, run_id: str, round: int
    ) -> Mapping[str, Any]:
        """Verify and decode one peer's payload into what `prepare` aggregates; raises one of
        `refusable`. Pure: may run in a worker thread as each packet arrives."""
        raise NotImplementedError

    @property
    def decode_workers(self) -> int:
        """Payloads decoded at once (`decode_many`, and on arrival): on the CPU the packet kernels'
        pool, one torch thread each, as many as torch's own threads (the cores one decode at a
        time would use, used better: a decode is many short ops, which split across cores poorly);
        elsewhere one."""
        return num_workers(None, self.aggregate_device)

    def decode_many(
        self, payloads: Mapping[str, bytes], public_key: Callable[[str], bytes], *, run_id: str, round: int
    ) -> dict[str, Mapping[str, Any] | Exception]:
        """`decode_or_refusal` of every payload, `decode_workers` at a time."""
        peers = sorted(payloads)
        one = lambda peer: decode_or_refusal(self, payloads[peer], public_key, peer_id=peer, run_id=run_id, round=round)
        workers = min(self.decode_workers, len(peers))
        return dict(zip(peers, pool_map(one, peers, workers)))

    def _decode_all(
        self,
        payloads: Mapping[str, bytes],
        public_key: Callable[[str], bytes],
        run_id: str,
        round: int,
        decoded: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Mapping[str, Any]], ApplyResult]:
        """Every payload decoded (taken from `decoded` where a payload was decoded on arrival: its
        tensors, or the exception its decoding raised; the others `decode_many`), in peer-id order;
        refusals recorded."""
        out: dict[str, Mapping[str, Any]] = {}
        result = ApplyResult(accepted=[])
        decoded = dict(decoded or {})
        decoded |= self.decode_many(
            {peer: data for peer, data in payloads.items() if decoded.get(peer) is None},
            public_key,
            run_id=run_id,
            round=round,
        )
        for peer_id in sorted(payloads):
            try:
                if isinstance(decoded[peer_id], BaseException):
                    raise decoded[peer_id]
                out[peer_id] = decoded[peer_id]
            except self.refusable as e:
                result.refused[peer_id] = f"{type(e).__name__}: {e}"
                log.warning("round %d: refusing packet of %s: %s", round, peer_id, result.refused[peer_id])
        result.accepted = sorted(out)
        return out, result

    def begin_round(self) -> None:
        """Mark the start of this peer's inner steps (without overlap also the global model)."""
        for name, p in self.params.items():
            self.local_start[name].copy_(p.detach(), non_blocking=True)  # also `start` without overlap
        self._copies_done()

    def reset_to_params(self) -> None:
        """Take the current parameters as the global model (after a snapshot load or a resume)."""
        for name, p in self.params.items():
            self.start[name].copy_(p.detach(), non_blocking=True)
            if self.local_start is not self.start:
                self.local_start[name].copy_(p.detach(), non_blocking=True)
        self._copies_done()

    def finish(self) -> None:
        """Set the parameters to the global model (end of an overlapped run, before evaluation)."""
        for name, p in self.params.items():
            p.data.copy_(self.start[name], non_blocking=True)
        self._copies_done()

    def apply(
        self,
        payloads: Mapping[str, bytes],
        public_key: Callable[[str], bytes] | None = None,
        *,
        run_id: str = "",
        round: int = 0,
    ) -> ApplyResult:
        """Verify, aggregate and take the outer step (`prepare` then `commit`)."""
        return self.commit(self.prepare(payloads, public_key, run_id=run_id, round=round))

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """Outer state every peer shares, served with parameter snapshots (none for SparseLoCo)."""
        return {}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """After loading a parameter snapshot: take its shared state and restart the round here."""
        self.reset_to_params()

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
        raise NotImplementedError

    def deltas(self):
        for name, p in self.params.items():
            yield name, self._to_params(self.local_start[name]) - p.detach()  # on the training device

    def _apply_nothing(self) -> None:
        """A round with no usable packet (empty manifest, all refused): the global model stays, and
        every peer's parameters go back to it. Leaving the locally trained ones would fork the peers."""
        for name in self.params:
            self._set_params(name, self.start[name].clone())
        self._copies_done()

    def _set_params(self, name: str, new: torch.Tensor) -> None:
        """The new global model of tensor `name` (on either device; with overlap in the state's
        memory). The caller waits for the copies (`_copies_done`) once all tensors are set."""
        if self.cfg.overlap:
            # Keep this peer's progress since its round start on top of the new global model.
            self.params[name].data.add_(self._to_params(new - self.local_start[name]))
        else:
            self.params[name].data.copy_(new, non_blocking=True)
        self.start[name].copy_(new)  # also `local_start` without overlap


def decode_or_refusal(
    outer, payload: bytes, public_key: Callable[[str], bytes], *, peer_id: str, run_id: str, round: int
) -> Mapping[str, Any] | Exception:
    """`outer.decode` (any outer step, a multi-rank node's too), or the refusal it raised (one of
    `outer.refusable`), returned."""
    try:
        return outer.decode(payload, public_key, peer_id=peer_id, run_id=run_id, round=round)
    except outer.refusable as e:
        return e


def decode_sparse(
    payload: bytes,
    spec: ModelSpec,
    cfg: OuterConfig,
    public_key: Callable[[str], bytes],
    *,
    peer_id: str,
    run_id: str,
    round: int,
    device: torch.device | str = "cpu",
) -> PacketSelections:
    """A SparseLoCo packet verified, bounded and decoded on `device`; refused when it names another peer."""
    packet = decode_packet(
        payload,
        spec,
        public_key,
        run_id=run_id,
        round=round,
        max_bytes=cfg.max_packet_bytes,
        max_abs_value=cfg.max_abs_value,
        device=device,
    )
    if packet.peer_id != peer_id:
        raise ProtocolError(f"packet names peer {packet.peer_id!r}")
    if cfg.aggregation == "median_clip":  # its norms now, on the decoding worker (kept for the aggregation)
        packet.tensors.squared_norms()
    return packet.tensors


class SparseLoCoOuter(OuterStep):
    def __init__(self, params, cfg: OuterConfig, state_placement: str = "host"):
        super().__init__(params, cfg, state_placement)
        self.spec = ModelSpec.from_named_tensors(self.params, cfg.top_k, cfg.chunk_size)
        self.layouts = self.spec.layouts()
        self.error_buffers = {name: self._state_zeros(p) for name, p in self.params.items()}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # What the buffers held belongs to rounds this peer missed: start over rather than send it late.
        for buffer in self.error_buffers.values():
            buffer.zero_()
        super().load_snapshot_state(tensors)

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
        """Fold this round's delta (given, or the parameters' since the round began) into the error
        buffers and encode what leaves them."""
        sparse = {}
        for name, delta in deltas.items() if deltas is not None else self.deltas():
            # Top-k runs on the training device: the buffer is staged there a tensor at a time.
            buffer = self.error_buffers[name]
            staged = self._to_params(buffer)
            sparse[name] = error_feedback_step(
                staged, self._to_params(delta.float()), self.layouts[name], self.cfg.error_decay, self.cfg.outer_lr
            )
            if staged is not buffer:
                buffer.copy_(staged, non_blocking=True)
        self._copies_done()
        return encode_packet(run_id, round, peer_id, bytes.fromhex(base_digest), self.spec, sparse, key)

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Add the packet's decoded values back into the error buffers (`OuterStep.return_unsent`):
        each buffer then holds its folded value before compression, to one float32 rounding."""
        # Decoded where the buffers live: with host placement this takes no memory on the training
        # device, whose gradients may be in use when the manifest comes; no transfer of the packet either.
        packet = decode_sparse(
            payload,
            self.spec,
            self.cfg,
            lambda _: public_key,
            peer_id=peer_id,
            run_id=run_id,
            round=round,
            device=self.state_device,
        )
        # Only the selected elements change, one tensor at a time: no dense copy of the model is made.
        for name, sparse in packet.items():
            restore_sent(self.error_buffers[name], sparse)

    def decode(
        self, payload: bytes, public_key: Callable[[str], bytes], *, peer_id: str, run_id: str, round: int
    ) -> PacketSelections:
        # Decoded where the aggregate is made: on CUDA without overlap that is the training device, whose
        # gradients are free by then, so the round's decoded packets take no host memory.
        return decode_sparse(
            payload,
            self.spec,
            self.cfg,
            public_key,
            peer_id=peer_id,
            run_id=run_id,
            round=round,
            device=self.aggregate_device,
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
        """Verify, decode and aggregate the round's packets; touches no parameter (runs beside training).
        `decoded` holds what `decode` already made of some payloads (or raised for them)."""
        decoded, result = self._decode_all(payloads, public_key, run_id, round, decoded)
        if not decoded:
            return Prepared(result, None)
        packets = [decoded[peer] for peer in result.accepted]  # PacketSelections, in peer-id order
        peer_scales = None
        if self.cfg.aggregation == "median_clip":
            peer_scales = packet_clip_scales(packets)
            for peer, scales in zip(result.accepted, peer_scales):
                for name, scale in zip(self.spec.shapes, scales):
                    if scale < 1.0:
                        result.scales.setdefault(peer, {})[name] = scale
        means = aggregate_packets(
            packets, device=self.aggregate_device, divide_by_peers=self.cfg.divide_by_peers, peer_scales=peer_scales
        )
        aggregates = {}
        for name in self.params:
            aggregate = means[name]
            if self.cfg.outer_lr != 1.0:
                aggregate = aggregate * self.cfg.outer_lr
            aggregates[name] = aggregate
        return Prepared(result, aggregates, decoded)

    def commit(self, prepared: Prepared) -> ApplyResult:
        """The outer step: theta = theta_start - outer_lr * aggregate."""
        if prepared.aggregates is None:
            self._apply_nothing()
        else:
            for name in self.params:
                aggregate = prepared.aggregates[name]
                self._set_params(name, self.start[name].to(aggregate.device, non_blocking=True) - aggregate)
            self._copies_done()
        return prepared.result


class DiLoCoOuter(OuterStep):
    def __init__(self, params, cfg: OuterConfig, state_placement: str = "host"):
        super().__init__(params, cfg, state_placement)
        self.momentum = {name: self._state_zeros(p) for name, p in self.params.items()}
        self.shapes = {name: tuple(p.shape) for name, p in self.params.items()}

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        return {f"outer_momentum.{name}": m.detach().cpu().contiguous() for name, m in self.momentum.items()}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, m in self.momentum.items():
            saved = tensors.get(f"outer_momentum.{name}")
            if saved is None or saved.shape != m.shape:
                raise ValueError(f"snapshot lacks the outer momentum of {name}")
            m.copy_(saved)
        super().load_snapshot_state(tensors)

    def make_payload(self, *, deltas: Mapping[str, torch.Tensor] | None = None, **_) -> bytes:
        from safetensors.torch import save

        pairs = deltas.items() if deltas is not None else self.deltas()
        return save({name: delta.float().contiguous().cpu() for name, delta in pairs})

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Does nothing, on purpose: DiLoCo has no error feedback, so there is no state to put a packet
        back into. The packet is the round's whole dense delta and nothing on this node keeps a copy,
        so when the swarm does not apply it that delta is lost (the DESIGN.md rule holds for SparseLoCo
        only). Keeping it would need a second model-sized buffer, which this dense baseline does not have."""

    refusable = (Exception,)  # safetensors raises its own and OS errors on hostile bytes

    def decode(self, payload: bytes, public_key=None, **_) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        if len(payload) > self.cfg.max_packet_bytes:
            raise ValueError("payload exceeds the size limit")
        tensors = load(bytes(payload))  # held packets may be views of a mapped file (node/exchange/spool.py)
        if {n: tuple(t.shape) for n, t in tensors.items()} != self.shapes:
            raise ShapeMismatch("tensor names or shapes differ from the model's")
        for name, t in tensors.items():
            if t.dtype != torch.float32:
                raise MalformedPacket(f"tensor {name!r} is {t.dtype}, not float32")
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteValue(f"tensor {name!r} holds NaN or Inf")
            if t.numel() and float(t.abs().max()) > self.cfg.max_abs_value:
                raise ValueOutOfRange(f"tensor {name!r}: a value exceeds max_abs_value {self.cfg.max_abs_value:g}")
        return tensors

    def prepare(
        self,
        payloads: Mapping[str, bytes],
        public_key=None,
        *,
        run_id: str = "",
        round: int = 0,
        decoded: Mapping[str, Any] | None = None,
        **_,
    ) -> Prepared:
        """Check the dense deltas and average them (peer-id order); touches no parameter."""
        deltas, result = self._decode_all(payloads, public_key, run_id, round, decoded)
        if not deltas:
            return Prepared(result, None)
        means = {}
        for name in self.params:
            total = torch.zeros_like(self.start[name])
            for peer in result.accepted:
                total += deltas[peer][name].to(total.device)
            means[name] = total / len(result.accepted)
        return Prepared(result, means, deltas)

    def commit(self, prepared: Prepared) -> ApplyResult:
        """Outer SGD with (Nesterov) momentum on the mean delta."""
        if prepared.aggregates is None:
            self._apply_nothing()
            return prepared.result
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for name in self.params:
            update = prepared.aggregates[name]
            if mu:
                self.momentum[name].mul_(mu).add_(update)
                update = update + mu * self.momentum[name] if self.cfg.nesterov else self.momentum[name].clone()
            self._set_params(name, self.start[name] - update * lr)
        self._copies_done()
        return prepared.result


def make_outer(
    params: Mapping[str, torch.nn.Parameter], cfg: OuterConfig, state_placement: str = "host"
) -> SparseLoCoOuter | DiLoCoOuter:
    """The outer step of `cfg.strategy`; `state_placement` ("host", "device"): see the module docstring."""
    return {"sparseloco": SparseLoCoOuter, "diloco": DiLoCoOuter}[cfg.strategy](params, cfg, state_placement)
