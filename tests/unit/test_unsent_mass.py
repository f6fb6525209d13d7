"""A packet that misses its round keeps its mass (DESIGN.md): `return_unsent` puts what a node's own
unapplied packet carried back into its error buffers, so that they again hold the round's folded
buffer before compression, and the values are sent in a later round instead of lost.

Exactness: the packet took q out of a selected value v, leaving r = fl(v - q); adding q back gives
fl(r + q), which is v in nearly every element and within a rounding or two otherwise. q lies within
the tensor's selected values (a bin mean plus the shift), so |r| <= 2 max|v| and the two roundings
cost at most 1.5 eps * max|v| of the tensor (eps = 2^-23 in float32): the tolerance used throughout
is 2 eps * max|v| (`ROUNDING` = 2^-22 for float32 buffers), with rtol 0.
"""

from __future__ import annotations

import pytest
import torch

from locoswarm_kernels.chunking import chunk_layout
from locoswarm_kernels.sparse import decompress, error_feedback_step, restore_sent
from node.training.model import build_model
from node.training.outer import make_outer
from node.training.params import flat_named_params, param_digest
from node.training.sharded_outer import ShardedSparseLoCo, row_ranges
from protocol.errors import ProtocolError
from protocol.packet import decode_packet
from protocol.run_config import OuterSection
from protocol.signing import PeerKey
from tests.fixtures.ranks import spawn_ranks

KEY = PeerKey.from_seed(b"me")
ROUNDING = 2.0**-22  # of the tensor's largest folded value: see the module docstring


def assert_within_rounding(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Every tensor within `ROUNDING` of its largest expected value; returns the largest difference."""
    for name, want in expected.items():
        torch.testing.assert_close(actual[name], want, rtol=0, atol=ROUNDING * float(want.abs().max()), msg=name)
    return max(float((actual[name] - want).abs().max()) for name, want in expected.items())


def perturb(model, seed: int, scale: float = 1e-2) -> None:
    """Stand-in for H inner steps: a deterministic perturbation of every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flat_named_params(model).values():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def node(top_k: int = 64, outer_lr: float = 1.0, buffer_seed: int | None = 7):
    """The tiny model and its SparseLoCo outer step; the error buffers seeded (a history to decay)."""
    model = build_model("tiny", seed=0)
    outer = make_outer(flat_named_params(model), OuterSection(strategy="sparseloco", top_k=top_k, lr=outer_lr))
    if buffer_seed is not None:
        gen = torch.Generator().manual_seed(buffer_seed)
        for buffer in outer.error_buffers.values():
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 3e-3)
    return model, outer


def train(model, outer, round: int) -> None:
    """Start round `round` from the global model and train (perturb) from there."""
    with torch.no_grad():  # the previous round applied nothing: back to its start, as every peer does
        for name, p in outer.params.items():
            p.copy_(outer.start[name])
    outer.begin_round()
    perturb(model, seed=round)


def fold(outer) -> dict[str, torch.Tensor]:
    """The error buffers with this round's delta folded in, replayed by hand beside the outer step.
    The same two in-place ops as locoswarm_kernels.sparse.error_feedback_step: add_ with alpha may fuse the
    multiply-add (one rounding), so `beta * e + lr * delta` written out can differ in the last bit."""
    cfg = outer.cfg
    return {
        name: outer.error_buffers[name].clone().mul_(cfg.error_decay).add_(delta.float(), alpha=cfg.lr)
        for name, delta in outer.deltas()
    }


def send(outer, round: int) -> bytes:
    return outer.make_payload(run_id="run", round=round, peer_id="me", base_digest=param_digest(outer.start), key=KEY)


def give_back(outer, payload: bytes, round: int) -> None:
    outer.return_unsent(payload, KEY.public_bytes, peer_id="me", run_id="run", round=round)


def decoded(outer, payload: bytes) -> dict[str, torch.Tensor]:
    """The dense values a packet stands for, per tensor."""
    tensors = decode_packet(payload, outer.spec, KEY.public_bytes).tensors
    return {name: decompress(sparse, torch.float32) for name, sparse in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,top_k",
    [((1,), 64), ((62,), 64), ((5, 64), 64), ((130, 64), 128), ((3, 7, 9), 64), ((64, 64), 4096)],
    ids=str,
)  # the last: k = chunk, all sent
def test_restore_sent_undoes_the_removal(shape, top_k, dtype):
    """The kernel alone on awkward shapes: compress a buffer in place, add the selection back."""
    layout = chunk_layout(shape, top_k)
    folded = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    buffer = folded.clone()
    sparse = error_feedback_step(buffer, None, layout, 1.0, 1.0)
    assert not torch.equal(buffer, folded)
    restore_sent(buffer, sparse)
    tolerance = 2 * torch.finfo(dtype).eps * float(folded.abs().max())
    torch.testing.assert_close(buffer, folded, rtol=0, atol=tolerance)


