"""A snapshot holder in a process of its own (with its p2pd), for tests that kill it mid-stream.

    python -m tests.integration.snapshot_holder RUN_ID ROUND INITIAL_PEER [--unit-delay-s S]

It joins the swarm through INITIAL_PEER, serves a snapshot of `Toy(1)` with its momentum for
ROUND (the same bytes the tests' in-process holders serve), and prints one line
"ready <libp2p id>" once the snapshot is announced; then it serves until killed. With
`--unit-delay-s` it pauses that long before each unit it serves, so a test can kill it in the
middle of a stream. It runs in a session of its own: `os.killpg(pid, SIGKILL)` takes p2pd too.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from torch import nn

from node.exchange.config import ExchangeConfig
from node.exchange.p2p import P2PExchange
from node.training.snapshot import Snapshot
from protocol.dht_records import PARAMS_ID


class Toy(nn.Module):
    """Three tensors, one crossing a chunk boundary, 10.3 MB in all (zeros without a seed)."""

    def __init__(self, seed: int | None):
        super().__init__()
        g = torch.Generator().manual_seed(seed or 0)
        make = (lambda *shape: torch.randn(*shape, generator=g)) if seed is not None else torch.zeros
        self.embed = nn.Parameter(make(1536, 1024))
        self.mlp = nn.Parameter(make(1000, 1001))
        self.norm = nn.Parameter(make(777))


def momentum_of(model: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """DiLoCo-style outer state of a model, served in the snapshot's second section."""
    return {f"outer_momentum.{name}": p.detach() * scale for name, p in model.named_parameters()}


def toy_snapshot(scale: float = -2.0) -> tuple[nn.Module, Snapshot]:
    model = Toy(1)
    return model, Snapshot.from_tensors(dict(model.named_parameters()), momentum_of(model, scale))


class SlowExchange(P2PExchange):
    unit_delay_s = 0.0

    def _payload_for(self, round, publisher, data):
        if publisher == PARAMS_ID:
            time.sleep(self.unit_delay_s)  # this process only serves: blocking its loop is the point
        return data


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_id")
    parser.add_argument("round", type=int)
    parser.add_argument("initial_peer")
    parser.add_argument("--unit-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    SlowExchange.unit_delay_s = args.unit_delay_s
    exchange = await SlowExchange.create(
        ExchangeConfig(run_id=args.run_id, initial_peers=(args.initial_peer,), max_packet_bytes=1 << 20)
    )
    _, snapshot = toy_snapshot()
    await exchange.publish_params(args.round, snapshot)
    print(f"ready {exchange.holder_id}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
