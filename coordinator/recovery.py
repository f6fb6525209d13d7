"""Whole-swarm restart: a run that every peer has left waits for its state instead of running on empty.

The coordinator holds no tensors: the run's state lives on the peers' disks (their checkpoints).
When the last live peer of a running run is gone (all stopped at night, a power cut, a crash),
closing rounds at their deadlines would only spin through empty rounds and, with ``max_rounds``,
finish a run nobody trained. Instead:

- **Paused.** With no live peer the run is paused (``paused_since``): the open round keeps no
  deadline and nothing closes. The last closed round's votes are final from then on (nobody is left
  to cast another), so its digest is agreed as when the next round closes. So are the votes of
  peers that return and apply it during the pause, a version amended meanwhile included
  (coordinator/rules/votes.py `is_settled`).
- **Waiting for state.** A returning peer says at join which round start it holds and its digest
  (its newest checkpoint; `protocol.http.JoinRequest.state_round`), and each applied report since
  (after applying round r it holds r + 1's start: a peer that replays the last closed round, its
  packets kept on the authors' disks, brings the open round's start back itself). The run needs the agreed
  start of its open round r: the majority digest of round r - 1, or the seeded initialisation
  for r = 0 and for a round that only empty rounds came before (every peer stopped before anyone
  submitted, so round 0 closed empty: no vote ever agrees on the seeded start, and every peer
  holds it). As soon as a live peer holds it, the open round starts afresh (a new deadline from
  now, with a heartbeat time-out added for the peer's start) and that peer trains it at once; peers with older or no state catch up from it by snapshot.
- **Rewind to the newest state held.** When no live peer holds the open round's start, the
  coordinator waits ``membership.state_wait_s`` from the first return for a peer that does. Then
  it takes the newest agreed state a live peer holds, round s < r, and reopens the run at round s:
  the rounds s..r-1, whose results nobody kept, are removed and recorded in the run's rewinds
  (from, to, when, why). An agreed state older than one a live peer holds is never chosen; round
  0 is chosen only when no round was ever agreed (nothing agreed is lost). While live peers hold
  no agreed state at all, the run keeps waiting, and the status says which peers last applied the
  state it needs (whoever holds their disks can bring it back).
- **Regrouping.** A round reopened by a resume or a rewind closes early only once every
  peer of the last closed round's manifest is back (live; then the usual rules say whether the
  round waits for it); else at its deadline (a round's time-out and a heartbeat time-out from
  the reopening). The peers of a swarm that stopped come back one by one: the first one back
  would otherwise close a round alone every few seconds while the others still load, finish a
  bounded run before they return, and leave with the only copies of its packets. One round's
  deadline is what a peer that never returns costs.
- **The packet mirror holds state too.** With snapshots in the packet mirror
  (coordinator/rules/snapshots.py), the newest agreed snapshot there counts as a held state like a
  live peer's (`STORE` among the holders), once any peer is live to load it: when it is the open
  round's start the run resumes at once and waits for every live peer (each loads it from the
  store); when it is older, the peers load it and replay the rounds since from the packets in the
  store, and the first that reports applying the last closed round resumes the run, before
  ``state_wait_s`` sends it back to that older start.

`hold` is called from `coordinator.rules.rounds.advance` inside the service's transaction, for a
running run, after the liveness sweep; it returns True while the run is paused, and the caller
then leaves the open round alone. `view` is the read side for the status JSON, the page and `locoswarm status`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.storage import PeerRow, RoundRow, RunRow, Storage
from protocol.http import MISSING_REPORT_ROUNDS, HeldState, Recovery, Rewind
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

STORE = "the packet mirror"  # among a plan's holders: the newest agreed snapshot in the run's store


@dataclass(frozen=True, slots=True)
class _Plan:
    round: int  # where the run goes on: the open round, or an older one to rewind to
    holders: list[str]  # live peers that hold that round's start


def agreed_start(storage: Storage, run_id: str, round_index: int) -> str | None:
    """The agreed digest of the parameters that start `round_index` (None for round 0, whose start is
    the seeded initialisation every peer makes, or when round r - 1 has no agreed digest)."""
    if round_index == 0:
        return None
    previous = storage.get_round(run_id, round_index - 1)
    return previous.agreed_digest if previous is not None else None


def holds(storage: Storage, run_id: str, peer: PeerRow) -> bool:
    """Whether the state `peer` said it holds at join is an agreed round start of the run."""
    if peer.state_round is None or peer.state_digest is None or peer.state_round < 1:
        return False
    return agreed_start(storage, run_id, peer.state_round) == peer.state_digest


def hold(
    storage: Storage,
    run: RunRow,
    config: RunConfig,
    now: float,
    round_timeout_s: Callable[[int], float],
    settle: Callable[[int], None],
) -> bool:
    """Pause, keep waiting, resume or rewind a running run (see the module docstring); True while
    it stays paused. `round_timeout_s(r)` is the deadline policy's timeout for round r;
    `settle(r)` counts closed round r's votes as final (the service's vote count)."""
    if run.paused_since is None and storage.count_live_peers(run.run_id):
        return False  # the common case, on every request of every peer: one count, no peer list
    live = [p for p in storage.list_peers(run.run_id) if p.status == "live"]
    if run.paused_since is None:
        if run.current_round > 0:
            # Nobody is left to vote on the last closed round: its votes are all in, as when the next
            # round closes. So a lone contributor's digest is agreed and its checkpoint can restart the run.
            settle(run.current_round - 1)
        storage.update_run(run.run_id, paused_since=now, state_wait_since=None)
        log.warning(
            "run %s paused at round %d: no live peer (it waits for its state to come back)",
            run.run_id,
            run.current_round,
        )
        return True
    if not live:
        if run.state_wait_since is not None:  # whoever returned left again: wait afresh
            storage.update_run(run.run_id, state_wait_since=None)
        return True
    plan = _plan(storage, run, live)
    wait_since = run.state_wait_since if run.state_wait_since is not None else now
    if plan is not None and (plan.round == run.current_round or now - wait_since >= config.membership.state_wait_s):
        # A heartbeat time-out more than a round's: the peer that resumed the run has only joined, and
        # still loads its checkpoint (10 s for tiny on 2 busy cores, where the round's 12 s ran out
        # and it closed empty). Every waited-for peer in, the round closes as early as ever.
        _reopen(
            storage, run, config, now, plan, live, round_timeout_s(plan.round) + config.membership.heartbeat_timeout_s
        )
        return False
    if run.state_wait_since is None:
        storage.update_run(run.run_id, state_wait_since=now)
    return True


def restarting(storage: Storage, run: RunRow) -> bool:
    """Whether the swarm is coming back: the run is paused, or its open round still regroups."""
    if run.paused_since is not None:
        return True
    open_round = storage.get_round(run.run_id, run.current_round)
    return open_round is not None and regrouping(storage, run.run_id, open_round)


def regrouping(storage: Storage, run_id: str, open_round: RoundRow) -> bool:
    """Whether open round r, reopened by a resume or a rewind, still waits for a peer of round
    r - 1's manifest to come back (see "Regrouping" above). A round the previous one's close
    opened has that close's time as its opening; a reopened one opened later."""
    previous = storage.get_round(run_id, open_round.round - 1) if open_round.round > 0 else None
    if previous is None or previous.closed_at is None or open_round.opened_at <= previous.closed_at:
        return False
    live = {p.peer_id for p in storage.list_peers(run_id) if p.status == "live"}
    return not storage.manifest_peers(run_id, previous.round) <= live


