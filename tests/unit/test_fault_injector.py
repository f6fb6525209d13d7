"""The fault injector (node/faults.py): spec parsing, each hook's effect, and that an unarmed
injector changes nothing; the `--inject` flag and NodeConfig field; refusals reported to the
coordinator reaching its status (and their bounds); the liar's made-up reports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import torch

from node.faults import Fault, FaultInjector, FaultSpecError, Phase, made_up_tree, parse_fault
from node.round.coordinator_client import wire_tree
from node.training.model import build_model
from node.training.outer import make_outer
from node.training.params import flat_named_params, param_digest, param_tree
from protocol import errors
from protocol.http import AppliedRequest, AppliedResponse
from protocol.packet import decode_packet
from protocol.run_config import OuterSection
from protocol.signing import PeerKey
from tests.fixtures.coordinator import REPO_ROOT, SignedPeer, create_run
from tests.unit.test_round_loop import digests_by_round, in_swarm, run_all

pytestmark = pytest.mark.timeout(60)


def test_parse_specs_and_their_defaults():
    crash = parse_fault("crash@round=3,phase=transfer")
    assert (crash.fault, crash.round, crash.phase) == (Fault.CRASH, 3, Phase.TRANSFER)
    assert parse_fault("crash").round is None and parse_fault("crash").phase is Phase.TRAINING
    poison = parse_fault("poison@factor=1000,mode=random")
    assert (poison.factor, poison.mode, poison.round) == (1000.0, "random", None)
    assert parse_fault("slow-upload@delay_s=2.5").delay_s == 2.5
    assert parse_fault("stale-submit@round=2").fires(2) and not parse_fault("stale-submit@round=2").fires(3)
    lie = parse_fault("lie@from_round=3")
    assert (lie.fault, lie.from_round) == (Fault.LIE, 3)
    assert [lie.fires(r) for r in (0, 2, 3, 4, 100)] == [False, False, True, True, True]
    assert parse_fault("lie").from_round == 0 and parse_fault("lie").fires(0)
    for text in (
        "crash@round=3,phase=transfer",
        "poison@round=1,factor=10.0,mode=scale",
        "corrupt-packet",
        "lie@from_round=3",
    ):
        assert str(parse_fault(str(parse_fault(text)))) == str(parse_fault(text))


@pytest.mark.parametrize(
    "bad",
    [
        "explode",
        "crash@round=-1",
        "crash@phase=upload",
        "crash@factor=2",
        "poison@mode=nice",
        "slow-upload@delay_s=inf",
        "crash@round",
        "poison@factor=x",
        "lie@round=3",
        "lie@from_round=-1",
        "lie@from_round=1.5",
        "crash@from_round=1",
    ],
)
def test_bad_specs_are_refused_with_the_reason(bad):
    with pytest.raises(FaultSpecError) as info:
        parse_fault(bad)
    assert repr(bad) in str(info.value)


def test_slow_compute_idles_up_to_its_floor_and_reports_the_whole():
    slow = FaultInjector.parse(["slow-compute@min_s=0.3"])
    assert parse_fault("slow-compute@round=2,min_s=4").min_s == 4.0
    started = time.monotonic()
    assert asyncio.run(slow.pad_compute(0, 0.1)) == 0.3
    assert 0.15 <= time.monotonic() - started < 1.0  # slept the 0.2 s left, not the whole floor
    started = time.monotonic()
    assert asyncio.run(slow.pad_compute(1, 0.5)) == 0.5  # already slower than the floor: no wait
    assert asyncio.run(FaultInjector.parse(["slow-compute@round=3,min_s=5"]).pad_compute(1, 0.1)) == 0.1
    assert asyncio.run(FaultInjector().pad_compute(1, 0.1)) == 0.1
    assert time.monotonic() - started < 0.5


def _outer(seed=0):
    model = build_model("tiny", seed)
    return model, make_outer(flat_named_params(model), OuterSection(strategy="sparseloco"))


def _train_a_little(model, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)


class _Training:
    """What the poison wrapper needs of a peer's training: train_round and the outer step."""

    def __init__(self, model, outer):
        self.model, self.outer = model, outer

    def train_round(self, round, on_step=None, on_step_queued=None):
        _train_a_little(self.model)  # the same honest update whatever the round
        return "result"


