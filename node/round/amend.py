"""Amended manifests on the node: packets nobody serves, and rounds applied from an older version.

DESIGN.md, "Manifests can be amended, never forked"; the coordinator's rules are in
coordinator/service.py and protocol/http.py ("Amended manifests"). node/round/steps.py
(`apply_manifest`) calls what is here at two moments:

- Some manifest entries could not be fetched within the fetch time-out (`await_amendment`): the
  node reports them (``POST rounds/{r}/missing``) and long-polls the round for a newer manifest
  version, for up to ``fetch_timeout_s`` more. When an amended manifest no longer lists what it
  lacks, it aggregates that one (fetching nothing new) and reports its digest with the version;
  otherwise the round loop catches up (`CatchUpNeeded`).
- The node had every packet and applied a version that is amended later (`KeptRound`,
  node/round/state.py): at each outer step it keeps the round's start (`OuterStep.keep_start`)
  and the round's packet bytes, until the next round's outer step. Before that step it looks at
  the kept round's latest view, read while the next round's packets were fetched (`watch_kept`,
  so the common case waits for nothing); when the version grew, it puts the start back and commits
  the amended set (`recompute`: outer.prepare on the remaining packets, `restore_start`, commit),
  reports the new digest with the version, and the round's `RoundReport` takes it.
  The coordinator's answer to an applied report carries the round's latest version too: an
  amendment that came between this node's fetch and its report is recomputed at once.
- The coordinator's answer to every applied report also lists the recent rounds that were
  amended (`Amendments.outdated`). A round this node applied at an older version that is no
  longer the kept one (the amendment came after the next round's outer step, as it can with
  overlap, whose next round is submitted before this one lands) cannot be recomputed: the node
  raises `CatchUpNeeded` and loads the swarm's parameters from a snapshot instead of staying
  forked.

Costs: one round of packet bytes held per round, and what puts the start back: for SparseLoCo only
the coordinates the aggregate moved, for DiLoCo (dense) a copy of the global model and its momentum
(node/training/round_start.py). A recompute decodes the kept packets again (it is rare). The
checkpoint written after the older version is not rewritten: on a restart the coordinator disagrees
with its digest and the node catches up.

With overlap (outer.overlap) the parameters have run a round ahead of the global model when a
round lands, so no start is kept: a node that learns that a round it applied was amended raises
`CatchUpNeeded` and loads the swarm's parameters from a snapshot. Reporting missing packets and
applying the amended manifest work the same with overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time

from node.round.coordinator_client import Refused
from node.round.session import Session
from node.round.state import Doing, KeptRound
from node.training.base import ApplyResult, Prepared
from node.training.params import param_tree
from protocol.http import MAX_LONG_POLL_S, MAX_REFUSED, RoundView

log = logging.getLogger("locoswarm.node")


async def await_amendment(s: Session, round: int, view: RoundView, missing: list[str]) -> RoundView | None:
    """Report the entries this node could not fetch and wait (up to fetch_timeout_s) for a manifest
    version without them; that view, or None (then the node catches up)."""
    s.state.doing(Doing.AWAITING_AMENDMENT)
    try:
        answer = await s.signed(s.client.missing, round, missing[:MAX_REFUSED])  # more: no amendment will do
    except Refused as e:
        log.warning("round %d: the report of missing packets was refused (%s: %s)", round, e.code, e.detail)
        return None
    fetch_timeout_s = s.config.network.fetch_timeout_s
    log.warning(
        "round %d: reported the packets of %s missing (manifest version %d); waiting up to %.0f s for "
        "an amended manifest",
        round,
        ", ".join(missing),
        answer.manifest_version,
        fetch_timeout_s,
    )
    version, lacking = view.manifest_version, set(missing)
    give_up_at = time.monotonic() + fetch_timeout_s
    while (remaining_s := give_up_at - time.monotonic()) > 0 and not s.stopping.is_set():
        latest = await s.client.round(round, wait_s=min(remaining_s, MAX_LONG_POLL_S), version_gt=version)
        if latest.manifest_version <= version:
            continue
        version = latest.manifest_version
        if not lacking & {e.peer_id for e in latest.manifest}:
            log.info("round %d: manifest version %d leaves out %s", round, version, ", ".join(sorted(latest.dropped)))
            return latest
    return None


def keep(s: Session, round: int, view: RoundView, payloads: dict[str, bytes], prepared: Prepared) -> None:
    """Keep what recomputing `round` needs; called just before its outer step commits `prepared`."""
    if s.run.outer.overlap:  # nothing to put back (see the module docstring): only the version
        s.state.amendments.keep(KeptRound(round, view.manifest_version, None, {}, {}))
        return
    s.state.amendments.keep(
        KeptRound(
            round=round,
            manifest_version=view.manifest_version,
            start=s.outer.keep_start(prepared),
            payloads={e.peer_id: payloads[e.peer_id] for e in view.manifest},
            public_keys={e.peer_id: bytes.fromhex(e.public_key) for e in view.manifest},
        )
    )


def watch_kept(s: Session) -> None:
    """Start reading the kept round's view (its latest manifest version) in the background."""
    kept = s.state.amendments.kept
    if kept is not None and kept.latest is None:
        kept.latest = asyncio.create_task(s.client.round(kept.round))


async def latest_view(s: Session, kept: KeptRound) -> RoundView:
    """The kept round's view: the read `watch_kept` started, or a new one."""
    task, kept.latest = kept.latest, None
    return await task if task is not None else await s.client.round(kept.round)


async def recompute(s: Session, view: RoundView) -> ApplyResult | None:
    """Apply `view` (a newer version of the kept round) instead of the version applied: put the
    kept start back and commit the amended set; the session's report of the round takes the new
    digest and version. None when that is not possible (overlap)."""
    kept = s.state.amendments.kept
    assert kept is not None and view.round == kept.round
    if kept.start is None or not {e.peer_id for e in view.manifest} <= set(kept.payloads):
        return None  # an amendment only removes entries, so only overlap gets here
    payloads = {e.peer_id: kept.payloads[e.peer_id] for e in view.manifest}
    prepared = await asyncio.to_thread(
        s.outer.prepare, payloads, kept.public_keys.__getitem__, run_id=s.run_id, round=kept.round
    )
    s.outer.restore_start(kept.start)
    applied = s.outer.commit(prepared)
    kept.payloads = payloads
    done = s.state.recomputed(kept, view.manifest_version, await asyncio.to_thread(param_tree, s.outer.start))
    # A recompute concerns a recent round: the reports are searched newest first.
    report = next((r for r in reversed(s.reports) if r.applied_round == done.round), None)
    if report is not None:
        report.digest, report.manifest_version = done.digest, done.to_version
    log.warning(
        "round %d: manifest amended from version %d to %d (dropped %s); recomputed from the kept "
        "round start: digest %s",
        done.round,
        done.from_version,
        done.to_version,
        ", ".join(sorted(view.dropped)),
        done.digest[:12],
    )
    return applied