def _plan(storage: Storage, run: RunRow, live: list[PeerRow]) -> _Plan | None:
    """The newest agreed round start a live peer holds (the open round's when anyone holds it)."""
    if _seeded_start(storage, run.run_id, run.current_round):
        return _Plan(run.current_round, [p.peer_id for p in live])
    held: dict[int, list[str]] = {}
    for peer in live:
        if holds(storage, run.run_id, peer) and peer.state_round <= run.current_round:
            held.setdefault(peer.state_round, []).append(peer.peer_id)
    stored = storage.newest_mirrored_snapshot(run.run_id)
    if stored is not None and stored.round + 1 <= run.current_round:
        held.setdefault(stored.round + 1, []).append(STORE)
    if held:
        newest = max(held)
        return _Plan(newest, sorted(held[newest]))
    if storage.latest_agreed_round(run.run_id) is None:  # nothing was ever agreed: nothing to lose
        return _Plan(0, [p.peer_id for p in live])
    return None


def _seeded_start(storage: Storage, run_id: str, round_index: int) -> bool:
    """Whether round r starts from the seeded initialisation every peer makes: every round before
    it closed with an empty manifest, so nothing was trained in (and no vote could agree on the
    digest of that start, `agreed_start`). Every returning peer holds it."""
    if round_index == 0:
        return True
    if storage.latest_agreed_round(run_id) is not None:  # an empty round's digest is agreed only after a trained one
        return False
    return not any(storage.manifest_peers(run_id, r) for r in range(round_index))


