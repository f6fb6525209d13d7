"""Snapshots in the packet mirror: who uploads the agreed parameters, and which upload is offered
(docs/DESIGN.md, "The packet mirror"; protocol/http.py, "Snapshots in the packet mirror").

    url = put_url_for(ctx, run, round_row, report)     # in the answer to a new vote, or None
    record_uploaded(ctx, run, round, peer, request)    # the uploader's word that the store took it

With ``exchange.mirror.snapshot_every_rounds`` N > 0, after each round r with r % N == 0 the
snapshot of round r+1's start goes to the store. The coordinator never sees the snapshot: it hands
a presigned PUT, signed for the size the report stated (`AppliedRequest.snapshot_bytes`), to each
of the first `SNAPSHOT_UPLOADERS` new votes of the round's latest manifest version whose digest is
the round's majority when they report (agreed or provisional: a lone contributor's vote is agreed
only when the next round closes, and the first vote of any round is the majority). Two, so an
uploader that dies leaves the other; an upload of a digest that then loses the vote lies under
another key (coordinator/mirror.py) and is never offered. The uploader reports the snapshot digest
once the store answered; that is recorded on its applied report, and what joiners are offered is
the newest recorded upload whose parameters are its round's agreed digest (`Views.mirrored_snapshot`).
Nothing here is trusted further than a peer's snapshot in the DHT: the fetcher checks every unit
against a hash tree whose root must be the agreed digest and whose snapshot digest is the one
recorded (node/round/catchup.py).
"""

from __future__ import annotations

from coordinator import errors
from coordinator.rules.context import Context
from coordinator.storage import AppliedRow, PeerRow, RoundRow, RunRow
from protocol.http import SNAPSHOT_UPLOADERS, SnapshotRecorded, SnapshotUploaded


def put_url_for(
    ctx: Context, run: RunRow, round_row: RoundRow, report: AppliedRow, size_bytes: int | None
) -> str | None:
    """The snapshot PUT URL for the answer to `report`, a new vote on the round's latest manifest
    version counted into `round_row`, or None when it is not this report's to upload (see the module
    docstring). Marks the report as handed one."""
    section = ctx.config(run).exchange.mirror
    if section is None or size_bytes is None or not section.snapshot_after(round_row.round):
        return None
    if report.params_digest != round_row.majority_digest:
        return None
    if ctx.storage.count_snapshot_uploaders(run.run_id, round_row.round, report.manifest_version) >= SNAPSHOT_UPLOADERS:
        return None
    mirror = ctx.views.mirror_of(run)
    if mirror is None:
        return None
    from coordinator.mirror import MAX_SNAPSHOT_BYTES  # boto3: loaded only where a run has a mirror

    if size_bytes > MAX_SNAPSHOT_BYTES:
        return None
    ctx.storage.update_applied(report, snapshot_bytes=size_bytes)
    return mirror.snapshot_put_url(run.run_id, round_row.round + 1, report.params_digest, size_bytes)


def record_uploaded(
    ctx: Context, run: RunRow, round_index: int, peer: PeerRow, request: SnapshotUploaded
) -> SnapshotRecorded:
    """Record that `peer` put the snapshot of round r+1's start into the store, at the URL the
    answer to its report of round r's latest manifest version handed it. A repeat of the same
    digest changes nothing; anything else is refused `no_snapshot_url`."""
    round_row = ctx.closed_round(run.run_id, round_index)
    report = ctx.storage.get_applied(run.run_id, round_index, peer.peer_id, round_row.manifest_version)
    if report is None or report.snapshot_bytes is None:
        raise errors.NoSnapshotUrl(f"round {round_index}: this peer was handed no snapshot URL")
    if report.snapshot_bytes != request.size_bytes:
        raise errors.NoSnapshotUrl(
            f"round {round_index}: the snapshot URL was signed for {report.snapshot_bytes} bytes,"
            f" not {request.size_bytes}"
        )
    if report.snapshot_digest not in (None, request.snapshot_digest):
        raise errors.NoSnapshotUrl(
            f"round {round_index}: this peer already reported snapshot {report.snapshot_digest[:16]}"
        )
    ctx.storage.update_applied(report, snapshot_digest=request.snapshot_digest)
    return SnapshotRecorded(round=round_index, recorded=True)
