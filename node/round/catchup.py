"""Catching up: bringing a node's parameters to the start of the coordinator's open round.

A node falls behind when it joins a running run, misses a round's deadline, cannot fetch a
manifest packet, or was paused. Closed rounds whose packets are still served are replayed (fetch
the manifest, as amended so far, and apply it: exact, and cheap); otherwise the newest parameter
snapshot whose digest the coordinator agreed on is fetched from peers and checked. Only agreed
digests are trusted, never a provisional majority (coordinator/service.py, "Agreed digests"): keys
that never trained cannot make a node refuse the swarm's parameters. While closed rounds that had
contributors have no agreed digest yet, the node waits for one (the next round's close settles
them). A replay asks the exchange first who holds the round's packets: when no peer announces
some packet (forgotten, or its publisher gone), it goes to a snapshot at once instead of waiting
out a fetch time-out, and it never reports packets missing (that is for the peers applying the
round as it happens). Error feedback restarts at zero after a snapshot (the update it held is
lost, not sent twice).

Packets nobody serves (DESIGN.md, "A submitted packet is durable until its round is final"): a
whole swarm stopped after a round closed comes back with that round's manifest and its packets
only on the disks of the nodes that kept them (node/round/own_packets.py), served again as each
restarts. A replay that finds entries nobody serves (`PacketsGone`) does not wait in silence: it
reports its own entry lost at once when it no longer holds its packet, an author's entry missing at
once when the coordinator says the author is gone, and any other entry once it has waited
`missing_after_s` for its live author to serve it; the coordinator drops such entries in a new
manifest version (coordinator/service.py, "Amended manifests") and the replay goes on with it.
Meanwhile the node's heartbeats say "stuck" with one line naming the round, what it waits for and
from whom (the status page shows it as the run's "stuck: ..."), logged once per change.

The packet mirror (the run's exchange.mirror) keeps the agreed snapshot every few rounds
(`RunStatus.snapshot_mirror`): its round is a candidate like the agreed rounds peers may hold,
and `load_snapshot` reads it from the store when no peer serves that snapshot (none announce
it, or every one failed), so a swarm whose every node died still has a start to replay from.

A run that ended while the node was behind (DESIGN.md, "A node behind a finished run says so
and stops"): once the run is finished or closed and no other peer is live, nobody is left to serve
a packet or a snapshot, and nobody will come back to; nor is a live peer that is catching up
itself (two nodes behind each waited for the other, a chaos run). With nothing to replay or load then,
`catch_up` raises `RunEnded` instead of polling for ever; the round loop logs it and the node
leaves. Without a packet mirror it does so before it tries anything: each try of a peer that is
gone lasts the fetch time-out, and a chaos run's node, paused while the others finished, spent 8
minutes on them (a replay and three snapshots a pass, from a status read before them). A try
under way when the last peer leaves is cancelled within ENDED_CHECK_S: the run's status is looked
at that often while it runs (`_unless_run_ends`). While the run still runs, or a peer is live, it
waits as below (a whole swarm restarting comes back one node at a time).

Only a snapshot newer than the parameters held is loaded: when the round after a loaded snapshot
cannot be replayed yet (its packets gone, its successor's digest not agreed yet), loading the same
snapshot again changes nothing, and the node waits instead, polling the coordinator at growing
intervals (IDLE_FIRST_S doubling to IDLE_MAX_S, from the first again once the open round or the
newest agreed digest moves) until a replay or a newer snapshot can go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar

from node.exchange import mirror
from node.round import resume
from node.round.coordinator_client import CoordinatorCallFailed, Refused
from node.round.reports import CatchUpReport, RoundTimes
from node.round.session import Session
from node.round.snapshots import serve_snapshot
from node.round.state import Doing
from node.round.steps import CatchUpNeeded, PacketsGone, ToApply, apply_manifest
from protocol.http import MAX_DETAIL_CHARS, MAX_REFUSED, MirroredSnapshot, RoundView, RunStatus
from protocol.snapshot import PARAMS_SECTION

log = logging.getLogger("locoswarm.node")
T = TypeVar("T")

SNAPSHOT_ROUNDS_TRIED = 3  # the newest agreed snapshots tried, newest first
HOLDERS_LOOKUP_S = 10.0  # at most this long (or the fetch time-out) to learn who holds a round's packets
IDLE_FIRST_S, IDLE_MAX_S = 1.0, 4.0  # with nothing to replay or load, poll again after this, doubling
ENDED_CHECK_S = 10.0  # while a replay or a snapshot load runs, the run's end is looked for this often
MIRROR = object()  # the packet mirror among a snapshot's sources, after the peers' digests
# what a peer that is behind too says it does: it serves nobody the run's end
BEHIND = frozenset({Doing.CATCHING_UP.value, Doing.LOADING_SNAPSHOT.value, Doing.STUCK.value})


class RunEnded(Exception):
    """The run ended while this node was behind, and no peer or mirror is left to catch up from:
    `str(error)` says at which rounds."""


async def catch_up(s: Session) -> CatchUpReport:
    """Bring the parameters to the start of the open round; say which round that is and how.
    Whatever local progress ran ahead of the global model (overlap) is dropped with the rounds
    skipped."""
    from_round = s.state.params_round
    try:
        round, method = await _catch_up_to_open_round(s)
    finally:
        s.state.clear_detail()
    s.outer.finish()
    s.outer.reset_to_params()
    return CatchUpReport(from_round=from_round, to_round=round, method=method)


async def _catch_up_to_open_round(s: Session) -> tuple[int, str]:
    s.state.doing(Doing.CATCHING_UP)
    loaded = False  # a snapshot was loaded on an earlier pass
    idle_s, seen = IDLE_FIRST_S, None  # the next pause with nothing to do; (open round, newest agreed)
    waits = GoneWaits(s)
    while not s.stopping.is_set():
        status = await s.client.status()
        current = _open_round(status)
        agreed = {h.round + 1: h.agreed_digest for h in status.history if h.agreed_digest}
        if (current, max(agreed, default=None)) != seen:  # the swarm moved on: what could not be done may be now
            idle_s, seen = IDLE_FIRST_S, (current, max(agreed, default=None))
            await resume.restore_agreed_since(s, agreed, current)  # this node's checkpoint, agreed since its start
        if s.state.params_round != current and s.run.exchange.mirror is None and _ended(s, status):
            raise RunEnded(_ended_line(s, status))  # no peer, no store: no fetch can succeed
        if s.state.params_round is not None and s.state.params_round < current:
            try:
                for r in range(s.state.params_round, current):
                    await _unless_run_ends(s, replay(s, r))
                return current, "snapshot+replay" if loaded else "replay"
            except PacketsGone as e:
                if await waits.settle(e, status):
                    continue  # the manifest was amended: replay it at once
            except CatchUpNeeded as e:
                log.info("replay stopped: %s; loading a snapshot", e)
        if s.state.params_round == current:
            return current, "snapshot" if loaded else "none"
        # A snapshot no newer than the parameters held would only load them again (see above).
        params_round = s.state.params_round
        held = params_round if params_round is not None and params_round <= current else -1
        newer = sorted((r for r in agreed if held < r <= current), reverse=True)[:SNAPSHOT_ROUNDS_TRIED]
        stored = status.snapshot_mirror
        if (
            stored is not None
            and held < stored.round <= current
            and agreed.get(stored.round) in (None, stored.params_digest)
        ):
            agreed.setdefault(stored.round, stored.params_digest)  # agreed, if older than the history read
            newer = sorted({*newer, stored.round}, reverse=True)
        else:
            stored = None
        for start_round in newer:
            mirrored = stored if stored is not None and stored.round == start_round else None
            if await _unless_run_ends(s, load_snapshot(s, start_round, agreed[start_round], mirrored)):
                loaded = True
                break
        else:
            if s.state.params_round != 0 and (current == 0 or not any(h.num_contributors for h in status.history)):
                s.state.seeded()  # nothing was ever trained in: the seeded initialisation is the start
                if current == 0:
                    return current, "none"
                continue  # and the empty rounds since replay from it
            if _ended(s, status):
                raise RunEnded(_ended_line(s, status))
            # Snapshots not announced or not agreed yet (peers are applying, voting), or none newer
            # than the parameters held while the next round cannot be replayed: wait, not spin.
            log.debug(
                "catch-up: nothing to replay or load at round %s (open round %d); polling again in %.1f s",
                s.state.params_round,
                current,
                idle_s,
            )
            await _pause(s, idle_s)
            idle_s = min(2 * idle_s, IDLE_MAX_S)
    return s.state.params_round or 0, "none"


def _ended(s: Session, status: RunStatus) -> bool:
    """Whether the run is over and no other peer that could serve it a round is live."""
    return status.run.state in ("finished", "closed") and not any(
        p.status == "live" and p.peer_id != s.peer_id and p.activity not in BEHIND for p in status.peers
    )


def _open_round(status: RunStatus) -> int:
    """The run's open round (its current one once it ended)."""
    return status.current_round.round if status.current_round else status.run.current_round