@pytest.mark.parametrize("top_k", [64, 128])
@pytest.mark.parametrize("outer_lr", [1.0, 0.7])
def test_the_buffer_gets_back_what_the_packet_took(top_k, outer_lr):
    model, outer = node(top_k, outer_lr)
    train(model, outer, round=3)
    folded = fold(outer)
    payload = send(outer, round=3)
    sent = sum(int((outer.error_buffers[n] != folded[n]).sum()) for n in folded)
    assert sent > 0.5 * top_k / 4096 * sum(f.numel() for f in folded.values())  # the packet took its values out
    give_back(outer, payload, round=3)
    worst = assert_within_rounding(outer.error_buffers, folded)
    assert worst <= 4e-9  # measured: 1.9e-9 at top_k 64 and outer_lr 0.7, 0.0 in the three others
    # Nearly every element is bit-exact: only a few sums r + q round (measured: 3 of 13074 sent at top_k 64
    # and outer_lr 0.7, none in the three others).
    rounded = sum(int((outer.error_buffers[n] != folded[n]).sum()) for n in folded)
    assert rounded <= 0.001 * sent


def test_a_returned_round_is_sent_in_the_next():
    """Round 1's packet is not applied. Round 2's packet then carries more mass with the return than
    without, and the node ends round 2 as a node that never sent round 1 would: its buffer plus what
    it sent is both rounds folded in, and its packet and buffer are that node's.

    To float32 rounding, not bit for bit: the return rounds a few elements by one ulp (see the module
    docstring), and one ulp in a value that round 2 selects can move its tensor's quantization table
    by one ulp, so the packet's bytes differ from the never-sent node's in some seeds (measured beside
    this test: in 4 of 12 seeds and configurations; the positions and codes never differed)."""
    models = {how: node() for how in ("returned", "lost", "never")}
    for how, (model, outer) in models.items():
        train(model, outer, round=1)
        if how == "never":  # folded, nothing compressed: the values stay in the buffer
            for name, buffer in fold(outer).items():
                outer.error_buffers[name].copy_(buffer)
            continue
        payload = send(outer, round=1)
        if how == "returned":
            give_back(outer, payload, round=1)
    folded, packets, sent = {}, {}, {}
    for how, (model, outer) in models.items():
        train(model, outer, round=2)
        folded[how] = fold(outer)
        packets[how] = send(outer, round=2)
        sent[how] = decoded(outer, packets[how])
    mass = {how: sum(float(v.double().square().sum()) for v in values.values()) ** 0.5 for how, values in sent.items()}
    assert mass["returned"] > 1.02 * mass["lost"], mass  # measured: 4.41 against 4.20

    returned = models["returned"][1]
    assert_within_rounding({n: b + sent["returned"][n] for n, b in returned.error_buffers.items()}, folded["never"])
    assert_within_rounding(returned.error_buffers, models["never"][1].error_buffers)
    assert_within_rounding(sent["returned"], sent["never"])
    for name, values in sent["returned"].items():  # the same elements sent
        assert torch.equal(values != 0, sent["never"][name] != 0), name


def test_a_damaged_packet_is_refused_and_changes_nothing():
    model, outer = node()
    train(model, outer, round=1)
    payload = send(outer, round=1)
    before = {n: b.clone() for n, b in outer.error_buffers.items()}
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x40
    refused = [
        lambda: give_back(outer, bytes(damaged), round=1),
        lambda: give_back(outer, payload[:-100], round=1),
        lambda: give_back(outer, payload, round=2),  # another round's
        lambda: outer.return_unsent(
            payload, PeerKey.from_seed(b"other").public_bytes, peer_id="me", run_id="run", round=1
        ),  # the signature does not verify
        lambda: outer.return_unsent(payload, KEY.public_bytes, peer_id="someone", run_id="run", round=1),
    ]
    for call in refused:
        with pytest.raises(ProtocolError):
            call()
    assert all(torch.equal(before[n], outer.error_buffers[n]) for n in before)