class _Exchange:
    def __init__(self):
        self.published = []

    async def publish(self, round, peer_id, data, announce=True):
        self.published.append((round, peer_id, data))
        return "announcement"


class _Client:
    """Answers `round` as open until its third call, and records submissions."""

    def __init__(self):
        self.calls, self.submitted = 0, []

    async def round(self, round, wait_s=0.0):
        self.calls += 1
        return type("View", (), {"state": "closed" if self.calls >= 3 else "open"})()

    async def submit(self, round, **fields):
        self.submitted.append((round, fields))
        return "response"


def test_unarmed_injector_changes_nothing():
    faults = FaultInjector.parse([])
    assert not faults and faults.describe() == "none"
    model, outer = _outer()
    training, exchange, client = _Training(model, outer), _Exchange(), _Client()
    assert faults.wrap_training(training) is training
    assert faults.wrap_exchange(exchange) is exchange
    assert faults.wrap_client(client) is client
    assert faults.exchange_class(dict) is dict
    asyncio.run(faults.at_phase(Phase.TRAINING, 0))


def test_poison_scales_the_update_or_replaces_it_by_noise():
    def update_after(faults: list[str], round: int) -> dict[str, torch.Tensor]:
        model, outer = _outer()
        training = FaultInjector.parse(faults).wrap_training(_Training(model, outer))
        assert training.train_round(round) == "result" and training.model is model  # the rest: the wrapped's
        return {name: delta.clone() for name, delta in outer.deltas()}

    honest = update_after([], 1)
    not_its_round = update_after(["poison@round=2,factor=1000"], 1)
    assert all(torch.equal(honest[n], d) for n, d in not_its_round.items())
    for name, delta in update_after(["poison@round=2,factor=1000"], 2).items():
        torch.testing.assert_close(delta, honest[name] * 1000, rtol=1e-3, atol=1e-4)

    noise = update_after(["poison@mode=random,factor=100"], 1)
    name = max(noise, key=lambda n: noise[n].numel())
    ratio = float(noise[name].std() / honest[name].std())
    assert 50 < ratio < 200 and not torch.allclose(noise[name], honest[name] * 100)


def test_corrupt_packet_is_refused_at_the_signature_by_any_decoder():
    model, outer = _outer()
    _train_a_little(model)
    key = PeerKey.from_seed(b"corrupt")
    payload = outer.make_payload(run_id="r", round=1, peer_id="p0", base_digest="00" * 32, key=key)
    inner = _Exchange()
    exchange = FaultInjector.parse(["corrupt-packet@round=1"]).wrap_exchange(inner)
    assert asyncio.run(exchange.publish(0, "p0", payload)) == "announcement"
    asyncio.run(exchange.publish(1, "p0", payload))
    (_, _, honest), (_, _, corrupted) = inner.published
    assert honest is payload
    assert len(corrupted) == len(payload) and corrupted != payload
    with pytest.raises(errors.BadSignature):
        decode_packet(corrupted, outer.spec, key.public_bytes, run_id="r", round=1)
    result = outer.commit(outer.prepare({"p0": corrupted}, lambda _: key.public_bytes, run_id="r", round=1))
    assert result.accepted == [] and result.refused["p0"].startswith("BadSignature")


def test_stale_submit_waits_for_the_round_to_close():
    inner = _Client()
    client = FaultInjector.parse(["stale-submit@round=4"]).wrap_client(inner)
    assert asyncio.run(client.submit(3, packet_digest="d3")) == "response"
    assert inner.calls == 0
    asyncio.run(client.submit(4, packet_digest="d4"))
    assert inner.calls == 3 and inner.submitted == [(3, {"packet_digest": "d3"}), (4, {"packet_digest": "d4"})]


class _ReportingClient:
    """Records applied reports and answers each as the coordinator would when `majority` (default:
    the digest reported) is the round's majority digest."""

    def __init__(self, majority: str | None = None):
        self.majority, self.reports = majority, []

    async def applied(self, round, params_digest, refused=None, manifest_version=1, *, tree=None, **fields):
        self.reports.append((round, params_digest, manifest_version, tree, refused, fields))
        majority = self.majority or params_digest
        return AppliedResponse(
            round=round,
            majority_digest=majority,
            agrees=majority == params_digest,
            num_reports=3,
            agreed_digest=majority,
            manifest_version=manifest_version,
        )


