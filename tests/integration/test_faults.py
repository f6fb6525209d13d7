"""Faults a swarm must survive, with real processes on 127.0.0.1 (coordinator, nodes, p2pd daemons,
SQLite), port 0, tiny preset, H = 5, threads 1. Faults come from the node's own injector
(`--inject`, node/faults.py) or from the test's signals sent through each process's handle;
readiness and progress are read from the coordinator's status, never waited for by sleeping. The
assertions read typed state: exit codes, the coordinator's status and manifests, the nodes'
`--report` JSON; log text only where a fact has no typed form, each such place says why.

- a node crashes (SIGKILL) in training; a new node joins mid-run and catches up;
- a node crashes in transfer after it is in the manifest, beside a peer that sends a corrupted
  packet and one that uploads slowly;
- a node is paused (SIGSTOP) for rounds, then resumed;
- the coordinator is SIGKILLed and restarted on its database, beside a stale submission and an
  unwritable checkpoint directory;
- a poisoning peer (x1000) against median-norm clipping, in process.

Every test asserts that the peers that applied a round hold the same parameter digest.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from node.cli.demo import LocalSwarm
from protocol.http import peer_id_from_public_key
from protocol.signing import PeerKey

pytestmark = [pytest.mark.slow]

H = 5
STATUS_POLL_S = 0.3
PACED_LINKS = ("--uplink-mbps", "5", "--downlink-mbps", "5")  # under 20 Mbps: uploads and downloads paced


# -- helpers ----------------------------------------------------------------------------------


def start_swarm(swarm: LocalSwarm, run_overrides: dict) -> None:
    """Coordinator, run, node 0 (the DHT's first node), then the other nodes; returns once all joined."""
    swarm.start_coordinator()
    swarm.create_run(run_overrides)
    swarm.start_node(0)
    swarm.wait_for_peers(1)
    for i in range(1, swarm.num_peers):
        swarm.start_node(i)
    wait_until(
        swarm,
        lambda s: sum(p["status"] == "live" for p in s["peers"]) >= swarm.num_peers,
        "every node joined",
        timeout_s=120,
    )


def wait_until(swarm: LocalSwarm, predicate, what: str, timeout_s: float = 120, may_die: tuple[int, ...] = ()):
    """Poll the coordinator's status until `predicate(status)`; fail early if a node dies unexpectedly."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, node in enumerate(swarm.nodes):
            if i not in may_die and node.poll() not in (None, 0):
                pytest.fail(
                    f"node {i} exited with {node.returncode} while waiting for {what}:\n" + tail(swarm.node_logs[i])
                )
        try:
            status = swarm.status()
        except Exception:  # the coordinator may be restarting
            status = None
        if status is not None and predicate(status):
            return status
        time.sleep(STATUS_POLL_S)
    pytest.fail(f"timed out waiting for {what}")


def wait_exit(swarm: LocalSwarm, indices, timeout_s: float = 180) -> list[int]:
    codes = []
    for i in indices:
        try:
            codes.append(swarm.nodes[i].wait(timeout=timeout_s))
        except Exception:
            pytest.fail(f"node {i} did not finish:\n" + tail(swarm.node_logs[i]))
    return codes


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def node_log(swarm: LocalSwarm, i: int) -> str:
    return (swarm.workdir / f"node{i}.log").read_text(errors="replace")


def rounds_of(swarm: LocalSwarm, i: int) -> list[dict]:
    return json.loads((swarm.workdir / f"node{i}.report.json").read_text())["rounds"]


def peer_id_of(swarm: LocalSwarm, i: int) -> str:
    """From the node's key file (a killed node writes no report), named as LocalSwarm names it."""
    key_path = swarm.workdir / f"node{i}.key"
    assert key_path.exists(), f"node {i} never made its key"
    return peer_id_from_public_key(PeerKey.load_or_create(key_path).public_bytes)


def manifests_of(swarm: LocalSwarm, rounds: int) -> dict[int, list[str]]:
    """Peer ids in each closed round's manifest, from the coordinator."""
    import httpx

    def view(r: int) -> dict:
        return httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/{r}", trust_env=False, timeout=30).json()

    return {r: [e["peer_id"] for e in view(r)["manifest"]] for r in range(rounds)}


def peer_view(status: dict, peer_id: str) -> dict:
    views = [p for p in status["peers"] if p["peer_id"] == peer_id]
    assert views, f"{peer_id} never joined"
    return views[0]


def assert_identical_digests(swarm: LocalSwarm, indices, history: list[dict]) -> dict[int, str]:
    """Per round, every node that applied it holds one digest, the coordinator's majority."""
    by_round: dict[int, set[str]] = {}
    for i in indices:
        rounds = [r["round"] for r in rounds_of(swarm, i)]
        assert rounds == sorted(set(rounds)), f"node {i} applied a round twice or out of order: {rounds}"
        for r in rounds_of(swarm, i):
            by_round.setdefault(r["round"], set()).add(r["digest"])
    majority = {h["round"]: h["majority_digest"] for h in history}
    for r, digests in by_round.items():
        assert digests == {majority[r]}, f"round {r}: digests {digests}, majority {majority[r]}"
    return {r: d.pop() for r, d in by_round.items()}


def assert_history_complete(history: list[dict], rounds: int) -> None:
    assert [h["round"] for h in history] == list(range(rounds)), "a round was lost or repeated"
    assert all(h["majority_digest"] for h in history), history


def swarm_for(tmp_path: Path, num_peers: int, rounds: int, extra=None) -> LocalSwarm:
    return LocalSwarm(
        tmp_path,
        num_peers=num_peers,
        preset="tiny",
        rounds=rounds,
        inner_steps=H,
        top_k=64,
        quiet=True,
        extra_node_args=extra,
    )


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_crash_in_training_and_a_late_joiner(tmp_path):
    """Node 2 SIGKILLs itself as round 1's training starts: round 1 closes without it (once the
    coordinator marks it gone), the others apply the same manifest. Node 3 joins the running swarm
    then, catches up from peers, and from its first round on its digest is everyone's."""
    rounds = 12  # rounds take under a second: enough of them to be running when node 3 is up
    with swarm_for(tmp_path, 3, rounds, {2: ("--inject", "crash@round=1,phase=training")}) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 6.0, "deadline": {"kind": "fixed", "round_timeout_s": 40.0}}
        )
        assert swarm.nodes[2].wait(timeout=120) == -signal.SIGKILL
        swarm.start_node(3)
        codes = wait_exit(swarm, (0, 1, 3))
        status = swarm.status()
        crashed, joined = peer_view(status, peer_id_of(swarm, 2)), peer_view(status, peer_id_of(swarm, 3))
        manifests = manifests_of(swarm, 2)
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    # Killed in round 1 before its packet was out: it made round 0, not round 1.
    assert crashed["peer_id"] in manifests[0] and crashed["peer_id"] not in manifests[1]
    assert len(manifests[1]) >= 2
    digests = assert_identical_digests(swarm, (0, 1, 3), history)
    assert len(digests) == rounds
    assert crashed["status"] == "gone" and "no heartbeat" in crashed["reason"], crashed
    joiner = rounds_of(swarm, 3)
    assert joiner and joiner[-1]["round"] == rounds - 1 and joined["status"] == "left"
    # It started from the seeded initialisation, yet its first round (not round 0) ends on the
    # swarm's digest: it caught up to that round's start before training it.
    assert joiner[0]["round"] > 0, joiner[0]
    assert all(r["digest"] == digests[r["round"]] for r in joiner)


