"""A member that signs absurd packets, with real processes on 127.0.0.1 (coordinator, three nodes,
their p2pd daemons, SQLite), port 0, tiny preset: node 2 runs `--inject poison@mode=overflow`
(node/faults.py) in round 1, a signed packet whose every table field is finite float32 (shift
1e30, bin means +-3e38) and whose values overflow once two peers' are summed. Before packets were
bounded, every peer accepted it and turned thousands of parameters into NaN, identically, so the
digests agreed and nothing was flagged. Now every node (the attacker too, applying its own round)
refuses it with ValueOutOfRange and says so in its report, the parameters stay finite and equal
everywhere, and the run goes on: the attacker's honest packets of rounds 0 and 2 are applied.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_faults import (
    assert_history_complete,
    assert_identical_digests,
    peer_id_of,
    rounds_of,
    start_swarm,
    swarm_for,
    wait_exit,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(180)
def test_an_overflowing_signed_packet_is_refused_by_every_node(tmp_path):
    rounds = 3
    with swarm_for(tmp_path, 3, rounds, {2: ("--inject", "poison@round=1,mode=overflow")}) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 30.0, "deadline": {"kind": "fixed", "round_timeout_s": 40.0}}
        )
        codes = wait_exit(swarm, (0, 1, 2), timeout_s=150)
        status = swarm.status()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert all(h["num_contributors"] == 3 for h in history), "the attacker's packet is in every manifest"
    digests = assert_identical_digests(swarm, (0, 1, 2), history)
    assert len(digests) == rounds

    attacker = peer_id_of(swarm, 2)
    for i in (0, 1, 2):
        by_round = {r["round"]: r for r in rounds_of(swarm, i)}
        assert sorted(by_round) == list(range(rounds)), f"node {i} applied every round"
        assert [by_round[r]["num_packets"] for r in range(rounds)] == [3, 2, 3]
        assert by_round[0]["refused"] == by_round[2]["refused"] == {}
        assert list(by_round[1]["refused"]) == [attacker]
        assert by_round[1]["refused"][attacker].startswith("ValueOutOfRange"), by_round[1]["refused"]
    assert list(history[1]["refused"]) == [attacker] and "ValueOutOfRange" in history[1]["refused"][attacker]

    finals = [load_file(str(tmp_path / f"node{i}.report.safetensors")) for i in (0, 1, 2)]
    for name, tensor in finals[0].items():
        assert bool(torch.isfinite(tensor).all()), f"{name} holds NaN or Inf"
        assert all(torch.equal(tensor, other[name]) for other in finals[1:])
