"""The network lab's numbers: per-round times, bytes and ratios from the nodes' --report files.

    result = summarize(reports, history, rate_mbps=100.0)   # reports: one parsed --report per node
    result = summarize(reports, history, rate_mbps=[50.0, 1000.0, ...])  # each node's own link
    print(format_table(result))

Per round, averaged over the peers that report it (every peer times its own round):

- compute_s, encode_s, wait_s, transfer_s (and the slowest peer's), aggregate_s: the node's timers
  on the round's critical path; wait_s runs from its submission to the round's close (packets
  already submitted are fetched meanwhile), transfer_s from the close to the last packet in hand;
  with overlap, the previous round's transfer runs behind compute (hidden_transfer_s);
- fetching_s: the wall time during which the node had at least one of the round's packet fetches
  in progress (DHT lookup, dial, request and bytes), early fetches included: the time its download
  link had work;
- round_s: the node's wall clock from the start of its inner steps to the start of its next
  round's (so waiting for a round to open counts); for its last round, to the end of its outer
  step (the sum of the timers for reports that lack the clock);
- idle_s = round_s - compute_s - encode_s - aggregate_s: time the node's CPU waits on the network
  and on the other peers;
- download_bytes: what one peer must fetch, the packets of every other peer in the round (its own
  is local); ideal_transfer_s: the least time the links allow, given when each packet was
  submitted (the nodes' `submitted_at`): each packet leaves its publisher from its submission at
  that uplink's full rate, the peer's downlink is shared fairly between those arriving, and the
  time it has work is the ideal (`_fluid_busy_s`); transfer_over_ideal = fetching_s / ideal, per
  peer then averaged; 1.0 is a link kept full whenever a fetch was in progress, as fast as the
  publishers' uplinks allow. ideal_all_ready_s is the bound with every packet ready at once (and
  the ideal for reports without submission times): download_bytes * 8 / the peer's link rate, or,
  where a slower uplink binds, the slowest other publisher's packet over its uplink; a swarm whose
  submissions spread out cannot reach it (a packet submitted alone leaves its publisher no faster
  than that publisher's uplink), so it only bounds; transfer_over_all_ready = fetching_s / it;
  after_close_over_ideal = transfer_s / ideal: the part left after the round closed (0 with
  overlap, where it runs behind compute);
- compute_utilization = compute_s / round_s, per peer then averaged;
- swarm_cycle_s: the coordinator's time from the previous round's close to this one's (rounds close
  when the last packet is submitted, so this is the swarm's round time, slowest peer included).

The summary averages rounds 1.. (round 0 carries start-up: first-step allocation, DHT warm-up)
when there is more than one round. With links of several rates, `summary["by_rate"]` gives the
same steady-state means for the peers of each rate.

Per peer (`peer_rows`, from the coordinator's closed rounds): whether its host was behind NAT, in
how many of the run's closed rounds' final manifests (after any amendment) its packet was, in how
many an amendment dropped it, and how many rounds its node reports having applied.
"""

from __future__ import annotations

import statistics

TIMERS = ("compute_s", "encode_s", "wait_s", "transfer_s", "aggregate_s")


SUMMARY_KEYS = (
    *TIMERS,
    "transfer_max_s",
    "fetching_s",
    "round_s",
    "idle_s",
    "packet_bytes",
    "download_bytes",
    "ideal_transfer_s",
    "transfer_over_ideal",
    "ideal_all_ready_s",
    "transfer_over_all_ready",
    "after_close_over_ideal",
    "compute_utilization",
)