def _ended_line(s: Session, status: RunStatus) -> str:
    return (
        f"the run is {status.run.state} at round {_open_round(status)} while this node's parameters are at round"
        f" {s.state.params_round}, and no peer is left to serve the rounds between or a newer"
        " snapshot: this node does not hold the run's final parameters"
    )


async def _unless_run_ends(s: Session, work: Awaitable[T]) -> T:
    """`work`'s result; in a run without a packet mirror, `RunEnded` instead (and `work` cancelled)
    once a look at the run's status, every ENDED_CHECK_S, finds it over with nobody left: each try
    of a gone peer lasts the fetch time-out, and a pass begun before the last peer left ran its
    tries to the end (two nodes left a chaos run 3 and 4 minutes after the others)."""
    if s.run.exchange.mirror is not None:  # the store serves what the peers no longer do
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_watch_for_end(s))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise RunEnded(watch.result())
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _watch_for_end(s: Session) -> str:
    """Returns, with `_ended_line`'s line, once the run is over and no peer is left to serve it."""
    while True:
        await asyncio.sleep(ENDED_CHECK_S)
        try:
            status = await s.client.status(history=0)
        except CoordinatorCallFailed as e:  # an outage: look again next time
            log.debug("catch-up: no status to look for the run's end: %s", e)
            continue
        if _ended(s, status):
            return _ended_line(s, status)