@pytest.mark.timeout(300)
def test_crash_in_transfer_beside_corrupt_and_slow_peers(tmp_path):
    """Round 1: node 3 is in the manifest and SIGKILLs itself during the transfer, once a peer holds
    a verified copy of its packet; node 2 sends a packet corrupted after signing; node 1 serves every
    stream 1 s late. The others fetch node 3's packet from the surviving holders, every honest peer
    refuses node 2's packet for the same reason (in its report), the coordinator's status shows it,
    and the digests agree."""
    rounds = 3
    extra = {
        1: ("--inject", "slow-upload@delay_s=1"),
        2: ("--inject", "corrupt-packet@round=1"),
        3: ("--inject", "crash@round=1,phase=transfer"),
    }
    with swarm_for(tmp_path, 4, rounds, extra) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 6.0, "deadline": {"kind": "fixed", "round_timeout_s": 40.0}}
        )
        assert swarm.nodes[3].wait(timeout=150) == -signal.SIGKILL
        codes = wait_exit(swarm, (0, 1, 2))
        status, manifests = swarm.status(), manifests_of(swarm, rounds)
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert history[1]["num_contributors"] == 4, "the crashing and the corrupt node are both in the manifest"
    digests = assert_identical_digests(swarm, (0, 1, 2), history)
    assert len(digests) == rounds
    corrupt = peer_id_of(swarm, 2)
    for i in (0, 1, 2):
        [round1] = [r for r in rounds_of(swarm, i) if r["round"] == 1]
        assert round1["num_packets"] == 3, "node 3's packet applied, node 2's refused"
        assert list(round1["refused"]) == [corrupt] and round1["refused"][corrupt].startswith("BadSignature")
    assert list(history[1]["refused"]) == [corrupt] and "BadSignature" in history[1]["refused"][corrupt]
    crashed = peer_view(status, peer_id_of(swarm, 3))
    # Killed in round 1's transfer: its packet is in the manifest, but it never reported applying
    # the round (only the other three did) and is in no later manifest.
    assert crashed["peer_id"] in manifests[1] and crashed["peer_id"] not in manifests[2]
    assert history[1]["num_applied"] == 3, history[1]
    assert crashed["status"] == "gone" and "no heartbeat" in crashed["reason"]