def summarize(reports: list[dict], history: list[dict], *, rate_mbps: float | list[float]) -> dict:
    """Per-round rows and a steady-state summary; `reports` are the nodes' --report objects, and
    `rate_mbps` their links' rate (one for all, or one per report; 0: unshaped)."""
    rates = list(rate_mbps) if isinstance(rate_mbps, (list, tuple)) else [rate_mbps] * len(reports)
    if len(rates) != len(reports):
        raise ValueError(f"{len(rates)} rates for {len(reports)} reports")
    node_rounds = [
        [r | {"rate_mbps": rate} for r in _with_next_start(report["rounds"])] for report, rate in zip(reports, rates)
    ]
    rounds = sorted({r["round"] for per_node in node_rounds for r in per_node})
    closed_at = {h["round"]: h["closed_at"] for h in history}
    rows, by_rate_rows = [], {rate: [] for rate in sorted(set(rates))}
    for k in rounds:
        per_peer = [r for per_node in node_rounds for r in per_node if r["round"] == k]
        rows.append(_round_row(k, per_peer, closed_at))
        if len(by_rate_rows) > 1:
            for rate, rate_rows in by_rate_rows.items():
                # Every peer's ideal depends on the others' uplinks: compute it over all, average a few.
                rate_rows.append(_round_row(k, per_peer, closed_at, only=lambda r: r["rate_mbps"] == rate))  # noqa: B023
    steady = slice(1, None) if len(rows) > 1 else slice(None)
    summary = {
        "rounds_averaged": [row["round"] for row in rows[steady]],
        **_means(rows[steady], "swarm_cycle_s"),
        "digests_agree_every_round": bool(rows) and all(row["digests_agree"] for row in rows),
    }
    if len(by_rate_rows) > 1:
        summary["by_rate"] = [
            {"rate_mbps": rate, "num_peers": rates.count(rate), **_means(rate_rows[steady])}
            for rate, rate_rows in by_rate_rows.items()
        ]
    return {"per_round": rows, "summary": summary}


PEER_KEYS = (
    "fetching_s",
    "ideal_transfer_s",
    "transfer_over_ideal",
    "transfer_over_all_ready",
    "round_s",
    "compute_utilization",
)


def summarize_peers(reports: list[dict], history: list[dict], *, rate_mbps: float | list[float]) -> list[dict]:
    """Each node's own steady-state means of PEER_KEYS (rounds 1.. when there are several), in
    the order of `reports`; ideals are computed over every peer of each round, as in `summarize`."""
    rates = list(rate_mbps) if isinstance(rate_mbps, (list, tuple)) else [rate_mbps] * len(reports)
    node_rounds = [
        [r | {"rate_mbps": rate, "node": i} for r in _with_next_start(report["rounds"])]
        for i, (report, rate) in enumerate(zip(reports, rates))
    ]
    rounds = sorted({r["round"] for per_node in node_rounds for r in per_node})
    closed_at = {h["round"]: h["closed_at"] for h in history}
    steady = rounds[1:] if len(rounds) > 1 else rounds
    means = []
    for i in range(len(reports)):
        rows = []
        for k in steady:
            per_peer = [r for per_node in node_rounds for r in per_node if r["round"] == k]
            if any(r["node"] == i for r in per_peer):
                rows.append(_round_row(k, per_peer, closed_at, only=lambda r: r["node"] == i))  # noqa: B023
        means.append({name: _mean(row[name] for row in rows) for name in PEER_KEYS})
    return means


def _means(rows: list[dict], *extra: str) -> dict:
    return {name: _mean(row[name] for row in rows) for name in (*SUMMARY_KEYS, *extra)}


def _with_next_start(rounds: list[dict]) -> list[dict]:
    """One node's rounds (copies), each with when that node's next round started: where it ended."""
    rounds = [dict(r) for r in rounds]
    for r, following in zip(rounds, rounds[1:]):
        if r.get("started_at") and following.get("started_at") and following["round"] == r["round"] + 1:
            r["next_started_at"] = following["started_at"]
    return rounds


def _transfer_s(t: dict) -> float:
    """The packets' transfer time, on the critical path or (overlap) hidden behind compute."""
    return t["transfer_s"] or t.get("hidden_transfer_s", 0.0)


def _fetching_s(r: dict) -> float | None:
    """Time the node's download link had work for the round (older reports: the transfer timer);
    None when it fetched nothing (with overlap, its first round applies no packets yet)."""
    return r.get("fetching_s") or _transfer_s(r["times"]) or None


