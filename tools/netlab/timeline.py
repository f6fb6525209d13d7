"""Where a lab run's packet time went: every fetch's timeline and the medians the lab README quotes,
from the nodes' debug lines and reports in the run's workdir.

    LOCOSWARM_LOG_LEVEL=DEBUG python -m tools.netlab ... --json --workdir W > run.json
    python -m tools.netlab.timeline W --lab-json run.json                     # medians over rounds 1..
    python -m tools.netlab.timeline W --lab-json run.json --round 2 --hosts h2,h4   # one round's fetches
    python -m tools.netlab.timeline W --lab-json run.json --busy             # the busy time, per link rate

The nodes log each packet they fetched ("...'s packet from <holder>: N bytes, answer after A s,
bytes in B s", node/exchange/fetch.py) and each push they made (node/exchange/push.py) at DEBUG;
their reports give each round's submission times. A fetch's "late" is its end less its packet's
submission: on the wire a packet takes its bytes over the slower of the two links. `--busy` splits
the lab's transfer figure (a node's `fetching_s` over its ideal, tools/netlab/report.py) per link
rate: the same over the union of the node's logged fetches (what is left is time waiting for a
pushed packet, which has no fetch line), and that union without the waits for the holders'
answers (dial, stream, request, first byte): how much of the figure is round trips. `--lab-json`
(the lab's `--json` output) gives the hosts' rates and which are behind NAT; without it every host
counts as one class. Round 0 carries start-up and is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tools.netlab.report import transfer_ideals

_STAMP = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime, local time
_LIBP2P_ID = re.compile(r"exchange up: libp2p id (\w+)")
_FETCH = re.compile(
    r"^(?P<stamp>\S+ \S+) DEBUG node\.exchange\.fetch: round (?P<round>\d+): (?P<publisher>\w+)'s packet from"
    r" (?P<holder>\w+): (?P<bytes>\d+) bytes, answer after (?P<answer>[\d.]+) s, bytes in (?P<bytes_s>[\d.]+) s"
)
_PUSH = re.compile(
    r"round (?P<round>\d+): pushed \d+ bytes to \w+.*?go-ahead after (?P<go>[\d.]+) s, written in (?P<written>[\d.]+) s"
)


@dataclass(frozen=True, slots=True)
class Fetch:
    """One packet a host fetched: whose, from which host, when it ended (epoch s), and its parts."""

    round: int
    host: str  # the fetcher, "h<i>"
    publisher: str  # host of the packet's publisher
    holder: str  # host it came from ("?" for a holder the workdir does not name)
    ended_at: float
    answer_s: float
    bytes_s: float

    @property
    def started_at(self) -> float:
        return self.ended_at - self.answer_s - self.bytes_s


@dataclass(frozen=True, slots=True)
class Push:
    round: int
    host: str
    go_ahead_s: float
    written_s: float


@dataclass
class Run:
    """A lab run's packet traffic, as its workdir records it."""

    submitted_at: dict[tuple[int, str], float]  # (round, host) -> epoch s
    fetches: list[Fetch]
    pushes: list[Push]
    reported: dict[tuple[int, str], dict] = field(default_factory=dict)  # (round, host) -> its report's round

    def late_s(self, fetch: Fetch) -> float | None:
        """From the packet's submission to the fetch's end (None: no submission time)."""
        submitted = self.submitted_at.get((fetch.round, fetch.publisher))
        return None if submitted is None else fetch.ended_at - submitted