def _report(client, round: int, digest: str, tree, manifest_version: int = 1) -> AppliedResponse:
    return asyncio.run(
        client.applied(
            round, digest, refused={"p1": "late"}, manifest_version=manifest_version, tree=tree, val_loss=2.5
        )
    )


def test_lie_replaces_the_digest_and_tree_from_its_round_on():
    real = param_tree(build_model("tiny", 0))
    inner = _ReportingClient()
    client = FaultInjector.parse(["lie@from_round=3"]).wrap_client(inner)
    honest = _report(client, 2, real.hex, real)
    assert inner.reports[0] == (2, real.hex, 1, real, {"p1": "late"}, {"val_loss": 2.5})
    assert honest.agrees

    lied = _report(client, 3, real.hex, real)
    round, digest, version, tree, refused, fields = inner.reports[1]
    assert (round, version, refused, fields) == (3, 1, {"p1": "late"}, {"val_loss": 2.5})
    assert digest != real.hex and tree.hex == digest and tree == made_up_tree(real, 3, 1)
    assert (tree.header, tree.body_bytes, len(tree.leaves)) == (real.header, real.body_bytes, len(real.leaves))
    assert AppliedRequest(params_digest=digest, tree=wire_tree(tree)).tree is not None  # hashes to the lie
    # The coordinator took the lie as the majority; the answer the node gets is of its real digest.
    assert lied.majority_digest == lied.agreed_digest == digest and not lied.agrees

    # Another liar, or this one restarted, tells the same lie; another round or version, another one.
    other = FaultInjector.parse(["lie"]).wrap_client(_ReportingClient())
    _report(other, 3, real.hex, real)
    _report(other, 3, real.hex, real, manifest_version=2)
    _report(other, 4, real.hex, real)
    same, amended, later = (report[1] for report in other._inner.reports)
    assert same == digest and len({digest, amended, later}) == 3


def test_a_liar_among_honest_peers_hears_that_its_real_digest_agrees():
    real = param_tree(build_model("tiny", 0))
    client = FaultInjector.parse(["lie"]).wrap_client(_ReportingClient(majority=real.hex))
    response = _report(client, 0, real.hex, real)
    assert client._inner.reports[0][1] != real.hex
    assert response.agrees and response.agreed_digest == real.hex


def test_lie_without_a_tree_of_the_digest_reports_a_made_up_digest_alone():
    real, stale = param_tree(build_model("tiny", 0)), param_tree(build_model("tiny", 1))
    inner = _ReportingClient()
    client = FaultInjector.parse(["lie"]).wrap_client(inner)
    _report(client, 1, real.hex, None)
    _report(client, 1, real.hex, stale)  # a tree of another digest is no tree of this one
    (_, first, _, no_tree, _, _), (_, second, _, still_none, _, _) = inner.reports
    assert first == second != real.hex and no_tree is None and still_none is None


def test_slow_upload_delays_every_served_stream():
    class Exchange:
        served_at: list[float] = []

        async def _serve(self, info, reader, writer):
            self.served_at.append(time.monotonic())

    slow = FaultInjector.parse(["slow-upload@delay_s=0.2"]).exchange_class(Exchange)
    assert issubclass(slow, Exchange) and slow is not Exchange
    start = time.monotonic()
    asyncio.run(slow()._serve(None, None, None))
    assert Exchange.served_at[-1] - start >= 0.2


