"""The steps of one round on a node, in order: train, send, collect, apply and report.

    loss = await train(s, r, times)                      # H inner steps in a worker thread
    await send(s, r, base_digest, report, opened)        # encode, publish, submit the packet
    view, payloads, prepared = await collect(s, r, times, prefetch)
    await apply_and_report(s, report, view, payloads, prepared)   # apply_manifest, then the report's figures

`apply_manifest` takes one round (`ToApply`: its view, what is in hand, whether to report missing
packets and whether to score) and returns what it applied (`Applied`); a replay (catchup.py) and the
last in-flight round with overlap (loop.py) take it too. The round state (node/round/state.py)
changes only through `s.state`: `applied` after the outer step, `doing(...)` at each step.

Decisions at the boundaries, each logged:
- a submission refused as late or stale: the round goes on without this packet; the node still
  applies the manifest (its own update stays in its error buffer for the next round);
- a manifest packet that cannot be fetched in time: the node reports it and waits for the
  coordinator to amend the manifest without it (node/round/amend.py); if no such version comes
  within another fetch time-out, the node cannot reproduce the round, so it raises
  `CatchUpNeeded` and catches up (node/round/catchup.py);
- a round this node applied whose manifest was amended since: recomputed from the kept round
  start before the next outer step, reported again, its `RoundReport` updated (amend.py);
- a packet that fails to verify or decode is left out (deterministically, by every honest peer);
- with a packet mirror (the run's exchange.mirror), an accepted submission's answer carries a URL
  the packet is uploaded to in the background (node/exchange/mirror.py); an upload that fails is
  logged and the round goes on, and fetches ask the mirror as one more holder (fetch.py); in
  rounds whose snapshot goes to the mirror, the applied report's answer may hand this node a URL
  its snapshot is uploaded to, the same way (node/round/snapshots.py);
- a submission refused "excluded" (contribution scoring judged this peer's updates harmful,
  protocol/scoring.py): as a late one, the node applies the round without its packet and trains on.

Contribution scores: before its outer step the node scores the round's updates on a batch of its own
data (node/training/scoring.py, in a worker thread, with nothing training meanwhile) and sends them
with its applied report; the report records them. Scoring that fails is logged and skipped: it never
holds up a round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass

from node.exchange import mirror
from node.exchange.base import MirrorCopy
from node.faults import Phase
from node.round import amend, resume
from node.round.coordinator_client import Refused
from node.round.own_packets import HeldPacket
from node.round.prefetch import Prefetch
from node.round.refusals import Action, Code
from node.round.reports import RoundReport, RoundTimes
from node.round.session import Session
from node.round.snapshots import mirror_snapshot_bytes, serve_snapshot
from node.round.state import Doing
from node.training.base import ApplyResult, Prepared
from node.training.params import param_tree
from node.training.scoring import PeerScore
from protocol.errors import ProtocolError
from protocol.http import (
    MAX_REFUSED,
    MAX_SAMPLE_CHARS,
    MAX_SCORES,
    AppliedResponse,
    ManifestEntry,
    PeerScoreReport,
    RoundView,
)

log = logging.getLogger("locoswarm.node")

MAX_REASON_CHARS = 256
SAMPLE_PROMPT, SAMPLE_TOKENS = "def ", 48  # the text sample sent with a validation loss (greedy)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what protocol.http.SampleText refuses
# Refusals of a submission after which the round goes on without this node's packet: those whose
# action (node/round/refusals.py) drops the packet, and the run's end ("run_closed": its last round
# closed first; its manifest is still applied, then the loop ends). "conflicting_submission": a node
# that caught up within a round it had already submitted to trained it again; the round keeps the
# first packet, served while this node still holds it, else amended out.
SUBMISSION_GOES_ON: frozenset[Action] = frozenset({Action.DROP_PACKET, Action.RUN_OVER})


class CatchUpNeeded(Exception):
    """This node cannot reproduce a round exactly and must load the swarm's parameters."""