def load(workdir: Path) -> Run:
    """Every node{i}.log and node{i}.report.json in `workdir` (host h<i>)."""
    hosts = {p: f"h{p.stem[4:]}" for p in workdir.glob("node*.log") if p.stem[4:].isdigit()}
    texts = {path: path.read_text(errors="replace") for path in hosts}
    by_libp2p, by_peer, submitted, reported = {}, {}, {}, {}
    for path, host in hosts.items():
        if found := _LIBP2P_ID.search(texts[path]):
            by_libp2p[found.group(1)[-8:]] = host  # the fetch lines name a holder by its id's last 8 characters
        report_path = path.with_suffix(".report.json")
        if report_path.exists():
            report = json.loads(report_path.read_text())
            by_peer[report["peer_id"]] = host
            for r in report["rounds"]:
                reported[(r["round"], host)] = r
                if r.get("submitted_at"):
                    submitted[(r["round"], host)] = r["submitted_at"]
    fetches, pushes = [], []
    for path, host in hosts.items():
        for line in texts[path].splitlines():
            if m := _FETCH.match(line):
                fetches.append(
                    Fetch(
                        round=int(m["round"]),
                        host=host,
                        publisher=by_peer.get(m["publisher"], m["publisher"]),
                        holder=by_libp2p.get(m["holder"], "?"),
                        ended_at=datetime.strptime(m["stamp"], _STAMP).timestamp(),
                        answer_s=float(m["answer"]),
                        bytes_s=float(m["bytes_s"]),
                    )
                )
            elif m := _PUSH.search(line):
                pushes.append(Push(int(m["round"]), host, float(m["go"]), float(m["written"])))
    return Run(submitted, fetches, pushes, reported)


def summarize(run: Run, rates: dict[str, float], nat: set[str]) -> dict:
    """Medians over rounds 1.. (the lab README's figures): per kind of packet, its late at the
    fastest hosts; the slowest publishers' answers to the fetches they served themselves; the
    pushes' write times."""
    fast = max(rates.values(), default=None)
    slow = min(rates.values(), default=None)

    def late(publishers: set[str], receivers: set[str]) -> dict:
        values = [
            x
            for f in run.fetches
            if f.round > 0 and f.publisher in publishers and f.host in receivers
            if (x := run.late_s(f)) is not None
        ]
        return _median(values)

    hosts = {f.host for f in run.fetches} | set(rates)
    fast_hosts = {h for h in hosts if rates.get(h, fast) == fast}
    slow_hosts = {h for h in hosts if rates and rates.get(h) == slow and slow != fast}
    direct = [f.answer_s for f in run.fetches if f.round > 0 and f.publisher in slow_hosts and f.holder == f.publisher]
    return {
        "fast_late_s": late(fast_hosts - nat, fast_hosts),
        "fast_nat_late_s": late(fast_hosts & nat, fast_hosts),
        "slow_late_s": late(slow_hosts, fast_hosts),
        "slow_publisher_answer_s": _median(direct),
        "push_written_s": _median([p.written_s for p in run.pushes if p.round > 0 and p.host in fast_hosts]),
        "slow_push_written_s": _median([p.written_s for p in run.pushes if p.round > 0 and p.host in slow_hosts]),
    }


def busy(run: Run, rates: dict[str, float]) -> dict[str, dict]:
    """Per link rate (Mbps, as text), the means over rounds 1.. and that rate's hosts of: the
    node's `fetching_s`, the union of its logged fetches, and that union without the answer waits,
    each over the host's ideal transfer time (tools/netlab/report.py). Rounds where a host lacks a
    report or a rate are left out."""
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    for k in sorted({r for r, _ in run.reported if r > 0}):
        hosts = sorted((h for r, h in run.reported if r == k and h in rates), key=lambda h: int(h[1:]))
        per_peer = [{**run.reported[k, h], "rate_mbps": rates[h]} for h in hosts]
        if not all(r.get("submitted_at") and r.get("packet_bytes") for r in per_peer):
            continue
        for host, report, ideal in zip(hosts, per_peer, transfer_ideals(per_peer)):
            fetches = [f for f in run.fetches if f.round == k and f.host == host]
            if not ideal or not report.get("fetching_s") or not fetches:
                continue
            logged = _union_s((f.started_at, f.ended_at) for f in fetches)
            bytes_only = _union_s((f.ended_at - f.bytes_s, f.ended_at) for f in fetches)
            ratios.setdefault(f"{rates[host]:g}", []).append(
                (report["fetching_s"] / ideal, logged / ideal, bytes_only / ideal)
            )
    return {
        rate: {
            "n": len(rows),
            "fetching_over_ideal": statistics.fmean(r[0] for r in rows),
            "fetches_over_ideal": statistics.fmean(r[1] for r in rows),
            "without_answers_over_ideal": statistics.fmean(r[2] for r in rows),
        }
        for rate, rows in sorted(ratios.items(), key=lambda item: float(item[0]))
    }


