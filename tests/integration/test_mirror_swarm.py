"""The packet mirror with real processes on 127.0.0.1: a coordinator that signs for an S3 store
(moto's, in this process: tests/fixtures/s3.py), three tiny-preset nodes, and one of them whose
packets only the mirror serves.

Node 2 runs with `--inject withhold`: it submits each round's packet and uploads it to the URL its
submission was answered with, but serves it to no peer (node/faults.py). Without a mirror the
coordinator would amend every round's manifest without it
(test_faults.py::test_a_packet_nobody_serves_is_dropped_from_the_manifest); with one, nodes 0
and 1 take node 2's packet from the store once the peers have not delivered it within
mirror_after_s, so every round keeps its first manifest, with all three packets, and every node
applies each round with one parameter digest. The agreed snapshots go to the store as well
(snapshot_every_rounds), uploaded by the nodes the coordinator chose and offered in the status.

Then the whole swarm dies, disks included: every node SIGKILLed in round 2, and one node that
never ran (a new key, no checkpoint) joins the paused run. The store holds round 2's agreed start,
so the run resumes at once (coordinator/recovery.py), the new node loads that start from the
store (no peer serves it), and trains the run to its end alone with no round lost.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.integration.test_faults import (
    assert_history_complete,
    assert_identical_digests,
    node_log,
    peer_id_of,
    report_of,
    rounds_of,
    start_swarm,
    swarm_for,
    tail,
    wait_exit,
    wait_until,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)
def test_a_packet_only_the_mirror_serves_is_applied_every_round(tmp_path, s3_store):
    rounds, fetch_timeout_s = 3, 20.0
    bucket = s3_store.create_bucket()
    common = ("--fetch-timeout", str(fetch_timeout_s))
    extra = {0: common, 1: common, 2: (*common, "--inject", "withhold")}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(
            swarm,
            {
                "exchange.mirror": {
                    "endpoint_url": s3_store.endpoint_url,
                    "bucket": bucket,
                    "prefix": "pk/",
                    "snapshot_every_rounds": 2,
                },
                "exchange.missing_grace_s": 10.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 60.0},
            },
        )
        codes = wait_exit(swarm, (0, 1, 2))
        status = swarm.status()
        views = [
            httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/{r}", trust_env=False, timeout=30).json()
            for r in range(rounds)
        ]
    assert codes == [0, 0, 0]
    assert_history_complete(status["history"], rounds)
    peers = [peer_id_of(swarm, i) for i in range(3)]
    for view in views:
        assert view["manifest_version"] == 1 and view["dropped"] == {}, view
        assert sorted(e["peer_id"] for e in view["manifest"]) == sorted(peers)
        assert all(e["mirror_url"] for e in view["manifest"])
    assert_identical_digests(swarm, (0, 1, 2), status["history"])
    for i in (0, 1):
        applied = rounds_of(swarm, i)
        assert [r["round"] for r in applied] == list(range(rounds))
        assert all(r["num_packets"] == 3 for r in applied), applied
    keys = set(s3_store.keys(bucket))
    withheld = {f"pk/{swarm.run_id}/{r:08d}/{peers[2]}.pkt" for r in range(rounds)}
    assert withheld <= keys, sorted(keys)
    # The agreed start of round 1 (snapshot_every_rounds 2: after rounds 0 and 2) went up too, and
    # is offered; the run's last round settles only when the run ends, so it may not be.
    offered = status["snapshot_mirror"]
    agreed = {h["round"] + 1: h["agreed_digest"] for h in status["history"]}
    assert offered is not None and offered["round"] in (1, 3) and offered["params_digest"] == agreed[offered["round"]]
    snapshots = {k for k in keys if k.startswith("snapshots/")}
    assert f"snapshots/{swarm.run_id}/00000001-{agreed[1]}.snap" in snapshots, sorted(snapshots)
    assert {k.rsplit("/", 1)[1][:8] for k in snapshots} <= {"00000001", "00000003"}  # due rounds only
    assert s3_store.check.num_denied == 0
    print(f"mirror: {len(keys)} objects in the bucket after {rounds} rounds of 3 nodes")


@pytest.mark.timeout(240)
def test_a_swarm_whose_every_node_died_goes_on_from_the_store(tmp_path, s3_store):
    rounds, timeout_s = 4, 5.0
    bucket = s3_store.create_bucket()
    slow = ("--inject", "slow-compute@min_s=3")  # a window to kill the swarm in round 2
    with swarm_for(tmp_path, 3, rounds, {i: slow for i in range(3)}) as swarm:
        start_swarm(
            swarm,
            {
                "exchange.mirror": {
                    "endpoint_url": s3_store.endpoint_url,
                    "bucket": bucket,
                    "snapshot_every_rounds": 1,
                },
                "membership.heartbeat_timeout_s": timeout_s,
                # The round the store resumes waits to its deadline for the dead nodes, who were
                # round 1's peers (coordinator/recovery.py, "Regrouping"): 25 s + the time-out.
                "deadline": {"kind": "fixed", "round_timeout_s": 25.0},
            },
        )
        before = wait_until(
            swarm,
            lambda s: (s["current_round"] or {}).get("round") == 2 and (s["snapshot_mirror"] or {}).get("round") == 2,
            "round 2 open and its start in the store",
        )
        for node in swarm.nodes:
            os.killpg(node.pid, signal.SIGKILL)
        assert [node.wait(timeout=30) for node in swarm.nodes] == [-signal.SIGKILL] * 3
        wait_until(swarm, lambda s: s["recovery"] is not None, "the run paused", timeout_s=60, may_die=(0, 1, 2))

        swarm.start_node(3)  # a node that never ran: a new key, nothing on disk
        codes = wait_exit(swarm, (3,), timeout_s=150)
        status = swarm.status()
        log = node_log(swarm, 3)
    assert codes == [0], tail(swarm.workdir / "node3.log")
    history = status["history"]
    assert_history_complete(history, rounds)
    assert status["rewinds"] == [] and status["recovery"] is None
    assert all(history[r]["agreed_digest"] == before["history"][r]["agreed_digest"] for r in (0, 1))
    report = report_of(swarm, 3)
    assert [c["method"] for c in report["catch_ups"]] == ["snapshot"], report["catch_ups"]
    assert "from the packet mirror" in log
    assert [r["round"] for r in report["rounds"]] == [2, 3]
    print(f"whole swarm dead in round 2: a new node went on from the store; rounds 2-{rounds - 1} closed, none lost")
