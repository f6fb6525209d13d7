"""Chaos: a local swarm under seeded faults, and what must hold once its run is over.

    python -m tools.chaos --seed 21 --rounds 30 --workdir /tmp/chaos-21
    python -m tools.chaos --seed 7 --adversary poison --max-outage-s 180

A coordinator and `--nodes` honest nodes on 127.0.0.1 (`LocalSwarm`, node/cli/demo.py: the tiny
preset, each node with a checkpoint folder), and with `--adversary` one more node running modified
code (`--inject`, node/faults.py): `poison`, `lie` or `withhold`; or `undialable`, honest code that
nobody can dial (it pushes its packets), which the checks count among the honest nodes. The seed draws the run's timings (a fixed deadline of 6-20 s,
a heartbeat time-out of 6-30 s) and a sequence of faults, one at a time, 3-20 s apart:

    pause      SIGSTOP a node's process group (node and p2pd) for 3-20 s, as a laptop's suspend
    kill       SIGKILL a node's group; start it again (same key and checkpoints) 1-17 s later
    outage     SIGKILL the coordinator; start it again on its port and database 10 s to
               `--max-outage-s` later
    kill-all   SIGKILL every node; start them again 1-20 s later
    blackout   SIGKILL every node and the coordinator; start them again 5-60 s later

Once the run finished (or `--timeout` passed), nodes still running `--linger` s later are stopped
and named. The checks, each a finding when it fails:

- the run finished, and every honest node's last process exited 0;
- every closed round with contributors has an agreed digest (the status history);
- each honest node's digest of each round it applied last is the round's agreed digest;
- no honest peer is flagged `params_mismatch` or excluded;
- the last validation loss the peers reported is finite and below the seeded model's;
- a `lie` or `poison` adversary is excluded.

Dropped manifest entries of honest authors are listed (`dropped`), not judged: a packet whose
author was killed before anyone fetched it is rightly dropped; one served by an author that was
back is a finding to read in the coordinator's log. Every process's log is in the workdir. Exit 0
when every check holds, 1 otherwise; one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ADVERSARIES = {
    "poison": ("--inject", "poison@factor=1000"),  # a signed update of 1000x an honest one, every round
    "lie": ("--inject", "lie@from_round=2"),  # an honest node that reports a made-up digest
    # Honest code behind a NAT: nobody can dial it, it pushes its packets. Checked as the honest nodes are.
    "undialable": ("--inject", "undialable", "--behind-nat"),
    "withhold": ("--inject", "withhold"),  # submits digests of packets it serves to nobody
}
EVENTS = {"pause": 3, "kill": 3, "outage": 2, "kill-all": 1, "blackout": 1}  # kind -> weight


@dataclass
class Chaos:
    swarm: object  # LocalSwarm
    rng: random.Random
    max_outage_s: float
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # node index -> its latest process
    events: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def say(self, line: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f} s] {line}", file=sys.stderr, flush=True)

    def start(self, i: int) -> None:
        self.procs[i] = self.swarm.start_node(i)

    def kill(self, i: int) -> None:
        process = self.procs[i]
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.wait()

    def kill_coordinator(self) -> int:
        port = urlsplit(self.swarm.url).port
        self.swarm.coordinator.kill()
        self.swarm.coordinator.wait()
        return port

    def status(self) -> dict | None:
        """The run's status, or None while the coordinator does not answer."""
        try:
            return self.swarm.status()
        except Exception:  # down, starting, or answering garbage: ask again later
            return None

    def one_event(self) -> None:
        rng, nodes = self.rng, sorted(self.procs)
        kind = rng.choices(list(EVENTS), weights=list(EVENTS.values()))[0]
        running = [i for i in nodes if self.procs[i].poll() is None]
        if kind in ("pause", "kill") and not running:
            return
        event: dict = {"kind": kind, "at_s": round(time.monotonic() - self.started, 1)}
        if kind == "pause":
            i, pause_s = rng.choice(running), rng.uniform(3, 20)
            event |= {"node": i, "for_s": round(pause_s, 1)}
            self.say(f"pause node {i} for {pause_s:.1f} s")
            _signal_group(self.procs[i], signal.SIGSTOP)
            time.sleep(pause_s)
            _signal_group(self.procs[i], signal.SIGCONT)
        elif kind == "kill":
            i, back_s = rng.choice(running), rng.uniform(1, 17)
            event |= {"node": i, "back_after_s": round(back_s, 1)}
            self.say(f"kill node {i}, back in {back_s:.1f} s")
            self.kill(i)
            time.sleep(back_s)
            self.start(i)
        elif kind == "outage":
            down_s = rng.uniform(10, self.max_outage_s)
            event |= {"down_s": round(down_s, 1)}
            self.say(f"kill the coordinator for {down_s:.1f} s")
            port = self.kill_coordinator()
            time.sleep(down_s)
            self.swarm.start_coordinator(port=port)
        else:
            back_s = rng.uniform(1, 20) if kind == "kill-all" else rng.uniform(5, 60)
            event |= {"back_after_s": round(back_s, 1)}
            self.say(
                f"{kind}: kill every node{' and the coordinator' if kind == 'blackout' else ''}, back in {back_s:.1f} s"
            )
            for i in nodes:
                self.kill(i)
            port = self.kill_coordinator() if kind == "blackout" else None
            time.sleep(back_s)
            if port is not None:
                self.swarm.start_coordinator(port=port)
            for i in nodes:
                self.start(i)
        self.events.append(event)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # LocalSwarm starts each node in a session of its own
    except ProcessLookupError:
        pass


