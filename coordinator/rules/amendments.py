"""Amended manifests: manifests can be amended, never forked (DESIGN.md, "Manifests can be amended,
never forked").

A closed round's manifest is version 1. A live member that cannot fetch some of its entries
reports them (`report_missing`): only entries of that round's manifest, never the reporter's own,
only for rounds closed at most ``MISSING_REPORT_ROUNDS`` before the open one (older packets are
forgotten by design: catch up instead), one report per reporter and entry (a repeat changes
nothing). An author that no longer holds its own packet (it restarted without it) says so with
``lost_own``, stored as a report of its entry whose reporter is the author itself. A contributor
of the round that reported applying it got every entry still undropped and serves its copies on;
a stranger's applied report is not believed; nor is a report whose reporter applied the round
with that packet since (it got the packet after all). A reported entry is dropped:

1. at once when no live contributor but the author and the entry's reporters applied the round,
   and either its author said it lost it or its author is not live (gone, left): nobody can serve
   that packet now, and nobody will. This holds however few peers are live, so a whole swarm
   killed after a round closed (its packets only in the dead nodes' memory) comes back and goes on.
   While the swarm restarts (the run paused or regrouping, coordinator/recovery.py), a gone
   author is waited for ``exchange.missing_grace_s`` from the entry's first report, by this rule
   and the next: it may be loading with its packet on disk (node/round/own_packets.py). In a chaos
   run every node was killed after a round closed; the first one back reported the others'
   packets, and an author back 4 s later with its packet found its entry dropped and itself
   flagged. So is an author not heard from since the coordinator resumed (its restart, or its
   database's failure: coordinator/rules/rounds.py, "Restart grace"), which may have gone down in
   the same outage: in another chaos run every node and the coordinator were killed while a round
   was open, the first node back reported an author's packet 1 s before the author came back with
   it, and the run had not paused (that node rejoined within the restart grace). An author that
   left is not waited for;
2. when every other live contributor of the round (the latest manifest's peers but its publisher)
   has reported it since its author's latest join (a report from before it restarted says nothing
   of the copy it serves now: in the chaos run above, the author's return let the coordinator drop
   its entry by this rule 0.15 s after it said it served its packet from disk). For an author back
   after the round closed, since ``missing_grace_s`` after that join: a fetch begun before it, at
   the addresses the manifest names (the author's old ones), may fail after it; in another chaos
   run a node killed after its round closed was back serving its packet from disk 1.2 s before
   a peer whose fetch had begun before it reported the packet missing, and rule 2 dropped it;
3. when ``exchange.missing_grace_s`` has passed since its first report and no contributor but its
   publisher and its reporters, live or not, applied the round. One that did got the packet: the
   fault is the reporters' links, and they catch up from a snapshot rather than take the packet
   from everyone (one peer that can fetch nothing must not empty every manifest).

No entry of round r is dropped once a later round with packets in its manifest was agreed: the
swarm trained on r's agreed state and went on from it, so a new version of r would rewrite the
history under that round (its start would no longer be r's result). A report for such a round is
refused (`round_too_old`: its reporter catches up from a snapshot) and reports already in wait
for nothing. An entry still undecided when its round falls out of the report window stays. A round older than
the window whose state nobody agreed since (no agreed digest at or after it: the swarm was down
for more rounds than the window) still takes reports: amending it is the only way on. Entries due
together make one new version: ``manifest_version`` + 1, the entries in ``dropped_entries`` with
the reason (which rule), and a new vote on the new version (coordinator/rules/votes.py; an emptied
round takes its start's digest). The empty rounds right after it, which had taken its old result
as theirs, lose that digest and take the new one once it is agreed.

Withheld flags. The publisher of a dropped entry is flagged (``withheld_round``): no round waits
for it while flagged (coordinator/rules/standing.py); it may still submit. The flag clears once
another peer votes on the latest manifest of a later round that holds a packet of its (the swarm
could fetch it again: `clear_withheld`). A flagged publisher whose packet of a later round is
dropped too is excluded for a few rounds, doubled at each repeat (protocol/scoring.py
`withheld_again`): flagged only, a node that submits every round and serves nobody cost every
other peer a stall time-out a round for the whole run. The drop rules are applied on reports, by the tick (so an
entry becomes due when its author times out or the grace ends) and by `advance`, also in finished
runs. Amendments never hold up opening or closing rounds.
"""

from __future__ import annotations

import json
import logging

from coordinator import errors, recovery, scoring
from coordinator.rules import votes
from coordinator.rules.context import Context
from coordinator.storage import AppliedRow, DroppedRow, MissingReportRow, RunRow
from protocol.http import MISSING_REPORT_ROUNDS, MissingRequest, MissingResponse

log = logging.getLogger("locoswarm.coordinator")


