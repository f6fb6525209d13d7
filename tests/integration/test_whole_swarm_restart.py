"""Every node of a run stops and stays away past the heartbeat timeout and the round's deadline,
with real processes (coordinator, nodes, p2pd, SQLite) on 127.0.0.1: the run pauses instead of
closing empty rounds (coordinator/recovery.py), and when the nodes come back with their
checkpoints it resumes at the round it stopped at, with the digests it had agreed. The rewind to an older state
is covered with a fake clock in tests/unit/test_coordinator_recovery.py. Restarted all at the same
moment, each node starts a DHT of its own (every address it was given is dead); they merge through
the coordinator's live members (node/round/rejoin.py), so a node restarted with an empty disk finds
the snapshot holders."""

from __future__ import annotations

import os
import shutil
import signal
import time
from contextlib import contextmanager

import pytest

from tests.integration.test_faults import (
    assert_history_complete,
    assert_identical_digests,
    checkpoint_round,
    manifests_of,
    peer_id_of,
    report_of,
    start_swarm,
    swarm_for,
    tail,
    wait_exit,
    wait_until,
)

pytestmark = [pytest.mark.slow]


@contextmanager
def swarm_killed_in_round_2(tmp_path, rounds: int, timeout_s: float, round_timeout_s: float):
    """(swarm, status before the kill, checkpoint folders): three nodes with checkpoints (and 2 s of
    compute a round) run until every one trains round 2 from its checkpoint, then are SIGKILLed."""
    ckpt = [tmp_path / f"ckpt{i}" for i in range(3)]
    extra = {i: ("--checkpoint-dir", str(ckpt[i]), "--inject", "slow-compute@min_s=2") for i in range(3)}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(
            swarm,
            {
                "membership.heartbeat_timeout_s": timeout_s,
                "membership.state_wait_s": 120.0,
                "deadline": {"kind": "fixed", "round_timeout_s": round_timeout_s},
            },
        )

        def all_training_round_2(status) -> bool:
            current = status["current_round"] or {}
            return (
                current.get("round") == 2
                and current.get("num_submitted") == 0
                and all(checkpoint_round(c) == 2 for c in ckpt)
            )

        before = wait_until(swarm, all_training_round_2, "every node training round 2 from its checkpoint")
        for node in swarm.nodes:
            os.killpg(node.pid, signal.SIGKILL)
        assert [node.wait(timeout=30) for node in swarm.nodes] == [-signal.SIGKILL] * 3
        yield swarm, before, ckpt


@pytest.mark.timeout(300)
def test_a_run_every_node_left_pauses_and_resumes_where_it_stopped(tmp_path):
    rounds, timeout_s, round_timeout_s = 5, 8.0, 12.0
    with swarm_killed_in_round_2(tmp_path, rounds, timeout_s, round_timeout_s) as (swarm, before, ckpt):
        deadline = before["current_round"]["deadline"]
        paused = wait_until(
            swarm,
            lambda s: s["recovery"] is not None and s["now"] > deadline + 2,
            "the run paused and past round 2's deadline",
            timeout_s=60,
            may_die=(0, 1, 2),
        )
        assert paused["current_round"]["round"] == 2 and [h["round"] for h in paused["history"]] == [0, 1]
        assert {p["status"] for p in paused["peers"]} == {"gone"}
        assert "every peer has stopped" in paused["recovery"]["message"]

        restarted_at = time.time()
        # Node 0 first, then the others once it resumed the run (they bootstrap from its DHT); the
        # next test restarts every node at the same moment. Round 2 waits for them to come back
        # (coordinator/recovery.py, "Regrouping"): node 0 does not finish the run alone meanwhile.
        swarm.start_node(0)  # swarm.nodes[3 + i]
        resumed = wait_until(swarm, lambda s: s["recovery"] is None, "node 0 resuming the run", may_die=(0, 1, 2))
        for i in (1, 2):
            swarm.start_node(i)
        codes = wait_exit(swarm, (3, 4, 5))
        status = swarm.status()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert status["recovery"] is None and status["rewinds"] == []
    assert all(history[r]["majority_digest"] == before["history"][r]["majority_digest"] for r in (0, 1))
    # Never closed by node 0 alone while the others load: with all three, or at its deadline (on
    # 2 busy cores a node can take longer to load its checkpoint than the deadline leaves).
    regroup_deadline = resumed["current_round"]["deadline"]
    assert history[2]["num_contributors"] == 3 or history[2]["closed_at"] >= regroup_deadline, history[2]
    reports = [report_of(swarm, i) for i in range(3)]
    for report in reports:
        assert report["resumed_from"] == 2, report
    assert_identical_digests(swarm, (0, 1, 2), history)
    print(
        f"whole-swarm restart: 0 agreed rounds lost, no empty round closed while paused; round 2 closed "
        f"{history[2]['closed_at'] - restarted_at:.1f} s after the restart"
    )


@pytest.mark.timeout(150)
def test_nodes_restarted_together_one_with_an_empty_disk_find_one_dht_and_the_fresh_one_loads_a_snapshot(tmp_path):
    """Every node SIGKILLed; the run pauses; all three restarted at the same moment, node 2 with
    its checkpoint folder emptied. Each finds every DHT address dead and starts a DHT of its own;
    the rejoin task (node/round/rejoin.py) merges them through the live members the coordinator
    lists. Nodes 0 and 1 resume from their checkpoints; node 2 finds them as snapshot holders,
    loads round 2's start, and contributes again; every digest agrees."""
    rounds, timeout_s = 6, 5.0  # the fresh node starts in ~10 s on 2 busy cores: rounds 2-5 leave it two to join
    with swarm_killed_in_round_2(tmp_path, rounds, timeout_s, 12.0) as (swarm, before, ckpt):
        wait_until(swarm, lambda s: s["recovery"] is not None, "the run paused", timeout_s=60, may_die=(0, 1, 2))
        shutil.rmtree(ckpt[2])
        ckpt[2].mkdir()

        restarted_at = time.time()
        for i in range(3):  # all at once: nobody's DHT is up for the others to bootstrap from
            swarm.start_node(i)  # swarm.nodes[3 + i]
        codes = wait_exit(swarm, (3, 4, 5), timeout_s=120)
        status, manifests = swarm.status(), manifests_of(swarm, rounds)
    assert codes == [0, 0, 0], [tail(swarm.workdir / f"node{i}.log") for i in range(3)]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert status["rewinds"] == []
    assert all(history[r]["majority_digest"] == before["history"][r]["majority_digest"] for r in (0, 1))
    reports = [report_of(swarm, i) for i in range(3)]
    assert reports[0]["resumed_from"] == 2 and reports[1]["resumed_from"] == 2, reports
    fresh = reports[2]
    assert fresh["resumed_from"] is None and any("snapshot" in c["method"] for c in fresh["catch_ups"]), fresh
    fresh_id = peer_id_of(swarm, 2)
    contributed = [r for r, ids in manifests.items() if r >= 2 and fresh_id in ids]
    assert contributed, "the node restarted with an empty disk never contributed again"
    assert_identical_digests(swarm, (0, 1, 2), history)
    print(
        f"whole-swarm restart, all at once, one empty disk: 0 agreed rounds lost; round 2 closed "
        f"{history[2]['closed_at'] - restarted_at:.1f} s after the restart; the fresh node's first packet is in "
        f"round {contributed[0]}, closed {history[contributed[0]]['closed_at'] - restarted_at:.1f} s after it"
    )
