"""Membership: joining, the proof of work, heartbeats, liveness and leaving.

- Joining (coordinator/join_guard.py). A key new to the run is rate-limited per source address and
  per run (``membership.join_rate_*``, ``join_burst*``: 429 ``rate_limited`` with Retry-After), then
  checked against the join policy (``open``, or ``token``: a join token whose sha256 the run
  stores) and, with ``membership.join_pow_bits``, a proof of work whose salt is derived per period
  from a per-run secret (`join_challenge`; the secret is made on first need). A member rejoins
  without rate limit or proof. A run that is not waiting or running refuses joins (``run_closed``).
- A new member is expected from the round after the open one (it cannot have the open round's
  start in time), unless it says it holds exactly the agreed start of the open round (its own
  checkpoint: ``state_round`` and ``state_digest``). Peer ids derive from keys; a new key gets the
  next peer index, and its data shard follows from it.
- Liveness. Any signed call counts as a sign of life (`require_live_member`). A live peer silent
  for longer than its silence limit is marked gone, with the reason; its silence counts from
  max(its last sign of life, the service's ``resumed_at``: coordinator/rules/rounds.py, "Restart
  grace"). A gone or departed peer rejoins with its key and keeps its id, index and data shard; it
  is expected from the next round on.
- Heartbeat period. Requests per second stay bounded however big the swarm: with N live peers the
  period is max(``heartbeat_timeout_s`` / 4, N / ``membership.max_heartbeats_per_s``), told at join
  and in every heartbeat answer, and stored per peer. A peer's silence limit is the longer of
  ``heartbeat_timeout_s`` and four of the periods it was last told, so a swarm that shrinks (and
  tells shorter periods) never marks gone a peer still beating at the longer period it was told.
- Heartbeats say what a peer is doing (its activity, round, inner step, loss, bandwidth, addresses,
  what it is stuck on) and are answered with the run's state, the open round's deadline and the
  period until its next heartbeat.
- Connection reversal. A member nobody can dial (``reachable`` false) may hold the only copies of
  a parameter snapshot, which a joiner cannot fetch from it. The answer to such a member's
  heartbeat lists (``dial_peers``) the listen addresses of at most ``MAX_DIAL_PEERS`` live members
  whose latest heartbeat, within two of their periods, said ``loading_snapshot`` and that no
  dial-back found undialable, most recently seen first; it dials them, and their snapshot fetches
  open streams over its connections. Nothing is stored for it: the activity is the heartbeat's,
  so any replica answers the same. Two members nobody can dial cannot meet this way (neither can
  open the connection); a relay (``--relay-via``) or the packet mirror serves them.
- Leaving marks the peer ``left``; the round may then close early (every peer it still waits for
  submitted), which the service applies after the leave.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from coordinator import errors
from coordinator.join_guard import JoinGuard, check_proof, period_of, salt_of
from coordinator.rules.context import Context
from coordinator.rules.states import ACTIVE_STATES
from coordinator.storage import PeerRow, RunRow
from protocol.http import (
    LOADING_SNAPSHOT,
    MAX_DIAL_PEERS,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinChallenge,
    JoinRequest,
    LeaveRequest,
    LeaveResponse,
)
from protocol.join_pow import JOIN_POW_PERIOD_S
from protocol.run_config import RunConfig


def join(
    ctx: Context,
    run: RunRow,
    peer_id: str,
    request: JoinRequest,
    source: str | None,
    guard: JoinGuard,
    now: float,
    reachable: bool | None = None,
) -> None:
    """Admit `peer_id` to `run` as a new member, or take a member back; `source` is the caller's
    address, for the rate limit of new keys; `reachable`, what the dial-back to it found
    (coordinator/reachability.py), unless the node says nobody can dial it."""
    if request.reachable is False:
        reachable = False
    run_id = run.run_id
    if run.state not in ACTIVE_STATES:
        raise errors.RunClosed(f"run {run_id} is {run.state}")
    existing = ctx.storage.get_peer(run_id, peer_id)
    membership = ctx.config(run).membership
    if existing is None:  # a new key pays its way in; members rejoin freely
        guard.admit(run_id, membership, source, now)
    _check_join_token(ctx.config(run), run, request.join_token)
    if existing is None and membership.join_pow_bits:
        check_proof(
            _join_secret(ctx, run),
            run_id,
            request.public_key,
            membership.join_pow_bits,
            request.pow_salt,
            request.pow_nonce,
            now,
        )
    first_round = run.current_round + (1 if run.state == "running" else 0)
    if run.state == "running" and _holds_open_round_start(ctx, run, request):
        first_round = run.current_round
    addrs = json.dumps(request.listen_multiaddrs)
    if existing is None:
        ctx.storage.insert_peer(
            PeerRow(
                run_id=run_id,
                peer_id=peer_id,
                public_key=request.public_key,
                peer_index=ctx.storage.next_peer_index(run_id),
                status="live",
                reason=None,
                activity="joining",
                device=request.device,
                listen_multiaddrs=addrs,
                bandwidth_mbps=request.bandwidth_mbps,
                last_loss=None,
                joined_at=now,
                last_seen_at=now,
                member_since_round=first_round,
                progress_round=None,
                uplink_mbps=request.uplink_mbps,
                state_round=request.state_round,
                state_digest=request.state_digest,
                reachable=reachable,
            )
        )
        ctx.members_changed(run_id)
        return
    rejoining = existing.status != "live"
    ctx.storage.update_peer(
        run_id,
        peer_id,
        status="live",
        reason=None,
        activity="joining",
        device=request.device,
        listen_multiaddrs=addrs,
        bandwidth_mbps=request.bandwidth_mbps,
        uplink_mbps=request.uplink_mbps,
        joined_at=now,
        last_seen_at=now,
        member_since_round=first_round if rejoining else existing.member_since_round,
        state_round=request.state_round,
        state_digest=request.state_digest,
        reachable=reachable,
    )
    ctx.members_changed(run_id)


def join_challenge(ctx: Context, run: RunRow, now: float) -> JoinChallenge:
    """The proof of work a new key solves before it joins (protocol/join_pow.py); bits 0 and an
    empty salt when the run asks for none."""
    bits = ctx.config(run).membership.join_pow_bits
    secret = _join_secret(ctx, run) if bits else ""
    period = period_of(now)
    return JoinChallenge(
        run_id=run.run_id,
        bits=bits,
        salt=salt_of(secret, run.run_id, period) if bits else "",
        expires_at=(period + 2) * JOIN_POW_PERIOD_S,
    )


def _join_secret(ctx: Context, run: RunRow) -> str:
    """The run's secret for proof-of-work salts, made on first need (runs stored before it have none)."""
    if run.join_secret:
        return run.join_secret
    secret = secrets.token_hex(32)
    ctx.storage.update_run(run.run_id, join_secret=secret)
    run.join_secret = secret
    return secret


