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


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, each as wide as its widest cell."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def render_status(status: dict[str, Any], now: float | None = None) -> str:
    run = status["run"]
    now = status.get("now", time.time()) if now is None else now
    config = run["config"]
    out = [
        f"run {run['run_id']} ({run['name']})  state {run['state']}  "
        f"{config['model']['preset']}/{config['outer']['strategy']} H={config['inner']['steps']}",
    ]
    current = status.get("current_round")
    if current is None:
        out.append("no open round")
    elif current["deadline"] is None:
        live = current["num_expected"]
        out.append(f"round {current['round']} pending: {live} peer{'' if live == 1 else 's'} live, "
                   f"waiting for {config['membership']['min_peers']}")
    else:
        left_s = max(0.0, current["deadline"] - now)
        out.append(
            f"round {current['round']} {current['state']}: {current['num_submitted']}/"
            f"{current['num_expected']} submitted, deadline in {left_s:.0f} s"
        )
    out.append("")
    peer_rows = []
    for peer in status["peers"]:
        notes = list(peer["flags"])
        if peer.get("reason"):
            notes.append(peer["reason"])
        peer_rows.append([
            peer["peer_id"],
            str(peer["peer_index"]),
            peer["status"],
            peer["activity"],
            _fmt(peer["last_loss"], 4),
            bandwidth(peer["bandwidth_mbps"], peer.get("uplink_mbps")),
            _fmt(peer["lag_rounds"]),
            "; ".join(notes),
        ])
    out.append(table(
        ["peer", "#", "state", "activity", "last loss", "bandwidth", "lag", "flags / reason"],
        peer_rows,
    ))
    history = status["history"][-RECENT_ROUNDS:]
    if history:
        out.append("")
        out.append(table(
            ["round", "contributors", "mean loss", "round time", "applied", "majority digest"],
            [
                [
                    str(h["round"]),
                    str(h["num_contributors"]),
                    _fmt(h["mean_loss"], 4),
                    f"{h['round_time_s']:.1f} s",
                    str(h["num_applied"]),
                    (h["majority_digest"] or "-")[:16],
                ]
                for h in reversed(history)
            ],
        ))
    return "\n".join(out)