@pytest.mark.timeout(300)
def test_paused_node_is_refused_as_stale_and_catches_up(tmp_path):
    """Node 2 is SIGSTOPped (its whole process group, p2pd included) after round 0 and resumed two
    rounds later: its submission for the round it was training is refused as stale or late, it
    applies and replays the rounds it missed instead, and its digests agree afterwards. Its round-1
    inner steps take at least 3 s (slow-compute), so the pause lands while it trains round 1: at
    H=5 the tiny model could otherwise train and submit round 1 between two status polls."""
    rounds = 5
    with swarm_for(tmp_path, 3, rounds, {2: ("--inject", "slow-compute@round=1,min_s=3")}) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 120.0, "deadline": {"kind": "fixed", "round_timeout_s": 8.0}}
        )
        wait_until(swarm, lambda s: s["history"] and s["history"][0]["num_applied"] == 3, "round 0 applied by all")
        paused = swarm.nodes[2]
        os.killpg(paused.pid, signal.SIGSTOP)
        try:
            wait_until(
                swarm,
                lambda s: (s["current_round"] or {}).get("round", rounds) >= 3,
                "two rounds closed without the paused node",
                may_die=(2,),
            )
        finally:
            os.killpg(paused.pid, signal.SIGCONT)
        codes = wait_exit(swarm, (0, 1, 2))
        status, manifests = swarm.status(), manifests_of(swarm, rounds)
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    paused_id = peer_id_of(swarm, 2)
    assert paused_id not in manifests[1] + manifests[2]
    assert_identical_digests(swarm, (0, 1, 2), history)
    reports = rounds_of(swarm, 2)
    # `submitted` is false exactly when the coordinator refused the submission (late or stale).
    refused = [r["round"] for r in reports if not r["submitted"]]
    assert refused and all(paused_id not in manifests[r] for r in refused), reports
    # Rounds it never trained, with agreeing digests after them: it caught up past them.
    assert set(range(rounds)) - {r["round"] for r in reports}, reports
    assert reports[-1]["round"] == rounds - 1, "it trained again after catching up"