def report_missing(
    ctx: Context, run: RunRow, round_index: int, reporter_id: str, request: MissingRequest, now: float
) -> MissingResponse:
    """Record that a live member could not fetch these entries of closed round r; drop those now
    due."""
    run_id = run.run_id
    ctx.closed_round(run_id, round_index)
    if round_index < run.current_round - MISSING_REPORT_ROUNDS and _agreed_at_or_after(ctx, run_id, round_index):
        raise errors.RoundTooOld(
            f"round {round_index} closed over {MISSING_REPORT_ROUNDS} rounds ago (open: {run.current_round});"
            " its packets may be forgotten: catch up from a snapshot"
        )
    if (later := _built_upon(ctx, run_id, round_index)) is not None:
        raise errors.RoundTooOld(
            f"round {later} was agreed on round {round_index}'s manifest as it stands: its entries stay;"
            " catch up from a snapshot"
        )
    entries = {s.peer_id for s in ctx.storage.list_submissions(run_id, round_index)}  # version 1
    wanted = sorted(set(request.peer_ids))
    if reporter_id in wanted:
        raise errors.InvalidRequest("a peer cannot report its own packet missing (lost_own says it lost it)")
    strangers = [p for p in wanted if p not in entries]
    if strangers:
        raise errors.NotInManifest(f"round {round_index}'s manifest has no entry of {', '.join(strangers[:4])}")
    if request.lost_own and reporter_id not in entries:
        raise errors.NotInManifest(f"round {round_index}'s manifest has no entry of {reporter_id}")
    dropped = {d.peer_id for d in ctx.storage.list_dropped(run_id, round_index)}
    # A lost packet is reported by its own author: the row whose reporter is the entry itself.
    for entry in wanted + ([reporter_id] if request.lost_own else []):
        if entry not in dropped:
            ctx.storage.add_missing_report(MissingReportRow(run_id, round_index, entry, reporter_id, now))
    amend(ctx, run_id, round_index, now)
    round_row = ctx.closed_round(run_id, round_index)
    dropped_rows = ctx.storage.list_dropped(run_id, round_index)
    gone = {d.peer_id for d in dropped_rows}
    pending = {m.peer_id for m in ctx.storage.list_missing_reports(run_id, round_index)} - gone
    return MissingResponse(
        round=round_index,
        manifest_version=round_row.manifest_version,
        dropped={d.peer_id: d.reason for d in dropped_rows},
        pending=sorted(pending),
    )


def pending_rounds(ctx: Context, run_id: str | None = None) -> list[tuple[str, int]]:
    """(run, round) pairs with an entry reported missing and not dropped yet, within the report
    window (of one run, or of all runs)."""
    return ctx.storage.rounds_with_pending_reports(MISSING_REPORT_ROUNDS, run_id)


