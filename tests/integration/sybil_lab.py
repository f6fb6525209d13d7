"""Modified nodes against the agreed digest: who owns a run's truth when keys lie.

    python -m tests.integration.sybil_lab                      # every scenario, then the table
    python -m tests.integration.sybil_lab empty_4_of_7 minority_of_one

Each scenario runs a real swarm on 127.0.0.1 (coordinator, nodes, their p2pd daemons, SQLite), tiny
preset, H = 5, min_peers = every starting node. Attackers are nodes started with fault flags
(node/faults.py), which is what a modified node does:

- ``poison@factor=0,mode=scale``: its update is zero (a node that need not train at all);
- ``poison@factor=1,mode=random``: Gaussian noise at the scale of its honest update;
- ``lie`` (or ``lie@from_round=K``): every applied report names the same made-up digest, with a
  made-up hash tree that hashes to it (colluding Sybils), while the node keeps its real state;
- ``copy``: it sends another peer's packet of the round as its own (re-signed), for credit.

What a scenario measures (tests/integration/test_sybil_digest.py asserts it; the table prints it):
rounds whose agreed digest is not the honest nodes' (captured), rounds agreed on the honest state,
rounds left undecided, honest peers flagged (``params_mismatch``, or excluded), attackers excluded,
and, where a newcomer joins mid-run, whether every round it applied ends on the honest digest.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.cli.demo import LocalSwarm
from protocol.http import peer_id_from_public_key
from protocol.signing import PeerKey

H = 5
POLL_S = 0.3
EMPTY = ("--inject", "poison@factor=0,mode=scale", "--inject", "lie")
NOISE = ("--inject", "poison@factor=1,mode=random", "--inject", "lie")


class ScenarioFailed(AssertionError):
    """The swarm did not finish; the message holds the logs' tails."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    honest: int
    attackers: int
    attacker_args: tuple[str, ...]
    rounds: int = 8
    newcomer_after_round: int | None = None  # an honest node that joins once this round is agreed
    attacker_args_by_index: dict[int, tuple[str, ...]] = field(default_factory=dict)  # attacker i's, if not the rest's
    why: str = ""


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "empty_4_of_7",
            3,
            4,
            EMPTY,
            rounds=12,
            newcomer_after_round=1,
            why="four keys send empty updates and report a made-up digest (the attack as found)",
        ),
        Scenario("empty_10_of_13", 3, 10, EMPTY, rounds=6, why="ten such keys against three"),
        Scenario("noise_4_of_7", 3, 4, NOISE, why="noise at the honest scale instead of empty updates"),
        Scenario(
            "copy_then_lie",
            3,
            3,
            ("--inject", "copy", "--inject", "lie@from_round=3"),
            why="three keys send copies of honest packets (re-signed) for credit, then lie from round 3",
        ),
        Scenario(
            "credit_then_lie",
            3,
            2,
            ("--inject", "lie@from_round=3"),
            attacker_args_by_index={1: ("--inject", "copy", "--inject", "lie@from_round=3")},
            why="one key trains honestly for three rounds, one sends copies; both lie from round 3 (CI)",
        ),
        Scenario(
            "honest_then_lie",
            3,
            1,
            ("--inject", "lie@from_round=3"),
            why="one key trains honestly for three rounds (earning credit), then lies",
        ),
        Scenario("minority_of_one", 1, 3, EMPTY, rounds=6, why="one honest node among three liars"),
    )
}


@dataclass(slots=True)
class Result:
    scenario: Scenario
    seconds: float = 0.0
    captured: list[int] = field(default_factory=list)  # rounds agreed on a digest no honest node holds
    honest_agreed: list[int] = field(default_factory=list)
    undecided: list[int] = field(default_factory=list)
    honest_flagged: dict[str, list[str]] = field(default_factory=dict)
    attackers_excluded: int = 0
    newcomer_on_honest: bool | None = None  # None: no newcomer
    disputes: dict[int, str] = field(default_factory=dict)  # round -> verdict
    honest_credit: list[int] = field(default_factory=list)
    attacker_credit: list[int] = field(default_factory=list)
    attacker_verdicts: list[str] = field(default_factory=list)  # each attacker's "useful/judged last", by index
    exit_codes: list[int] = field(default_factory=list)
    sent_own: list[int] = field(default_factory=list)  # per attacker: rounds `copy` found nothing to copy

    def row(self) -> list[str]:
        s = self.scenario
        return [
            s.name,
            f"{s.honest}+{s.attackers}",
            str(len(self.captured)),
            f"{len(self.honest_agreed)}/{s.rounds}",
            str(len(self.undecided)),
            str(len(self.honest_flagged)),
            f"{self.attackers_excluded}/{s.attackers}",
            "-" if self.newcomer_on_honest is None else ("yes" if self.newcomer_on_honest else "NO"),
            ",".join(map(str, self.honest_credit)),
            ",".join(map(str, self.attacker_credit)),
            f"{self.seconds:.0f} s",
        ]


HEADER = [
    "scenario",
    "honest+attackers",
    "rounds captured",
    "agreed honest",
    "undecided",
    "honest flagged",
    "attackers excluded",
    "newcomer on honest",
    "honest credit",
    "attacker credit",
    "time",
]


