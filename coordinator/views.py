"""The coordinator's read side: stored rows turned into the response models of `protocol.http`.

Kept apart from the rules (coordinator/rules/) so that what a peer or a monitor sees (status
JSON, round views with manifests, the join answer) reads in one place. Nothing here writes, and
nothing here applies a rule: a read answers with what the rules last committed. Who a round waits
for, and each peer's standing, are the rule's own answers (coordinator/rules/standing.py). The
service holds one `Views` as ``service.views``; the routes, `/metrics` and the authenticator read
through it.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from coordinator import disputes, errors, recovery
from coordinator.rules import standing
from coordinator.storage import PeerRow, RoundRow, RoundStats, RunRow, SelectionRow, Storage
from protocol import selection
from protocol.http import (
    CurrentRound,
    Dispute,
    DisputeSide,
    JoinResponse,
    ManifestEntry,
    MirroredSnapshot,
    ParamsSource,
    PeerAddress,
    PeerScoreView,
    PeerView,
    Pick,
    RoundSummary,
    RoundView,
    RunInfo,
    RunList,
    RunStatus,
    Sample,
)
from protocol.model_sizes import dense_bytes
from protocol.run_config import RunConfig
from protocol.scoring import Standing

if TYPE_CHECKING:
    from coordinator.mirror import Mirror

log = logging.getLogger("locoswarm.coordinator")

HISTORY_LIMIT = 1000


class Views:
    """Read-only answers from `storage`; also what the service's rules read (configs, runs)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._configs: dict[str, RunConfig] = {}  # configs never change after creation
        self._mirrors: dict[str, Mirror | None] = {}  # by run id: its packet mirror's signer, if any

    def config_of(self, run: RunRow) -> RunConfig:
        config = self._configs.get(run.run_id)
        if config is None:
            config = RunConfig.from_stored(run.config_json)  # also a flat one from before the sections
            self._configs[run.run_id] = config
        return config

    def mirror_of(self, run: RunRow) -> Mirror | None:
        """The signer of the run's packet mirror (coordinator/mirror.py); None without one, or when
        this coordinator cannot sign (logged once: the run goes on without the mirror)."""
        if run.run_id not in self._mirrors:
            section = self.config_of(run).exchange.mirror
            mirror = None
            if section is not None:
                from coordinator.mirror import Mirror, MirrorUnavailable  # boto3: only for runs with a mirror

                try:
                    mirror = Mirror(section)
                except MirrorUnavailable as e:
                    log.error("run %s: packets are not mirrored: %s", run.run_id, e)
            self._mirrors[run.run_id] = mirror
        return self._mirrors[run.run_id]

    def require_run(self, run_id: str) -> RunRow:
        run = self.storage.get_run(run_id)
        if run is None:
            raise errors.RunNotFound(f"no run {run_id!r}")
        return run

    def public_key_of(self, peer_id: str) -> bytes | None:
        """The key a peer joined with (any run), to verify its signed requests."""
        key_hex = self.storage.find_public_key(peer_id)
        return bytes.fromhex(key_hex) if key_hex else None

    # -- runs ---------------------------------------------------------------------------------

    def run_info(self, run_id: str) -> RunInfo:
        return self._run_info(self.require_run(run_id))

    def _run_info(self, run: RunRow) -> RunInfo:
        return RunInfo(
            run_id=run.run_id,
            name=run.name,
            state=run.state,
            created_at=run.created_at,
            closed_at=run.closed_at,
            current_round=run.current_round,
            config=self.config_of(run),
        )

    def list_runs(self) -> RunList:
        return RunList(runs=[self._run_info(run) for run in self.storage.list_runs()])

    def latest_run_id(self) -> str | None:
        """The run a viewer most likely means: the newest still waiting or running, else the newest.

        Not simply the newest: a test run created and closed beside a long one must not hide it.
        """
        runs = self.storage.list_runs()
        live = [run for run in runs if run.state in ("waiting", "running")]
        return (live or runs)[-1].run_id if runs else None

    # -- rounds -------------------------------------------------------------------------------

    def round_view(self, run_id: str, round_index: int) -> RoundView:
        run = self.require_run(run_id)
        round_row = self.storage.get_round(run_id, round_index)
        if round_row is None:
            if run.state in ("waiting", "running"):
                return RoundView(
                    run_id=run_id,
                    round=round_index,
                    state="pending",
                    opened_at=None,
                    deadline=None,
                    closed_at=None,
                    num_submitted=0,
                    manifest=[],
                    majority_digest=None,
                )
            raise errors.RoundNotFound(f"run {run_id} is {run.state}; round {round_index} never ran")
        closed = round_row.closed_at is not None
        dropped = {d.peer_id: d.reason for d in self.storage.list_dropped(run_id, round_index)}
        mirror = self.mirror_of(run)
        manifest = [
            ManifestEntry(
                peer_id=s.peer_id,
                packet_digest=s.packet_digest,
                packet_size_bytes=s.packet_size_bytes,
                multiaddrs=json.loads(s.multiaddrs),
                public_key=self.storage.find_public_key(s.peer_id) or "",
                mirror_url=mirror.get_url(run_id, round_index, s.peer_id) if mirror is not None else None,
            )
            for s in self.storage.manifest_entries(run_id, round_index)
        ]
        return RoundView(
            run_id=run_id,
            round=round_index,
            state="closed" if closed else "open",
            opened_at=round_row.opened_at,
            deadline=round_row.deadline,
            closed_at=round_row.closed_at,
            num_submitted=self.storage.count_submissions(run_id, round_index),
            manifest=manifest if closed else [],
            submitted=[] if closed else manifest,
            majority_digest=round_row.majority_digest,
            manifest_version=round_row.manifest_version,
            dropped=dropped,
            agreed_digest=round_row.agreed_digest,
            provisional=round_row.majority_digest is not None and round_row.agreed_digest is None,
            num_votes=round_row.num_votes,
            picks={row.peer_id: _pick(row) for row in self.storage.list_selections(run_id, round_index)},
            seed_round=round_row.seed_round,
        )

    def manifest_version(self, run_id: str, round_index: int) -> int | None:
        """The round's manifest version (None: the round never opened)."""
        round_row = self.storage.get_round(run_id, round_index)
        return None if round_row is None else round_row.manifest_version

    def num_submitted(self, run_id: str, round_index: int) -> int:
        return self.storage.count_submissions(run_id, round_index)

    def round_is_over(self, run_id: str, round_index: int) -> bool:
        """Whether the round closed, or never will (the run ended before it opened): a long-poll on
        it has nothing left to wait for."""
        run = self.require_run(run_id)
        round_row = self.storage.get_round(run_id, round_index)
        if round_row is None:
            return run.state not in ("waiting", "running")
        return round_row.closed_at is not None

    # -- join ---------------------------------------------------------------------------------

    def _params_source(self, run_id: str) -> ParamsSource:
        agreed = self.storage.latest_agreed_round(run_id)
        if agreed is None:
            return ParamsSource(round=0, digest=None, holders=[])
        live = {p.peer_id: p for p in self.storage.list_peers(run_id) if p.status == "live"}
        holders = [  # anyone who reported the agreed digest of the latest version holds those parameters
            PeerAddress(peer_id=a.peer_id, multiaddrs=json.loads(live[a.peer_id].listen_multiaddrs))
            for a in self.storage.list_applied(run_id, agreed.round)
            if a.params_digest == agreed.agreed_digest
            and a.manifest_version == agreed.manifest_version
            and a.peer_id in live
        ]
        return ParamsSource(
            round=agreed.round + 1,
            digest=agreed.agreed_digest,
            holders=holders,
            mirror=self.mirrored_snapshot(self.require_run(run_id)),
        )

    def mirrored_snapshot(self, run: RunRow) -> MirroredSnapshot | None:
        """The newest agreed snapshot in the run's packet mirror, with a GET URL (coordinator/rules/snapshots.py)."""
        mirror = self.mirror_of(run)
        row = self.storage.newest_mirrored_snapshot(run.run_id) if mirror is not None else None
        if row is None:
            return None
        return MirroredSnapshot(
            round=row.round + 1,
            params_digest=row.params_digest,
            snapshot_digest=row.snapshot_digest,
            size_bytes=row.snapshot_bytes,
            url=mirror.snapshot_get_url(run.run_id, row.round + 1, row.params_digest),
        )

    def join_response(self, run: RunRow, peer_id: str) -> JoinResponse:
        config = self.config_of(run)
        peer = self.storage.get_peer(run.run_id, peer_id)
        assert peer is not None  # called right after the join wrote it
        return JoinResponse(
            run_id=run.run_id,
            peer_id=peer_id,
            peer_index=peer.peer_index,
            data_shard=peer.peer_index % config.model.num_data_shards,
            num_shards=config.model.num_data_shards,
            config=config,
            run_state=run.state,
            current_round=run.current_round,
            params=self._params_source(run.run_id),
            dht_bootstrap=list(config.exchange.dht_bootstrap),
            heartbeat_interval_s=peer.heartbeat_period_s or config.membership.heartbeat_timeout_s / 4,
            reachable=None if peer.reachable is None else bool(peer.reachable),
        )

    # -- status -------------------------------------------------------------------------------

    def status(self, run_id: str, now: float, history_limit: int = HISTORY_LIMIT) -> RunStatus:
        run = self.require_run(run_id)
        peers = self.storage.list_peers(run_id)
        return RunStatus(
            now=now,
            run=self._run_info(run),
            current_round=self._current_round(run, peers),
            peers=self._peer_views(run, peers),
            history=self._history(run_id, history_limit),
            recovery=recovery.view(self.storage, run, self.config_of(run), now, peers),
            rewinds=recovery.rewinds(run),
            stuck=_stuck(peers),
            sample=self._sample(run_id),
            snapshot_mirror=self.mirrored_snapshot(run),
        )

    def _sample(self, run_id: str) -> Sample | None:
        row = self.storage.latest_sample(run_id)
        return None if row is None else Sample(round=row.round, peer_id=row.peer_id, text=row.sample)

    def _current_round(self, run: RunRow, peers: list[PeerRow]) -> CurrentRound | None:
        if run.state == "waiting":
            return CurrentRound(
                round=0,
                state="pending",
                opened_at=None,
                deadline=None,
                num_submitted=0,
                num_expected=sum(p.status == "live" for p in peers),
            )
        if run.state != "running":
            return None
        round_row = self.storage.get_round(run.run_id, run.current_round)
        assert round_row is not None  # a running run always has its open round
        membership = self.config_of(run).membership
        waited = standing.waited_for(
            self.storage, run.run_id, run.current_round, membership.max_missed_rounds, membership.min_peers
        )
        return CurrentRound(
            round=round_row.round,
            state="open",
            opened_at=round_row.opened_at,
            deadline=round_row.deadline,
            num_submitted=self.storage.count_submissions(run.run_id, run.current_round),
            num_expected=len(waited),
        )

    def _peer_views(self, run: RunRow, peers: list[PeerRow]) -> list[PeerView]:
        latest_applied = self.storage.latest_applied_by_peer(run.run_id)
        agreed: dict[int, tuple[str | None, int]] = {}  # round -> (agreed digest, latest manifest version)
        for report in latest_applied.values():
            if report.round not in agreed:
                round_row = self.storage.get_round(run.run_id, report.round)
                agreed[report.round] = (round_row.agreed_digest, round_row.manifest_version) if round_row else (None, 0)
        window, forming = self.config_of(run).membership.max_missed_rounds, self.config_of(run).membership.min_peers
        waited = (
            standing.waited_for(self.storage, run.run_id, run.current_round, window, forming)
            if run.state == "running"
            else {}
        )
        # Stragglers: live peers the last closed round waited for, that it closed without.
        last_closed = run.current_round - 1
        waited_last = (
            standing.waited_for(self.storage, run.run_id, last_closed, window, forming) if last_closed >= 0 else {}
        )
        views = []
        for peer in peers:
            report = latest_applied.get(peer.peer_id)
            # Only a report of the round's latest version can differ from its agreed digest.
            mismatch = (
                report is not None
                and agreed[report.round][0] is not None
                and report.manifest_version == agreed[report.round][1]
                and report.params_digest != agreed[report.round][0]
            )
            straggler = waited_last.get(peer.peer_id) is False
            peer_standing, standing_reason = standing.standing_of(
                peer, run.current_round, window, peer.peer_id in waited
            )
            views.append(
                PeerView(
                    peer_id=peer.peer_id,
                    peer_index=peer.peer_index,
                    data_shard=peer.peer_index % self.config_of(run).model.num_data_shards,
                    status=peer.status,
                    reason=peer.reason,
                    activity=peer.activity,
                    device=peer.device,
                    bandwidth_mbps=peer.bandwidth_mbps,
                    uplink_mbps=peer.uplink_mbps,
                    reachable=None if peer.reachable is None else bool(peer.reachable),
                    last_loss=peer.last_loss,
                    last_seen_at=peer.last_seen_at,
                    heartbeat_interval_s=peer.heartbeat_period_s,
                    lag_rounds=(
                        None if peer.progress_round is None else max(0, run.current_round - peer.progress_round)
                    ),
                    inner_step=peer.inner_step,
                    flags=(["params_mismatch"] if mismatch else [])
                    + (["straggler"] if straggler else [])
                    + (["withheld_packet"] if peer.withheld_round is not None else []),
                    mismatch_round=report.round if mismatch and report else None,
                    listen_multiaddrs=json.loads(peer.listen_multiaddrs),
                    standing=peer_standing,
                    standing_reason=standing_reason,
                    waited_for=peer.peer_id in waited,
                    last_contributed_round=peer.last_contributed_round,
                    detail=peer.detail,
                    **_score_fields(peer, run.current_round),
                )
            )
        return views

    def _history(self, run_id: str, limit: int) -> list[RoundSummary]:
        rounds: list[RoundRow] = self.storage.closed_rounds(run_id, limit)
        if not rounds:
            return []
        first, last = rounds[0].round, rounds[-1].round
        stats = self.storage.round_stats(run_id, first, last)
        applied = self.storage.applied_counts(run_id, first, last)
        refusals = self.storage.refusals(run_id, first, last)
        val_losses = self.storage.val_losses(run_id, first, last)
        picks = self.storage.selections_between(run_id, first, last)
        config = self.config_of(self.require_run(run_id))
        inner = config.inner
        tokens_per_contributor = inner.steps * inner.batch_size * inner.seq_len
        history = []
        for round_row in rounds:
            assert round_row.closed_at is not None  # closed_rounds returns closed ones only
            stat = stats.get(round_row.round)
            history.append(
                RoundSummary(
                    round=round_row.round,
                    opened_at=round_row.opened_at,
                    closed_at=round_row.closed_at,
                    round_time_s=round_row.closed_at - round_row.opened_at,
                    num_contributors=stat.num_contributors if stat else 0,
                    mean_loss=stat.mean_loss if stat else None,
                    majority_digest=round_row.majority_digest,
                    num_applied=applied.get(round_row.round, 0),
                    agreed_digest=round_row.agreed_digest,
                    provisional=round_row.majority_digest is not None and round_row.agreed_digest is None,
                    num_votes=round_row.num_votes,
                    dispute=self._dispute(run_id, round_row),
                    refused=refusals.get(round_row.round, {}),
                    tokens=(stat.num_contributors if stat else 0) * tokens_per_contributor,
                    packet_bytes=stat.packet_bytes if stat else 0,
                    val_loss=val_losses.get(round_row.round),
                    compression_ratio=_compression_ratio(config.model, stat),
                    **_pick_fields(picks.get(round_row.round)),
                )
            )
        return history

    def _dispute(self, run_id: str, round_row: RoundRow) -> Dispute | None:
        """The round's dispute: as decided (stored), or while undecided, its sides as the votes stand."""
        record = disputes.load(round_row.dispute)
        if record is not None:
            return Dispute(
                sides=[DisputeSide(**side) for side in record["sides"]],
                decided=True,
                excluded=record["excluded"],
                verdict=record["verdict"],
            )
        if round_row.agreed_digest is not None or round_row.num_votes < 2:
            return None
        reports = [
            a
            for a in self.storage.list_applied(run_id, round_row.round)
            if a.vote and a.manifest_version == round_row.manifest_version
        ]
        if len({a.params_digest for a in reports}) < 2:
            return None
        credit = self.storage.credits(run_id)
        sides = disputes.sides(reports, credit, round_row.majority_digest)
        return Dispute(
            sides=[DisputeSide(**side) for side in sides],
            decided=False,
            verdict=(
                "undecided: "
                + (
                    f"the votes of credit lead with {sides[0]['digest'][:16]}"
                    if sides[0]["credit"]
                    else "no vote of credit yet; a majority of keys without credit decides nothing"
                )
            ),
        )


