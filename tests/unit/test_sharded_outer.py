"""The sharded outer step (node/training/sharded_outer.py) against the 1-rank one, on 2 gloo ranks.

Two processes (torch.multiprocessing, gloo on 127.0.0.1) each hold rows of the same seeded
tensors, as FSDP2 cuts them; every rank also runs the 1-rank SparseLoCoOuter on the whole tensors.
Over three rounds of seeded deltas: the 2-rank node's packet is byte-identical to the 1-rank
node's, each rank's error buffer rows are the 1-rank buffer's rows bit for bit, the parameters
after the outer step (another peer's packet aggregated too, median clip on) are bit-identical, and
the digest rank 0 computes from gathered tensors is the 1-rank digest. The shapes cover tensors
whose shards follow the tiles (aligned), tensors whose shards cut through tiles (handled by
gathering the delta to rank 0), a 1-D tensor of each kind, and a rank holding no rows.
"""

from __future__ import annotations

import pytest
import torch

from node.training.outer import SparseLoCoOuter
from node.training.params import param_digest
from node.training.sharded_outer import ShardedSparseLoCo, is_aligned, row_ranges
from protocol.packet import ModelSpec
from protocol.run_config import OuterSection
from protocol.signing import PeerKey
from tests.fixtures.ranks import spawn_ranks

SHAPES = {
    "a.aligned": (128, 96),  # 64-row tiles, 64 rows a rank
    "b.mlp": (352, 128),  # 44-row tiles, 176 rows a rank
    "c.cut": (130, 64),  # 26-row tiles, 65 rows a rank: shards cut through tiles
    "d.vector": (96,),  # chunks of 48, one a rank
    "e.vector_cut": (62,),  # one chunk of 62, cut in two
    "f.short": (1, 8),  # one row: rank 1 holds none
    "g.odd": (5, 64),  # 3 and 2 rows of a 5-row tile
}
WORLD = 2
ROUNDS = 3


def _full(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in SHAPES.items()}


def _check(rank: int, cfg: OuterSection) -> None:
    start = _full(0)
    reference = SparseLoCoOuter({n: torch.nn.Parameter(t.clone()) for n, t in start.items()}, cfg)
    rows = {n: row_ranges(shape[0], WORLD)[rank] for n, shape in SHAPES.items()}
    local = {n: t[slice(*rows[n])].clone() for n, t in start.items()}
    sharded = ShardedSparseLoCo(local, SHAPES, cfg)
    assert {n: s.aligned for n, s in sharded.shards.items()} == {
        "a.aligned": True,
        "b.mlp": True,
        "c.cut": False,
        "d.vector": True,
        "e.vector_cut": False,
        "f.short": True,
        "g.odd": False,
    }
    key, other_key = PeerKey.from_seed(b"node"), PeerKey.from_seed(b"other")
    other = SparseLoCoOuter({n: torch.nn.Parameter(t.clone()) for n, t in start.items()}, cfg)
    for round in range(ROUNDS):
        digest = param_digest(reference.start)
        delta, other_delta = _full(100 + round, 0.01), _full(200 + round, 0.03)
        reference.begin_round()
        sharded.begin_round()
        other.begin_round()
        with torch.no_grad():
            for n in SHAPES:
                reference.params[n].sub_(delta[n])
                local[n].sub_(delta[n][slice(*rows[n])])
                other.params[n].sub_(other_delta[n])
        expected = reference.make_payload(run_id="run", round=round, peer_id="node", base_digest=digest, key=key)
        packet = sharded.make_payload(
            run_id="run", round=round, peer_id="node", base_digest=digest, key=key if rank == 0 else None
        )
        if rank == 0:
            assert packet == expected, f"round {round}: the packets differ"
        else:
            assert packet is None
        for n, shard in sharded.shards.items():
            mine = sharded.error_buffers.get(n)
            if shard.aligned:
                assert torch.equal(mine, reference.error_buffers[n][slice(*rows[n])]), f"round {round}: {n}"
            elif rank == 0:
                assert torch.equal(mine, reference.error_buffers[n]), f"round {round}: {n}"
            else:
                assert mine is None
        payloads = {
            "node": expected,
            "other": other.make_payload(run_id="run", round=round, peer_id="other", base_digest=digest, key=other_key),
        }
        keys = {"node": key.public_bytes, "other": other_key.public_bytes}
        applied = reference.commit(reference.prepare(payloads, keys.__getitem__, run_id="run", round=round))
        other.commit(other.prepare(payloads, keys.__getitem__, run_id="run", round=round))
        result = sharded.commit(sharded.prepare(payloads, keys, run_id="run", round=round))
        assert result.accepted == applied.accepted == ["node", "other"] and result.scales == applied.scales
        for n in SHAPES:
            assert torch.equal(local[n], reference.params[n].detach()[slice(*rows[n])]), f"round {round}: {n}"
            assert torch.equal(sharded.start[n], reference.start[n][slice(*rows[n])])
        tree = sharded.params_tree()
        if rank == 0:
            assert tree.hex == param_digest(reference.start)
    # A refused payload is refused on every rank alike, and the rest still applies.
    payloads = {"node": expected, "bad": b"\x00" * 40}
    keys["bad"] = other_key.public_bytes
    result = sharded.prepare(payloads, keys, run_id="run", round=ROUNDS - 1)
    assert result.result.accepted == ["node"] and list(result.result.refused) == ["bad"]


def test_layout_alignment_follows_fsdp_rows():
    layouts = ModelSpec(SHAPES, 64).layouts()
    assert row_ranges(130, 2) == [(0, 65), (65, 130)] and row_ranges(1, 2) == [(0, 1), (1, 1)]
    assert row_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert is_aligned(layouts["a.aligned"], 2) and not is_aligned(layouts["a.aligned"], 4)  # 32-row shards
    assert not is_aligned(layouts["c.cut"], 2) and is_aligned(layouts["c.cut"], 1)


@pytest.mark.parametrize(
    "cfg",
    [OuterSection(), OuterSection(aggregation="mean", lr=0.7, error_decay=0.9)],
    ids=["median_clip", "mean_lr0.7"],
)
def test_two_ranks_match_one_rank_bit_for_bit(cfg, tmp_path):
    spawn_ranks(_check, tmp_path, cfg, world_size=WORLD)