class PacketsGone(CatchUpNeeded):
    """Entries of a closed round's manifest that no holder serves (node/round/catchup.py decides
    whether to wait for them, report them missing, or load a snapshot)."""

    def __init__(self, round: int, view: RoundView, peer_ids: list[str]):
        super().__init__(f"round {round}: no peer holds the packets of {', '.join(peer_ids)}")
        self.round, self.view, self.peer_ids = round, view, peer_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class ToApply:
    """One closed round for `apply_manifest`: its manifest, what is in hand, what goes beside it."""

    view: RoundView  # the closed round's view: its manifest and manifest version
    payloads: dict[str, bytes] | None = None  # the manifest's packets in hand (collect); None: fetched here
    prepared: Prepared | None = None  # their aggregate (collect); None: made here
    # Packets it cannot fetch: report them and wait for an amended manifest without them; False:
    # `PacketsGone` at once (a replay, which loads a snapshot instead).
    report_missing: bool = True
    score: bool = True  # score the round's updates and send the scores with the applied report


@dataclass(frozen=True, slots=True)
class Applied:
    """What `apply_manifest` applied: the outer step's result and this node's scores of the round."""

    result: ApplyResult
    scores: dict[str, PeerScore]


async def wait_open(s: Session, round: int) -> RoundView | None:
    """The round's view once it is open (or closed); None if the node is stopping."""
    delay_s, previous_closed = 0.1, round == 0
    while not s.stopping.is_set():
        view = await s.client.round(round)
        if view.state != "pending":
            return view
        if not previous_closed:  # round r opens when r-1 closes: long-poll for that moment
            previous_closed = (await s.client.round(round - 1, wait_s=30)).state == "closed"
            continue
        await asyncio.sleep(delay_s)  # r-1 closed and r not open yet (a run's start): poll
        delay_s = min(delay_s * 1.5, 2.0)
    return None


async def train(s: Session, round: int, times: RoundTimes) -> float:
    """The round's H inner steps, in a worker thread; returns the mean loss."""
    s.state.training()
    s.spawn(beat_now(s))  # the status shows it training now, not an interval later (after "applied")
    bar = _progress_bar(s, round)
    first_step = round * s.training.inner_steps  # train_round's global steps start here

    def count_step(step: int) -> None:  # in the worker thread: one int the heartbeat task reads
        s.state.activity.inner_step = step - first_step + 1

    def show_step(step: int, loss: float, tokens_per_s: float) -> None:  # a device sync a step: the bar only
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.3f} {tokens_per_s:,.0f} tok/s")

    await s.faults.at_phase(Phase.TRAINING, round)
    result = await asyncio.to_thread(s.training.train_round, round, show_step if bar else None, count_step)
    if bar:
        bar.close()
    times.compute_s = await s.faults.pad_compute(round, result.compute_s)
    s.state.activity.last_loss = result.mean_loss
    return result.mean_loss


async def beat_now(s: Session) -> None:
    """One heartbeat with the node's activity at once, beside the periodic ones (Node._heartbeats).

    The coordinator labels a peer by its last report: "submitted" at its submission, "applied" at
    its applied report, else the state of its last heartbeat. Without this beat a peer that
    applied round r and went on training r + 1 read "applied", with no inner step, for up to a
    heartbeat interval. A failed beat changes nothing: the next periodic one says the same."""
    from node.round.coordinator_client import CoordinatorCallFailed

    try:
        await s.heartbeat()
    except CoordinatorCallFailed as e:
        log.debug("heartbeat at the start of training failed: %s", e)


