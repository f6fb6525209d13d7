"""The outer step of a node holding the whole model: how a round's pseudo-gradients become the next
shared parameters.

Two strategies behind the `OuterStep` protocol (node/training/base.py), over any exchange (the
in-process simulator, the real network): each round a peer snapshots theta at the round start, runs H inner steps, turns
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

Configuration: the run's [outer] section (protocol.run_config.OuterSection) as it is, and the
packet bound of its [exchange] section (`max_packet_bytes`).

Placement (`state_placement`, the node's memory.state_placement): the parameters and the inner optimizer live on the
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
since decoding is deterministic, every honest peer leaves out the same payloads. Decoding itself
(workers, refusals) is node/training/decode.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors import SafetensorError

from locoswarm_kernels.sparse import (
    PacketSelections,
    aggregate_packets,
    error_feedback_step,
    packet_clip_scales,
    restore_sent,
)
from node.training.base import ApplyResult, OuterState, Prepared
from node.training.decode import decode_all, workers_for
from node.training.round_start import RoundStart, StartPatch
from protocol.errors import (
    MalformedPacket,
    NonFiniteValue,
    OversizedPacket,
    ProtocolError,
    ShapeMismatch,
    ValueOutOfRange,
)
from protocol.packet import DEFAULT_MAX_PACKET_BYTES, ModelSpec, decode_packet, encode_packet
from protocol.run_config import OuterSection
from protocol.signing import PeerKey

STATE_PLACEMENTS = ("host", "device")


def state_placement_device(param_device: torch.device | str, state_placement: str) -> tuple[torch.device, bool]:
    """Where the outer state of parameters on `param_device` lives under `state_placement`, and
    whether it is pinned: "host" puts it in CPU memory (pinned for CUDA, so copies can be
    non-blocking), "device" beside the parameters. Pure: it answers for CUDA on a machine without one."""
    if state_placement not in STATE_PLACEMENTS:
        raise ValueError(f"outer state placement must be one of {STATE_PLACEMENTS}, got {state_placement!r}")
    param_device = torch.device(param_device)
    if state_placement == "device" or param_device.type in ("cpu", "meta"):
        return param_device, False
    return torch.device("cpu"), param_device.type == "cuda"


class OuterStepBase:
    """Round bookkeeping shared by the strategies: the global parameters, the local round start,
    and the outer update (the `OuterStep` protocol's common part).

    `start` is the global model G_r, identical on every peer; `local_start` is where this peer's
    inner steps of the round began. Without overlap both are G_r, and after the outer step the
    parameters become G_{r+1}. With overlap (a one-round-delayed outer step), a peer sends
    delta_r and starts round r+1 at once from its local parameters; the aggregate of round r-1,
    applied then, moves G and shifts the local parameters by the same amount, so that the local
    model is G_r - delta_r: the global model plus its own update still in flight.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        cfg: OuterSection,
        *,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
        state_placement: str = "host",
    ):
        self.params = dict(params)
        self.cfg = cfg
        self.max_packet_bytes = max_packet_bytes  # larger payloads are refused unread
        self.param_device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self.state_device, self.state_pinned = state_placement_device(self.param_device, state_placement)
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

    @property
    def decode_workers(self) -> int:
        """Payloads decoded at once: the policy of node/training/decode.py for where the aggregate is made."""
        return workers_for(self.aggregate_device)

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

    def keep_start(self, prepared: Prepared) -> RoundStart:
        """The coordinates `prepared`'s step moves, kept on the training device (StartPatch)."""
        return RoundStart(StartPatch.before(self.start, prepared.aggregates, device=self.param_device))

    def restore_start(self, kept: RoundStart) -> None:
        with torch.no_grad():
            for name, p in self.params.items():  # one tensor at a time: no second copy of the model
                p.copy_(kept.params.restored(name, self.start[name]))
            self._restore_outer_state(kept.outer_state)
        self.reset_to_params()  # the kept start is the global model again

    def _restore_outer_state(self, kept: Mapping[str, torch.Tensor]) -> None:
        """The outer state `keep_start` copied (none here: SparseLoCo's step leaves its buffers alone)."""

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """Outer state every peer shares, served with parameter snapshots (none for SparseLoCo)."""
        return {}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """After loading a parameter snapshot: take its shared state and restart the round here."""
        self.reset_to_params()

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


