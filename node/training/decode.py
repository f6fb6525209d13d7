"""Decoding a round's packets: the one place that runs `OuterStep.decode`, and how many at once.

    early = EarlyDecodes()
    early.start(outer, payload, public_key, peer_id=p, packet_digest=d, run_id=run, round=r)  # on arrival
    decoded = await early.take(r, [(p, d), ...])          # the manifest's, decoded so far
    tensors, result = decode_all(outer, payloads, public_key, run_id=run, round=r, decoded=decoded)

A node decodes each packet as it arrives (node/round/prefetch.py calls `EarlyDecodes.start`), off
the round's critical path, and the outer step's `prepare` decodes what is left (`decode_all`). Both
run `decode_or_refusal`: the decoded tensors, or the refusal (one of `outer.refusable`) returned
as a value, so a packet decoded early is refused exactly as one decoded late. Anything else a
decode raises is a bug and propagates.

Workers: decoding shares the CPU with training. On the CPU `outer.decode_workers` packets decode
at once (`workers_for`: as many as torch's own threads), each on a worker of the packet kernels'
pool (locoswarm_kernels.chunking.worker_pool) with one torch thread: a decode is many short ops,
which split across cores poorly. Elsewhere one at a time (a device runs its kernels in parallel).
Early decodes take turns for the same workers (a semaphore of `decode_workers`); `decode_all`
maps the rest over the same pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from locoswarm_kernels.chunking import num_workers, pool_map, worker_pool
from node.training.base import ApplyResult, OuterStep

log = logging.getLogger(__name__)

PacketKey = tuple[str, str]  # (publisher peer id, packet digest)
Decoded = Mapping[str, Any] | Exception  # what `decode_or_refusal` returns


def workers_for(device: torch.device | str) -> int:
    """Payloads decoded at once when decoding makes its tensors on `device` (see the module docstring)."""
    return num_workers(None, device)


def decode_or_refusal(
    outer: OuterStep,
    payload: bytes,
    public_key: Callable[[str], bytes] | bytes,
    *,
    peer_id: str,
    run_id: str,
    round: int,
) -> Decoded:
    """`outer.decode` of one payload, or the refusal it raised (one of `outer.refusable`), returned."""
    try:
        return outer.decode(payload, public_key, peer_id=peer_id, run_id=run_id, round=round)
    except outer.refusable as e:
        return e


def decode_all(
    outer: OuterStep,
    payloads: Mapping[str, bytes],
    public_key: Callable[[str], bytes],
    *,
    run_id: str,
    round: int,
    decoded: Mapping[str, Decoded] | None = None,
) -> tuple[dict[str, Mapping[str, Any]], ApplyResult]:
    """Every payload decoded, in peer-id order: taken from `decoded` where it was decoded on arrival
    (its tensors, or the refusal its decoding raised), the others `outer.decode_workers` at a time;
    refusals recorded and logged."""
    decoded = dict(decoded or {})
    missing = sorted(peer for peer, _ in payloads.items() if decoded.get(peer) is None)

    def one(peer: str) -> Decoded:
        return decode_or_refusal(outer, payloads[peer], public_key, peer_id=peer, run_id=run_id, round=round)

    decoded |= dict(zip(missing, pool_map(one, missing, min(outer.decode_workers, len(missing)))))
    out: dict[str, Mapping[str, Any]] = {}
    result = ApplyResult(accepted=[])
    for peer_id in sorted(payloads):
        try:
            if isinstance(decoded[peer_id], BaseException):
                raise decoded[peer_id]
            out[peer_id] = decoded[peer_id]
        except outer.refusable as e:
            result.refused[peer_id] = f"{type(e).__name__}: {e}"
            log.warning("round %d: refusing packet of %s: %s", round, peer_id, result.refused[peer_id])
    result.accepted = sorted(out)
    return out, result


@dataclass(slots=True)
class EarlyDecodes:
    """Packets decoded as they arrived, by round, until the round's aggregate takes them."""

    tasks: dict[int, dict[PacketKey, asyncio.Task]] = field(default_factory=dict)
    slots: asyncio.Semaphore | None = None  # `decode_workers` of them, made at the first packet

    def start(
        self,
        outer: OuterStep,
        payload: bytes,
        public_key: bytes,
        *,
        peer_id: str,
        packet_digest: str,
        run_id: str,
        round: int,
    ) -> None:
        """Decode `payload` in the background (in the event loop's thread: it makes an asyncio task)."""
        self.tasks.setdefault(round, {})[peer_id, packet_digest] = asyncio.create_task(
            self._decode(outer, payload, public_key, peer_id, run_id, round)
        )

    async def _decode(
        self, outer: OuterStep, payload: bytes, public_key: bytes, peer_id: str, run_id: str, round: int
    ) -> Decoded:
        workers = outer.decode_workers
        if self.slots is None:
            self.slots = asyncio.Semaphore(workers)
        async with self.slots:
            decode = functools.partial(
                decode_or_refusal, outer, payload, public_key, peer_id=peer_id, run_id=run_id, round=round
            )
            return await asyncio.get_running_loop().run_in_executor(
                worker_pool(workers) if workers > 1 else None, decode
            )

    async def take(self, round: int, manifest: Iterable[PacketKey]) -> dict[str, Decoded]:
        """The manifest's packets of `round` decoded so far (publisher -> decoded or refusal); rounds
        before it are dropped (left behind by a catch-up)."""
        decoding = self.tasks.pop(round, {})
        for r in [r for r in self.tasks if r < round]:
            del self.tasks[r]
        return {
            peer_id: await task for peer_id, digest in manifest if (task := decoding.get((peer_id, digest))) is not None
        }
