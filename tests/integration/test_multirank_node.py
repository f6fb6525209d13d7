"""A 2-rank node (FSDP2 on gloo, CPU) beside a 1-rank node in a real swarm on 127.0.0.1.

A coordinator process, one `node join --ranks 2` (rank 0 starts rank 1 itself) and one plain
`node join`, tiny preset, three rounds. Both nodes report the same digest after every round, and
the coordinator agrees it (the round's agreed digest, from the contributors' votes): the 2-rank
node's packet and outer step match a 1-rank node's. Every process exits 0, and the follower rank
is gone afterwards (its pid is in the node's log). The 2-rank node's checkpoint holds the
agreed global model. And a follower rank exits when its rank 0 is killed (no orphans).
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.cli.demo import LocalSwarm
from node.training.checkpoint import checkpoint_meta

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_two_rank_node_agrees_with_one_rank_node(tmp_path):
    rounds, peers = 3, 2
    with LocalSwarm(
        tmp_path,
        num_peers=peers,
        preset="tiny",
        rounds=rounds,
        inner_steps=4,
        top_k=64,
        quiet=True,
        extra_node_args={0: ("--ranks", "2", "--checkpoint-dir", str(tmp_path / "checkpoint"))},
    ) as swarm:
        summary = swarm.run(timeout_s=240)
        codes = [node.wait(timeout=60) for node in swarm.nodes]
        status = swarm.status()
    assert codes == [0] * peers
    log = (tmp_path / "node0.log").read_text()
    followers = [int(pid) for pid in re.search(r"ranks 1\.\.1 started as processes (\d+)", log).group(1).split()]
    assert followers and all(_gone(pid) for pid in followers), "a follower rank outlived its node"
    reports = [json.loads((tmp_path / f"node{i}.report.json").read_text())["rounds"] for i in range(peers)]
    history = {h["round"]: h for h in status["history"]}
    for k in range(rounds):
        digests = {next(r for r in rep if r["round"] == k)["digest"] for rep in reports}
        assert len(digests) == 1, f"round {k}: the 2-rank and the 1-rank node disagree"
        assert history[k]["agreed_digest"] == digests.pop(), f"round {k}: not the agreed digest"
        assert history[k]["num_contributors"] == peers and history[k]["num_applied"] == peers
        assert all(next(r for r in rep if r["round"] == k)["num_packets"] == peers for rep in reports)
    assert summary["digests_identical"]
    # Rank 0 checkpoints the global model (gathered from the ranks): the swarm's agreed state.
    meta = checkpoint_meta(tmp_path / "checkpoint")
    assert (meta["round"], meta["digest"]) == (rounds, history[rounds - 1]["agreed_digest"])
    assert reports[0][-1]["train_loss"] < reports[0][0]["train_loss"]


RANK0_THEN_SLEEP = """
import sys, time
from node.training.distributed import RankGroup
group = RankGroup.spawn(2, "cpu", threads=1)
print(" ".join(str(f.pid) for f in group.followers), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return True


def test_a_follower_exits_when_rank_0_is_killed():
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0_THEN_SLEEP],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        followers = [int(pid) for pid in rank0.stdout.readline().split()]  # once the group is up
        assert followers and not any(_gone(pid) for pid in followers)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in followers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(pid) for pid in followers), "a follower outlived its rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
