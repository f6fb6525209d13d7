"""Retention: what the database keeps of old rounds, so it grows with rounds, not peers x rounds.

A run gains rows per peer per round: submissions, applied reports (with their scores, losses and
samples), missing-packet reports and dropped entries. Once a round is more than ``keep_rounds``
behind the run's current round (``coordinator serve --keep-rounds``, default `DEFAULT_KEEP_ROUNDS`,
the status page's history; 0 keeps everything) its per-peer rows are deleted, and what the run's
truth rests on stays: the round row (times, agreed digest, manifest version, dispute) and its
manifest, the submissions in it (the latest version, after amendments). A pruned round's view
still shows its manifest; its applied reports, refusals and validation losses are gone.

Nothing the rules still read is pruned: votes, disputes and amendments concern the newest rounds,
standings a window of a few rounds (coordinator/rules/standing.py), a rewind goes back to a state a
returning peer holds (coordinator/recovery.py). Each run records how far it was pruned
(``runs.pruned_before``), and one pass prunes at most `ROUNDS_PER_PASS` rounds, so the first pass
over a long run that never pruned stays a short transaction; the tick runs a pass every
`PRUNE_INTERVAL_S`.
"""

from __future__ import annotations

from coordinator.rules.context import Context

DEFAULT_KEEP_ROUNDS = 1000  # coordinator/views.py HISTORY_LIMIT: the status page's history stays whole
ROUNDS_PER_PASS = 100
PRUNE_INTERVAL_S = 60.0


def prune(ctx: Context, run_id: str, keep_rounds: int) -> int:
    """Delete the per-peer rows of `run_id`'s rounds more than `keep_rounds` behind its current
    round, at most `ROUNDS_PER_PASS` of them; the number of rounds pruned. Call inside a
    transaction."""
    if keep_rounds <= 0:
        return 0
    run = ctx.run(run_id)
    end = min(run.current_round - keep_rounds, run.pruned_before + ROUNDS_PER_PASS)
    if end <= run.pruned_before:
        return 0
    ctx.storage.prune_rounds(run_id, run.pruned_before, end)
    ctx.storage.update_run(run_id, pruned_before=end)
    return end - run.pruned_before