def test_crash_kills_the_process_with_sigkill_at_its_round_and_phase():
    script = (
        "import asyncio\n"
        "from node.faults import FaultInjector, Phase\n"
        "faults = FaultInjector.parse(['crash@round=2,phase=training'])\n"
        "asyncio.run(faults.at_phase(Phase.TRAINING, 1))\n"
        "asyncio.run(faults.at_phase(Phase.TRANSFER, 2))\n"
        "print('survived round 1 and the transfer phase', flush=True)\n"
        "asyncio.run(faults.at_phase(Phase.TRAINING, 2))\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == -9, done.stderr
    assert "survived" in done.stdout and "not reached" not in done.stdout
    assert "crash (SIGKILL) in round 2" in done.stderr


def test_inject_flag_and_node_config_field():
    import argparse

    from node.cli import join as node_cli
    from node.cli.config_flags import config_overrides
    from node.config import NodeConfig, load_node_config

    parser = argparse.ArgumentParser()
    node_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "node",
            "join",
            "--coordinator",
            "http://127.0.0.1:1",
            "--inject",
            "crash@round=1",
            "--inject",
            "slow-upload@delay_s=1",
        ]
    )
    config = load_node_config(None, config_overrides(args, NodeConfig))
    assert config.debug.inject == ("crash@round=1", "slow-upload@delay_s=1")
    assert load_node_config(None, {"coordinator": "http://x:1"}).debug.inject == ()


def test_refused_packets_reach_the_status_and_are_bounded(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    a, b = (SignedPeer(client, clock=fake_clock) for _ in range(2))
    for peer in (a, b):
        assert peer.join(run_id).status_code == 200
    for peer in (a, b):
        assert peer.submit(run_id, 0).status_code == 200
    path = f"/v1/runs/{run_id}/rounds/0/applied"
    digest = "11" * 32
    reason = "BadSignature: signature does not verify"
    assert a.post(path, {"params_digest": digest, "refused": {b.peer_id: reason}}).status_code == 200
    fake_clock.advance(1.0)
    assert b.post(path, {"params_digest": digest, "refused": {b.peer_id: "later reason"}}).status_code == 200
    [summary] = client.get(f"/v1/runs/{run_id}/status").json()["history"]
    assert summary["refused"] == {b.peer_id: reason} and summary["num_applied"] == 2
    # bounded: at most 64 entries, reasons of 256 characters, keys that are peer ids
    too_many = {f"p{i:016x}": "x" for i in range(65)}
    for bad in (too_many, {b.peer_id: "x" * 257}, {"not-a-peer": "x"}, {b.peer_id: 5}):
        response = a.post(path, {"params_digest": digest, "refused": bad})
        assert response.status_code == 422, response.text
    assert "refused packets" in client.get(f"/?run={run_id}").text


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_a_round_with_no_usable_packet_leaves_every_peer_at_the_global_model(strategy):
    """Found under load: round 0 closed at its deadline with an empty manifest and each peer kept
    its own locally trained parameters, forking the swarm. An empty or all-refused round is a no-op."""
    key = PeerKey.from_seed(b"p0")
    digests = set()
    for seed in (1, 2):  # two peers that trained differently
        model = build_model("tiny", 0)
        outer = make_outer(flat_named_params(model), OuterSection(strategy=strategy))
        start = param_digest(model)
        outer.begin_round()
        _train_a_little(model, seed)
        payload = outer.make_payload(run_id="r", round=0, peer_id="p0", base_digest=start, key=key)
        assert outer.commit(outer.prepare({}, lambda _: key.public_bytes, run_id="r", round=0)).accepted == []
        assert param_digest(model) == start
        _train_a_little(model, seed)
        truncated = payload[: len(payload) // 2]  # refused by both strategies (DiLoCo payloads are unsigned)
        result = outer.commit(outer.prepare({"p0": truncated}, lambda _: key.public_bytes, run_id="r", round=0))
        assert result.accepted == [] and "p0" in result.refused
        digests.add(param_digest(model))
    assert digests == {start}


@in_swarm
async def test_a_liar_trains_on_with_its_real_state(swarm):
    """Three honest peers and one that lies from round 1: the swarm agrees on the honest digests,
    and the liar, whose answers say its real digest agrees, applies every round without a catch-up."""
    await swarm.create_run(min_peers=4, max_rounds=4)
    honest = [swarm.node(name)[0] for name in "abc"]
    liar, _ = swarm.node("liar", FaultInjector.parse(["lie@from_round=1"]))
    await run_all(*honest, liar)
    agreed = {h.round: h.agreed_digest for h in (await swarm.status()).history}
    assert sorted(agreed) == [0, 1, 2, 3]
    assert liar.catch_ups == [] and [r.round for r in liar.reports] == [0, 1, 2, 3]
    for node in (*honest, liar):
        assert digests_by_round(node) == agreed