def transfer_ideals(per_peer: list[dict]) -> list[float | None]:
    """Each peer's least transfer time (None for an unshaped peer): with every publisher's
    submission time known, the busy time of `_fluid_busy_s`; otherwise `_all_ready_s`."""
    if not all(r.get("submitted_at") for r in per_peer):
        return _all_ready_s(per_peer)
    ideal = []
    for r in per_peer:
        others = [o for o in per_peer if o is not r]
        packets = [(o["submitted_at"], o["packet_bytes"], _bytes_per_s(o["rate_mbps"])) for o in others]
        ideal.append(_fluid_busy_s(packets, _bytes_per_s(r["rate_mbps"])) if r["rate_mbps"] > 0 else None)
    return ideal


def _all_ready_s(per_peer: list[dict]) -> list[float | None]:
    """Each peer's least transfer time with every packet ready at once: its own downlink carrying
    every other packet, or the slowest other publisher's uplink sending its packet once (None for
    an unshaped peer)."""
    ideal = []
    for r in per_peer:
        others = [o for o in per_peer if o is not r]
        bounds = [o["packet_bytes"] * 8 / (o["rate_mbps"] * 1e6) for o in others if o["rate_mbps"] > 0]
        if r["rate_mbps"] > 0:
            bounds.append(sum(o["packet_bytes"] for o in others) * 8 / (r["rate_mbps"] * 1e6))
        ideal.append(max(bounds) if bounds and r["rate_mbps"] > 0 else None)
    return ideal


def _bytes_per_s(rate_mbps: float) -> float:
    return rate_mbps * 1e6 / 8 if rate_mbps > 0 else float("inf")


def _fluid_busy_s(packets: list[tuple[float, int, float]], downlink: float) -> float:
    """The time a downlink of `downlink` bytes/s has work, when each packet (ready at, bytes, its
    publisher's uplink in bytes/s) leaves its publisher as it is submitted at that uplink's full
    rate and the downlink is shared fairly (max-min) between the packets arriving: the least time
    the links allow given when the packets were submitted. Gaps with nothing left to receive do
    not count, as they do not in the nodes' `fetching_s`."""
    pending = sorted(packets)
    active: list[list[float]] = []  # [bytes left, uplink]
    now, busy, i = pending[0][0] if pending else 0.0, 0.0, 0
    while i < len(pending) or active:
        while i < len(pending) and pending[i][0] <= now:
            active.append([float(pending[i][1]), pending[i][2]])
            i += 1
        if not active:
            now = pending[i][0]
            continue
        rates, left = {}, downlink
        for n, packet in enumerate(sorted(active, key=lambda p: p[1])):  # water-filling, smallest cap first
            rates[id(packet)] = min(packet[1], left / (len(active) - n))
            left -= rates[id(packet)]
        step = min(p[0] / rates[id(p)] for p in active)
        if i < len(pending):
            step = min(step, pending[i][0] - now)
        for packet in active:
            packet[0] -= rates[id(packet)] * step
        active = [p for p in active if p[0] > 1e-6]
        now, busy = now + step, busy + step
    return busy


def replay_over_ideal(
    schedule: dict[int, tuple[float, int]], rates_mbps: dict[int, float], busy_s: dict[int, float], no_path=()
) -> dict[int, float | None]:
    """Each host's `busy_s` in a replay of a round's schedule (host -> seconds after the first
    submission, packet bytes) over its ideal for the same schedule (`_fluid_busy_s`), counting the
    senders it had a path from (`no_path`: (sender, receiver) pairs); None for an unshaped host."""
    ratios = {}
    for host, busy in busy_s.items():
        packets = [
            (delay_s, num_bytes, _bytes_per_s(rates_mbps[sender]))
            for sender, (delay_s, num_bytes) in schedule.items()
            if sender != host and (sender, host) not in no_path
        ]
        ideal = _fluid_busy_s(packets, _bytes_per_s(rates_mbps[host])) if packets and rates_mbps[host] > 0 else 0.0
        ratios[host] = busy / ideal if ideal > 0 and busy else None
    return ratios


