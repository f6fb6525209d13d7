"""What every rule is handed: the storage it reads and writes (inside the service's transaction),
the views it reads runs and configs through, when the service resumed, and the runs it changed.

`CoordinatorService` (coordinator/service.py) holds one `Context` and opens the transaction; the
rule modules beside this one take it as their first argument and never commit, so each request's
rules commit together or not at all. `changed` collects the runs whose long-polls wake once the
transaction commits (the service empties it either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator import errors
from coordinator.storage import RoundRow, RunRow, Storage
from coordinator.views import Views
from protocol.run_config import RunConfig


@dataclass(slots=True)
class Context:
    storage: Storage
    views: Views
    resumed_at: float  # see coordinator/rules/rounds.py, "Restart grace"
    changed: set[str] = field(default_factory=set)  # run ids whose change wakes long-polls on commit

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