def _reopen(
    storage: Storage, run: RunRow, config: RunConfig, now: float, plan: _Plan, live: list[PeerRow], timeout_s: float
) -> None:
    """Open round `plan.round` afresh: the open round itself (whatever was submitted to it came from
    peers that are gone, their packets with them), or an older one, the rounds since removed."""
    storage.delete_rounds_from(run.run_id, plan.round)
    storage.insert_round(RoundRow(run.run_id, plan.round, now, now + timeout_s, None, None))
    fields: dict = {"current_round": plan.round, "paused_since": None, "state_wait_since": None}
    if plan.round < run.current_round:
        reason = (
            f"no live peer held the start of round {run.current_round} after waiting "
            f"{config.membership.state_wait_s:g} s; {', '.join(plan.holders)} held round {plan.round}'s"
        )
        fields["rewinds"] = json.dumps(
            json.loads(run.rewinds or "[]")
            + [{"at": now, "from_round": run.current_round, "to_round": plan.round, "reason": reason}]
        )
        log.warning(
            "run %s rewound from round %d to %d: rounds %d-%d are lost (%s)",
            run.run_id,
            run.current_round,
            plan.round,
            plan.round,
            run.current_round - 1,
            reason,
        )
    else:
        log.warning("run %s resumed at round %d: %s hold(s) its start", run.run_id, plan.round, ", ".join(plan.holders))
    storage.update_run(run.run_id, **fields)
    # The holders train the round at once, so it waits for them, and so for the peers that hold an
    # agreed state at most MISSING_REPORT_ROUNDS older: they replay up to it from the packets their
    # authors kept, a moment behind (after a whole swarm restarted, the first replay to report
    # resumes the run; the others must not find it closed on that one packet). The others catch up
    # by snapshot and are expected from the next round. The deadline bounds the wait either way.
    for peer in live:
        replays = holds(storage, run.run_id, peer) and plan.round - peer.state_round <= MISSING_REPORT_ROUNDS
        expected = peer.peer_id in plan.holders or replays or STORE in plan.holders  # the store: all load it
        storage.update_peer(run.run_id, peer.peer_id, member_since_round=plan.round + (0 if expected else 1))


def view(
    storage: Storage, run: RunRow, config: RunConfig, now: float, peers: list[PeerRow] | None = None
) -> Recovery | None:
    """What a paused run waits for, for the status JSON (None while it is not paused); `peers`: the
    run's peers where the caller has read them already."""
    if run.paused_since is None or run.state != "running":
        return None
    peers = storage.list_peers(run.run_id) if peers is None else peers
    live = [p for p in peers if p.status == "live"]
    needed = agreed_start(storage, run.run_id, run.current_round)
    held = [HeldState(peer_id=p.peer_id, state_round=p.state_round, agreed=holds(storage, run.run_id, p)) for p in live]
    plan = _plan(storage, run, live) if live else None
    last_holders = _last_holders(storage, run.run_id, run.current_round, needed) if needed is not None else []
    rewind_at = (
        run.state_wait_since + config.membership.state_wait_s
        if run.state_wait_since is not None and plan is not None
        else None
    )
    if not live:
        message = (
            f"every peer has stopped; the run is paused at round {run.current_round} and goes on when a peer "
            f"holding its start returns" + (f" (last applied by {', '.join(last_holders[:4])})" if last_holders else "")
        )
    elif plan is None:
        message = (
            f"waiting for state: no live peer holds an agreed round start; round {run.current_round}'s "
            f"start was last applied by {', '.join(last_holders[:4]) or 'nobody reported'}"
        )
    else:
        message = (
            f"waiting for state: the newest held is round {plan.round}'s start "
            f"({', '.join(plan.holders[:4])}); the run goes back to it unless a peer holding round "
            f"{run.current_round}'s start returns"
        )
    return Recovery(
        paused_since=run.paused_since,
        waiting_since=run.state_wait_since,
        round=run.current_round,
        needed_digest=needed,
        newest_held_round=plan.round if plan is not None else None,
        rewind_at=rewind_at,
        held=held,
        last_holders=last_holders,
        message=message,
    )


def _last_holders(storage: Storage, run_id: str, round_index: int, needed: str) -> list[str]:
    """Who applied the state that starts `round_index` last: their checkpoints may hold it. Empty
    rounds just before it end on the same state (they change no parameter), so those who applied
    the rounds back to the last one with packets hold it too; nobody may have applied an empty
    round (it closed while every peer was down)."""
    holders: set[str] = set()
    r = round_index - 1
    while (row := storage.get_round(run_id, r)) is not None and row.agreed_digest == needed:
        holders |= {a.peer_id for a in storage.list_applied(run_id, r) if a.params_digest == needed}
        if storage.manifest_peers(run_id, r, row.manifest_version):
            break  # the round that made this state
        r -= 1
    return sorted(holders)


def rewinds(run: RunRow) -> list[Rewind]:
    return [Rewind(**r) for r in json.loads(run.rewinds or "[]")]