def _round_row(k: int, per_peer: list[dict], closed_at: dict[int, float], only=None) -> dict:
    """Round k's means over the peers (`only`: over those it selects; ideals use everyone)."""
    # Each peer downloads every other peer's packet: the round's total less its own.
    total_bytes = sum(r["packet_bytes"] for r in per_peer)
    download_bytes = [total_bytes - r["packet_bytes"] for r in per_peer]
    ideal_s, all_ready_s = transfer_ideals(per_peer), _all_ready_s(per_peer)
    if only is not None:
        chosen = [only(r) for r in per_peer]
        per_peer, download_bytes, ideal_s, all_ready_s = (
            [x for x, c in zip(xs, chosen) if c] for xs in (per_peer, download_bytes, ideal_s, all_ready_s)
        )
    times = [r["times"] for r in per_peer]
    # A peer's round: wall clock from the start of its inner steps to the end of its outer step
    # (reports from older nodes lack the clock: the sum of the timers stands in).
    round_s = [
        r["next_started_at"] - r["started_at"]
        if r.get("next_started_at")
        else r["ended_at"] - r["started_at"]
        if r.get("ended_at") and r.get("started_at")
        else sum(t[name] for name in TIMERS)
        for r, t in zip(per_peer, times)
    ]
    packet_bytes = [r["packet_bytes"] for r in per_peer]
    measured = [r["downloaded_bytes"] for r in per_peer if r.get("downloaded_bytes") is not None]
    row = {
        "round": k,
        "num_peers": len(per_peer),
        **{name: _mean(t[name] for t in times) for name in TIMERS},
        "transfer_max_s": max((_transfer_s(t) for t in times), default=None),
        "hidden_transfer_s": _mean(t.get("hidden_transfer_s", 0.0) for t in times),
        "fetching_s": _mean(_fetching_s(r) for r in per_peer),
        "round_s": _mean(round_s),
        "idle_s": _mean(total - t["compute_s"] - t["encode_s"] - t["aggregate_s"] for total, t in zip(round_s, times)),
        "packet_bytes": _mean(packet_bytes),
        "download_bytes": _mean(download_bytes),
        "measured_download_bytes": _mean(measured) if measured else None,
        "ideal_transfer_s": _mean(ideal_s),
        "transfer_over_ideal": _mean(f / s for r, s in zip(per_peer, ideal_s) if s and (f := _fetching_s(r))),
        "ideal_all_ready_s": _mean(all_ready_s),
        "transfer_over_all_ready": _mean(f / s for r, s in zip(per_peer, all_ready_s) if s and (f := _fetching_s(r))),
        "after_close_over_ideal": _mean(t["transfer_s"] / s for t, s in zip(times, ideal_s) if s),
        "compute_utilization": _mean(t["compute_s"] / total for t, total in zip(times, round_s) if total > 0),
        "swarm_cycle_s": closed_at[k] - closed_at[k - 1] if k in closed_at and k - 1 in closed_at else None,
        "digests_agree": len({r["digest"] for r in per_peer}) == 1,
        "num_packets": min((r["num_packets"] for r in per_peer), default=0),
    }
    return row


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def peer_rows(
    peer_ids: list[str | None],
    behind_nat: list[bool],
    rounds: dict[int, dict],
    reports: list[dict],
    peers: list[dict] = (),
    relayed: list[bool] | None = None,
) -> list[dict]:
    """One row per node host h1..hN (in order): `peer_ids` its node's peer id (None: unknown),
    `rounds` the coordinator's view of each closed round (RoundView: its final `manifest` and the
    entries `dropped` from it), `reports` the nodes' --report objects, `peers` the run status's
    peer list (for each peer's standing, and whether the coordinator's dial-back reached it);
    `relayed`: which hosts' nodes were reachable through a relay (--relay-via). `path` says how a
    node's packet left it: "relay" (fetched through the relay), "push" (it pushed it to a reachable
    peer in some round), or "direct" (peers dialled it)."""
    if not len(peer_ids) == len(behind_nat) == len(reports):
        raise ValueError(f"{len(peer_ids)} peer ids, {len(behind_nat)} NAT flags, {len(reports)} reports")
    closed = [view for _, view in sorted(rounds.items()) if view["state"] == "closed"]
    standing = {p["peer_id"]: p.get("standing") for p in peers}
    reachable = {p["peer_id"]: p.get("reachable") for p in peers}
    rows = []
    relayed = relayed or [False] * len(peer_ids)
    for i, (peer_id, nat, report, via_relay) in enumerate(zip(peer_ids, behind_nat, reports, relayed), start=1):
        pushed = sum(bool(r.get("pushed_to")) for r in report.get("rounds", []))
        rows.append(
            {
                "host": f"h{i}",
                "peer_id": peer_id,
                "behind_nat": nat,
                "rounds_in_manifest": sum(any(e["peer_id"] == peer_id for e in view["manifest"]) for view in closed),
                "rounds": len(closed),
                "rounds_dropped": sum(peer_id in view.get("dropped", {}) for view in closed),
                "rounds_applied": len(report.get("rounds", [])),
                "standing": standing.get(peer_id),
                "reachable": reachable.get(peer_id),  # the coordinator's dial-back at join (None: unknown)
                "rounds_pushed": pushed,
                "path": "relay" if via_relay else "push" if pushed else "direct",
            }
        )
    return rows