def decode_sparse(
    payload: bytes,
    spec: ModelSpec,
    cfg: OuterSection,
    public_key: Callable[[str], bytes] | bytes,
    *,
    max_packet_bytes: int,
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
        max_bytes=max_packet_bytes,
        max_abs_value=cfg.max_abs_value,
        device=device,
    )
    if packet.peer_id != peer_id:
        raise ProtocolError(f"packet names peer {packet.peer_id!r}")
    if cfg.aggregation == "median_clip":  # its norms now, on the decoding worker (kept for the aggregation)
        packet.tensors.squared_norms()
    return packet.tensors


class SparseLoCoOuter(OuterStepBase):
    def __init__(
        self,
        params,
        cfg: OuterSection,
        *,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
        state_placement: str = "host",
    ):
        super().__init__(params, cfg, max_packet_bytes=max_packet_bytes, state_placement=state_placement)
        self.spec = ModelSpec.from_named_tensors(self.params, cfg.top_k, cfg.chunk_size)
        self.layouts = self.spec.layouts()
        self.error_buffers = {name: self._state_zeros(p) for name, p in self.params.items()}

    def load_snapshot_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # What the buffers held belongs to rounds this peer missed: start over rather than send it late.
        for buffer in self.error_buffers.values():
            buffer.zero_()
        super().load_snapshot_state(tensors)

    def state_dict(self) -> OuterState:
        return {"error_buffers": self.error_buffers}

    def load_state_dict(self, state: OuterState) -> None:
        _copy_or_zero(self.error_buffers, state.get("error_buffers", {}))

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
                staged, self._to_params(delta.float()), self.layouts[name], self.cfg.error_decay, self.cfg.lr
            )
            if staged is not buffer:
                buffer.copy_(staged, non_blocking=True)
        self._copies_done()
        return encode_packet(run_id, round, peer_id, bytes.fromhex(base_digest), self.spec, sparse, key)

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Add the packet's decoded values back into the error buffers (`OuterStep.return_unsent`, the
        contract):
        each buffer then holds its folded value before compression, to one float32 rounding."""
        # Decoded where the buffers live: with host placement this takes no memory on the training
        # device, whose gradients may be in use when the manifest comes; no transfer of the packet either.
        packet = decode_sparse(
            payload,
            self.spec,
            self.cfg,
            lambda _: public_key,
            max_packet_bytes=self.max_packet_bytes,
            peer_id=peer_id,
            run_id=run_id,
            round=round,
            device=self.state_device,
        )
        # Only the selected elements change, one tensor at a time: no dense copy of the model is made.
        for name, sparse in packet.items():
            restore_sent(self.error_buffers[name], sparse)

    def decode(
        self, payload: bytes, public_key: Callable[[str], bytes] | bytes, *, peer_id: str, run_id: str, round: int
    ) -> PacketSelections:
        # Decoded where the aggregate is made: on CUDA without overlap that is the training device, whose
        # gradients are free by then, so the round's decoded packets take no host memory.
        return decode_sparse(
            payload,
            self.spec,
            self.cfg,
            public_key,
            max_packet_bytes=self.max_packet_bytes,
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
        decoded, result = decode_all(self, payloads, public_key, run_id=run_id, round=round, decoded=decoded)
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
        means = aggregate_packets(packets, device=self.aggregate_device, peer_scales=peer_scales)
        aggregates = {}
        for name in self.params:
            aggregate = means[name]
            if self.cfg.lr != 1.0:
                aggregate = aggregate * self.cfg.lr
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


class DiLoCoOuter(OuterStepBase):
    def __init__(
        self,
        params,
        cfg: OuterSection,
        *,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
        state_placement: str = "host",
    ):
        super().__init__(params, cfg, max_packet_bytes=max_packet_bytes, state_placement=state_placement)
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

    def state_dict(self) -> OuterState:
        return {"outer_momentum": self.momentum}

    def load_state_dict(self, state: OuterState) -> None:
        _copy_or_zero(self.momentum, state.get("outer_momentum", {}))

    def keep_start(self, prepared: Prepared) -> RoundStart:
        """A dense copy of the global model and the momentum (the step moves every coordinate)."""
        return RoundStart(StartPatch.copy_of(self.start), {name: m.clone() for name, m in self.momentum.items()})

    def _restore_outer_state(self, kept: Mapping[str, torch.Tensor]) -> None:
        for name, m in self.momentum.items():
            m.copy_(kept[name])

    def make_payload(self, *, deltas: Mapping[str, torch.Tensor] | None = None, **_) -> bytes:
        from safetensors.torch import save

        pairs = deltas.items() if deltas is not None else self.deltas()
        return save({name: delta.float().contiguous().cpu() for name, delta in pairs})

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Does nothing, on purpose: DiLoCo has no error feedback, so there is no state to put a packet
        back into. The packet is the round's whole dense delta and nothing on this node keeps a copy,
        so when the swarm does not apply it that delta is lost (the DESIGN.md rule holds for SparseLoCo
        only). Keeping it would need a second model-sized buffer, which this dense baseline does not have."""

    def decode(self, payload: bytes, public_key=None, **_) -> dict[str, torch.Tensor]:
        """The dense deltas, checked against the model's names, shapes and dtype and `max_abs_value`
        (unsigned: a DiLoCo payload is not a packet); refused as a `ProtocolError` otherwise."""
        from safetensors.torch import load

        if len(payload) > self.max_packet_bytes:
            raise OversizedPacket("payload exceeds the size limit")
        try:
            tensors = load(bytes(payload))  # held packets may be views of a mapped file (node/exchange/spool.py)
        except (SafetensorError, KeyError) as e:  # KeyError: a dtype safetensors reads and torch lacks ("F4")
            raise MalformedPacket(f"not a safetensors payload: {e}") from e
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
        deltas, result = decode_all(self, payloads, public_key, run_id=run_id, round=round, decoded=decoded)
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
        mu, lr = self.cfg.momentum, self.cfg.lr
        for name in self.params:
            update = prepared.aggregates[name]
            if mu:
                self.momentum[name].mul_(mu).add_(update)
                update = update + mu * self.momentum[name] if self.cfg.nesterov else self.momentum[name].clone()
            self._set_params(name, self.start[name] - update * lr)
        self._copies_done()
        return prepared.result


def make_outer(
    params: Mapping[str, torch.nn.Parameter],
    cfg: OuterSection,
    *,
    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
    state_placement: str = "host",
) -> SparseLoCoOuter | DiLoCoOuter:
    """The outer step of `cfg.strategy` (the run's [outer]); `max_packet_bytes`: the run's
    exchange.max_packet_bytes; `state_placement` ("host", "device"): see the module docstring.

    Raises ValueError for the "ddp" baseline: it syncs every inner step and has no outer step (the
    simulator runs it apart)."""
    if cfg.strategy == "ddp":
        raise ValueError("the ddp baseline has no outer step: it syncs every inner step, in the simulator only")
    outer = {"sparseloco": SparseLoCoOuter, "diloco": DiLoCoOuter}[cfg.strategy]
    return outer(params, cfg, max_packet_bytes=max_packet_bytes, state_placement=state_placement)


def _copy_or_zero(tensors: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    """Each of `tensors` takes its saved value in place, or zero where `saved` lacks it
    (`OuterStep.load_state_dict`: what a checkpoint lacks starts at zero)."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in saved:
                tensor.copy_(saved[name])
            else:
                tensor.zero_()