async def send(
    s: Session,
    round: int,
    base_digest: str,
    report: RoundReport,
    opened: bool,
    deltas: dict | None = None,
    foreground: bool = True,
    held: HeldPacket | None = None,
) -> None:
    """Encode the round's update (the given deltas, or the parameters' since the round began),
    keep the packet on disk (with a checkpoint directory), publish it and submit it. `held`: the
    packet this node kept for the round before a restart, sent as it is instead (nothing is
    encoded: its values left the error buffer of the process that made it). In the background
    (overlap) it runs beside the next round's training and its time counts as hidden."""
    if foreground:
        s.state.doing(Doing.ENCODING)
    start = time.perf_counter()

    def encode() -> bytes:
        with s.buffers_lock:  # a catch-up resetting the buffers waits for a running encode
            return s.outer.make_payload(
                run_id=s.run_id, round=round, peer_id=s.peer_id, base_digest=base_digest, key=s.key, deltas=deltas
            )

    if held is None:
        async with s.encode_lock:  # error feedback folds rounds in order
            payload = await asyncio.to_thread(encode)
        s.sent[round] = payload
        await keep_own(s, round, payload, base_digest, report)
    else:
        payload = held.payload
        log.info("round %d: sending the packet kept on disk before this node restarted (%s)", round, held.digest[:12])
    # Announced in the DHT only once submitted (Exchange.announce): a copier learns of it too late.
    announcement = await s.exchange.publish(round, s.peer_id, payload, announce=False)
    await s.faults.at_phase(Phase.PUBLISHED, round)
    encode_s = time.perf_counter() - start
    if foreground:
        report.times.encode_s = encode_s
        s.state.doing(Doing.SUBMITTING)
    else:
        report.times.hidden_encode_s = encode_s
    report.packet_bytes = announcement.size_bytes
    if not opened:  # trained ahead of the round's opening (overlap): submit once it opens
        await wait_open(s, round)
    from node.round.coordinator_client import Refused
    from node.round.push import push_own, push_plan

    targets = await push_plan(s, round)  # nobody can dial this node: its packet is fetched from targets[0]
    try:
        answer = await s.signed(
            s.client.submit,
            round,
            packet_digest=announcement.digest,
            packet_size_bytes=announcement.size_bytes,
            train_loss=report.train_loss,
            compute_s=report.times.compute_s,
            encode_s=encode_s,
            multiaddrs=targets[0] if targets else announcement.multiaddrs,
        )
        report.submitted_at = s.clock()
        if answer.mirror_put_url is not None:  # the run's packet mirror: one more holder, for peers behind NAT
            s.spawn(
                mirror.upload(
                    answer.mirror_put_url,
                    payload,
                    timeout_s=s.config.network.fetch_timeout_s,
                    label=f"round {round}: this node's packet",
                )
            )
        if targets:
            s.spawn(push_own(s, round, targets, report))
    except Refused as e:
        if e.action not in SUBMISSION_GOES_ON:
            raise
        report.submitted = False
        log.warning(
            "round %d: submission refused (%s%s); applying the round without this packet",
            round,
            e.code,
            f": {e.detail}" if e.code is Code.EXCLUDED else "",
        )
    finally:
        # After the submission, and only when it counts or its answer was lost: a refused packet is
        # in no manifest, and announced it would only be offered to a copier, whose copy of a
        # packet nobody else applies judges cannot tell from its own work (protocol/scoring.py).
        if report.submitted:
            await s.exchange.announce(round, s.peer_id)
    await s.faults.at_phase(Phase.SUBMITTED, round)


async def keep_own(s: Session, round: int, payload: bytes, base_digest: str, report: RoundReport) -> None:
    """This node's packet on disk before it is submitted (node/round/own_packets.py). A disk that
    refuses is logged and the round goes on: only a restart before the round is final loses it."""
    if s.own_packets is None:
        return
    try:
        await asyncio.to_thread(
            s.own_packets.keep,
            round,
            payload,
            run_id=s.run_id,
            peer_id=s.peer_id,
            base_digest=base_digest,
            train_loss=report.train_loss,
            compute_s=report.times.compute_s,
        )
    except OSError as e:
        log.error(
            "round %d: the packet could not be kept on disk (%s); a restart before the round is final loses it",
            round,
            e,
        )