@pytest.mark.timeout(300)
def test_coordinator_restart_stale_submission_and_unwritable_checkpoints(tmp_path):
    """The coordinator is SIGKILLed after round 1 and restarted on the same database and port: the
    nodes retry with backoff and the run resumes, every round once. Node 2 holds back its round-3
    submission until the round closed (refused as late, applied without it). Node 1's checkpoint
    directory lies under a regular file: every save fails with a logged error and it trains on;
    node 0 saves a checkpoint after every round."""
    rounds = 5
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    extra = {
        0: ("--checkpoint-dir", str(tmp_path / "ckpt0")),
        1: ("--checkpoint-dir", str(blocker / "ckpt")),
        2: ("--inject", "stale-submit@round=3"),
    }
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 60.0, "deadline": {"kind": "fixed", "round_timeout_s": 15.0}}
        )
        wait_until(swarm, lambda s: len(s["history"]) >= 2, "round 1 closed")
        port = int(swarm.url.rsplit(":", 1)[1])
        swarm.coordinator.kill()
        swarm.coordinator.wait(timeout=30)
        deadline = time.monotonic() + 60
        # Log text: a running node has no typed state to read (its report is written at exit), and
        # its outage line is the only sign that it saw the coordinator gone.
        while not any("unreachable" in node_log(swarm, i) for i in range(3)):
            assert time.monotonic() < deadline, "no node noticed the coordinator was gone"
            time.sleep(STATUS_POLL_S)
        swarm.start_coordinator(port=port)
        codes = wait_exit(swarm, (0, 1, 2))
        status, manifests = swarm.status(), manifests_of(swarm, rounds)
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    assert peer_id_of(swarm, 2) not in manifests[3], "the late submission is left out"
    digests = assert_identical_digests(swarm, (0, 1, 2), history)
    assert len(digests) == rounds and all(rounds_of(swarm, i)[-1]["round"] == rounds - 1 for i in range(3))
    [round3] = [r for r in rounds_of(swarm, 2) if r["round"] == 3]
    assert not round3["submitted"], "the coordinator refused the held-back submission"
    # Log text: the report has no field for checkpoints, so the logged error is the only record
    # that each save was tried and failed for the blocked directory.
    log1 = node_log(swarm, 1)
    assert log1.count("checkpoint not saved, training goes on") == len(rounds_of(swarm, 1)), tail(
        swarm.workdir / "node1.log"
    )
    assert "Not a directory" in log1 or "File exists" in log1
    meta = json.loads((tmp_path / "ckpt0" / "meta.json").read_text())
    assert meta["round"] == rounds and meta["digest"] == digests[rounds - 1]


def report_of(swarm: LocalSwarm, i: int) -> dict:
    return json.loads((swarm.workdir / f"node{i}.report.json").read_text())


def checkpoint_round(path: Path) -> int | None:
    meta = path / "meta.json"
    return json.loads(meta.read_text())["round"] if meta.exists() else None


@pytest.mark.timeout(300)
def test_everything_killed_at_once_resumes_from_checkpoints(tmp_path):
    """Every node and the coordinator SIGKILLed at once mid-run, while the nodes train a round
    (3 s each); all started again at once with the same keys, checkpoint folders and database.
    Each node resumes from its own checkpoint (the coordinator agrees with its digest) and trains
    the open round: no agreed round is lost or changed, the loss goes on from where it was, and
    the run finishes with every digest agreeing. The nodes state 5 Mbps links, so their uploads
    and downloads go through the pacers (node/exchange/pace.py) before and after the kill."""
    rounds = 6
    ckpt = [tmp_path / f"ckpt{i}" for i in range(3)]
    extra = {i: ("--checkpoint-dir", str(ckpt[i]), "--inject", "slow-compute@min_s=3", *PACED_LINKS) for i in range(3)}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 5.0, "deadline": {"kind": "fixed", "round_timeout_s": 30.0}}
        )

        def all_training_round_2(status) -> bool:  # every checkpoint starts round 2, nobody submitted yet
            current = status["current_round"] or {}
            return (
                current.get("round") == 2
                and current.get("num_submitted") == 0
                and all(checkpoint_round(c) == 2 for c in ckpt)
            )

        before = wait_until(swarm, all_training_round_2, "every node training round 2 from its checkpoint")
        port = int(swarm.url.rsplit(":", 1)[1])
        for node in swarm.nodes:
            os.killpg(node.pid, signal.SIGKILL)
        swarm.coordinator.kill()
        assert [node.wait(timeout=30) for node in swarm.nodes] == [-signal.SIGKILL] * 3
        swarm.coordinator.wait(timeout=30)

        restarted_at = time.time()
        swarm.start_coordinator(port=port)
        for i in range(3):
            swarm.start_node(i)  # swarm.nodes[3 + i]
        codes = wait_exit(swarm, (3, 4, 5))
        status = swarm.status()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    agreed_before = {h["round"]: h["majority_digest"] for h in before["history"]}
    assert sorted(agreed_before) == [0, 1]
    assert all(history[r]["majority_digest"] == digest for r, digest in agreed_before.items())
    reports = [report_of(swarm, i) for i in range(3)]
    assert all(h["num_contributors"] == 3 for h in history[2:]), (history, reports)  # all back at once
    for report in reports:
        assert report["resumed_from"] == 2 and report["catch_ups"] == [], report
        assert [r["round"] for r in report["rounds"]] == list(range(2, rounds))
    assert_identical_digests(swarm, (0, 1, 2), history)
    # The loss goes on from round 1's, not from the seeded initialisation's.
    first_resumed = history[2]["mean_loss"]
    assert first_resumed < history[0]["mean_loss"] - 0.1 and first_resumed < history[1]["mean_loss"] + 0.2, history
    print(
        f"recovery: 0 agreed rounds lost; round 2 closed {history[2]['closed_at'] - restarted_at:.1f} s after the "
        f"restart (rounds take >= 3 s)"
    )


