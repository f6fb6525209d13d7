"""`GET /metrics`: the coordinator's state in the Prometheus text exposition format (v0.0.4).

Written by hand: a dozen gauges do not justify a dependency. Values are read from the same
status views the page uses (`coordinator.views`), so the two never disagree. Per-run series are
emitted for runs that are still active, which keeps the series count bounded on a long-lived
coordinator.

Per replica: the long-polls parked on it, whether it leads (coordinator/storage/cluster.py), since when, and when its first
tick as leader finished. Per round, of the last closed one: mean train loss, time, contributors, tokens trained, packet
bytes and the compression against sending the updates dense. The validation loss is that of the
latest round peers evaluated (they do every few rounds, `eval_every_rounds`), with its round
beside it; rounds are looked for up to VAL_LOSS_LOOKBACK_ROUNDS back.
"""

from __future__ import annotations

from collections import Counter

from coordinator.rules.states import ACTIVE_STATES
from coordinator.storage import Storage
from coordinator.storage.cluster import Cluster
from coordinator.views import Views

VAL_LOSS_LOOKBACK_ROUNDS = 100

_HELP = {
    "locoswarm_http_responses_total": ("counter", "HTTP responses sent, by status code."),
    "locoswarm_coordinator_leader": ("gauge", "1 if this replica leads (runs deadlines and timeouts), else 0."),
    "locoswarm_coordinator_leader_since_seconds": ("gauge", "Unix time this replica took the lead."),
    "locoswarm_coordinator_first_tick_seconds": ("gauge", "Unix time of this leader's first tick."),
    "locoswarm_long_polls_waiting": ("gauge", "Round long-polls parked on this replica now."),
    "locoswarm_runs": ("gauge", "Runs known to the coordinator, by state."),
    "locoswarm_run_current_round": ("gauge", "The open round, or the next to open."),
    "locoswarm_run_peers": ("gauge", "Peers of a run, by membership status."),
    "locoswarm_run_peers_flagged": ("gauge", "Peers whose parameter digest lost the majority."),
    "locoswarm_round_submitted": ("gauge", "Submissions to the open round so far."),
    "locoswarm_round_expected": ("gauge", "Live peers expected to submit to the open round."),
    "locoswarm_round_deadline_seconds": ("gauge", "Unix time of the open round's deadline."),
    "locoswarm_rounds_closed": ("gauge", "Closed rounds of a run."),
    "locoswarm_last_round_mean_loss": ("gauge", "Mean train loss submitted to the last round."),
    "locoswarm_last_round_time_seconds": ("gauge", "Open-to-close time of the last round."),
    "locoswarm_last_round_contributors": ("gauge", "Packets in the last round's manifest."),
    "locoswarm_last_round_tokens": ("gauge", "Tokens trained into the last round (contributors x H x batch)."),
    "locoswarm_last_round_packet_bytes": ("gauge", "Bytes of the packets submitted to the last round."),
    "locoswarm_last_round_compression_ratio": (
        "gauge",
        "Dense fp32 size of the last round's updates over its packet bytes.",
    ),
    "locoswarm_val_loss": ("gauge", "Validation loss of the model after the latest round peers evaluated."),
    "locoswarm_val_loss_round": ("gauge", "The round locoswarm_val_loss is of."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class _Exposition:
    def __init__(self) -> None:
        self._samples: dict[str, list[str]] = {name: [] for name in _HELP}

    def add(self, name: str, value: float, **labels: str) -> None:
        self._samples[name].append(f"{name}{_labels(labels)} {float(value)!r}")

    def text(self) -> str:
        lines = []
        for name, (kind, help_text) in _HELP.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(self._samples[name])
        return "\n".join(lines) + "\n"


def render(
    storage: Storage, views: Views, now: float, response_counts: Counter[int], cluster: Cluster, num_long_polls: int
) -> str:
    out = _Exposition()
    for code, count in sorted(response_counts.items()):
        out.add("locoswarm_http_responses_total", count, code=str(code))
    out.add("locoswarm_coordinator_leader", int(cluster.is_leader))
    if cluster.leader_since is not None:
        out.add("locoswarm_coordinator_leader_since_seconds", cluster.leader_since)
    if cluster.first_tick_at is not None:
        out.add("locoswarm_coordinator_first_tick_seconds", cluster.first_tick_at)
    out.add("locoswarm_long_polls_waiting", num_long_polls)
    runs = storage.list_runs()
    for state, count in sorted(Counter(run.state for run in runs).items()):
        out.add("locoswarm_runs", count, state=state)
    for run in runs:
        if run.state not in ACTIVE_STATES:
            continue
        status = views.status(run.run_id, now=now, history_limit=VAL_LOSS_LOOKBACK_ROUNDS)
        labels = {"run": run.run_id}
        out.add("locoswarm_run_current_round", run.current_round, **labels)
        for peer_status, count in sorted(Counter(p.status for p in status.peers).items()):
            out.add("locoswarm_run_peers", count, status=peer_status, **labels)
        out.add("locoswarm_run_peers_flagged", sum(bool(p.flags) for p in status.peers), **labels)
        current = status.current_round
        if current is not None:
            out.add("locoswarm_round_submitted", current.num_submitted, **labels)
            out.add("locoswarm_round_expected", current.num_expected, **labels)
            if current.deadline is not None:
                out.add("locoswarm_round_deadline_seconds", current.deadline, **labels)
        if status.history:
            last = status.history[-1]
            out.add("locoswarm_rounds_closed", last.round + 1, **labels)
            if last.mean_loss is not None:
                out.add("locoswarm_last_round_mean_loss", last.mean_loss, **labels)
            out.add("locoswarm_last_round_time_seconds", last.round_time_s, **labels)
            out.add("locoswarm_last_round_contributors", last.num_contributors, **labels)
            out.add("locoswarm_last_round_tokens", last.tokens, **labels)
            out.add("locoswarm_last_round_packet_bytes", last.packet_bytes, **labels)
            if last.compression_ratio is not None:
                out.add("locoswarm_last_round_compression_ratio", last.compression_ratio, **labels)
        evaluated = [h for h in status.history if h.val_loss is not None]
        if evaluated:
            out.add("locoswarm_val_loss", evaluated[-1].val_loss, **labels)
            out.add("locoswarm_val_loss_round", evaluated[-1].round, **labels)
    return out.text()