def return_if_unsent(s: Session, round: int, view: RoundView) -> None:
    """DESIGN.md, "A packet that misses its round keeps its mass": this session's packet of `round`
    is not in the manifest as applied (refused as late, excluded, amended out), so the values it
    carried go back into the error buffer and are sent in a later round instead of lost."""
    payload = s.sent.get(round)
    if payload is None or s.peer_id in {e.peer_id for e in view.manifest}:
        return
    del s.sent[round]
    try:
        with s.buffers_lock:
            s.outer.return_unsent(payload, s.key.public_bytes, peer_id=s.peer_id, run_id=s.run_id, round=round)
    except ProtocolError as e:  # its own packet, made here: a bug, but it costs one round's values, not the run
        log.error("round %d: this node's unapplied packet could not be put back: %s", round, e)
        return
    log.info(
        "round %d: this node's packet is not in manifest version %d; its values are back in the error buffer",
        round,
        view.manifest_version,
    )


async def collect(s: Session, round: int, times: RoundTimes, prefetch: Prefetch, foreground: bool = True):
    """Wait for the round's manifest (the prefetch fetching packets as they come), fetch whatever
    it lists that is not in hand yet, and, when every packet is in hand, verify, decode and
    aggregate them (no parameter changes). Returns (view, payloads, prepared or None)."""
    if foreground:
        s.state.doing(Doing.WAITING)
    start = time.perf_counter()
    try:
        view = await prefetch.task
        times.wait_s = time.perf_counter() - start
        amend.watch_kept(s)  # has the round applied before been amended? (read beside the fetch)
        payloads = await fetch_manifest(s, round, view, times, prefetch, foreground)
    finally:
        prefetch.cancel()  # fetches of packets that did not make the manifest, or a stop
    prepared = None
    if {e.peer_id for e in view.manifest} <= set(payloads):
        if foreground:
            s.state.doing(Doing.AGGREGATING)
        start = time.perf_counter()
        prepared = await prepare(s, view, payloads)
        times.aggregate_s = time.perf_counter() - start
    return view, payloads, prepared


async def fetch_manifest(
    s: Session,
    round: int,
    view: RoundView,
    times: RoundTimes,
    prefetch: Prefetch | None = None,
    foreground: bool = True,
) -> dict[str, bytes]:
    """The manifest's packets: the prefetch's early fetches, then the others. A packet gets
    `fetch_timeout_s` in all: one whose early fetch failed is asked again for what is left of it
    (nothing, when that fetch timed out), so a packet nobody serves is reported missing after one
    time-out, not two (a withheld packet held every other node that much longer). A suspect's
    (node/round/prefetch.py) whose early fetch gave it up is not asked again."""
    if foreground:
        s.state.doing(Doing.TRANSFERRING)
    start = time.perf_counter()
    budget_s = s.config.network.fetch_timeout_s
    loop = asyncio.get_running_loop()
    payloads: dict[str, bytes] = {}
    left_s: dict[str, float] = {}  # what is left of each packet's time-out
    suspects = prefetch.suspects if prefetch is not None else set()
    for e in view.manifest:
        key = (e.peer_id, e.packet_digest)
        if prefetch is not None and (task := prefetch.early.get(key)) is not None:
            payloads |= await task
            elapsed_s = loop.time() - prefetch.started.get(key, loop.time())
            left_s[e.peer_id] = 0.0 if e.peer_id in suspects else budget_s - elapsed_s  # a suspect's: given up
    rest = [e for e in view.manifest if e.peer_id not in payloads and left_s.get(e.peer_id, budget_s) > 0]
    if rest:
        payloads |= await s.exchange.fetch(
            round,
            {e.peer_id: e.packet_digest for e in rest},
            {e.peer_id: e.multiaddrs for e in rest},
            timeout_s=max(left_s.get(e.peer_id, budget_s) for e in rest),
            mirrors=mirror_copies(rest),
            suspects=suspects,
        )
    times.transfer_s = time.perf_counter() - start
    return payloads


