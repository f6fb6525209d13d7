"""SparseLoCo's outer step on a node whose parameters are sharded by rows across torch.distributed ranks.

One node may be N ranks (an 8-GPU machine as one peer, FSDP2 inside: node/training/distributed.py).
Every rank holds rows [row_start, row_end) of every tensor, as FSDP2's `Shard(0)` cuts them
(torch.chunk over dim 0: ceil(rows / N) rows a rank, the last ranks possibly fewer or none), and
keeps the round start, the error buffer and the aggregate of those rows only. The node still
publishes exactly the packet a 1-rank node would publish from the same error buffer
(DESIGN.md, "Packets do not depend on how a node is sharded"), and after the outer step every
rank holds exactly its rows of what a 1-rank node would hold:

- A tensor is *aligned* when every rank's first row is a multiple of the chunk geometry's unit
  (the tile height of a 2-D tensor, the chunk length of a 1-D one; kernels/chunking.py). Its
  chunks are then whole on one rank, and a rank's chunks are a contiguous run of the tensor's
  (chunks are numbered tile-row-major). Error feedback and the per-chunk Top-k run on each rank's
  rows; the selected values and positions (1/64 of the rows at the paper's density) are gathered
  to rank 0, which builds the per-tensor 2-bit table from all of them in chunk order (the same
  float32 sums as a 1-rank node) and hands each rank back the table and the codes of its chunks,
  so each rank removes from its buffer exactly the values sent.
- Any other tensor (an awkward shape) keeps its whole error buffer on rank 0: its delta rows are
  gathered there and the 1-rank `error_feedback_step` runs on the full tensor.

A packet the swarm did not apply goes back into the buffers (`return_unsent`): every rank decodes
it and adds the values of the chunks it holds, so the rows again equal a 1-rank node's.

Apply: every rank decodes the whole packets (cheap: the compressed sections), takes the
median-clip norms from the whole tensors, and scatter-means only its own chunks (aligned) or the
whole tensor then its rows (the rest). Sums run per element in peer order, as on a 1-rank node.

The digest (`params_tree`) gathers one tensor at a time to rank 0 in canonical order and feeds
the hash tree of protocol/digest.py, so rank 0 holds at most one whole tensor: a 2-rank node and
a 1-rank node report the same digest.

Every method is a collective: all ranks call it in the same order with the same arguments
(rank 0 alone needs the key; payload bytes must be the same on every rank). The node's round loop
sees this outer step through rank 0's `RankedOuter` (node/training/ranked.py), which implements the
`OuterStep` protocol (node/training/base.py) by commanding these methods on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from locoswarm_kernels.chunking import ChunkLayout, flat_indices, to_chunks
from locoswarm_kernels.quantize import QuantTable, quantize
from locoswarm_kernels.sparse import (
    SparseTensor,
    error_feedback_step,
    median_clip_scales,
    restore_sent,
    scatter_mean,
    select_topk,
)
from node.training.base import ApplyResult, Prepared
from node.training.params import tensor_bytes
from protocol.digest import ChunkHasher, Tree, encode_header
from protocol.errors import ProtocolError
from protocol.packet import DEFAULT_MAX_PACKET_BYTES, ModelSpec, decode_packet, encode_packet
from protocol.run_config import OuterSection
from protocol.signing import PeerKey


def row_ranges(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Per rank, the rows [start, end) FSDP2's Shard(0) gives it (torch.chunk: ceil(rows / N) each)."""
    per = -(-num_rows // world_size)
    return [(min(r * per, num_rows), min((r + 1) * per, num_rows)) for r in range(world_size)]


def _rows_of(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, everything else): a view that also holds for zero rows."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _chunk_span(shard: TensorShard, rank: int) -> tuple[int, int]:
    """(first chunk, number of chunks) of rank `rank`'s rows of an aligned tensor."""
    start, end = shard.rows[rank]
    chunks_per_row = shard.layout.numel // _rows_of(shard.layout.shape) / shard.layout.chunk_len
    return int(start * chunks_per_row), int((end - start) * chunks_per_row)


def _row_unit(layout: ChunkLayout) -> int | None:
    """Rows of the tensor that make whole chunks (None for a 0-D tensor: it has no rows to cut)."""
    if len(layout.shape) >= 2:
        return layout.tile_rows
    return layout.chunk_len if len(layout.shape) == 1 else None


def is_aligned(layout: ChunkLayout, world_size: int) -> bool:
    """Do all ranks' rows of this tensor start at a chunk boundary?"""
    unit = _row_unit(layout)
    if world_size == 1:
        return True
    return unit is not None and all(start % unit == 0 for start, _ in row_ranges(_rows_of(layout.shape), world_size))


def local_layout(layout: ChunkLayout, num_rows: int) -> ChunkLayout:
    """The layout of `num_rows` rows of an aligned tensor: same tiles and k, fewer tile rows."""
    if len(layout.shape) >= 2:
        return ChunkLayout(
            (num_rows, *layout.shape[1:]), num_rows, layout.cols, layout.tile_rows, layout.tile_cols, layout.k
        )
    return ChunkLayout((num_rows,), 1, num_rows, 1, layout.tile_cols, layout.k)


@dataclass(frozen=True, slots=True)
class TensorShard:
    """One tensor as this rank holds it."""

    name: str
    layout: ChunkLayout  # of the whole tensor, as a 1-rank node chunks it
    rows: list[tuple[int, int]]  # every rank's rows [start, end)
    aligned: bool
    local: ChunkLayout | None  # of this rank's rows (aligned tensors only)


class ShardedSparseLoCo:
    """The outer state of one rank: round start, error buffer and aggregate of its rows.

    `params`: name -> this rank's rows of the parameter (a plain tensor written in place; for
    FSDP2, `DTensor.to_local()`), `shapes`: name -> the whole tensor's shape, `cfg`: the run's
    [outer], `max_packet_bytes`: its exchange.max_packet_bytes.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        cfg: OuterSection,
        *,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
        group: dist.ProcessGroup | None = None,
    ):
        if cfg.strategy != "sparseloco" or cfg.overlap:
            raise ValueError("a multi-rank node runs the sparseloco strategy without overlap")
        self.cfg, self.group = cfg, group
        self.max_packet_bytes = max_packet_bytes
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.spec = ModelSpec({name: tuple(shapes[name]) for name in sorted(shapes)}, cfg.top_k, cfg.chunk_size)
        self.params = {name: params[name] for name in self.spec.shapes}
        self.shards: dict[str, TensorShard] = {}
        for name, layout in self.spec.layouts().items():
            if not layout.shape and self.world_size > 1:
                raise ValueError(f"{name}: a 0-D parameter has no rows to shard")
            rows = row_ranges(_rows_of(layout.shape), self.world_size)
            start, end = rows[self.rank]
            if layout.shape and tuple(self.params[name].shape) != (end - start, *layout.shape[1:]):
                raise ValueError(
                    f"{name}: rank {self.rank} holds {tuple(self.params[name].shape)}, "
                    f"expected rows {start}:{end} of {layout.shape}"
                )
            aligned = is_aligned(layout, self.world_size)
            self.shards[name] = TensorShard(
                name, layout, rows, aligned, local_layout(layout, end - start) if aligned else None
            )
        self.start = {name: p.detach().clone() for name, p in self.params.items()}
        # Aligned tensors: this rank's rows; the rest: the whole buffer on rank 0, nothing elsewhere.
        self.error_buffers = {
            name: torch.zeros_like(self.params[name], dtype=torch.float32)
            if shard.aligned
            else torch.zeros(shard.layout.shape, dtype=torch.float32, device=self.params[name].device)
            for name, shard in self.shards.items()
            if shard.aligned or self.rank == 0
        }

    # --- the round ---------------------------------------------------------------------------

    def begin_round(self) -> None:
        for name, p in self.params.items():
            self.start[name].copy_(p.detach())

    reset_to_params = begin_round  # without overlap the round start is the global model

    def zero_error_buffers(self) -> None:
        for buffer in self.error_buffers.values():
            buffer.zero_()

    def make_payload(
        self, *, run_id: str, round: int, peer_id: str, base_digest: str, key: PeerKey | None
    ) -> bytes | None:
        """Fold this round's delta into the error buffers, encode; the packet on rank 0, None elsewhere."""
        sparse: dict[str, SparseTensor | None] = {}
        for name, shard in self.shards.items():
            delta = (self.start[name] - self.params[name].detach()).float()
            sparse[name] = self._encode_aligned(shard, delta) if shard.aligned else self._encode_gathered(shard, delta)
        if self.rank != 0:
            return None
        return encode_packet(run_id, round, peer_id, bytes.fromhex(base_digest), self.spec, sparse, key)

    def _encode_aligned(self, shard: TensorShard, delta: torch.Tensor) -> SparseTensor | None:
        buffer, layout, local = self.error_buffers[shard.name], shard.layout, shard.local
        if self.cfg.error_decay != 1.0:
            buffer.mul_(self.cfg.error_decay)
        buffer.add_(delta, alpha=self.cfg.lr)
        chunks = to_chunks(buffer, local)  # (local chunks, chunk_len)
        positions, selected = select_topk(chunks, layout.k)  # (local chunks, k) each
        chunk_counts = [count for _, count in (_chunk_span(shard, r) for r in range(self.world_size))]
        all_selected = self._gather_rows(selected, chunk_counts)
        all_positions = self._gather_rows(positions, chunk_counts)
        table, codes = None, None
        if self.rank == 0:
            finite = bool(torch.isfinite(all_selected).all())
            if finite:
                codes, table = quantize(all_selected)
            flags = torch.tensor(
                [
                    float(finite),
                    table.shift if finite else 0.0,
                    *(table.lookup.double().tolist() if finite else [0.0] * 4),
                ],
                dtype=torch.float64,
            )
        else:
            flags = torch.zeros(6, dtype=torch.float64)
        dist.broadcast(flags, 0, group=self.group)
        if not flags[0]:
            raise ValueError(f"cannot compress {shard.name}: it holds NaN or Inf")
        table = table or QuantTable(shift=float(flags[1]), lookup=flags[2:].float(), dtype=selected.dtype)
        local_codes = self._scatter_rows(codes, chunk_counts, layout.k).to(selected.device)
        residual = selected - table.decode(local_codes).to(selected.dtype)
        if local.is_view:  # chunks is a view of the buffer: write through it
            chunks.scatter_(1, positions, residual)
        else:
            buffer.view(-1).index_put_((flat_indices(positions, local).reshape(-1),), residual.reshape(-1))
        if self.rank != 0:
            return None
        narrow = torch.int16 if layout.chunk_len <= 2**15 else torch.int64
        return SparseTensor(layout, all_positions.to(narrow), codes, table)

    def _encode_gathered(self, shard: TensorShard, delta: torch.Tensor) -> SparseTensor | None:
        full = self._gather_rows(_as_rows(delta), [end - start for start, end in shard.rows])
        sparse, ok = None, torch.ones(1, dtype=torch.float64)
        if self.rank == 0:
            try:
                sparse = error_feedback_step(
                    self.error_buffers[shard.name],
                    full.reshape(shard.layout.shape),
                    shard.layout,
                    self.cfg.error_decay,
                    self.cfg.lr,
                )
            except ValueError:
                ok.zero_()
        dist.broadcast(ok, 0, group=self.group)
        if not ok[0]:
            raise ValueError(f"cannot compress {shard.name}: it holds NaN or Inf")
        return sparse

    def return_unsent(self, payload: bytes, public_key: bytes, *, peer_id: str, run_id: str, round: int) -> None:
        """Add this node's own packet's values back into the error buffers' rows, when the swarm did
        not apply it (node.training.base.OuterStep.return_unsent has the contract). Every rank
        decodes the whole packet, as `prepare` does, and adds the values of its own chunks (aligned
        tensors) or, on rank 0, of the whole tensor (the rest): each rank's rows end as a 1-rank
        node's buffer would. No collective runs: a packet that does not decode raises the same
        `ProtocolError` on every rank, before any buffer changes."""
        packet = decode_packet(
            payload,
            self.spec,
            public_key,
            run_id=run_id,
            round=round,
            max_bytes=self.max_packet_bytes,
            max_abs_value=self.cfg.max_abs_value,
        )
        if packet.peer_id != peer_id:
            raise ProtocolError(f"packet names peer {packet.peer_id!r}")
        for name, shard in self.shards.items():
            sent = packet.tensors[name]
            if shard.aligned:
                first, count = _chunk_span(shard, self.rank)
                restore_sent(
                    self.error_buffers[name],
                    SparseTensor(
                        shard.local,
                        sent.positions[first : first + count],
                        sent.codes[first : first + count],
                        sent.table,
                    ),
                )
            elif self.rank == 0:
                restore_sent(self.error_buffers[name], sent)

    # --- apply -------------------------------------------------------------------------------

    refusable: tuple[type[Exception], ...] = (ProtocolError,)

    def prepare(
        self, payloads: Mapping[str, bytes], public_keys: Mapping[str, bytes], *, run_id: str, round: int
    ) -> Prepared:
        """Verify and decode every payload (the same on every rank), aggregate this rank's rows."""
        decoded, result = {}, ApplyResult(accepted=[])
        for peer_id in sorted(payloads):
            try:
                packet = decode_packet(
                    payloads[peer_id],
                    self.spec,
                    public_keys[peer_id],
                    run_id=run_id,
                    round=round,
                    max_bytes=self.max_packet_bytes,
                    max_abs_value=self.cfg.max_abs_value,
                )
                if packet.peer_id != peer_id:
                    raise ProtocolError(f"packet names peer {packet.peer_id!r}")
                decoded[peer_id] = packet.tensors
            except self.refusable as e:
                result.refused[peer_id] = f"{type(e).__name__}: {e}"
        result.accepted = sorted(decoded)
        if not decoded:
            return Prepared(result, None)
        aggregates = {}
        for name, shard in self.shards.items():
            selections = [decoded[peer][name] for peer in result.accepted]
            scales = None
            if self.cfg.aggregation == "median_clip":  # from the whole tensors: the same on every rank
                scales = median_clip_scales([math.sqrt(s.squared_norm()) for s in selections])
                for peer, scale in zip(result.accepted, scales):
                    if scale < 1.0:
                        result.scales.setdefault(peer, {})[name] = scale
            device = self.params[name].device
            if shard.aligned:
                first, count = _chunk_span(shard, self.rank)
                mine = [
                    SparseTensor(
                        shard.local, s.positions[first : first + count], s.codes[first : first + count], s.table
                    )
                    for s in selections
                ]
                aggregate = (
                    scatter_mean(mine, device=device, peer_scales=scales)
                    if count
                    else torch.zeros_like(self.start[name])
                )
            else:  # the whole tensor, then this rank's rows
                start, end = shard.rows[self.rank]
                aggregate = scatter_mean(selections, device=device, peer_scales=scales)[start:end].contiguous()
            if self.cfg.lr != 1.0:
                aggregate = aggregate * self.cfg.lr
            aggregates[name] = aggregate
        return Prepared(result, aggregates)

    def commit(self, prepared: Prepared) -> ApplyResult:
        """theta = theta_start - aggregate, on this rank's rows (the start stays where nothing was usable)."""
        for name, p in self.params.items():
            new = (
                self.start[name].clone()
                if prepared.aggregates is None
                else self.start[name] - prepared.aggregates[name].reshape(self.start[name].shape)
            )
            p.detach().copy_(new)
            self.start[name].copy_(new)
        return prepared.result

    # --- whole tensors -----------------------------------------------------------------------

    def gather(self, name: str, which: str = "start") -> torch.Tensor | None:
        """The whole tensor (of the round start, or the parameters) on rank 0; None elsewhere."""
        local = (self.start if which == "start" else self.params)[name].detach()
        shard = self.shards[name]
        full = self._gather_rows(_as_rows(local), [end - start for start, end in shard.rows])
        return None if full is None else full.reshape(shard.layout.shape)

    def load(self, name: str, full: torch.Tensor | None) -> None:
        """Set the parameter and round start of `name` from the whole tensor rank 0 passes."""
        shard, local = self.shards[name], self.params[name]
        whole = (
            full.to(local.device, torch.float32).contiguous()
            if self.rank == 0
            else torch.empty(shard.layout.shape, dtype=torch.float32, device=local.device)
        )
        dist.broadcast(whole, 0, group=self.group)
        start, end = shard.rows[self.rank]
        local.detach().copy_(whole[start:end])
        self.start[name].copy_(local.detach())

    def params_tree(self) -> Tree | None:
        """The hash tree of the round start (protocol/digest.py) on rank 0, one tensor in memory at a time."""
        header = encode_header((name, str(t.dtype), self.spec.shapes[name]) for name, t in self.start.items())
        hasher = ChunkHasher() if self.rank == 0 else None
        for name in self.spec.shapes:
            full = self.gather(name)
            if hasher is not None and full.numel():
                hasher.update(tensor_bytes(full.contiguous()))
        return None if hasher is None else Tree(header, hasher.num_bytes, hasher.finish())

    def _gather_rows(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's (count_r, ...) rows on rank 0, in rank order; None elsewhere."""
        if self.world_size == 1:
            return local
        most = max(counts)
        padded = torch.zeros((most, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in counts] if self.rank == 0 else None
        dist.gather(padded, pieces, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])

    def _scatter_rows(self, full: torch.Tensor | None, counts: list[int], width: int) -> torch.Tensor:
        """Rank r's rows of `full` (rank 0's), the inverse of `_gather_rows`."""
        if self.world_size == 1:
            return full
        most, mine = max(counts), counts[self.rank]
        out = torch.empty((most, width), dtype=torch.uint8)
        pieces = None
        if self.rank == 0:
            pieces, offset = [], 0
            for count in counts:
                piece = torch.zeros((most, width), dtype=torch.uint8)
                piece[:count] = full[offset : offset + count]
                pieces.append(piece)
                offset += count
        dist.scatter(out, pieces, src=0, group=self.group)
        return out[:mine]
