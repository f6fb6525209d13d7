"""`locoswarm demo`: a local swarm in one command.

    locoswarm demo [--peers 3] [--rounds 4] [--preset tiny] [--ranks 2] [--json]

The demo starts a coordinator on a free port with a SQLite file in a temporary folder, creates a
run, starts N node processes on 127.0.0.1 (each its own key, DHT identity and libp2p daemon),
shows the swarm's progress from the coordinator's status, and at the end checks that every
peer holds the same parameter digest and that the validation loss fell, and prints a short sample
of text from the final model (node 0's parameters at the end, which its --report saves beside the
report; `locoswarm generate` does the sampling). Every process it starts, it stops (SIGINT, then
SIGKILL after a grace period), by its own handle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from node.cli.processes import stop_processes

# The demo trains on Python's standard library (byte-level text): a sample continues a definition.
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 40
SAMPLE_TEMPERATURE = 0.8


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="a local swarm: coordinator + N nodes on 127.0.0.1")
    demo.add_argument("--peers", type=int, default=3)
    demo.add_argument("--rounds", type=int, default=4)
    demo.add_argument("--preset", default="tiny")
    demo.add_argument("--inner-steps", type=int, default=15)
    demo.add_argument("--top-k", type=int, default=64)
    demo.add_argument("--overlap", action="store_true", help="one-round-delayed outer step")
    demo.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="node 0 runs as this many torch.distributed ranks (FSDP2, gloo), beside 1-rank nodes",
    )
    demo.add_argument("--workdir", default=None, help="keep the database and logs here (default: a temp dir)")
    demo.add_argument("--json", action="store_true", help="print one JSON object at the end")
    demo.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="the nodes and the coordinator also log the libraries' lines (in their log files)",
    )
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="locoswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with LocalSwarm(
        workdir,
        num_peers=args.peers,
        preset=args.preset,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        top_k=args.top_k,
        quiet=args.json,
        verbose=args.verbose,
        run_overrides={"outer.overlap": args.overlap},
        extra_node_args={0: ("--ranks", str(args.ranks))} if args.ranks > 1 else None,
    ) as swarm:
        summary = swarm.run()
    summary["sample"] = _sample(workdir / "node0.report.safetensors", args.preset)
    if args.json:
        print(json.dumps(summary))
    else:
        ok = "yes" if summary["digests_identical"] else "NO"
        print(f"\nall {args.peers} peers hold the same parameter digest after every round: {ok}")
        print(
            f"validation loss: {summary['val_loss_start']:.4f} -> {summary['val_loss_end']:.4f} "
            f"({'fell' if summary['loss_fell'] else 'did NOT fall'})"
        )
        print(f"packet size: {summary['mean_packet_bytes']:,.0f} bytes per peer per round; logs in {workdir}")
        if summary["sample"] is not None:
            print(
                f"sample from the final model ({SAMPLE_TOKENS} tokens, temperature {SAMPLE_TEMPERATURE:g}, seed 0): "
                f"{summary['sample']!r}"
            )
    return 0 if summary["digests_identical"] and summary["loss_fell"] else 1


class LocalSwarm:
    """A coordinator and N nodes on 127.0.0.1, as child processes this object owns.

    Each node runs in its own process group, with its p2pd daemon: `stop` signals the group, so a
    node that was SIGKILLed (a fault test) leaves no orphaned daemon behind.
    `extra_node_args` maps a node index to extra `node join` flags (e.g. `--inject crash@round=1`).
    `run_overrides` change the run config `run` creates, by dotted key (protocol/config_file.py):
    {"outer.overlap": True, "deadline": {"kind": "fixed", "round_timeout_s": 40.0}}.
    `verbose` passes `-v` to every process: their log files then hold the libraries' lines too.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        num_peers: int,
        preset: str,
        rounds: int,
        inner_steps: int,
        top_k: int,
        quiet: bool = False,
        extra_node_args: dict[int, tuple[str, ...]] | None = None,
        run_overrides: dict | None = None,
        verbose: bool = False,
    ):
        self.workdir, self.num_peers, self.preset, self.rounds = workdir, num_peers, preset, rounds
        self.inner_steps, self.top_k, self.quiet = inner_steps, top_k, quiet
        self.verbose_args = ("-v",) if verbose else ()
        self.extra_node_args = dict(extra_node_args or {})
        self.run_overrides = dict(run_overrides or {})  # RunConfig fields for `run`, by dotted key
        self.admin_token = os.urandom(16).hex()
        self.coordinator: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.node_logs: list[Path] = []  # each process's log, beside it in `nodes` (a restarted node appends)
        self.url = ""

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "LOCOSWARM_ADMIN_TOKEN": self.admin_token,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def start_coordinator(self, timeout_s: float = 60.0, port: int = 0) -> str:
        """Start the coordinator (port 0: a free one; a restart passes the old port) on the swarm's database."""
        log = open(self.workdir / "coordinator.log", "ab")
        self.coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locoswarm",
                "coordinator",
                "serve",
                "--db",
                f"sqlite:///{self.workdir / 'coordinator.db'}",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *self.verbose_args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            env=self._env(),
            cwd=_repo_root(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.coordinator.stdout.readline().decode()
            if not line and self.coordinator.poll() is not None:
                raise RuntimeError(f"coordinator exited; see {self.workdir / 'coordinator.log'}")
            if line.startswith("coordinator listening on "):
                self.url = line.split()[-1]
                return self.url
        raise TimeoutError("coordinator did not start")

    def create_run(self, overrides: dict | None = None) -> str:
        """Create the swarm's run; `overrides` by dotted key ("membership.heartbeat_timeout_s")."""
        import httpx

        from protocol.config_file import with_overrides

        H = self.inner_steps
        config = with_overrides(
            {
                "name": "demo",
                "max_rounds": self.rounds,
                "model": {"preset": self.preset, "num_data_shards": max(1, self.num_peers)},
                "inner": {
                    "steps": H,
                    "batch_size": 8,
                    "seq_len": 64,
                    "warmup_steps": max(1, H),
                    "total_steps": H * self.rounds,
                },
                "outer": {"strategy": "sparseloco", "top_k": self.top_k},
                "membership": {"min_peers": self.num_peers, "heartbeat_timeout_s": 60.0},
                "deadline": {"kind": "fixed", "round_timeout_s": 300.0},
            },
            overrides,
        )
        response = httpx.post(
            f"{self.url}/v1/runs",
            json=config,
            trust_env=False,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        response.raise_for_status()
        self.run_id = response.json()["run_id"]
        return self.run_id

    def start_node(self, index: int) -> subprocess.Popen:
        """Start node `index` (its key, report and log by index); its process goes to the end of `nodes`."""
        log_path = self.workdir / f"node{index}.log"
        log = open(log_path, "ab")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locoswarm",
                "node",
                "join",
                "--coordinator",
                self.url,
                "--run",
                self.run_id,
                "--device",
                "cpu",
                "--key",
                str(self.workdir / f"node{index}.key"),
                "--threads",
                "1",
                "--no-progress",
                "--report",
                str(self.workdir / f"node{index}.report.json"),
                *self.verbose_args,
                *self.extra_node_args.get(index, ()),
            ],
            stdout=log,
            stderr=log,
            env=self._env(),
            cwd=_repo_root(),
            start_new_session=True,
        )
        self.nodes.append(process)
        self.node_logs.append(log_path)
        return process

    def status(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/v1/runs/{self.run_id}/status", trust_env=False, timeout=30).json()

    def wait_for_peers(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(p["status"] == "live" for p in self.status()["peers"]) >= count:
                return
            self._check_nodes()
            time.sleep(0.2)
        raise TimeoutError(f"{count} peers did not join in {timeout_s} s")

    def _check_nodes(self) -> None:
        for i, node in enumerate(self.nodes):
            if node.poll() not in (None, 0):
                raise RuntimeError(f"node {i} exited with {node.returncode}; see {self.node_logs[i]}")

    def run(self, timeout_s: float = 1800.0) -> dict:
        from node.training.data import evaluate, load_corpus
        from node.training.model import build_model

        self.start_coordinator()
        self.create_run(self.run_overrides)
        self._say(f"coordinator at {self.url} (status page: {self.url}/?run={self.run_id}); run {self.run_id}")
        # The first node founds the DHT; the others bootstrap through it (its multiaddrs are in the status).
        self.start_node(0)
        self.wait_for_peers(1)
        for i in range(1, self.num_peers):
            self.start_node(i)
        deadline, last_line = time.monotonic() + timeout_s, ""
        while any(n.poll() is None for n in self.nodes):
            self._check_nodes()
            if time.monotonic() > deadline:
                raise TimeoutError("the swarm did not finish in time")
            status = self.status()
            line = progress_line(status, self.rounds)
            if line != last_line:
                self._say(line)
                last_line = line
            time.sleep(0.5)
        self._check_nodes()
        reports = [
            json.loads((self.workdir / f"node{i}.report.json").read_text())["rounds"] for i in range(self.num_peers)
        ]
        digests_per_round = [
            {r["digest"] for rep in reports for r in rep if r["round"] == k} for k in range(self.rounds)
        ]
        final_digest = next(iter(digests_per_round[-1])) if digests_per_round and digests_per_round[-1] else None

        # Validation loss at the start (the seeded model) and at the end (rebuilt from the last round's
        # parameters: every peer holds the same, so any peer's checkpointless digest identifies them).
        corpus = load_corpus(None)
        model = build_model(self.preset, 0)
        val_start = evaluate(model, corpus.val, 8, batch_size=8, seq_len=64)
        val_end = _final_val_loss(self.workdir / "node0.report.safetensors", self.preset, corpus)
        return {
            "coordinator": self.url,
            "run_id": self.run_id,
            "peers": self.num_peers,
            "rounds": self.rounds,
            "digests_identical": all(len(d) == 1 for d in digests_per_round) and len(digests_per_round) == self.rounds,
            "final_digest": final_digest,
            "val_loss_start": val_start,
            "val_loss_end": val_end,
            "loss_fell": val_end < val_start,
            "mean_packet_bytes": sum(r["packet_bytes"] for r in reports[0]) / max(1, len(reports[0])),
            "round_times_s": [r["times"] for r in reports[0]],
            "train_loss": [r["train_loss"] for r in reports[0]],
        }

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the nodes and the coordinator, and what is left of each node's session (its p2pd)."""
        stop_processes([*self.nodes, *([self.coordinator] if self.coordinator is not None else [])], grace_s)


def _final_model(path: Path, preset: str):
    from safetensors.torch import load_file

    from node.training.model import build_model

    model = build_model(preset, 0)
    model.load_state_dict(load_file(str(path)), strict=False)  # tied weights are saved once
    return model


def _final_val_loss(path: Path, preset: str, corpus) -> float:
    from node.training.data import evaluate

    return evaluate(_final_model(path, preset), corpus.val, 8, batch_size=8, seq_len=64)


def _sample(path: Path, preset: str) -> str | None:
    """A short sample from the final model (`path`, as for the validation loss), or None after one
    line on stderr: the sample is a look at the model, and no reason for the demo to fail."""
    from safetensors import SafetensorError

    from node.training.sampling import GenerateError, SampleConfig, generate_text, run_tokenizer

    try:
        model = _final_model(path, preset).eval()
        sample = SampleConfig(max_new_tokens=SAMPLE_TOKENS, temperature=SAMPLE_TEMPERATURE, seed=0)
        return generate_text(model, run_tokenizer(model.config, None), SAMPLE_PROMPT, sample)
    # A missing or unreadable file, weights of another shape, a model that cannot generate: the
    # demo's verdict stands without the sample.
    except (OSError, SafetensorError, RuntimeError, ValueError, KeyError, GenerateError) as error:
        print(f"no sample from the final model: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
        return None


def progress_line(status: dict, rounds: int) -> str:
    """One line of the swarm's progress, true at the moment of `status` (the coordinator's status
    JSON, protocol/http.py RunStatus) for a run of `rounds` rounds (numbered from 0, as everywhere):

        round 2 of 0-3 open: 1/3 submitted; round 1: 3 contributors, 2 applied, mean loss 5.412 | ...
        run finished after 4 rounds; round 3: 3 contributors, 3 applied, mean loss 4.981 | ...

    The open round's count and each peer's activity can be of different rounds: a round closes as
    its last expected packet comes in, so its peers still say "submitted" beside the next round's
    0 submitted. Each peer's activity therefore names its round where that is not the open one."""
    line, peers = _run_progress(status, rounds), _peer_activities(status)
    return f"{line} | {peers}" if peers else line


def _run_progress(status: dict, rounds: int) -> str:
    """Where the run stands: finished (the open round is null then), paused, waiting for peers, or
    its open round's count; with the figures of the last closed round."""
    run, current, recovery = status["run"], status.get("current_round"), status.get("recovery")
    history = status.get("history") or []
    last = f"; {_round_figures(history[-1])}" if history else ""
    if run["state"] in ("finished", "closed"):
        if not history:
            return f"run {run['state']} before any round closed"
        return f"run {run['state']} after {history[-1]['round'] + 1} rounds{last}"
    if recovery is not None:
        return f"run paused: {recovery['message']}{last}"  # the message names the round
    if current is None or current["state"] == "pending":
        live = sum(p["status"] == "live" for p in status.get("peers", []))
        needed = run["config"]["membership"]["min_peers"]
        return f"waiting for peers: {live} live of the {needed} the run needs to start"
    return (
        f"round {current['round']} of 0-{rounds - 1} open: "
        f"{current['num_submitted']}/{current['num_expected']} submitted{last}"
    )


def _round_figures(summary: dict) -> str:
    """A closed round's figures from the status history (protocol/http.py RoundSummary)."""
    loss = f", mean loss {summary['mean_loss']:.3f}" if summary.get("mean_loss") is not None else ""
    contributors = summary["num_contributors"]
    return (
        f"round {summary['round']}: {contributors} contributor{'' if contributors == 1 else 's'}, "
        f"{summary['num_applied']} applied{loss}"
    )


def _peer_activities(status: dict) -> str:
    """Each live peer's activity ("a1b2c3d:training 7/15"), with " rN" where it is of round N and
    N is not the open round; every peer's round is named once no round is open."""
    run, current = status["run"], status.get("current_round")
    open_round = current["round"] if current is not None else None
    steps = run["config"]["inner"]["steps"]
    parts = []
    for peer in (p for p in status.get("peers", []) if p["status"] == "live"):
        text = f"{peer['peer_id'][:7]}:{peer['activity']}"
        if peer["activity"] == "training" and peer.get("inner_step") is not None:
            text += f" {peer['inner_step']}/{steps}"
        round_index = _activity_round(peer, run["current_round"])
        if round_index is not None and round_index != open_round:
            text += f" r{round_index}"
        parts.append(text)
    return ", ".join(parts)


def _activity_round(peer: dict, run_round: int) -> int | None:
    """The round a peer's activity is of; None before it reports one. `lag_rounds` counts back from
    the run's round (the open one, or the next once finished) to the round the peer said it works
    on, which after "applied" is the one after the round applied (coordinator/service.py). A peer
    ahead of the open round (overlap) reads as on it: `lag_rounds` stops at 0."""
    if peer.get("lag_rounds") is None:
        return None
    round_index = run_round - peer["lag_rounds"]
    return round_index - 1 if peer["activity"] == "applied" else round_index


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])