def mirror_copies(entries: list[ManifestEntry]) -> dict[str, MirrorCopy] | None:
    """The packet mirror's copies of these entries' packets (None: the run has no mirror)."""
    copies = {e.peer_id: MirrorCopy(e.mirror_url, e.packet_size_bytes) for e in entries if e.mirror_url}
    return copies or None


async def prepare(s: Session, view: RoundView, payloads: dict[str, bytes]) -> Prepared:
    """Verify, decode and aggregate the manifest's packets, in a worker thread; no parameter changes.
    Packets decoded as they arrived (`s.decoded`) are not decoded again."""
    public_keys = {e.peer_id: bytes.fromhex(e.public_key) for e in view.manifest}
    early = await s.decoded.take(view.round, [(e.peer_id, e.packet_digest) for e in view.manifest])
    return await asyncio.to_thread(
        s.outer.prepare, payloads, public_keys.__getitem__, run_id=s.run_id, round=view.round, decoded=early
    )


async def apply_manifest(s: Session, job: ToApply, times: RoundTimes) -> Applied:
    """Take the round's outer step (fetching and aggregating its manifest unless `job` has them);
    report the digest of the global model; serve a snapshot of it. Packets that cannot be fetched
    are reported missing and the round applied as amended without them (`job.report_missing`).
    Before the outer step, the round applied before it is brought to its latest manifest version
    (amend.py); after its report, a newer version of this round is too."""
    view, payloads, prepared = job.view, job.payloads, job.prepared
    round = view.round
    if payloads is None:
        payloads = await fetch_manifest(s, round, view, times)
    await s.faults.at_phase(Phase.TRANSFER, round, exchange=s.exchange, peer_id=s.peer_id)
    missing = sorted({e.peer_id for e in view.manifest} - set(payloads))
    if missing:
        amended = await amend.await_amendment(s, round, view, missing) if job.report_missing else None
        if amended is None:
            # Aggregating a subset would fork this peer from the swarm: catch up instead.
            raise PacketsGone(round, view, missing)
        view, prepared = amended, None
        payloads = {e.peer_id: payloads[e.peer_id] for e in view.manifest}

    s.state.doing(Doing.AGGREGATING)
    start = time.perf_counter()
    kept = s.state.amendments.kept
    if kept is not None and kept.round != round - 1:
        s.state.amendments.forget()  # the parameters moved on by other means (a catch-up)
    await _recompute_if_amended(s)
    if prepared is None:
        prepared = await prepare(s, view, payloads)
    amend.keep(s, round, view, payloads, prepared)
    scores = await score(s, round, prepared) if job.score else {}
    applied = s.outer.commit(prepared)
    await asyncio.to_thread(return_if_unsent, s, round, view)
    await s.faults.at_phase(Phase.APPLIED, round)
    tree = await asyncio.to_thread(param_tree, s.outer.start)
    s.state.applied(round, tree)
    times.aggregate_s += time.perf_counter() - start  # after the prepare's share, if collect ran it
    response = await _report(s, round, applied, view.manifest_version, scores)
    if response.manifest_version > view.manifest_version:  # amended while this node fetched
        applied = await _recompute_if_amended(s, await s.client.round(round)) or applied
    if outdated := s.state.amendments.outdated(response.amended):
        s.state.amendments.reset()
        raise CatchUpNeeded(
            "amended after this node applied them: "
            + ", ".join(f"round {r} (version {old} -> {new})" for r, (old, new) in outdated.items())
        )
    if resume.due(s, round):
        await asyncio.to_thread(resume.save, s, round, s.faults.checkpoint_hook(round))
    await serve_snapshot(s, round + 1, tree, mirror_put_url=response.snapshot_put_url)
    return Applied(applied, scores)