def amend(ctx: Context, run_id: str, round_index: int, now: float) -> None:
    """Drop the entries of closed round r that are due; all of them in one new version."""
    run = ctx.run(run_id)
    round_row = ctx.storage.get_round(run_id, round_index)
    if round_row is None or round_row.closed_at is None or _built_upon(ctx, run_id, round_index) is not None:
        return
    grace_s = ctx.config(run).exchange.missing_grace_s
    submitters = {s.peer_id for s in ctx.storage.list_submissions(run_id, round_index)}
    manifest = sorted(ctx.storage.manifest_peers(run_id, round_index))
    peers = {p.peer_id: p for p in ctx.storage.list_peers(run_id)}
    live = {p for p, row in peers.items() if row.status == "live"}
    restarting = recovery.restarting(ctx.storage, run)
    # Every version so far held each entry still undropped: whoever applied one got its packet.
    # Only the round's contributors are believed: a stranger's report must not keep an entry
    # nobody serves.
    applied = [a for a in ctx.storage.list_applied(run_id, round_index) if a.peer_id in submitters]
    appliers = {a.peer_id for a in applied}
    reports: dict[str, list[MissingReportRow]] = {}
    for report in ctx.storage.list_missing_reports(run_id, round_index):
        if report.reporter_id == report.peer_id or not _fetched_since(applied, report):
            reports.setdefault(report.peer_id, []).append(report)
    due: dict[str, str] = {}
    for entry, rows in reports.items():
        if entry not in manifest:
            continue
        reporters = {r.reporter_id for r in rows}
        author = peers.get(entry)
        status = author.status if author is not None else "unknown"
        # An author back after the round closed (a restart) serves its copy from its join on, and a
        # fetch begun before that may fail after it: such reports wait out the grace from the join.
        back = author is not None and author.joined_at > round_row.closed_at
        counted_from = (author.joined_at + (grace_s if back else 0.0)) if author is not None else -1.0
        since_join = {r.reporter_id for r in rows if r.reported_at >= counted_from}
        others = {p for p in manifest if p != entry and p in live}
        waited_s = now - min(r.reported_at for r in rows)
        # Rule 1: nobody can serve it. A live applier that did not report it holds a copy.
        copies = (appliers & live) - reporters - {entry}
        if entry in reporters and not copies:  # the author's own report: lost_own
            due[entry] = (
                "its author said it lost the packet (restarted without it) and no live peer that "
                "applied the round serves a copy"
            )
        elif status == "gone" and waited_s < grace_s and (restarting or author.last_seen_at < ctx.resumed_at):
            continue  # it may be loading, its packet on disk: rules 1 and 2 wait for it
        elif entry not in live and not copies:
            due[entry] = (
                f"reported missing; its author is not live ({status}) and no live peer that applied"
                " the round serves a copy"
            )
        elif others and others <= since_join:
            due[entry] = f"reported missing by all {len(others)} other live contributors"
        elif waited_s >= grace_s and not appliers - reporters - {entry}:
            due[entry] = (
                f"reported missing by {len(reporters)} peer(s) and not served for"
                f" {waited_s:.0f} s (missing_grace_s {grace_s:g} s)"
            )
    if not due:
        return
    version = round_row.manifest_version + 1
    for entry, reason in sorted(due.items()):
        ctx.storage.insert_dropped(DroppedRow(run_id, round_index, entry, reason, version, now))
        peer = ctx.storage.get_peer(run_id, entry)
        if peer is not None and (peer.withheld_round is None or peer.withheld_round < round_index):
            if peer.withheld_round is not None:  # flagged still: no packet of its reached anyone since
                scoring.exclude_for_withholding(ctx.storage, run_id, peer, round_index)
            ctx.storage.update_peer(run_id, entry, withheld_round=round_index)
        ctx.storage.refresh_last_contributed(run_id, entry)
    # A new version is a new vote: no report can name it yet.
    ctx.storage.update_round(
        run_id, round_index, manifest_version=version, majority_digest=None, agreed_digest=None, num_votes=0
    )
    votes.forget_empty_after(ctx, run_id, round_index)  # they carried its old result as theirs
    votes.agree_empty_from(ctx, run_id, round_index)
    log.warning(
        "run %s round %d: manifest version %d drops %s",
        run_id,
        round_index,
        version,
        "; ".join(f"{entry}: {reason}" for entry, reason in sorted(due.items())),
    )
    ctx.changed.add(run_id)


def clear_withheld(ctx: Context, run_id: str, round_index: int, reporter_id: str) -> None:
    """`reporter_id` voted on round r's latest manifest: the publishers in it that were flagged for
    an earlier round got a packet through, and are waited for again."""
    flagged = {
        p.peer_id: p
        for p in ctx.storage.list_peers(run_id)
        if p.withheld_round is not None and p.withheld_round < round_index and p.peer_id != reporter_id
    }
    if not flagged:
        return
    for peer_id in sorted(ctx.storage.manifest_peers(run_id, round_index) & set(flagged)):
        ctx.storage.update_peer(run_id, peer_id, withheld_round=None)
        log.info(
            "run %s: %s's packet of round %d was applied by %s; it is waited for again",
            run_id,
            peer_id,
            round_index,
            reporter_id,
        )


def _agreed_at_or_after(ctx: Context, run_id: str, round_index: int) -> bool:
    """Whether the swarm agreed a state at or after round r, so a peer catches up past it from a
    snapshot. While it has not (every round since closed with nobody applying: a swarm down for
    more than MISSING_REPORT_ROUNDS deadlines, back before its heartbeat time-out), round r's
    missing entries are still taken, however old: amending r is the only way on."""
    latest = ctx.storage.latest_agreed_round(run_id)
    return latest is not None and latest.round >= round_index


def _built_upon(ctx: Context, run_id: str, round_index: int) -> int | None:
    """The first round after r with packets in its manifest and an agreed digest: the swarm went on
    from r's agreed state (None: no such round, and r may still be amended)."""
    latest = ctx.storage.latest_agreed_round(run_id)
    if latest is None or latest.round <= round_index:
        return None
    for later in range(round_index + 1, latest.round + 1):
        row = ctx.storage.get_round(run_id, later)
        if row is not None and row.agreed_digest is not None and ctx.storage.manifest_peers(run_id, later):
            return later
    return None


def _fetched_since(applied: list[AppliedRow], report: MissingReportRow) -> bool:
    """Whether the report's reporter applied the round with the reported packet after it reported
    it (an entry is in every version until it is dropped; `refused` names what it left out)."""
    return any(
        a.peer_id == report.reporter_id
        and a.reported_at > report.reported_at
        and report.peer_id not in json.loads(a.refused or "{}")
        for a in applied
    )