@pytest.mark.timeout(300)
def test_coordinator_down_past_the_heartbeat_timeout(tmp_path):
    """The coordinator is SIGKILLed and stays down for three heartbeat timeouts (15 s against 5 s):
    every node keeps its state and waits; once the coordinator is back (same port, same database)
    its members are still members, the open round takes their packets, and the run finishes with
    every node exiting 0 and every digest agreeing. The nodes state 5 Mbps links (paced)."""
    rounds, down_s = 5, 15.0
    with swarm_for(tmp_path, 3, rounds, dict.fromkeys(range(3), PACED_LINKS)) as swarm:
        start_swarm(
            swarm, {"membership.heartbeat_timeout_s": 5.0, "deadline": {"kind": "fixed", "round_timeout_s": 30.0}}
        )
        wait_until(swarm, lambda s: len(s["history"]) >= 2, "rounds 0 and 1 closed")
        port = int(swarm.url.rsplit(":", 1)[1])
        swarm.coordinator.kill()
        swarm.coordinator.wait(timeout=30)
        time.sleep(down_s)  # the outage itself: nothing to wait for but time
        assert all(node.poll() is None for node in swarm.nodes), "a node exited while the coordinator was away"
        restarted_at = time.time()
        swarm.start_coordinator(port=port)
        codes = wait_exit(swarm, (0, 1, 2))
        status = swarm.status()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    # Nobody was dropped: every node applied every round, whether or not its packet made the round
    # the coordinator came back in (a node's backoff, up to 15 s with jitter, may outlast the
    # 5 s restart grace of this short-timeout run).
    assert all(p["status"] == "left" for p in status["peers"]), status["peers"]
    assert all([r["round"] for r in rounds_of(swarm, i)] == list(range(rounds)) for i in range(3))
    assert sum(h["num_contributors"] for h in history) >= 3 * rounds - 3, history
    first_after = next(h for h in history if h["closed_at"] > restarted_at)
    print(
        f"recovery: 0 agreed rounds lost; round {first_after['round']} closed "
        f"{first_after['closed_at'] - restarted_at:.1f} s after the coordinator came back"
    )
    assert_identical_digests(swarm, (0, 1, 2), history)


@pytest.mark.timeout(300)
def test_a_packet_nobody_serves_is_dropped_from_the_manifest(tmp_path):
    """Node 2 submits its round-1 packet and serves it to nobody. Nodes 0 and 1 report it missing
    after their 5 s fetch time-out; the coordinator amends round 1's manifest (version 2, without
    it); everyone applies the amended round within two fetch time-outs of its close, node 2
    recomputes from its kept start, and every later round is applied with agreeing digests."""
    rounds, fetch_timeout_s = 4, 5.0
    common = ("--fetch-timeout", str(fetch_timeout_s))
    extra = {0: common, 1: common, 2: (*common, "--inject", "withhold@round=1")}
    with swarm_for(tmp_path, 3, rounds, extra) as swarm:
        start_swarm(
            swarm,
            {
                "exchange.missing_grace_s": 5.0,
                "membership.heartbeat_timeout_s": 60.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 30.0},
            },
        )
        codes = wait_exit(swarm, (0, 1, 2))
        status = swarm.status()
        import httpx

        round1 = httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/1", trust_env=False, timeout=30).json()
    assert codes == [0, 0, 0]
    history = status["history"]
    assert_history_complete(history, rounds)
    withholder = peer_id_of(swarm, 2)
    assert round1["manifest_version"] == 2 and list(round1["dropped"]) == [withholder], round1
    assert withholder not in [e["peer_id"] for e in round1["manifest"]]
    assert_identical_digests(swarm, (0, 1, 2), history)
    for i in (0, 1):
        [applied] = [r for r in rounds_of(swarm, i) if r["round"] == 1]
        assert applied["num_packets"] == 2
        delay_s = applied["ended_at"] - history[1]["closed_at"]
        assert delay_s < 2 * fetch_timeout_s + 5.0, delay_s
        print(f"recovery: node {i} applied the amended round 1 {delay_s:.1f} s after it closed")


