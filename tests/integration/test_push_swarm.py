"""A node nobody can dial, with real processes on 127.0.0.1 (coordinator, three tiny-preset nodes,
their p2pd daemons, SQLite): its packets reach the swarm by push (node/round/push.py).

Node 2 runs with `--behind-nat --inject undialable`: it says nobody can dial it, and its exchange
closes every packet stream it is asked for, so peers can get its packets only from the reachable
peer it pushes each one to. The coordinator's dial-back finds nodes 0 and 1 reachable (their p2pd
listens on 127.0.0.1); without a push, every round's manifest would be amended without node 2's
packet (test_faults.py::test_a_packet_nobody_serves_is_dropped_from_the_manifest).
"""

from __future__ import annotations

import pytest

from tests.integration.test_faults import (
    assert_history_complete,
    assert_identical_digests,
    peer_id_of,
    peer_view,
    rounds_of,
    start_swarm,
    swarm_for,
    wait_exit,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)
def test_a_node_nobody_can_dial_pushes_its_packet_and_it_is_applied_every_round(tmp_path):
    rounds = 3
    extra = {2: ("--behind-nat", "--inject", "undialable")}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(swarm, {"exchange.missing_grace_s": 10.0, "deadline": {"kind": "fixed", "round_timeout_s": 60.0}})
        codes = wait_exit(swarm, (0, 1, 2))
        status = swarm.status()
    assert codes == [0, 0, 0]
    assert_history_complete(status["history"], rounds)
    peers = [peer_id_of(swarm, i) for i in range(3)]
    assert [peer_view(status, p)["reachable"] for p in peers] == [True, True, False]
    assert all(h["num_contributors"] == 3 for h in status["history"]), status["history"]
    assert_identical_digests(swarm, (0, 1, 2), status["history"])
    pushed = [r.get("pushed_to") for r in rounds_of(swarm, 2)]
    assert len(pushed) == rounds and all(pushed), pushed
    for i in (0, 1):
        assert all(r["num_packets"] == 3 for r in rounds_of(swarm, i)), rounds_of(swarm, i)
