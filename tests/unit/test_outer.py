"""Outer steps: every peer ends a round bit-identical, whatever the arrival order; bad payloads
are left out by everyone alike; the default aggregation clips each peer's tensors to the round's
median norm; DiLoCo's outer step is torch's Nesterov SGD."""

import json
import math

import pytest
import torch

from locoswarm_kernels.sparse import median_clip_scales, scatter_mean
from node.training.model import build_model
from node.training.outer import make_outer
from node.training.params import flat_named_params, param_digest
from protocol.packet import decode_packet
from protocol.run_config import OuterSection
from protocol.signing import PeerKey
from tools.sim.cli import write_summary
from tools.sim.engine import SimConfig, simulate
from tools.sim.plot import plot_summary

PEERS = ["p0", "p1", "p2"]
KEYS = {p: PeerKey.from_seed(p.encode()) for p in PEERS}


def public(peer):
    return KEYS[peer].public_bytes


def local_training(model, seed):
    """Stand-in for H inner steps: a deterministic perturbation, different per peer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flat_named_params(model).values():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)


def swarm(cfg, num_peers=3):
    models = [build_model("tiny", seed=0) for _ in range(num_peers)]
    return models, [make_outer(flat_named_params(m), cfg) for m in models]


def payloads_for(models, outers, round, base):
    out = {}
    for i, (model, outer) in enumerate(zip(models, outers)):
        local_training(model, seed=100 * round + i)
        out[PEERS[i]] = outer.make_payload(
            run_id="r", round=round, peer_id=PEERS[i], base_digest=base, key=KEYS[PEERS[i]]
        )
    return out


@pytest.mark.parametrize("aggregation", ["mean", "median_clip"])
def test_sparseloco_peers_stay_identical_and_apply_the_scatter_mean(aggregation):
    models, outers = swarm(OuterSection(strategy="sparseloco", aggregation=aggregation))
    start = {n: p.detach().clone() for n, p in flat_named_params(models[0]).items()}
    base = param_digest(models[0])
    payloads = payloads_for(models, outers, 0, base)
    for i, outer in enumerate(outers):
        order = dict(reversed(payloads.items())) if i % 2 else payloads  # arrival order differs
        result = outer.commit(outer.prepare(order, public, run_id="r", round=0))
        assert result.accepted == PEERS and not result.refused
    assert len({param_digest(m) for m in models}) == 1
    spec = outers[0].spec
    decoded = [decode_packet(payloads[p], spec, public(p)) for p in PEERS]
    clipped = 0
    for name, p in flat_named_params(models[0]).items():
        selections = [d.tensors[name] for d in decoded]
        scales = None
        if aggregation == "median_clip":  # per tensor: the peer above the median of 3 comes down to it
            scales = median_clip_scales([math.sqrt(s.squared_norm()) for s in selections])
            assert sorted(scales)[1:] == [1.0, 1.0] and 0 < min(scales) <= 1
            clipped += sum(s < 1 for s in scales)
        expected = start[name] - scatter_mean(selections, peer_scales=scales)
        assert torch.equal(p.detach(), expected)
    if aggregation == "median_clip":
        assert clipped == sum(len(s) for s in result.scales.values()) > len(start) // 2
    # the round after starts where the last ended
    payloads = payloads_for(models, outers, 1, param_digest(models[0]))
    for outer in outers:
        outer.commit(outer.prepare(payloads, public, run_id="r", round=1))
    assert len({param_digest(m) for m in models}) == 1


def test_bad_packets_are_left_out_by_every_peer():
    models, outers = swarm(OuterSection(strategy="sparseloco"))
    payloads = payloads_for(models, outers, 0, param_digest(models[0]))
    payloads["p1"] = payloads["p1"][:-1] + bytes([payloads["p1"][-1] ^ 1])  # broken signature
    payloads["p2"] = outers[2].make_payload(
        run_id="r", round=5, peer_id="p2", base_digest="00" * 32, key=KEYS["p2"]
    )  # replayed into the wrong round
    results = [outer.commit(outer.prepare(payloads, public, run_id="r", round=0)) for outer in outers]
    for result in results:
        assert result.accepted == ["p0"]
        assert "BadSignature" in result.refused["p1"] and "WrongRound" in result.refused["p2"]
    assert len({param_digest(m) for m in models}) == 1


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_payloads_decoded_on_arrival_aggregate_exactly_like_those_decoded_at_the_end(strategy):
    """A node decodes each packet as it arrives (outer.decode, the refusal kept as the exception)
    and hands those to prepare: the aggregate and the refusals are the same bits."""
    models, outers = swarm(OuterSection(strategy=strategy))
    payloads = payloads_for(models, outers, 0, param_digest(models[0]))
    payloads["p1"] = payloads["p1"][: len(payloads["p1"]) // 2]  # cut short
    outer = outers[0]
    early = {}
    for peer in ("p0", "p1"):  # p2 arrived last: decoded by prepare itself
        try:
            early[peer] = outer.decode(payloads[peer], public(peer), peer_id=peer, run_id="r", round=0)
        except outer.refusable as e:
            early[peer] = e
    assert isinstance(early["p1"], Exception)
    late = outer.prepare(payloads, public, run_id="r", round=0)
    ahead = outer.prepare(payloads, public, run_id="r", round=0, decoded=early)
    assert ahead.result.accepted == late.result.accepted == ["p0", "p2"]
    assert ahead.result.refused == late.result.refused and "p1" in ahead.result.refused
    assert all(torch.equal(ahead.aggregates[n], late.aggregates[n]) for n in late.aggregates)


def test_median_norm_clipping_bounds_a_poisoned_peer():
    cfg = OuterSection(strategy="sparseloco")
    assert cfg.aggregation == "median_clip", "robust aggregation is the default"
    models, outers = swarm(cfg)
    base = param_digest(models[0])
    for i, (model, outer) in enumerate(zip(models, outers)):
        local_training(model, seed=i)
        if i == 2:  # the attacker scales its whole update by 1000
            with torch.no_grad():
                for name, p in flat_named_params(model).items():
                    p.copy_(outer.start[name] + (p - outer.start[name]) * 1000)
    payloads = {
        PEERS[i]: o.make_payload(run_id="r", round=0, peer_id=PEERS[i], base_digest=base, key=KEYS[PEERS[i]])
        for i, o in enumerate(outers)
    }
    result = outers[0].commit(outers[0].prepare(payloads, public, run_id="r", round=0))
    assert set(result.scales) == {"p2"} and len(result.scales["p2"]) == len(outers[0].params)
    # Each tensor on its own: about 1/1000, but a norm gain sends 2 values, whose honest norms vary a lot.
    factors = sorted(result.scales["p2"].values())
    assert factors[len(factors) // 2] < 0.002 and factors[-1] < 0.5, factors
    moved = sum(float((p.detach() - outers[0].start[n]).abs().max()) for n, p in flat_named_params(models[0]).items())
    assert moved == 0.0  # start was advanced with the parameters
    update = max(
        float((m.detach() - s.detach()).abs().max())
        for m, s in zip(flat_named_params(models[0]).values(), flat_named_params(build_model("tiny", 0)).values())
    )
    assert update < 0.5  # unclipped, the poisoned values would be about 1000 * 1e-2 * 3 sigma


def test_diloco_outer_step_is_nesterov_sgd():
    cfg = OuterSection(strategy="diloco", lr=0.7, momentum=0.9, nesterov=True)
    models, outers = swarm(cfg, num_peers=2)
    reference = build_model("tiny", seed=0)
    ref_params = list(flat_named_params(reference).values())
    sgd = torch.optim.SGD(ref_params, lr=0.7, momentum=0.9, nesterov=True)
    for round in range(2):
        payloads = payloads_for(models, outers, round, "00" * 32)
        mean_delta = [
            (o0 + o1) / 2
            for o0, o1 in zip(
                [s - p.detach() for s, p in zip(outers[0].start.values(), flat_named_params(models[0]).values())],
                [s - p.detach() for s, p in zip(outers[1].start.values(), flat_named_params(models[1]).values())],
            )
        ]
        for outer in outers:
            outer.commit(outer.prepare(payloads))
        for p, g in zip(ref_params, mean_delta):
            p.grad = g
        sgd.step()
        assert len({param_digest(m) for m in models}) == 1
        for p, q in zip(flat_named_params(models[0]).values(), ref_params):
            assert torch.allclose(p, q, atol=1e-6)


def test_simulator_smoke(tmp_path):
    cfg = SimConfig(
        preset="tiny",
        num_peers=2,
        inner_steps=2,
        num_rounds=2,
        batch_size=2,
        seq_len=32,
        eval_every_rounds=1,
        eval_batches=1,
        threads=1,
    )
    summary = simulate(cfg, show_progress=False)
    write_summary(summary, tmp_path)  # as `locoswarm sim` writes it, with its figure
    plot_summary(summary, tmp_path / "val_loss.png")
    for algo in ("sparseloco", "diloco", "ddp"):
        r = summary["strategies"][algo]
        assert r["tokens"] == 2 * 2 * 2 * 2 * 32
        assert r["final_val_loss"] < r["curve"][0][1]  # learning happened
    s = summary["strategies"]
    assert s["diloco"]["bytes_sent_per_peer_per_round"] > 30 * s["sparseloco"]["bytes_sent_per_peer_per_round"]
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["preset"] == "tiny"
    assert (tmp_path / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlap_keeps_the_global_model_identical_and_learns(tmp_path):
    """One-round-delayed outer step: peers' global models agree every round (the simulator raises
    otherwise) and the model still learns; the local model is global minus own in-flight update."""
    cfg = SimConfig(
        algos=("sparseloco",),
        preset="tiny",
        num_peers=2,
        inner_steps=3,
        num_rounds=3,
        batch_size=2,
        seq_len=32,
        eval_every_rounds=1,
        eval_batches=1,
        threads=1,
        overlap=True,
    )
    r = simulate(cfg, show_progress=False)["strategies"]["sparseloco"]
    assert r["final_val_loss"] < r["curve"][0][1]


def test_overlap_local_model_is_global_minus_pending_delta():
    cfg = OuterSection(strategy="sparseloco", overlap=True)
    models, outers = swarm(cfg, num_peers=2)
    first = payloads_for(models, outers, 0, "00" * 32)
    for outer in outers:
        outer.begin_round()
    local_before = [{n: p.detach().clone() for n, p in flat_named_params(m).items()} for m in models]
    second = payloads_for(models, outers, 1, "00" * 32)  # round 1 trains before round 0 lands
    pending = [{n: d.clone() for n, d in o.deltas()} for o in outers]
    for outer in outers:
        outer.commit(outer.prepare(first, public, run_id="r", round=0))
    assert len({param_digest(o.start) for o in outers}) == 1
    for model, outer, delta in zip(models, outers, pending):
        for name, p in flat_named_params(model).items():
            assert torch.allclose(p.detach(), outer.start[name] - delta[name], atol=1e-6)
    assert second and local_before