@pytest.mark.timeout(240)
def test_median_norm_clipping_keeps_a_poisoned_swarm_on_course():
    """In process, 4 peers through real packets: peer 3 poisons every update (x1000, the node's own
    injector). With median-norm clipping the validation loss ends close to the clean swarm's; without
    it, far worse."""
    clean = _poison_sim(poisoned=False, clip=False)
    clipped = _poison_sim(poisoned=True, clip=True)
    unclipped = _poison_sim(poisoned=True, clip=False)
    start = _poison_sim(poisoned=False, clip=False, num_rounds=0)
    print(
        f"val loss: start {start:.4f} clean {clean:.4f} clipped+poisoned {clipped:.4f} "
        f"unclipped+poisoned {unclipped:.4f}"
    )
    assert clean < start - 0.05, "the clean swarm learned"
    assert abs(clipped - clean) < 0.25 * (start - clean), (start, clean, clipped)
    assert unclipped > start + 0.5, (start, unclipped)


def _poison_sim(*, poisoned: bool, clip: bool, num_rounds: int = 5, num_peers: int = 4) -> float:
    """The swarm's validation loss after `num_rounds`, each peer built and trained as a node's
    is (PeerTraining), the last one through the node's poison wrapper."""
    import torch

    from node.faults import FaultInjector
    from node.training.data import evaluate, load_corpus
    from node.training.params import param_digest
    from node.training.peer import PeerTraining
    from protocol.run_config import RunConfig
    from protocol.signing import PeerKey

    torch.set_num_threads(1)
    corpus = load_corpus(None)
    run = RunConfig.model_validate(
        {
            "name": "poison",
            "model": {"preset": "tiny", "seed": 0},
            "inner": {
                "steps": H,
                "warmup_steps": min(H, max(1, num_rounds * H)),
                "total_steps": max(1, num_rounds * H),
                "batch_size": 8,
                "seq_len": 64,
            },
            "outer": {"clip_to_median_norm": clip},
        }
    )
    peers = [f"p{i:02d}" for i in range(num_peers)]
    keys = {p: PeerKey.from_seed(p.encode()) for p in peers}
    trainings = [PeerTraining.build(run, "cpu", corpus.train.shard(i, num_peers)) for i in range(num_peers)]
    poison = FaultInjector.parse(["poison@factor=1000"] if poisoned else [])
    trainings[-1] = poison.wrap_training(trainings[-1])
    models = [training.model for training in trainings]
    digest = param_digest(models[0])
    for r in range(num_rounds):
        payloads = {}
        for peer, training in zip(peers, trainings):
            training.outer.begin_round()
            training.train_round(r)
            payloads[peer] = training.outer.make_payload(
                run_id="sim", round=r, peer_id=peer, base_digest=digest, key=keys[peer]
            )
        for training in trainings:
            training.outer.commit(
                training.outer.prepare(payloads, lambda p: keys[p].public_bytes, run_id="sim", round=r)
            )
        digests = {param_digest(m) for m in models}
        assert len(digests) == 1, f"round {r}: peers diverged"
        digest = digests.pop()
    loss = evaluate(models[0], corpus.val, 8, batch_size=8, seq_len=64)
    return loss if loss == loss else float("inf")  # NaN (a blown-up model) counts as infinitely bad