def test_diloco_keeps_nothing_to_return():
    """DiLoCo sends its whole dense delta and keeps no copy: the method changes nothing, refuses nothing."""
    model = build_model("tiny", seed=0)
    outer = make_outer(flat_named_params(model), OuterSection(strategy="diloco", lr=0.7, momentum=0.9))
    perturb(model, seed=1)
    payload = outer.make_payload()
    state = lambda: [
        {n: t.clone() for n, t in part.items()} for part in (flat_named_params(model), outer.start, outer.momentum)
    ]
    before = state()
    for data in (payload, b"not a packet"):
        outer.return_unsent(data, KEY.public_bytes, peer_id="me", run_id="run", round=0)
    for was, now in zip(before, state()):
        assert all(torch.equal(was[n], now[n]) for n in was)


# A multi-rank node: the shapes cover tensors whose rows follow the tiles (each rank adds its own
# chunks) and tensors whose rows cut through them (the whole buffer on rank 0), and a rank with no rows.
SHARDED_SHAPES = {
    "a.aligned": (128, 96),  # 64-row tiles, 64 rows a rank
    "c.cut": (130, 64),  # 26-row tiles, 65 rows a rank
    "d.vector": (96,),  # chunks of 48, one a rank
    "e.vector_cut": (62,),  # one chunk of 62, cut in two
    "f.short": (1, 8),  # one row: rank 1 holds none
}
WORLD = 2


def _check_sharded(rank: int) -> None:
    """Each rank's buffer rows after a return equal the 1-rank node's bit for bit, and so its folded
    buffer to rounding; a damaged packet is refused on every rank and changes no row."""
    gen = torch.Generator().manual_seed(0)
    start = {name: torch.randn(shape, generator=gen) for name, shape in SHARDED_SHAPES.items()}
    history = {name: torch.randn(shape, generator=gen) * 3e-3 for name, shape in SHARDED_SHAPES.items()}
    delta = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in SHARDED_SHAPES.items()}
    cfg = OuterSection(lr=0.7)
    reference = make_outer({n: torch.nn.Parameter(t.clone()) for n, t in start.items()}, cfg)
    rows = {n: slice(*row_ranges(shape[0], WORLD)[rank]) for n, shape in SHARDED_SHAPES.items()}
    local = {n: t[rows[n]].clone() for n, t in start.items()}
    sharded = ShardedSparseLoCo(local, SHARDED_SHAPES, cfg)
    assert {n for n, s in sharded.shards.items() if not s.aligned} == {"c.cut", "e.vector_cut"}

    def mine(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank holds of whole buffers: its rows (aligned), the whole tensor on rank 0 (the rest)."""
        return {
            n: full[n][rows[n]] if shard.aligned else full[n]
            for n, shard in sharded.shards.items()
            if shard.aligned or rank == 0
        }

    for name, buffer in reference.error_buffers.items():
        buffer.copy_(history[name])
    for name, buffer in mine(history).items():
        sharded.error_buffers[name].copy_(buffer)
    with torch.no_grad():
        for name in SHARDED_SHAPES:
            reference.params[name].sub_(delta[name])
            local[name].sub_(delta[name][rows[name]])
    folded = fold(reference)
    digest = param_digest(reference.start)
    payload = reference.make_payload(run_id="run", round=0, peer_id="me", base_digest=digest, key=KEY)
    packet = sharded.make_payload(
        run_id="run", round=0, peer_id="me", base_digest=digest, key=KEY if rank == 0 else None
    )
    assert packet == (payload if rank == 0 else None)

    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x40
    before = {n: b.clone() for n, b in sharded.error_buffers.items()}
    with pytest.raises(ProtocolError):
        sharded.return_unsent(bytes(damaged), KEY.public_bytes, peer_id="me", run_id="run", round=0)
    assert all(torch.equal(before[n], sharded.error_buffers[n]) for n in before)

    give_back(reference, payload, round=0)
    sharded.return_unsent(payload, KEY.public_bytes, peer_id="me", run_id="run", round=0)
    assert set(sharded.error_buffers) == set(mine(folded))
    for name, rows_of_reference in mine(reference.error_buffers).items():
        assert torch.equal(sharded.error_buffers[name], rows_of_reference), name
    assert_within_rounding(reference.error_buffers, folded)


def test_a_multi_rank_node_returns_its_rows(tmp_path):
    spawn_ranks(_check_sharded, tmp_path, world_size=WORLD)
