"""Runs: created by the operator with a config, closed by the operator or finished by the rules.

A run is ``waiting`` until round 0 opens (``membership.min_peers`` live peers), then ``running``;
it is ``finished`` once ``max_rounds`` rounds have closed (coordinator/rules/rounds.py), and
``closed`` when the operator closes it: its open round closes at once with what was submitted, the
round before it is settled (its votes are final, coordinator/rules/votes.py), and nobody can join
or submit any more. A run's config is stored redacted (no join tokens), with the sha256 of each
join token beside it; a config token written ``sha256:<hex>`` is already hashed. A config never
changes after the run is created.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from coordinator import errors
from coordinator.rules import picks, votes
from coordinator.rules.context import Context
from coordinator.rules.states import ACTIVE_STATES
from coordinator.storage import RunRow
from protocol.run_config import RunConfig


def hash_join_token(token: str) -> str:
    """Join tokens are stored as sha256 hex; 'sha256:<hex>' in a config is already hashed."""
    if token.startswith("sha256:"):
        digest = token.removeprefix("sha256:").lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise errors.InvalidConfig("a 'sha256:' join token needs 64 hex characters")
        return digest
    return hashlib.sha256(token.encode()).hexdigest()


def new_run(config: RunConfig, now: float) -> RunRow:
    """A run for `config`, waiting for its peers (``invalid_config`` when its join policy cannot
    admit anyone)."""
    if config.membership.join_policy == "token" and not config.membership.join_tokens:
        raise errors.InvalidConfig("membership.join_policy 'token' needs at least one join token")
    token_hashes = sorted({hash_join_token(t) for t in config.membership.join_tokens})
    return RunRow(
        run_id=f"run-{secrets.token_hex(5)}",
        name=config.name,
        config_json=config.redacted().model_dump_json(),
        join_token_hashes=json.dumps(token_hashes),
        state="waiting",
        created_at=now,
        closed_at=None,
        current_round=0,
    )


def close_run(ctx: Context, run: RunRow, now: float) -> None:
    """Stop a run: its open round closes now with what was submitted; nobody can join."""
    if run.state not in ACTIVE_STATES:
        return
    if run.state == "running":
        ctx.storage.update_round(run.run_id, run.current_round, closed_at=now)
        picks.pick(ctx.storage, run.run_id, run.current_round, ctx.config(run).outer.max_contributors)
        ctx.storage.mark_contributors(run.run_id, run.current_round)
        if run.current_round > 0:
            votes.count_votes(ctx, run.run_id, run.current_round - 1, settled=True)
        ctx.changed.add(run.run_id)
    ctx.storage.update_run(run.run_id, state="closed", closed_at=now)
