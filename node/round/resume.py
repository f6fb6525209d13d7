"""Resuming from this node's own checkpoint: a node that stopped (a night, a crash, a reboot)
goes on as if it had never stopped, when the swarm agrees with what it holds.

After applying round r a node writes (node.training.checkpoint, atomically, every
`checkpoint_every_rounds` rounds) the global model that starts round r+1, its inner AdamW
moments, its error-feedback buffers (SparseLoCo) or outer momentum (DiLoCo), the round, and the
parameter digest; the data position is the round itself (batches are a function of the global
step). On start, `restore` loads the newest checkpoint of this run, if any, and keeps it when
its digest is the coordinator's agreed digest for the start of that round (agreed, never merely
provisional: coordinator/service.py, "Agreed digests"); the round loop then
trains the open round directly, or replays the rounds closed since (node/round/catchup.py),
with the error feedback and the Adam moments it had. A checkpoint the swarm does not agree
with, of another run, or unreadable is set aside with one log line, and the node catches up
from peers as a new one would. One whose digest the swarm agrees on later (a lone contributor's
round is agreed only when the next round closes, and a swarm restarted in between finds no
agreed digest yet) is loaded by the catch-up then (`restore_agreed_since`). A checkpoint the swarm agrees with is also what this node serves
to peers catching up: its files are streamed as they are (node/training/snapshot.py).

The outer step's own state goes through the `OuterStep` protocol (node/training/base.py):
`state_dict` when saving, `load_state_dict` when loading. With overlap the error buffers already
hold the update of the round in flight when a checkpoint is written; that update is not sent
again: they restart at zero, as after a snapshot.
"""

from __future__ import annotations

import asyncio
import logging

from node.round.session import Session
from node.round.snapshots import serve_snapshot

log = logging.getLogger("locoswarm.node")


def save(s: Session, applied_round: int, midway=None) -> None:
    """The checkpoint after applying `applied_round` (it starts the next); a failure is logged and
    training goes on: the swarm does not need this node's copy. `midway`: fault injection's crash
    while the checkpoint is written (node/faults.py)."""
    from node.training.checkpoint import CheckpointError, save_checkpoint

    try:
        save_checkpoint(
            s.config.checkpoints.checkpoint_dir,
            applied_round + 1,
            s.training.model,
            s.training.optimizer,
            extra={"run_id": s.run_id, "applied_round": applied_round, "peer_id": s.peer_id},
            params=s.outer.start,
            midway=midway,
            **s.outer.state_dict(),  # error_buffers (SparseLoCo), outer_momentum (DiLoCo)
        )
    except CheckpointError as e:  # disk full, unwritable
        log.error("round %d: checkpoint not saved, training goes on: %s", applied_round, e)


def held_state(config, run_id: str) -> tuple[int, str] | None:
    """(round, digest) of this run's checkpoint in `config.checkpoints.checkpoint_dir`, read from its meta only;
    the node tells the coordinator at join, which then expects it in the open round at once when
    that is the agreed state."""
    from node.training.checkpoint import CheckpointError, checkpoint_meta

    if config.checkpoints.checkpoint_dir is None:
        return None
    try:
        meta = checkpoint_meta(config.checkpoints.checkpoint_dir)
    except CheckpointError:
        return None
    if meta.get("extra", {}).get("run_id") != run_id or not isinstance(meta.get("round"), int) or meta["round"] < 1:
        return None
    return meta["round"], meta["digest"]


def due(s: Session, applied_round: int) -> bool:
    checkpoints = s.config.checkpoints
    return checkpoints.checkpoint_dir is not None and (applied_round + 1) % checkpoints.checkpoint_every_rounds == 0


async def restore(s: Session) -> bool:
    """Load this run's checkpoint when the coordinator agrees with its digest; True if loaded."""
    from node.training.checkpoint import CheckpointError, checkpoint_meta

    directory = s.config.checkpoints.checkpoint_dir
    if directory is None:
        return False
    try:
        meta = checkpoint_meta(directory)
    except CheckpointError as e:
        log.info("no checkpoint to resume from: %s", e)
        return False
    round, digest, run_id = meta.get("round"), meta.get("digest"), meta.get("extra", {}).get("run_id")
    if run_id != s.run_id:
        log.warning("the checkpoint in %s is of run %s, not %s: not used", directory, run_id, s.run_id)
        return False
    status = await s.client.status()
    agreed = {h.round + 1: h.agreed_digest for h in status.history if h.agreed_digest}
    if agreed.get(round) != digest:
        log.warning(
            "the checkpoint of round %s (digest %s) is not the swarm's agreed state (%s): catching up instead"
            " (it is loaded still if the swarm agrees on it later)",
            round,
            str(digest)[:12],
            (agreed.get(round) or "none")[:12],
        )
        return False
    return await _load_agreed(s, directory, round, digest)


async def restore_agreed_since(s: Session, agreed: dict[int, str], current: int) -> bool:
    """During a catch-up: load this run's checkpoint when the swarm has agreed on its digest since
    `restore` set it aside, and it is newer than the parameters held; True if loaded. A round's
    digest is agreed only when the next round closes (a lone contributor's, or once nobody is left
    to vote): a whole swarm restarted in that gap sets every checkpoint aside at start, and then
    nobody serves the agreed state although every node holds it on disk."""
    held = held_state(s.config, s.run_id)
    if held is None:
        return False
    round, digest = held
    params_round = s.state.params_round
    if agreed.get(round) != digest or round > current or (params_round is not None and round <= params_round):
        return False
    return await _load_agreed(s, s.config.checkpoints.checkpoint_dir, round, digest, since=True)


async def _load_agreed(s: Session, directory, round: int, digest: str, since: bool = False) -> bool:
    from node.training.checkpoint import CheckpointError

    try:
        await asyncio.to_thread(_load, s, directory)
    except CheckpointError as e:  # unreadable or corrupt tensors: the digest check inside refuses them
        log.warning("the checkpoint in %s does not load: %s; catching up instead", directory, e)
        s.state.params_unknown()  # some tensors may be the checkpoint's already
        return False
    s.sent.clear()  # the error buffers are the checkpoint's: nothing sent from later ones can go back
    s.state.loaded(round, digest, None)
    log.info(
        "resumed from the checkpoint of round %d (digest %s%s)", round, digest[:12], ", agreed since" if since else ""
    )

    await serve_snapshot(s, round)  # streamed from the checkpoint's files to peers catching up
    return True


def _load(s: Session, directory) -> None:
    from node.training.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(directory, s.training.model, s.training.optimizer, device=s.training.device)
    # With overlap the saved buffers hold the update in flight then: they restart at zero (see above).
    error_buffers = {} if s.run.outer.overlap else checkpoint.error_buffers
    with s.buffers_lock:
        s.outer.reset_to_params()  # the saved parameters are the global model that starts the round
        s.outer.load_state_dict({"error_buffers": error_buffers, "outer_momentum": checkpoint.outer_momentum})