async def _report(
    s: Session, round: int, applied, manifest_version: int, scores: dict[str, PeerScore] | None = None
) -> AppliedResponse:
    """Tell the coordinator the digest after `round` (as of `manifest_version`); what this node
    left out, and why, goes on its status page; so does the validation loss, in rounds it is due,
    and the contribution scores."""
    refused = {peer: reason[:MAX_REASON_CHARS] for peer, reason in sorted(applied.refused.items())[:MAX_REFUSED]}
    snapshot_bytes = await mirror_snapshot_bytes(s, round)
    val_loss = await _validation_loss(s, round)
    sample = await asyncio.to_thread(text_sample, s, round) if val_loss is not None else None
    reports = {
        peer: PeerScoreReport(
            loss_delta=sc.loss_delta, cosine=sc.cosine, overlap=sc.overlap, overlap_with=list(sc.overlap_with)
        )
        for peer, sc in sorted((scores or {}).items())[:MAX_SCORES]
    }
    try:
        response = await s.signed(
            s.client.applied,
            round,
            s.state.digest,
            refused=refused,
            manifest_version=manifest_version,
            val_loss=val_loss,
            scores=reports,
            sample=sample,
            tree=s.state.tree,
            snapshot_bytes=snapshot_bytes,
        )
    except Refused as e:
        if e.action is not Action.CATCH_UP:
            raise
        # This node reported another digest for this round before (reports are immutable): one of
        # the two states is not what the manifest gives, so take the swarm's agreed state instead.
        raise CatchUpNeeded(f"round {round}: {e.detail}") from e
    if response.manifest_version == manifest_version and response.agreed_digest not in (None, s.state.digest):
        log.error(
            "round %d: my digest %s differs from the agreed %s",
            round,
            s.state.digest[:12],
            response.agreed_digest[:12],
        )
    elif not response.agrees and response.manifest_version == manifest_version:
        log.warning(
            "round %d: my digest %s differs from the provisional majority %s",
            round,
            s.state.digest[:12],
            (response.majority_digest or "(none)")[:12],
        )
    return response


async def score(s: Session, round: int, prepared) -> dict[str, PeerScore]:
    """This node's contribution scores of the round's updates (`prepared`, before the outer step
    moves the start); {} when scoring is off, nothing was accepted, or scoring failed (logged)."""
    section = s.run.scoring
    if not section.enabled or prepared is None or prepared.aggregates is None or not prepared.updates:
        return {}
    if s.run.outer.overlap:
        # Such a node judges nobody (it is still judged): its parameters are already training the
        # next round, so it holds no own update of this round for the cosine.
        return {}
    from node.training.scoring import score_round

    start = time.perf_counter()
    try:
        scores = await asyncio.to_thread(
            score_round, s.training, s.outer.start, prepared, s.peer_id, round, section, s.run.outer.lr
        )
    except Exception as e:  # scores are advice to the coordinator: a round never fails for them
        log.warning("round %d: no contribution scores: %s: %s", round, type(e).__name__, e)
        return {}
    log.info(
        "round %d: scored %d update(s) in %.2f s: %s",
        round,
        len(scores),
        time.perf_counter() - start,
        ", ".join(f"{p[:8]} {sc.loss_delta:+.4f}/{sc.cosine:+.2f}/{sc.overlap:.2f}" for p, sc in scores.items()),
    )
    return scores


async def _validation_loss(s: Session, round: int) -> float | None:
    """The global model's loss on the held-out batches after `round`, in rounds 0, N, 2N... for
    N = eval_every_rounds (every peer evaluates the same rounds, so the page's series has no holes
    between them); None in other rounds, or when it is not finite (a diverged model)."""
    every = s.config.training.eval_every_rounds
    if not every or round % every:
        return None
    val_loss = await asyncio.to_thread(s.training.evaluate_global)
    if val_loss is None or not math.isfinite(val_loss):
        if val_loss is not None:
            log.warning("round %d: validation loss is %s; not reported", round, val_loss)
        return None
    log.info("round %d: validation loss %.4f", round, val_loss)
    return val_loss


