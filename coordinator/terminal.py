"""`locoswarm status`: the run status JSON rendered as plain-text tables for a terminal.

Works on the JSON dict (not the pydantic model) so the CLI needs nothing but httpx and this
module, and keeps working when a newer coordinator adds fields.
"""

from __future__ import annotations

import time
from typing import Any

RECENT_ROUNDS = 8


def _fmt(value: Any, digits: int | None = None) -> str:
    if value is None:
        return "-"
    if digits is not None and isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def bandwidth(measured: float | None, uplink: float | None) -> str:
    """The bandwidth column: measured on the peer's downloads, and the uplink its operator stated."""
    parts = ([f"{measured:.0f} Mbps"] if measured is not None else []) + ([f"up {uplink:.0f}"] if uplink else [])
    return ", ".join(parts) or "-"


def score_text(score: dict[str, Any] | None) -> str:
    """A peer's running contribution score (PeerScoreView): median loss delta and cosine, hurting rounds."""
    if not score:
        return "-"
    hurt = f" {score['num_hurt']}/{score['num_rounds']} hurt" if score["num_hurt"] else ""
    return f"dloss {_fmt(score['loss_delta'], 3)} cos {_fmt(score['cosine'], 2)}{hurt}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, each as wide as its widest cell."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def pick_run(runs: list[dict[str, Any]]) -> str:
    """The run to show when none is named (`/v1/runs` order, oldest first): the newest still
    waiting or running, else the newest; as the page does (coordinator.views.latest_run_id)."""
    live = [run for run in runs if run["state"] in ("waiting", "running")]
    return (live or runs)[-1]["run_id"]


def training_percent(status: dict[str, Any]) -> float:
    """The open round's inner steps done by live peers (each up to H), in percent of H per live peer."""
    steps = status["run"]["config"]["inner"]["steps"]
    live = [p for p in status["peers"] if p["status"] == "live"]
    done = sum(min(p.get("inner_step") or 0, steps) for p in live if p["lag_rounds"] == 0)
    return 100.0 * done / (steps * len(live)) if live else 0.0


def render_status(status: dict[str, Any], now: float | None = None) -> str:
    run = status["run"]
    now = status.get("now", time.time()) if now is None else now
    config = run["config"]
    out = [
        f"run {run['run_id']} ({run['name']})  state {run['state']}  "
        f"{config['model']['preset']}/{config['outer']['strategy']} H={config['inner']['steps']}",
    ]
    current = status.get("current_round")
    recovery = status.get("recovery")
    if recovery is not None:  # paused: every peer stopped (coordinator/recovery.py)
        since_s = now - (recovery["waiting_since"] or recovery["paused_since"])
        out.append(f"PAUSED at round {recovery['round']} for {since_s:.0f} s: {recovery['message']}")
        if recovery["rewind_at"] is not None:
            out.append(
                f"  goes back to round {recovery['newest_held_round']}'s start in "
                f"{max(0.0, recovery['rewind_at'] - now):.0f} s"
            )
    if status.get("stuck"):  # live peers waiting on packets nobody serves (node/round/catchup.py)
        out.append(status["stuck"])
    for rewind in status.get("rewinds", [])[-3:]:
        out.append(f"rewound from round {rewind['from_round']} to {rewind['to_round']}: {rewind['reason']}")
    if current is None:
        out.append("no open round")
    elif current["deadline"] is None:
        live = current["num_expected"]
        out.append(
            f"round {current['round']} pending: {live} peer{'' if live == 1 else 's'} live, "
            f"waiting for {config['membership']['min_peers']}"
        )
    else:
        left_s = current["deadline"] - now
        out.append(
            f"round {current['round']} {current['state']}: {current['num_submitted']}/"
            f"{current['num_expected']} submitted, "
            + (f"deadline in {left_s:.0f} s" if left_s >= 0 else f"STALLED: {-left_s:.0f} s past its deadline")
            + f", {training_percent(status):.0f}% of the inner steps trained"
        )
    out.append("")
    peer_rows = []
    for peer in status["peers"]:
        notes = list(peer["flags"])
        if peer.get("excluded"):
            notes.append(f"excluded: {peer['excluded_reason']}")
        if peer.get("reason"):
            notes.append(peer["reason"])
        peer_rows.append(
            [
                peer["peer_id"],
                str(peer["peer_index"]),
                peer["status"],
                peer["activity"]
                + (
                    f" {peer['inner_step']}/{config['inner']['steps']}"
                    if peer["activity"] == "training" and peer.get("inner_step") is not None
                    else ""
                ),
                _fmt(peer["last_loss"], 4),
                bandwidth(peer["bandwidth_mbps"], peer.get("uplink_mbps")),
                _fmt(peer["lag_rounds"]),
                score_text(peer.get("score")),
                str(peer.get("credit", 0)),
                "; ".join(notes),
            ]
        )
    out.append(
        table(
            ["peer", "#", "state", "activity", "last loss", "bandwidth", "lag", "score", "credit", "flags / reason"],
            peer_rows,
        )
    )
    history = status["history"][-RECENT_ROUNDS:]
    if history:
        out.append("")
        out.append(
            table(
                ["round", "contributors", "mean loss", "round time", "applied", "digest"],
                [
                    [
                        str(h["round"]),
                        str(h["num_contributors"])
                        if h.get("num_picked") is None
                        else f"{h['num_picked']} of {h['num_contributors']} picked",
                        _fmt(h["mean_loss"], 4),
                        f"{h['round_time_s']:.1f} s",
                        str(h["num_applied"]),
                        (h.get("agreed_digest") or h["majority_digest"] or "-")[:16]
                        + ("" if h.get("agreed_digest") or not h["majority_digest"] else " (provisional)"),
                    ]
                    for h in reversed(history)
                ],
            )
        )
        for h in history:
            if h.get("dispute"):
                out.append(f"round {h['round']} dispute: {h['dispute']['verdict']}")
    return "\n".join(out)
