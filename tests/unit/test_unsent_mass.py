"""A packet that misses its round keeps its mass (DESIGN.md): `OuterStep.return_unsent` puts what a
node's own unapplied packet carried back into its error buffer, so that the buffer is again what it
was once the delta was folded in and before compression."""

import pytest
import torch

from node.training.model import build_model
from node.training.outer import OuterConfig, make_outer
from node.training.params import flat_named_params, param_digest
from protocol.errors import ProtocolError
from protocol.signing import PeerKey

KEY = PeerKey.from_seed(b"me")


def perturb(model, seed: int, scale: float = 1e-2) -> None:
    """Stand-in for H inner steps: a deterministic perturbation of every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flat_named_params(model).values():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def node(top_k: int, outer_lr: float = 1.0):
    model = build_model("tiny", seed=0)
    outer = make_outer(flat_named_params(model), OuterConfig(strategy="sparseloco", top_k=top_k, outer_lr=outer_lr))
    return model, outer


def packet(model, outer, round: int) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Train (perturb), encode round `round`'s packet; returns it and the folded buffer before compression."""
    outer.begin_round()
    perturb(model, seed=round)
    folded = {name: outer.cfg.error_decay * outer.error_buffers[name] + outer.cfg.outer_lr * delta
              for name, delta in outer.deltas()}
    payload = outer.make_payload(run_id="run", round=round, peer_id="me", base_digest=param_digest(outer.start),
                                 key=KEY)
    return payload, folded


@pytest.mark.parametrize("top_k,outer_lr", [(64, 1.0), (128, 1.0), (64, 0.7)])
def test_the_buffer_gets_back_what_the_packet_took(top_k, outer_lr):
    model, outer = node(top_k, outer_lr)
    with torch.no_grad():  # a buffer with history: the fold decays it
        for name, buffer in outer.error_buffers.items():
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(7)) * 3e-3)
    payload, folded = packet(model, outer, round=3)
    moved = sum(int((outer.error_buffers[n] != folded[n]).sum()) for n in folded)
    assert moved > 0  # the packet took values out
    outer.return_unsent(payload, KEY.public_bytes, peer_id="me", run_id="run", round=3)
    worst = max(float((outer.error_buffers[n] - folded[n]).abs().max()) for n in folded)
    for name in folded:
        # The buffer held v - q(v) where q(v) was sent; adding q(v) back is one fp32 rounding away from v.
        torch.testing.assert_close(outer.error_buffers[name], folded[name], rtol=0, atol=1e-7)
    assert worst <= 1e-7


def test_a_returned_round_is_sent_later():
    """Round 1's packet returned: round 2's packet sends again much of what round 1's took (its
    largest values are still the largest), and more mass than without the return."""
    sizes, overlap = {}, {}
    for returned in (False, True):
        model, outer = node(64)
        payload, folded1 = packet(model, outer, round=1)
        sent1 = {n: outer.error_buffers[n] != folded1[n] for n in folded1}
        if returned:
            outer.return_unsent(payload, KEY.public_bytes, peer_id="me", run_id="run", round=1)
        with torch.no_grad():  # the round applied nothing: back to the round start, as every peer does
            for name, p in outer.params.items():
                p.copy_(outer.start[name])
        payload2, folded2 = packet(model, outer, round=2)
        sent2 = {n: outer.error_buffers[n] != folded2[n] for n in folded2}
        sizes[returned] = sum(float((folded2[n] - outer.error_buffers[n]).norm() ** 2) for n in folded2) ** 0.5
        overlap[returned] = (sum(int((sent1[n] & sent2[n]).sum()) for n in sent1)
                             / sum(int(sent1[n].sum()) for n in sent1))
    assert sizes[True] > sizes[False], sizes
    # Measured: 24 % of round 1's positions sent again with the return, 0.25 % without.
    assert overlap[True] > 0.15 and overlap[True] > 20 * overlap[False], overlap


def test_a_damaged_packet_is_refused_and_changes_nothing():
    model, outer = node(64)
    payload, _ = packet(model, outer, round=1)
    before = {n: b.clone() for n, b in outer.error_buffers.items()}
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x40
    with pytest.raises(ProtocolError):
        outer.return_unsent(bytes(damaged), KEY.public_bytes, peer_id="me", run_id="run", round=1)
    with pytest.raises(ProtocolError):  # someone else's key: the signature does not verify
        outer.return_unsent(payload, PeerKey.from_seed(b"other").public_bytes, peer_id="me", run_id="run", round=1)
    assert all(torch.equal(before[n], outer.error_buffers[n]) for n in before)


def test_dense_strategies_keep_nothing_to_return():
    model = build_model("tiny", seed=0)
    outer = make_outer(flat_named_params(model), OuterConfig(strategy="diloco"))
    start = {n: p.detach().clone() for n, p in flat_named_params(model).items()}
    outer.return_unsent(b"anything", KEY.public_bytes, peer_id="me", run_id="run", round=0)
    assert all(torch.equal(start[n], p) for n, p in flat_named_params(model).items())
