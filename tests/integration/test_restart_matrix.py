"""Every node SIGKILLed at one phase of a round, back at one timing (tests/integration/restart_matrix.py,
real processes on 127.0.0.1): no agreed round is lost, every round ends agreed, every node holds the
agreed digests, and the first round with contributors after the restart closes within two round
times plus the restart. CI runs the cells that reach the new paths; `python -m
tests.integration.restart_matrix` runs all 42.

- mixed, deadline first: two of three submitted, the round closed at its deadline with their two
  packets before the heartbeat time-out marked anyone gone; back after it. The packets exist only
  on their authors' disks: the nodes replay the round from them.
- published, after both: every node died between keeping its packet and submitting it; the run
  paused; the nodes come back and send the kept packets without training the round again.
- transfer, before, coordinator too: the round closed with every packet; nodes and coordinator die
  while fetching and come back at once.
"""

from __future__ import annotations

import pytest

from tests.integration.restart_matrix import CRASH_ROUND, Cell, run_cell

pytestmark = [pytest.mark.slow]

# Two round times plus the restart (three nodes starting on two busy cores: about 10-25 s).
RESTART_ALLOWANCE_S = 60.0


@pytest.mark.timeout(420)
@pytest.mark.parametrize("cell", ["mixed:deadline_first:nodes", "published:after_both:nodes", "transfer:before:both"])
def test_a_swarm_killed_at_once_resumes(tmp_path, cell):
    result = run_cell(tmp_path, Cell.parse(cell))
    assert result.problems() == [], (result.problems(), result.history)
    assert result.rounds_lost == 0 and result.rewinds == []
    assert result.recovered_s is not None
    assert result.recovered_s < 2 * max(result.round_time_s, 1.0) + RESTART_ALLOWANCE_S, result.recovered_s
    if cell.startswith("mixed"):
        # The round closed with the two packets and kept both: served from their authors' disks.
        assert result.crash_round_packets == 2, result.history[CRASH_ROUND]
    if cell.startswith("published"):
        assert result.kept_sent == 3 and result.crash_round_packets == 3, result.history[CRASH_ROUND]
    print(
        f"{cell}: recovered {result.recovered_s:.1f} s after the restart (rounds of {result.round_time_s:.1f} s), "
        f"{result.wall_s:.0f} s in all"
    )