def _check_join_token(config: RunConfig, run: RunRow, token: str | None) -> None:
    if config.membership.join_policy == "open":
        return
    if token is None:
        raise errors.JoinRefused("this run needs a join token")
    if hashlib.sha256(token.encode()).hexdigest() not in json.loads(run.join_token_hashes):
        raise errors.JoinRefused("the join token is not valid for this run")


def _holds_open_round_start(ctx: Context, run: RunRow, request: JoinRequest) -> bool:
    """Whether a joining peer's stated state is the agreed start of the run's open round."""
    if request.state_round is None or request.state_round != run.current_round:
        return False
    previous = ctx.storage.get_round(run.run_id, run.current_round - 1)
    return previous is not None and previous.agreed_digest == request.state_digest


def require_live_member(ctx: Context, run_id: str, peer_id: str, now: float) -> PeerRow:
    """The caller's membership (``not_member``, ``peer_gone``); the call counts as a sign of life."""
    peer = ctx.storage.get_peer(run_id, peer_id)
    if peer is None:
        raise errors.NotMember(f"peer {peer_id} has not joined run {run_id}")
    if peer.status != "live":
        raise errors.PeerGone(f"peer {peer_id} is {peer.status} ({peer.reason}); rejoin")
    ctx.storage.update_peer(run_id, peer_id, last_seen_at=now)
    return peer


def heartbeat_period_s(config: RunConfig, num_live: int) -> float:
    """Seconds between a peer's heartbeats in a run of `num_live` live peers: four beats per
    timeout (one lost request never costs a peer its membership), stretched so that all of them
    together send at most ``max_heartbeats_per_s``."""
    membership = config.membership
    return max(membership.heartbeat_timeout_s / 4, num_live / membership.max_heartbeats_per_s)


def silence_limit_s(config: RunConfig, peer: PeerRow) -> float:
    """How long `peer` may be silent before it is marked gone: the timeout, or four of the
    heartbeat periods it was last told, whichever is longer."""
    return max(config.membership.heartbeat_timeout_s, 4 * (peer.heartbeat_period_s or 0.0))