def text_sample(s: Session, round: int) -> str | None:
    """A short text the global model writes after `round` (greedy, from SAMPLE_PROMPT), sent with the
    validation loss for the status page; None where it cannot be made here (a multi-rank node's
    sharded model, overlap's parameters running ahead of the global model, no tokenizer at hand).
    Control characters become "?": the coordinator refuses them."""
    from node.training.data import DataError
    from node.training.peer import PeerTraining
    from node.training.sampling import GenerateError, SampleConfig, generate_text, run_tokenizer

    if s.run.outer.overlap or not isinstance(s.training, PeerTraining):
        return None
    model = s.training.model
    try:
        # A byte-level model needs no tokenizer file; a tokenizer run's data directory holds its own.
        source = (s.config.training.data or s.run.model.data) if model.config.tokenizer_id else None
        tokenizer = run_tokenizer(model.config, source)
        was_training = model.training
        model.eval()
        try:
            text = generate_text(
                model, tokenizer, SAMPLE_PROMPT, SampleConfig(max_new_tokens=SAMPLE_TOKENS, temperature=0.0)
            )
        finally:
            model.train(was_training)
    except (GenerateError, DataError, OSError, ValueError) as e:  # a look at the model: never fails a round
        log.debug("round %d: no text sample: %s", round, e)
        return None
    return _CONTROL.sub("?", text)[:MAX_SAMPLE_CHARS]


async def _recompute_if_amended(s: Session, latest: RoundView | None = None):
    """Bring the kept round (the last one applied) to its latest manifest version; `latest` is
    its view when the caller has one. Returns the recomputed outer step's result, if any."""
    kept = s.state.amendments.kept
    if kept is None:
        return None
    if latest is None:
        latest = await amend.latest_view(s, kept)
    if latest.manifest_version <= kept.manifest_version:
        return None
    applied = await amend.recompute(s, latest)
    if applied is not None:
        await asyncio.to_thread(return_if_unsent, s, kept.round, latest)
    if applied is None:
        s.state.amendments.forget()
        raise CatchUpNeeded(
            f"round {kept.round}: its manifest was amended to version {latest.manifest_version} "
            f"after this node applied version {kept.manifest_version} (with overlap)"
        )
    response = await _report(s, kept.round, applied, latest.manifest_version)
    await serve_snapshot(s, kept.round + 1, mirror_put_url=response.snapshot_put_url)
    return applied


async def apply_and_report(
    s: Session, report: RoundReport, view: RoundView, payloads: dict[str, bytes], prepared: Prepared | None
) -> RoundReport:
    """Apply `view`'s round (the report's round, or with overlap the one before) and fill the report."""
    applied_round = view.round
    applied = await apply_manifest(s, ToApply(view=view, payloads=payloads, prepared=prepared), report.times)
    traffic = s.exchange.traffic(applied_round)
    report.digest, report.num_packets = s.state.digest, len(applied.result.accepted)
    report.refused = applied.result.refused
    report.downloaded_bytes, report.fetching_s = traffic.downloaded_bytes, traffic.fetching_s()
    # Over the time any fetch ran: with early fetches, the bytes span more than the transfer timer.
    if traffic.downloaded_bytes and report.fetching_s > 0.01:  # goes to the coordinator with the heartbeats
        s.state.activity.bandwidth_mbps = min(1e7, traffic.downloaded_bytes * 8 / report.fetching_s / 1e6)
    report.uploaded_bytes = s.exchange.traffic(report.round).uploaded_bytes
    report.ended_at, report.applied_round = s.clock(), applied_round
    report.manifest_version = s.state.amendments.applied_versions.get(applied_round, view.manifest_version)
    report.scores = {peer: {"loss_delta": sc.loss_delta, "cosine": sc.cosine} for peer, sc in applied.scores.items()}
    return report


def _progress_bar(s: Session, round: int):
    if not s.config.debug.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=s.training.inner_steps, desc=f"round {round}", unit="step", leave=False)
