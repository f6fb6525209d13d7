"""Catching up: bringing a node's parameters to the start of the coordinator's open round.

A node falls behind when it joins a running run, misses a round's deadline, cannot fetch a
manifest packet, or was paused. Closed rounds whose packets are still served are replayed (fetch
the manifest, as amended so far, and apply it: exact, and cheap); otherwise the newest parameter
snapshot whose digest the coordinator recorded as the majority is fetched from peers and
checked. A replay asks the exchange first who holds the round's packets: when no peer announces
some packet (forgotten, or its publisher gone), it goes to a snapshot at once instead of waiting
out a fetch time-out, and it never reports packets missing (that is for the peers applying the
round as it happens). Error feedback restarts at zero after a snapshot (the update it held is
lost, not sent twice).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from node.round.prefetch import Decoded
from node.round.reports import CatchUpReport, RoundTimes
from node.round.session import Session
from node.round.steps import CatchUpNeeded, apply_manifest
from protocol.http import RoundView

log = logging.getLogger("locoswarm.node")

SNAPSHOT_ROUNDS_TRIED = 3  # the newest agreed snapshots tried, newest first
HOLDERS_LOOKUP_S = 10.0  # at most this long (or the fetch time-out) to learn who holds a round's packets


async def catch_up(s: Session, decoded: Decoded) -> CatchUpReport:
    """Bring the parameters to the start of the open round; say which round that is and how.
    Whatever local progress ran ahead of the global model (overlap) is dropped with the rounds
    skipped."""
    from_round = s.params_round
    round, method = await _catch_up_to_open_round(s, decoded)
    s.outer.finish()
    s.outer.reset_to_params()
    return CatchUpReport(from_round=from_round, to_round=round, method=method)


async def _catch_up_to_open_round(s: Session, decoded: Decoded) -> tuple[int, str]:
    s.activity.state = "catching_up"
    loaded = False  # a snapshot was loaded on an earlier pass
    while not s.stopping.is_set():
        status = await s.client.status()
        current = status.current_round.round if status.current_round else status.run.current_round
        majority = {h.round + 1: h.majority_digest for h in status.history if h.majority_digest}
        if s.params_round is not None and s.params_round < current:
            try:
                for r in range(s.params_round, current):
                    await replay(s, r, decoded)
                return current, "snapshot+replay" if loaded else "replay"
            except CatchUpNeeded as e:
                log.info("replay stopped: %s; loading a snapshot", e)
        if s.params_round == current:
            return current, "snapshot" if loaded else "none"
        for start_round in sorted((r for r in majority if r <= current), reverse=True)[:SNAPSHOT_ROUNDS_TRIED]:
            if await load_snapshot(s, start_round, majority[start_round]):
                loaded = True
                break
        else:
            if current == 0 or not majority:
                s.params_round = 0  # nothing applied yet: the seeded initialisation is the start
                return current, "none"
            await asyncio.sleep(1.0)  # snapshots not announced yet: peers are still applying
    return s.params_round or 0, "none"


async def replay(s: Session, round: int, decoded: Decoded) -> None:
    """Apply a closed round's manifest without having trained in it."""
    view = await s.client.round(round)
    if view.state != "closed":
        raise CatchUpNeeded(f"round {round} is not closed")
    if gone := await packets_gone(s, round, view):
        raise CatchUpNeeded(f"round {round}: no peer holds the packets of {', '.join(gone)}")
    await apply_manifest(s, round, view, RoundTimes(), decoded, report_missing=False)
    log.info("round %d: replayed the manifest (%d packets)", round, len(view.manifest))


async def packets_gone(s: Session, round: int, view: RoundView) -> list[str]:
    """Manifest entries of `round` that no peer announces holding, as the exchange's lookup says;
    [] when the lookup fails or is slow (the fetch then decides)."""
    if not view.manifest:
        return []

    async def lookup() -> list[str]:
        announced = await s.exchange.announcements(round)
        unsure = [e for e in view.manifest if (a := announced.get(e.peer_id)) is None or a.digest != e.packet_digest]
        holders = await asyncio.gather(*(s.exchange.holders(round, e.peer_id) for e in unsure))
        return [e.peer_id for e, found in zip(unsure, holders) if not any(h.digest == e.packet_digest for h in found)]

    try:
        return await asyncio.wait_for(lookup(), timeout=min(HOLDERS_LOOKUP_S, s.config.fetch_timeout_s))
    except Exception as e:  # looking up holders only saves time; fetching decides
        log.debug("round %d: looking up the packets' holders failed: %r", round, e)
        return []


async def load_snapshot(s: Session, round: int, params_digest: str) -> bool:
    """Fetch peers' snapshot of the parameters that start `round`; keep it if its digest matches."""
    import torch
    from safetensors.torch import load

    from node.training.params import flat_named_params, param_digest

    holders = await s.exchange.params_holders(round)
    for blob_digest, _ in Counter(h.digest for h in holders).most_common():
        data = await s.exchange.fetch_params(round, blob_digest, timeout_s=s.config.fetch_timeout_s)
        if data is None:
            continue
        try:
            tensors = load(data)
        except Exception as e:  # hostile bytes: safetensors raises its own types
            log.warning("round %d: snapshot %s does not load: %s", round, blob_digest[:12], e)
            continue
        params = flat_named_params(s.training.model)
        if any(name not in tensors or tensors[name].shape != p.shape for name, p in params.items()):
            log.warning("round %d: snapshot %s does not fit the model", round, blob_digest[:12])
            continue
        if param_digest({n: tensors[n] for n in params}) != params_digest:
            log.warning("round %d: snapshot %s is not the coordinator's parameters", round, blob_digest[:12])
            continue
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])
        await asyncio.to_thread(_load_outer_state, s, tensors)
        s.amendments.reset()  # these parameters follow none of the rounds applied here
        s.params_round = round
        log.info("round %d: loaded parameters %s from peers (%d bytes)", round, params_digest[:12], len(data))
        return True
    return False


def _load_outer_state(s: Session, tensors) -> None:
    with s.buffers_lock:  # an encode cancelled by the catch-up may still be running
        s.outer.load_snapshot_state(tensors)