def _stuck(peers: list[PeerRow]) -> str | None:
    """The run's "stuck: ..." line: what the first live peer (by id) that says it is stuck waits for,
    and how many say so when several do. A submission or an applied report clears a peer's line
    (it got on), so a peer whose activity still reads "stuck" without one is not counted."""
    stuck = sorted(
        (p for p in peers if p.status == "live" and p.activity == "stuck" and p.detail), key=lambda p: p.peer_id
    )
    if not stuck:
        return None
    more = f" ({len(stuck)} peers)" if len(stuck) > 1 else ""
    return f"stuck: {stuck[0].peer_id}: {stuck[0].detail}{more}"


def _score_fields(peer: PeerRow, open_round: int) -> dict:
    """PeerView's contribution-scoring fields from the stored standing (protocol/scoring.py)."""
    if peer.standing is None:
        return {"credit_reason": "none: not judged yet (a new key starts with none)"}
    standing = Standing.from_json(peer.standing)
    why = standing.exclusion(open_round) if peer.excluded_round is not None else None
    score = PeerScoreView(
        num_rounds=standing.num_rounds,
        num_hurt=standing.num_hurt,
        recent_hurt=list(standing.recent_hurt),
        loss_delta=standing.loss_delta,
        cosine=standing.cosine,
        num_useful=standing.num_useful,
        last_verdict=standing.last_verdict,
    )
    return {
        "score": score,
        "excluded": why is not None,
        "excluded_reason": why,
        "excluded_until_round": standing.excluded_until if why is not None else None,
        "credit": peer.credit,
        "credit_reason": _credit_reason(standing, peer.credit),
    }


