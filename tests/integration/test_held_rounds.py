"""A round does not close at its deadline on a minority while most of the previous round's
contributors are still fetching that round (coordinator/rules/rounds.py, "Held for the previous
round"), with real processes on 127.0.0.1: coordinator, four nodes, their p2pd daemons, SQLite.

The attack it stops: one modified node withholds its round-0 packet (node/faults.py `withhold`),
so the three honest nodes wait out their fetch time-out and the amendment before they can apply
round 0, while it applies round 0 at once, trains round 1 and submits. Closed at its deadline,
round 1 would hold its packet alone: its update alone moves the shared model, its lone vote is the
round's agreed digest, and a round built on it can no longer be amended.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_faults import (
    assert_history_complete,
    assert_identical_digests,
    manifests_of,
    peer_id_of,
    rounds_of,
    start_swarm,
    swarm_for,
    wait_exit,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_a_withholder_cannot_make_the_next_round_alone_while_the_others_wait_for_its_packet(tmp_path):
    rounds, fetch_timeout_s, round_timeout_s = 3, 10.0, 4.0
    honest = ("--fetch-timeout", str(fetch_timeout_s))
    extra = {0: honest, 1: honest, 2: honest, 3: (*honest, "--inject", "withhold@round=0")}
    with swarm_for(tmp_path, 4, rounds, extra) as swarm:
        start_swarm(
            swarm,
            {
                "exchange.missing_grace_s": 5.0,
                "membership.heartbeat_timeout_s": 60.0,
                # Round 0 waits for every node's start-up (no history yet); the others get 4 s.
                "deadline": {"kind": "adaptive", "initial_s": 120.0, "min_s": 2.0, "max_s": round_timeout_s},
            },
        )
        codes = wait_exit(swarm, (0, 1, 2, 3))
        status = swarm.status()
        manifests = manifests_of(swarm, rounds)
        round0 = httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/0", trust_env=False, timeout=30).json()
    assert codes == [0, 0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    withholder, honest_ids = peer_id_of(swarm, 3), {peer_id_of(swarm, i) for i in range(3)}
    assert list(round0["dropped"]) == [withholder], round0  # in round 0, then dropped as missing
    assert set(manifests[0]) == honest_ids
    # The honest nodes were still fetching round 0 when round 1's 4 s ran out: it waited for them.
    assert honest_ids <= set(manifests[1]), (manifests, history[1])
    held_s = history[1]["closed_at"] - history[0]["closed_at"]
    assert held_s > round_timeout_s + fetch_timeout_s / 2, history
    assert_identical_digests(swarm, range(4), history)
    # One fetch time-out per packet nobody serves, early fetch and the close's together: the honest
    # nodes applied the amended round 0 within it (and the amendment), not two of them.
    for i in range(3):
        [applied] = [r for r in rounds_of(swarm, i) if r["round"] == 0]
        delay_s = applied["ended_at"] - history[0]["closed_at"]
        assert applied["num_packets"] == 3 and delay_s < fetch_timeout_s + 8.0, (i, delay_s)
    print(f"held rounds: round 1 closed {held_s:.1f} s after it opened (its timeout {round_timeout_s:.0f} s)")
