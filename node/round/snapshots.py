"""Serving the global model to peers catching up: a snapshot of the parameters that start a round
(and the outer state), published off the critical path after every outer step, at resume and
after a catch-up. From this node's checkpoint when it holds that round, else from the round-start
tensors themselves. Failing to serve never stops the node: serving helps others."""

from __future__ import annotations

import asyncio
import logging

from node.round.session import Session
from protocol.digest import Tree

log = logging.getLogger("locoswarm.node")


async def serve_snapshot(
    s: Session, round: int, params_tree: Tree | None = None, state_tree: Tree | None = None
) -> None:
    """Serve the global model that starts `round` (and the outer state), published off the
    critical path: from this node's checkpoint when it holds that round, else from the round-start
    tensors themselves, read as they are served (no copy: served until the next outer step moves
    them, then the fetchers resume at another holder). `params_tree`: their hash tree, if known."""
    if params_tree is not None and params_tree.hex != s.state.digest:
        params_tree = state_tree = None  # the start moved since (a recompute): hash it as it is now
    try:
        snapshot = await asyncio.to_thread(_snapshot_of, s, round, params_tree, state_tree)
    except Exception as e:  # serving snapshots helps others; failing to must not stop this node
        log.warning("round %d: no parameter snapshot to serve: %s", round, e)
        return
    s.spawn(_publish_snapshot(s, round, snapshot))


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
