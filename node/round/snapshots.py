"""Serving the global model to peers catching up: a snapshot of the parameters that start a round
(and the outer state), published off the critical path after every outer step, at resume and
after a catch-up. From this node's checkpoint when it holds that round, else from the round-start
tensors themselves. Failing to serve never stops the node: serving helps others.

With snapshots in the packet mirror, the answer to an applied report may hand this node a
presigned PUT (`AppliedResponse.snapshot_put_url`): the same snapshot is then streamed to the store
in the background (node/exchange/mirror.py) and, once the store took it, reported to the
coordinator with its digest and size (coordinator/rules/snapshots.py). A failed upload or report is
logged: the other uploader, or the peers, still serve it. `mirror_snapshot_bytes` is the size an
applied report states in the rounds whose snapshot goes to the store."""

from __future__ import annotations

import asyncio
import logging

from node.round.session import Session
from protocol.digest import Tree

log = logging.getLogger("locoswarm.node")


async def serve_snapshot(
    s: Session,
    round: int,
    params_tree: Tree | None = None,
    state_tree: Tree | None = None,
    mirror_put_url: str | None = None,
) -> None:
    """Serve the global model that starts `round` (and the outer state), published off the
    critical path: from this node's checkpoint when it holds that round, else from the round-start
    tensors themselves, read as they are served (no copy: served until the next outer step moves
    them, then the fetchers resume at another holder). `params_tree`: their hash tree, if known;
    `mirror_put_url`: where to upload it too (see the module docstring)."""
    if params_tree is not None and params_tree.hex != s.state.digest:
        params_tree = state_tree = None  # the start moved since (a recompute): hash it as it is now
    try:
        snapshot = await asyncio.to_thread(_snapshot_of, s, round, params_tree, state_tree)
    except Exception as e:  # serving snapshots helps others; failing to must not stop this node
        log.warning("round %d: no parameter snapshot to serve: %s", round, e)
        return
    s.spawn(_publish_snapshot(s, round, snapshot))
    if mirror_put_url is not None:
        s.spawn(_mirror_snapshot(s, round, snapshot, mirror_put_url))


async def mirror_snapshot_bytes(s: Session, applied_round: int) -> int | None:
    """The size of the snapshot of round `applied_round` + 1's start, for the applied report of
    `applied_round` when that snapshot goes to the packet mirror; None otherwise."""
    section = s.run.exchange.mirror
    if section is None or not section.snapshot_after(applied_round):
        return None
    from node.training.params import flat_named_params
    from node.training.snapshot import snapshot_size

    return await asyncio.to_thread(lambda: snapshot_size(flat_named_params(s.training.model), s.outer.snapshot_state()))


async def _mirror_snapshot(s: Session, round: int, snapshot, url: str) -> None:
    from node.exchange import mirror
    from node.round.coordinator_client import CoordinatorCallFailed, Refused

    label = f"round {round}: the snapshot of its start"
    if not await mirror.upload_snapshot(url, snapshot, timeout_s=s.config.network.fetch_timeout_s, label=label):
        return
    try:
        await s.signed(s.client.snapshot_uploaded, round - 1, snapshot.digest, snapshot.size_bytes)
    except (Refused, CoordinatorCallFailed) as e:  # the mirror only helps: never stop for it
        log.warning("%s is in the mirror, but reporting it failed: %s", label, e)


async def _publish_snapshot(s: Session, round: int, snapshot) -> None:
    try:
        await s.exchange.publish_params(round, snapshot)
    except Exception as e:  # serving snapshots helps others; failing to must not stop this node
        log.warning("round %d: could not publish a parameter snapshot: %s", round, e)


def _snapshot_of(s: Session, round: int, params_tree: Tree | None, state_tree: Tree | None):
    from node.training.checkpoint import CheckpointError, checkpoint_meta
    from node.training.params import flat_named_params
    from node.training.snapshot import Snapshot

    directory = s.config.checkpoints.checkpoint_dir
    if directory is not None:
        try:
            meta = checkpoint_meta(directory)
            if (
                meta.get("round") == round
                and meta.get("extra", {}).get("run_id") == s.run_id
                and (params_tree is None or meta.get("digest") == params_tree.hex)
            ):
                return Snapshot.from_checkpoint(directory, params_tree)
        except CheckpointError as e:
            log.info("round %d: serving the snapshot from memory, not the checkpoint: %s", round, e)
    # The global model (equal to the parameters, except with overlap, where they run ahead).
    params = {n: s.outer.start[n] for n in flat_named_params(s.training.model)}
    return Snapshot.from_tensors(params, s.outer.snapshot_state(), params_tree, state_tree)
