"""What every rule is handed: the storage it reads and writes (inside the service's transaction),
the views it reads runs and configs through, when the service resumed, and the runs it changed.

`CoordinatorService` (coordinator/service.py) holds one `Context` and opens the transaction; the
rule modules beside this one take it as their first argument and never commit, so each request's
rules commit together or not at all. `changed` collects the runs whose long-polls wake once the
transaction commits (the service empties it either way). `live_peers` is a count of a run's live
members, taken again after a membership change here and at most `LIVE_COUNT_MAX_AGE_S` old (other
replicas' changes), for what needs only the swarm's size (the heartbeat period), so that a
heartbeat does not count every member.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator import errors
from coordinator.storage import RoundRow, RunRow, Storage
from coordinator.views import Views
from protocol.run_config import RunConfig

LIVE_COUNT_MAX_AGE_S = 5.0


@dataclass(slots=True)
class Context:
    storage: Storage
    views: Views
    resumed_at: float  # see coordinator/rules/rounds.py, "Restart grace"
    changed: set[str] = field(default_factory=set)  # run ids whose change wakes long-polls on commit
    _live_counts: dict[str, tuple[float, int]] = field(default_factory=dict)  # run id -> (counted at, count)
    # (run id, round, opened at) -> the round's timeout, which depends on earlier rounds only
    # (coordinator/rules/rounds.py `round_timeout_s`): asked every tick once a round is past it
    round_timeouts: dict[tuple[str, int, float], float] = field(default_factory=dict)

    def live_peers(self, run_id: str, now: float) -> int:
        """How many live members `run_id` has, as counted at most `LIVE_COUNT_MAX_AGE_S` ago."""
        counted = self._live_counts.get(run_id)
        if counted is None or not 0 <= now - counted[0] <= LIVE_COUNT_MAX_AGE_S:
            counted = (now, self.storage.count_live_peers(run_id))
            self._live_counts[run_id] = counted
        return counted[1]

    def members_changed(self, run_id: str) -> None:
        """A member of `run_id` joined, left or was marked gone here: count afresh next time."""
        self._live_counts.pop(run_id, None)

    def run(self, run_id: str) -> RunRow:
        """The run as stored now, or `RunNotFound`."""
        return self.views.require_run(run_id)

    def config(self, run: RunRow) -> RunConfig:
        return self.views.config_of(run)

    def closed_round(self, run_id: str, round_index: int) -> RoundRow:
        """Round r, which must have closed (`RoundNotFound`, `RoundNotClosed`)."""
        round_row = self.storage.get_round(run_id, round_index)
        if round_row is None:
            raise errors.RoundNotFound(f"round {round_index} has not opened")
        if round_row.closed_at is None:
            raise errors.RoundNotClosed(f"round {round_index} has no manifest yet")
        return round_row
