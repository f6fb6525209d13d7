"""A node left out of a bounded round keeps what it trained (DESIGN.md, "A packet that misses its
round keeps its mass"): a real coordinator on a SQLite file builds a bounded round (M = 1) that
does not pick the node's packet, and the node's own step (node/round/steps.py `return_if_unsent`)
puts the packet's values back into the node's error buffers from that round view; a picked
packet's values stay sent."""

from __future__ import annotations

import hashlib

import pytest
import torch

from node.round.session import Session
from node.round.steps import return_if_unsent
from node.training.data import load_corpus
from node.training.params import param_digest
from node.training.peer import PeerTraining
from protocol.http import RoundView
from protocol.run_config import RunConfig
from protocol.selection import round_seed, tie_break
from protocol.signing import PeerKey
from tests.doubles.memory_exchange import MemorySwarm
from tests.doubles.session import node_session
from tests.fixtures.coordinator import SignedPeer, create_run, run_config
from tests.unit.test_unsent_mass import assert_within_rounding, fold, perturb

pytestmark = pytest.mark.timeout(60)

BOUNDED = {"membership.min_peers": 2, "outer.max_contributors": 1}


def session_of(peer: SignedPeer, run_id: str, run: RunConfig, tmp_path) -> Session:
    """A node's session as the round loop holds it: `tiny` training, its key and peer id."""
    return node_session(
        tmp_path,
        run,
        client=None,  # the step under test talks to nobody: the round view is handed to it
        exchange=MemorySwarm().exchange("node"),
        training=PeerTraining.build(run, "cpu", load_corpus(None).train),
        run_id=run_id,
        peer_id=peer.peer_id,
        key=peer.key,
        clock=lambda: 0.0,
    )


def test_a_peer_not_picked_gets_its_packet_values_back(coordinator_client, fake_clock, tmp_path):
    client = coordinator_client
    run_id = create_run(client, BOUNDED)
    run = RunConfig.model_validate(run_config(BOUNDED))
    peers = [SignedPeer(client, key=PeerKey.from_seed(seed), clock=fake_clock) for seed in (b"a", b"b")]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    # Both are newcomers that waited 0 rounds: the seeded hash decides, and the node comes second.
    picked, node_peer = sorted(peers, key=lambda p: tie_break(round_seed(run_id, 0, None), p.peer_id))
    s = session_of(node_peer, run_id, run, tmp_path)
    outer = s.outer
    outer.begin_round()
    perturb(s.training.model, seed=3)  # stands in for the inner steps
    folded = fold(outer)
    payload = outer.make_payload(
        run_id=run_id, round=0, peer_id=s.peer_id, base_digest=param_digest(outer.start), key=s.key
    )
    s.sent[0] = payload
    sent = {n: b.clone() for n, b in outer.error_buffers.items()}
    assert any(not torch.equal(sent[n], folded[n]) for n in folded), "the packet took values out"
    digest = hashlib.sha256(payload).hexdigest()
    assert node_peer.submit(run_id, 0, digest=digest, packet_size_bytes=len(payload)).status_code == 200
    assert picked.submit(run_id, 0).status_code == 200  # the pick is settled: the round closes

    view = RoundView.model_validate(client.get(f"/v1/runs/{run_id}/rounds/0").json())
    assert view.state == "closed" and [e.peer_id for e in view.manifest] == [picked.peer_id]
    assert view.picks[s.peer_id].reason.startswith("not picked: newcomer rank 2 of 2")

    as_picked = view.model_copy(
        update={"manifest": view.manifest + [view.manifest[0].model_copy(update={"peer_id": s.peer_id})]}
    )
    return_if_unsent(s, 0, as_picked)  # had it been picked, its values stay sent
    assert all(torch.equal(outer.error_buffers[n], sent[n]) for n in sent) and 0 in s.sent

    return_if_unsent(s, 0, view)
    assert 0 not in s.sent
    assert_within_rounding(outer.error_buffers, folded)
