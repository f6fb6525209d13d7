"""Every node of a run stops and stays away past the heartbeat timeout and the round's deadline,
with real processes (coordinator, nodes, p2pd, SQLite) on 127.0.0.1: the run pauses instead of
closing empty rounds (coordinator/recovery.py), and when the nodes come back with their
checkpoints it resumes at the round it stopped at, with the digests it had agreed. The rewind to an older state
is covered with a fake clock in tests/unit/test_coordinator_recovery.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.test_faults import (assert_history_complete, assert_identical_digests, checkpoint_round,
                                           report_of, start_swarm, swarm_for, wait_exit, wait_until)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_a_run_every_node_left_pauses_and_resumes_where_it_stopped(tmp_path):
    rounds, timeout_s, round_timeout_s = 5, 8.0, 12.0
    ckpt = [tmp_path / f"ckpt{i}" for i in range(3)]
    extra = {i: ("--checkpoint-dir", str(ckpt[i]), "--inject", "slow-compute@min_s=2") for i in range(3)}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(swarm, {"membership.heartbeat_timeout_s": timeout_s, "membership.state_wait_s": 120.0,
                            "deadline": {"kind": "fixed", "round_timeout_s": round_timeout_s}})

        def all_training_round_2(status) -> bool:
            current = status["current_round"] or {}
            return (current.get("round") == 2 and current.get("num_submitted") == 0
                    and all(checkpoint_round(c) == 2 for c in ckpt))

        before = wait_until(swarm, all_training_round_2, "every node training round 2 from its checkpoint")
        for node in swarm.nodes:
            os.killpg(node.pid, signal.SIGKILL)
        assert [node.wait(timeout=30) for node in swarm.nodes] == [-signal.SIGKILL] * 3
        deadline = before["current_round"]["deadline"]
        paused = wait_until(swarm, lambda s: s["recovery"] is not None and s["now"] > deadline + 2,
                            "the run paused and past round 2's deadline", timeout_s=60, may_die=(0, 1, 2))
        assert paused["current_round"]["round"] == 2 and [h["round"] for h in paused["history"]] == [0, 1]
        assert {p["status"] for p in paused["peers"]} == {"gone"}
        assert "every peer has stopped" in paused["recovery"]["message"]

        restarted_at = time.time()
        # Node 0 first, as at the start: the dead peers' DHT addresses fail, it starts the DHT the
        # others then join (nodes started together each start their own; see the closing note).
        swarm.start_node(0)  # swarm.nodes[3 + i]
        wait_until(swarm, lambda s: s["recovery"] is None, "node 0 resuming the run", may_die=(0, 1, 2))
        for i in (1, 2):
            swarm.start_node(i)
        codes = wait_exit(swarm, (3, 4, 5))
        status = swarm.status()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert status["recovery"] is None and status["rewinds"] == []
    assert all(history[r]["majority_digest"] == before["history"][r]["majority_digest"] for r in (0, 1))
    reports = [report_of(swarm, i) for i in range(3)]
    for report in reports:
        assert report["resumed_from"] == 2, report
    assert_identical_digests(swarm, (0, 1, 2), history)
    print(f"whole-swarm restart: 0 agreed rounds lost, no empty round closed while paused; round 2 closed "
          f"{history[2]['closed_at'] - restarted_at:.1f} s after the restart")