def run(scenario: Scenario, workdir: Path) -> Result:
    num = scenario.honest + scenario.attackers
    extra = {
        scenario.honest + i: scenario.attacker_args_by_index.get(i, scenario.attacker_args)
        for i in range(scenario.attackers)
    }
    started = time.monotonic()
    swarm = LocalSwarm(
        workdir,
        num_peers=num,
        preset="tiny",
        rounds=scenario.rounds,
        inner_steps=H,
        top_k=64,
        quiet=True,
        extra_node_args=extra,
    )
    with swarm:
        swarm.start_coordinator()
        swarm.create_run(
            {
                "membership.min_peers": num,
                "membership.heartbeat_timeout_s": 30.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 60.0},
            }
        )
        swarm.start_node(0)
        swarm.wait_for_peers(1)
        for i in range(1, num):
            swarm.start_node(i)
        newcomer = None
        if scenario.newcomer_after_round is not None:
            _wait(
                swarm,
                lambda s: any(h["round"] >= scenario.newcomer_after_round and h["agreed_digest"] for h in s["history"]),
                "a round to be agreed before the newcomer",
                300,
            )
            newcomer = num
            swarm.start_node(newcomer)
        indices = list(range(num)) + ([newcomer] if newcomer is not None else [])
        codes = []
        for i in indices:
            try:
                codes.append(swarm.nodes[i].wait(timeout=600))
            except Exception:
                raise ScenarioFailed(f"node {i} did not finish:\n{_tail(workdir / f'node{i}.log')}") from None
        status = swarm.status()
    result = Result(scenario, seconds=time.monotonic() - started, exit_codes=codes)
    honest_nodes = list(range(scenario.honest)) + ([newcomer] if newcomer is not None else [])
    honest_ids = {_peer_id(workdir, i) for i in honest_nodes}
    attacker_ids = [_peer_id(workdir, i) for i in range(scenario.honest, num)]  # by attacker index
    honest_digests: dict[int, set[str]] = {}
    for i in honest_nodes:
        for r in _rounds(workdir, i):
            honest_digests.setdefault(r["round"], set()).add(r["digest"])
    for h in status["history"]:
        agreed, r = h["agreed_digest"], h["round"]
        if agreed is None:
            result.undecided.append(r)
        elif agreed in honest_digests.get(r, ()):
            result.honest_agreed.append(r)
        else:
            result.captured.append(r)
        if h.get("dispute"):
            result.disputes[r] = h["dispute"]["verdict"]
    by_peer = {peer["peer_id"]: peer for peer in status["peers"]}
    for peer in status["peers"]:
        if peer["peer_id"] in honest_ids:
            flags = [f for f in peer["flags"] if f == "params_mismatch"] + (["excluded"] if peer["excluded"] else [])
            if flags:
                result.honest_flagged[peer["peer_id"]] = flags
            if newcomer is None or peer["peer_id"] != _peer_id(workdir, newcomer):
                result.honest_credit.append(peer["credit"])
    for i in range(scenario.honest, num):
        log_text = (workdir / f"node{i}.log").read_text(errors="replace")
        result.sent_own.append(log_text.count("no other packet to copy"))
    for peer in (by_peer[p] for p in attacker_ids if p in by_peer):
        result.attackers_excluded += bool(peer["excluded"])
        result.attacker_credit.append(peer["credit"])
        score = peer.get("score") or {}
        result.attacker_verdicts.append(
            f"{score.get('num_useful', 0)}/{score.get('num_rounds', 0)} {score.get('last_verdict')}"
        )
    if newcomer is not None:
        agreed = {h["round"]: h["agreed_digest"] for h in status["history"]}
        applied = _rounds(workdir, newcomer)
        result.newcomer_on_honest = bool(applied) and all(r["digest"] == agreed[r["round"]] for r in applied)
    return result


def _wait(swarm: LocalSwarm, predicate, what: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, node in enumerate(swarm.nodes):
            if node is not None and node.poll() not in (None, 0):
                raise ScenarioFailed(
                    f"node {i} exited with {node.returncode} waiting for {what}:\n"
                    f"{_tail(swarm.workdir / f'node{i}.log')}"
                )
        try:
            status = swarm.status()
        except Exception:
            status = None
        if status is not None and predicate(status):
            return status
        time.sleep(POLL_S)
    raise ScenarioFailed(f"timed out waiting for {what}")


def _rounds(workdir: Path, i: int) -> list[dict]:
    path = workdir / f"node{i}.report.json"
    if not path.exists():
        raise ScenarioFailed(f"node {i} wrote no report:\n{_tail(workdir / f'node{i}.log')}")
    return json.loads(path.read_text())["rounds"]


def _peer_id(workdir: Path, i: int) -> str:
    return peer_id_from_public_key(PeerKey.load_or_create(workdir / f"node{i}.key").public_bytes)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def table(results: list[Result]) -> str:
    rows = [HEADER] + [r.row() for r in results]
    widths = [max(len(row[c]) for row in rows) for c in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv: list[str]) -> int:
    names = argv or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"sybil-{name}-") as tmp:
            result = run(SCENARIOS[name], Path(tmp))
        results.append(result)
        print(
            f"{name}: {SCENARIOS[name].why}; exit codes {result.exit_codes}; attackers' useful/judged rounds, last verdict"
            f" {result.attacker_verdicts}",
            flush=True,
        )
        for r, verdict in sorted(result.disputes.items())[:3]:
            print(f"  round {r} dispute: {verdict}", flush=True)
    print(table(results))
    return 0 if all(not r.captured and not r.honest_flagged for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