def tell_period(ctx: Context, run_id: str, peer_id: str, config: RunConfig, now: float) -> float:
    """The heartbeat period for `peer_id` now, stored as the one it was told."""
    period_s = heartbeat_period_s(config, ctx.live_peers(run_id, now))
    ctx.storage.update_peer(run_id, peer_id, heartbeat_period_s=period_s)
    return period_s


def mark_silent_gone(ctx: Context, run: RunRow, config: RunConfig, now: float) -> None:
    """Mark gone the live peers silent past their silence limit, counted from `ctx.resumed_at` at
    the earliest."""
    timeout_s = config.membership.heartbeat_timeout_s
    # Every request runs this: only the candidates are read, not every peer of the run (a
    # millisecond of slack so float rounding never hides one; the exact test below decides).
    cutoff = now - timeout_s + 1e-3
    if ctx.resumed_at >= cutoff:
        return
    for peer in ctx.storage.silent_live_peers(run.run_id, cutoff, now + 1e-3):
        silent_s = now - max(peer.last_seen_at, ctx.resumed_at)
        limit_s = silence_limit_s(config, peer)
        if peer.status == "live" and silent_s > limit_s:
            since = " since the coordinator resumed" if peer.last_seen_at < ctx.resumed_at else ""
            limit = f"timeout {timeout_s:g} s" if limit_s == timeout_s else f"4 heartbeat periods: {limit_s:g} s"
            ctx.storage.update_peer(
                run.run_id, peer.peer_id, status="gone", reason=f"no heartbeat for {silent_s:.0f} s{since} ({limit})"
            )
            ctx.members_changed(run.run_id)


def heartbeat(ctx: Context, run_id: str, peer_id: str, request: HeartbeatRequest, now: float) -> HeartbeatResponse:
    """Record what a live member says it is doing; answer with the run's state, the open round,
    its heartbeat period (stored with the rest, in one write) and, to a member nobody can dial,
    the members loading a snapshot that it should dial (`dial_peers`)."""
    member = require_live_member(ctx, run_id, peer_id, now)
    run = ctx.run(run_id)
    period_s = heartbeat_period_s(ctx.config(run), ctx.live_peers(run_id, now))
    # inner_step always: a step count left from an older round would read as progress in this one.
    fields: dict = {
        "heartbeat_period_s": period_s,
        "activity": request.state,
        "progress_round": request.round,
        "inner_step": request.inner_step,
        "detail": request.detail,
    }
    if request.bandwidth_mbps is not None:
        fields["bandwidth_mbps"] = request.bandwidth_mbps
    if request.train_loss is not None:
        fields["last_loss"] = request.train_loss
    if request.listen_multiaddrs is not None:
        fields["listen_multiaddrs"] = json.dumps(request.listen_multiaddrs)
    ctx.storage.update_peer(run_id, peer_id, **fields)
    round_row = ctx.storage.get_round(run_id, run.current_round)
    round_state = "pending" if round_row is None else ("closed" if round_row.closed_at is not None else "open")
    return HeartbeatResponse(
        run_state=run.state,
        current_round=run.current_round,
        round_state=round_state,
        deadline=round_row.deadline if round_row else None,
        heartbeat_interval_s=period_s,
        dial_peers=_loaders_to_dial(ctx, run_id, peer_id, now) if _undialable(member) else None,
    )


def _undialable(peer: PeerRow) -> bool:
    """Whether a dial-back found nobody can dial `peer` (stored as 0; None: not known)."""
    return peer.reachable is not None and not peer.reachable


def _loaders_to_dial(ctx: Context, run_id: str, peer_id: str, now: float) -> list[list[str]] | None:
    """The listen addresses of the dialable members loading a snapshot now (module docstring,
    "Connection reversal"); None when there are none."""
    loaders = ctx.storage.dialable_peers_doing(run_id, LOADING_SNAPSHOT, now, peer_id, MAX_DIAL_PEERS)
    dial = [addrs for addrs in (json.loads(p.listen_multiaddrs) for p in loaders) if addrs]
    return dial or None


def leave(ctx: Context, run_id: str, peer_id: str, request: LeaveRequest, now: float) -> LeaveResponse:
    require_live_member(ctx, run_id, peer_id, now)
    ctx.storage.update_peer(run_id, peer_id, status="left", reason=f"left: {request.reason}", activity="left")
    ctx.members_changed(run_id)
    return LeaveResponse(peer_id=peer_id, status="left")