def _union_s(spans) -> float:
    """The time covered by (start, end) spans."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _median(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def format_round(run: Run, round: int, hosts: list[str] | None, rates: dict[str, float]) -> str:
    """One round's fetches per host, in seconds after the round's first submission."""
    times = {h: t for (r, h), t in run.submitted_at.items() if r == round}
    if not times:
        return f"round {round}: no submission times in the reports"
    t0 = min(times.values())
    lines = ["submissions: " + " ".join(f"{h}@{t - t0:.2f}" for h, t in sorted(times.items(), key=lambda x: x[1]))]
    for host in hosts or sorted({f.host for f in run.fetches}, key=lambda h: int(h[1:])):
        rate = f" ({rates[host]:g} Mbps)" if host in rates else ""
        lines.append(f"{host}{rate}:")
        for f in sorted((f for f in run.fetches if f.round == round and f.host == host), key=lambda f: f.started_at):
            direct = "*" if f.holder == f.publisher else " "
            late = run.late_s(f)
            lines.append(
                f"  {f.started_at - t0:6.2f}-{f.ended_at - t0:6.2f}  {f.publisher}'s from {f.holder}{direct}"
                f"  answer {f.answer_s:.2f} s, bytes {f.bytes_s:.2f} s"
                + (f", late {late:.2f} s" if late is not None else "")
            )
    return "\n".join(lines)


def lab_facts(lab_json: Path | None) -> tuple[dict[str, float], set[str]]:
    """(each host's rate in Mbps, the hosts behind NAT) from the lab's --json output."""
    if lab_json is None:
        return {}, set()
    result = json.loads(lab_json.read_text())
    rates = result.get("link", {}).get("host_rates_mbps") or []
    nat = result.get("nat") or {}
    return {f"h{i}": r for i, r in enumerate(rates) if i > 0}, set(nat.get("hosts", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path, help="the lab run's --workdir")
    parser.add_argument("--lab-json", type=Path, help="the lab run's --json output (hosts' rates, NAT)")
    parser.add_argument("--round", type=int, help="print this round's fetches instead of the medians")
    parser.add_argument("--hosts", help="with --round: only these fetchers, e.g. h2,h4")
    parser.add_argument("--busy", action="store_true", help="the transfer figure split per link rate (see above)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    run = load(args.workdir)
    if not run.fetches:
        print(
            f"no fetch lines in {args.workdir}/node*.log: run the lab with LOCOSWARM_LOG_LEVEL=DEBUG",
            file=sys.stderr,
        )
        return 1
    rates, nat = lab_facts(args.lab_json)
    if args.round is not None:
        print(format_round(run, args.round, args.hosts.split(",") if args.hosts else None, rates))
        return 0
    if args.busy:
        split = busy(run, rates)
        if args.json:
            print(json.dumps(split))
            return 0
        for rate, row in split.items():
            print(
                f"{rate} Mbps (n={row['n']}): fetching/ideal {row['fetching_over_ideal']:.3f}, logged fetches "
                f"{row['fetches_over_ideal']:.3f}, without the answer waits {row['without_answers_over_ideal']:.3f}"
            )
        return 0
    summary = summarize(run, rates, nat)
    if args.json:
        print(json.dumps(summary))
        return 0
    for key, value in summary.items():
        figure = (
            f"median {value['median']:.2f} s ({value['min']:.2f}-{value['max']:.2f}, n={value['n']})"
            if value["n"]
            else "none"
        )
        print(f"{key}: {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