async def _pause(s: Session, seconds: float) -> None:
    """Sleep, ending early if the node is stopping."""
    try:
        await asyncio.wait_for(s.stopping.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def replay(s: Session, round: int) -> None:
    """Apply a closed round's manifest without having trained in it: what it cannot fetch it does
    not report (the peers applying the round as it happens do), nor does it score the round."""
    view = await s.client.round(round)
    if view.state != "closed":
        raise CatchUpNeeded(f"round {round} is not closed")
    if gone := await packets_gone(s, round, view):
        s.mend_dht.set()  # a routing table emptied by a pause finds no holder: mend it now (rejoin.py)
        raise PacketsGone(round, view, gone)
    await apply_manifest(s, ToApply(view=view, report_missing=False, score=False), RoundTimes())
    log.info("round %d: replayed the manifest (%d packets)", round, len(view.manifest))


async def packets_gone(s: Session, round: int, view: RoundView) -> list[str]:
    """Manifest entries of `round` that no peer announces holding, as the exchange's lookup says;
    [] when the lookup fails or is slow (the fetch then decides)."""
    if not view.manifest:
        return []

    async def lookup() -> list[str]:
        announced = await s.exchange.announcements(round)
        unsure = [  # a packet with a copy in the packet mirror is not gone: the fetch asks the store
            e
            for e in view.manifest
            if not e.mirror_url and ((a := announced.get(e.peer_id)) is None or a.digest != e.packet_digest)
        ]
        holders = await asyncio.gather(*(s.exchange.holders(round, e.peer_id) for e in unsure))
        return [e.peer_id for e, found in zip(unsure, holders) if not any(h.digest == e.packet_digest for h in found)]

    try:
        return await asyncio.wait_for(lookup(), timeout=min(HOLDERS_LOOKUP_S, s.config.network.fetch_timeout_s))
    except Exception as e:  # looking up holders only saves time; fetching decides
        log.debug("round %d: looking up the packets' holders failed: %r", round, e)
        return []


async def load_snapshot(s: Session, round: int, params_digest: str, mirrored: MirroredSnapshot | None = None) -> bool:
    """Fetch peers' snapshot of the parameters that start `round` straight into the model (and the
    outer state), each unit checked against a hash tree whose root must be `params_digest` before
    it is written (node/training/snapshot.py); host memory holds one 4 MiB chunk, whatever the
    model's size. A holder that fails midway is followed by the next from the first chunk not yet
    verified; a snapshot is given up after a fetch time-out without progress, or at once when every
    holder has moved on from it (the caller then looks for a newer one). While it fetches from
    peers the heartbeats say `loading_snapshot`, and the coordinator asks the holders nobody can
    dial to dial this node (connection reversal, coordinator/rules/membership.py): their copies
    then come over the connections they opened. `mirrored`: the packet
    mirror's copy of this snapshot, read when no peer delivered one (node/exchange/mirror.py). Once
    bytes were written and no snapshot completed, the parameters are unknown
    (`RoundState.params_unknown`)."""
    from node.training.params import flat_named_params
    from node.training.snapshot import SnapshotSink

    holders = await s.exchange.params_holders(round)
    # On the CPU the outer state's tensors are the live ones (written in place); elsewhere host copies.
    state = s.outer.snapshot_state()
    sink = SnapshotSink(flat_named_params(s.training.model), state, params_digest)
    sources = [digest for digest, _ in Counter(h.digest for h in holders).most_common()]
    if mirrored is not None:
        sources.append(MIRROR)
    for source in sources:
        try:
            if source is MIRROR:
                digest = mirrored.snapshot_digest
                sink.expect(digest)  # from the first byte unless the peers got some of this one
                done = await mirror.download_snapshot(
                    mirrored.url,
                    mirrored.size_bytes,
                    sink,
                    timeout_s=s.config.network.fetch_timeout_s,
                    label=f"round {round}: snapshot {digest[:12]}",
                )
            else:
                digest = source
                s.state.doing(Doing.LOADING_SNAPSHOT)  # the heartbeats ask holders nobody can dial to dial this node
                try:
                    while True:
                        before = sink.offset if sink.digest == digest else 0
                        done = await s.exchange.fetch_params(
                            round, digest, sink, timeout_s=s.config.network.fetch_timeout_s
                        )
                        if done or sink.offset <= before:
                            break
                finally:
                    s.state.doing(Doing.CATCHING_UP)
        finally:
            if sink.written_bytes:  # also when cut short (cancelled: the run ended meanwhile)
                s.state.params_unknown()  # part of the model may now be this snapshot's
        if not done:
            log.warning(
                "round %d: snapshot %s not loaded (%d of %d bytes verified)",
                round,
                digest[:12],
                sink.offset,
                sink.total_bytes,
            )
            continue
        await asyncio.to_thread(_load_outer_state, s, state)
        s.sent.clear()  # the error buffers restarted at zero: nothing sent from them can go back
        s.state.loaded(round, params_digest, sink.trees[PARAMS_SECTION])
        log.info(
            "round %d: loaded parameters %s from %s (%d bytes)",
            round,
            params_digest[:12],
            "the packet mirror" if source is MIRROR else "peers",
            sink.total_bytes,
        )
        await serve_snapshot(s, round, *sink.trees)  # a holder now too
        return True
    return False


def _load_outer_state(s: Session, tensors) -> None:
    with s.buffers_lock:  # an encode cancelled by the catch-up may still be running
        s.outer.load_snapshot_state(tensors)


class GoneWaits:
    """What one catch-up does about manifest entries nobody serves (see the module docstring)."""

    def __init__(self, s: Session):
        self.s = s
        self.first_seen: dict[tuple[int, str], float] = {}  # (round, author) -> monotonic time first found gone
        self.reported: set[tuple[int, str]] = set()
        self.said = ""  # the last stuck line logged

    @property
    def missing_after_s(self) -> float:
        """How long a live author gets to serve its packet again (it may be restarting too)."""
        return min(self.s.config.network.fetch_timeout_s, self.s.run.membership.heartbeat_timeout_s)

    async def settle(self, gone: PacketsGone, status: RunStatus) -> bool:
        """Report what is due for `gone`'s round and say what the node waits for; True when the
        round's manifest is now a newer version than the one the replay tried."""
        s, round, now = self.s, gone.round, time.monotonic()
        live = {p.peer_id for p in status.peers if p.status == "live"}
        lost_own = s.peer_id in gone.peer_ids and not await self._serve_own(gone)
        others = [p for p in gone.peer_ids if p != s.peer_id]
        for author in others:
            self.first_seen.setdefault((round, author), now)
        due = [
            p
            for p in others
            if (round, p) not in self.reported
            and (p not in live or now - self.first_seen[round, p] >= self.missing_after_s)
        ]
        version = gone.view.manifest_version
        if due or (lost_own and (round, s.peer_id) not in self.reported):
            self.reported.update((round, p) for p in [*due, *([s.peer_id] if lost_own else [])])
            try:
                answer = await s.signed(s.client.missing, round, due[:MAX_REFUSED], lost_own=lost_own)
            except Refused as e:  # too old, say: the snapshot route is the way
                log.warning(
                    "round %d: reporting %s missing was refused (%s: %s)",
                    round,
                    ", ".join([*due, *(["this node's own packet"] if lost_own else [])]),
                    e.code,
                    e.detail,
                )
            else:
                log.warning(
                    "round %d: reported %s missing; manifest version %d (dropped so far: %s)",
                    round,
                    ", ".join([*due, *(["this node's own packet (lost in a restart)"] if lost_own else [])]),
                    answer.manifest_version,
                    ", ".join(f"{p}: {why}" for p, why in answer.dropped.items()) or "none",
                )
                version = answer.manifest_version
        self._say(round, others, live, lost_own)
        return version > gone.view.manifest_version

    async def _serve_own(self, gone: PacketsGone) -> bool:
        """Whether this node still holds its own entry's packet on disk (then it announces it again:
        the lookup did not find the announcement made at start); False: it is lost."""
        s = self.s
        entry = next((e for e in gone.view.manifest if e.peer_id == s.peer_id), None)
        held = await asyncio.to_thread(s.own_packets.load, gone.round) if s.own_packets is not None else None
        if entry is None or held is None or held.digest != entry.packet_digest:
            return False
        await s.exchange.publish(gone.round, s.peer_id, held.payload)
        return True

    def _say(self, round: int, others: list[str], live: set[str], lost_own: bool) -> None:
        """One line, logged when it changes and sent with the heartbeats while the node is stuck."""
        parts = []
        for author in others:
            if (round, author) in self.reported:
                parts.append(
                    f"{author} ({'gone' if author not in live else 'live'}; reported missing, "
                    "waiting for the amended manifest)"
                )
            else:
                parts.append(f"{author} (live; not served yet, reported missing after {self.missing_after_s:.0f} s)")
        if lost_own:
            parts.append("this node's own (lost in a restart; reported)")
        line = f"round {round}: waiting for the packets of {', '.join(parts)}"
        self.s.state.stuck(line[:MAX_DETAIL_CHARS])
        if line != self.said:
            log.warning("catch-up %s", line)
            self.said = line