def _credit_reason(standing: Standing, credit: int) -> str:
    """Why a judged peer's credit (protocol/scoring.py, rule 5) is what it is."""
    if standing.code == "wrong_digest":
        return "none: it reported a digest the peers of credit did not compute"
    judged = (
        f"useful in {standing.num_useful} of {standing.num_rounds} judged round(s)"
        f"{', hurting in ' + str(standing.num_hurt) if standing.num_hurt else ''}"
    )
    last = {
        "useful": "its last update was useful (+1)",
        "not_useful": "its last update was neither useful nor hurting: empty, noise or unrelated (halved)",
        "copy": "its last packet was a copy of a packet submitted before it (halved)",
        "hurt": "its last update hurt (all lost)",
    }.get(standing.last_verdict or "", "")
    return f"{'none' if credit == 0 else credit}: {judged}" + (f"; {last}" if last else "")


def _compression_ratio(model, stat: RoundStats | None) -> float | None:
    """How many times smaller the round's packets were than the same updates sent dense (fp32)."""
    if stat is None or not stat.packet_bytes:
        return None
    dense = dense_bytes(model, stat.num_contributors)
    return None if dense is None else dense / stat.packet_bytes


def _pick(row: SelectionRow) -> Pick:
    """A stored pick of a bounded round, with the rule's words for why (protocol/selection.py)."""
    ranked = selection.Ranked(
        selection.Candidate(row.peer_id, bool(row.proven), row.waited_rounds),
        row.rank,
        row.tier_size,
        row.tier_places,
        bool(row.picked),
    )
    return Pick(
        picked=ranked.picked,
        proven=ranked.candidate.proven,
        waited_rounds=row.waited_rounds,
        rank=row.rank,
        tier_size=row.tier_size,
        tier_places=row.tier_places,
        reason=ranked.reason(),
    )


def _pick_fields(rows: list[SelectionRow] | None) -> dict:
    """A history row's picks: how many submissions the manifest took, and why the rest were left out."""
    if rows is None:
        return {}
    return {
        "num_picked": sum(row.picked for row in rows),
        "not_picked": {row.peer_id: _pick(row).reason for row in rows if not row.picked},
    }