def run_chaos(args: argparse.Namespace) -> dict:
    from node.cli.demo import LocalSwarm

    rng = random.Random(args.seed)
    deadline_s, heartbeat_s = round(rng.uniform(6, 20), 1), round(rng.uniform(6, 30), 1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    honest = args.nodes
    total = honest + (1 if args.adversary else 0)
    extra = {
        i: ("--checkpoint-dir", str(workdir / f"ckpt{i}"), "--fetch-timeout", str(args.fetch_timeout_s))
        for i in range(total)
    }
    if args.adversary:
        extra[honest] += ADVERSARIES[args.adversary]
    overrides = {
        "deadline": {"kind": "fixed", "round_timeout_s": deadline_s},
        "membership": {"min_peers": honest, "heartbeat_timeout_s": heartbeat_s},
    }
    swarm = LocalSwarm(
        workdir, num_peers=total, preset="tiny", rounds=args.rounds, inner_steps=4, top_k=64, extra_node_args=extra
    )
    chaos = Chaos(swarm, rng, args.max_outage_s)
    summary: dict = {
        "seed": args.seed,
        "workdir": str(workdir),
        "rounds": args.rounds,
        "deadline_s": deadline_s,
        "heartbeat_timeout_s": heartbeat_s,
        "adversary": args.adversary,
    }
    chaos.say(f"workdir {workdir}: deadline {deadline_s} s, heartbeat time-out {heartbeat_s} s")
    with swarm:
        swarm.start_coordinator()
        swarm.create_run(overrides)
        chaos.start(0)
        swarm.wait_for_peers(1)
        for i in range(1, total):
            chaos.start(i)
        give_up = time.monotonic() + args.timeout
        next_event = time.monotonic() + rng.uniform(5, 15)
        status = None
        while time.monotonic() < give_up:
            status = chaos.status() or status
            if status and status["run"]["state"] not in ("waiting", "running"):
                break
            if time.monotonic() >= next_event:
                chaos.one_event()
                next_event = time.monotonic() + rng.uniform(3, 20)
            time.sleep(0.5)
        finished = bool(status) and status["run"]["state"] == "finished"
        chaos.say(f"run {'finished' if finished else 'NOT finished'}; waiting up to {args.linger} s for the nodes")
        linger_until = time.monotonic() + args.linger
        while time.monotonic() < linger_until and any(p.poll() is None for p in chaos.procs.values()):
            time.sleep(0.5)
        stragglers = [i for i, p in chaos.procs.items() if p.poll() is None]
        swarm.stop()
        exits = {i: p.returncode for i, p in chaos.procs.items()}
        swarm.start_coordinator()  # read what the run left, on the same database
        summary |= {"events": chaos.events, "finished": finished, "exits": exits, "stragglers": stragglers}
        checked = total if args.adversary == "undialable" else honest
        summary |= check(swarm, checked, args.adversary, finished, exits, stragglers, workdir)
    return summary


def check(swarm, honest: int, adversary: str | None, finished: bool, exits, stragglers, workdir: Path) -> dict:
    """The findings (each a line) and what to read (dropped entries) once the run is over."""
    import httpx

    findings: list[str] = []
    status = swarm.status()
    if not finished:
        findings.append(f"the run did not finish: {status['run']['state']} at round {status['run']['current_round']}")
    findings += [f"node {i} exited {exits[i]}" for i in range(honest) if exits[i] != 0 and i not in stragglers]
    findings += [f"node {i} still ran after the linger" for i in stragglers if i < honest]
    agreed = {h["round"]: h["agreed_digest"] for h in status["history"]}
    findings += [
        f"round {h['round']}: {h['num_contributors']} contributor(s), {h['num_votes']} vote(s), no agreed digest"
        for h in status["history"]
        if h["num_contributors"] and h["agreed_digest"] is None
    ]
    honest_ids = []
    for i in range(honest):
        report_path = workdir / f"node{i}.report.json"
        if not report_path.exists():
            findings.append(f"node {i} wrote no report")
            continue
        report = json.loads(report_path.read_text())
        honest_ids.append(report["peer_id"])
        last = {r["applied_round"]: r["digest"] for r in report["rounds"] if r["applied_round"] >= 0}
        findings += [
            f"node {i} round {r}: digest {d[:12]}, agreed {agreed[r][:12]}"
            for r, d in sorted(last.items())
            if agreed.get(r) and d != agreed[r]
        ]
    peers = {p["peer_id"]: p for p in status["peers"]}
    for peer_id in honest_ids:
        peer = peers.get(peer_id, {})
        if "params_mismatch" in peer.get("flags", []) or peer.get("excluded"):
            findings.append(
                f"honest peer {peer_id}: flags {peer.get('flags')}, excluded: {peer.get('excluded_reason')}"
            )
    adversaries = [p for p in peers.values() if p["peer_id"] not in honest_ids]
    if adversary in ("lie", "poison") and not any(p["excluded"] for p in adversaries):
        findings.append(f"the {adversary} adversary was not excluded")
    dropped = []
    for h in status["history"]:
        view = httpx.get(f"{swarm.url}/v1/runs/{swarm.run_id}/rounds/{h['round']}", trust_env=False, timeout=30).json()
        dropped += [
            {"round": h["round"], "peer_index": honest_ids.index(p), "reason": why}
            for p, why in view.get("dropped", {}).items()
            if p in honest_ids
        ]
    losses = val_losses(swarm.preset, status["history"])
    if losses["end"] is None:
        findings.append("no round reported a validation loss")
    elif not (math.isfinite(losses["end"]) and losses["end"] < losses["start"]):
        findings.append(f"validation loss {losses['start']:.3f} at the start, {losses['end']:.3f} at the end")
    return {"findings": findings, "dropped": dropped, "val_loss": losses, "agreed_rounds": len(agreed)}


def val_losses(preset: str, history: list[dict]) -> dict:
    """The seeded model's validation loss, and the last one the peers reported (every few rounds,
    from the agreed digest's holders: protocol/http.py RoundSummary)."""
    from node.training.data import evaluate, load_corpus
    from node.training.model import build_model

    start = evaluate(build_model(preset, 0), load_corpus(None).val, 8, batch_size=8, seq_len=64)
    reported = [(h["round"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    return {
        "start": start,
        "end": reported[-1][1] if reported else None,
        "end_round": reported[-1][0] if reported else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=4, help="honest nodes (default 4)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--adversary", choices=sorted(ADVERSARIES), help="one more node running modified code")
    parser.add_argument("--max-outage-s", type=float, default=120.0, help="the longest coordinator outage drawn")
    parser.add_argument("--fetch-timeout-s", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="for the whole run, in seconds")
    parser.add_argument("--linger", type=float, default=120.0, help="after the run ended, for the nodes to exit")
    parser.add_argument("--workdir", help="every process's log, the database and the reports (default: a temp dir)")
    args = parser.parse_args(argv)
    summary = run_chaos(args)
    print(json.dumps(summary, indent=1))
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