def format_peers(rows: list[dict]) -> str:
    """The per-peer rows as a plain-text table."""
    headings = (
        "host",
        "peer",
        "NAT",
        "reachable",
        "path",
        "in manifest",
        "pushed",
        "dropped",
        "applied",
        "standing",
        "xfer/ideal",
        "util",
    )
    cells = [
        [
            row["host"],
            row["peer_id"] or "-",
            "yes" if row["behind_nat"] else "no",
            {True: "yes", False: "no"}.get(row.get("reachable"), "-"),
            row.get("path", "-"),
            f"{row['rounds_in_manifest']}/{row['rounds']}",
            str(row.get("rounds_pushed", 0)),
            str(row["rounds_dropped"]),
            str(row["rounds_applied"]),
            row["standing"] or "-",
            f"{row['transfer_over_ideal']:.1f}x" if row.get("transfer_over_ideal") is not None else "-",
            f"{row['compute_utilization']:.0%}" if row.get("compute_utilization") is not None else "-",
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headings)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headings, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# -- the table ------------------------------------------------------------------------------------

COLUMNS = (  # (heading, key, format)
    ("round", "round", "{:d}"),
    ("compute", "compute_s", "{:.2f}s"),
    ("encode", "encode_s", "{:.2f}s"),
    ("wait", "wait_s", "{:.2f}s"),
    ("transfer", "transfer_s", "{:.2f}s"),
    ("xfer max", "transfer_max_s", "{:.2f}s"),
    ("fetching", "fetching_s", "{:.2f}s"),
    ("aggregate", "aggregate_s", "{:.2f}s"),
    ("round", "round_s", "{:.2f}s"),
    ("idle", "idle_s", "{:.2f}s"),
    ("packet", "packet_bytes", "{:,.0f}B"),
    ("download/peer", "download_bytes", "{:,.0f}B"),
    ("ideal", "ideal_transfer_s", "{:.3f}s"),
    ("xfer/ideal", "transfer_over_ideal", "{:.1f}x"),
    ("close/ideal", "after_close_over_ideal", "{:.1f}x"),
    ("util", "compute_utilization", "{:.0%}"),
    ("cycle", "swarm_cycle_s", "{:.2f}s"),
    ("digests", "digests_agree", "{}"),
)


def format_table(result: dict) -> str:
    """The per-round rows and the steady-state line as a plain-text table."""
    rows = [[_cell(row, key, fmt) for _, key, fmt in COLUMNS] for row in result["per_round"]]
    summary = {"round": "mean", **result["summary"], "digests_agree": result["summary"]["digests_agree_every_round"]}
    rows.append([_cell(summary, key, fmt) for _, key, fmt in COLUMNS])
    headings = [heading for heading, _, _ in COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headings, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "agree" if value else "DIFFER"
    if isinstance(value, str):
        return value
    return fmt.format(value)
