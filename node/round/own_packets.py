"""This node's own packets on disk until their rounds are final, beside its checkpoint.

DESIGN.md, "A submitted packet is durable until its round is final". A swarm stopped all at once
after a round closed holds that round's manifest at the coordinator and its packets nowhere but in
the memory of the nodes that died; restarted, nobody could apply the round. So a node with a
checkpoint directory writes each packet it is about to submit here first (atomically, fsynced),
and on a restart serves every packet it still holds again:

    packets = OwnPackets.beside(checkpoint_dir)   # None without a checkpoint directory
    packets.keep(round, payload, train_loss=..., compute_s=...)   # before the submission
    held = packets.load(round)                    # a HeldPacket (bytes checked), or None
    packets.forget_before(round)                  # rounds that can no longer be amended

Layout: ``<checkpoint_dir>-packets/round-<r>.pkt`` (the signed packet's bytes) and
``round-<r>.json`` (its sha256, the run, the publisher, the round start's digest, and the round's
train loss and compute time, written after the bytes: a packet without its meta is a crash midway and is ignored). The
directory sits beside the checkpoint, not in it, because a checkpoint is replaced as a whole
directory (node/training/checkpoint.py).

A round is final once it is older than the coordinator's window for amendments
(protocol.http.MISSING_REPORT_ROUNDS) below the round applied: nobody asks for its packet any
more, and a catching-up peer loads a snapshot instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from node.durable import fsync_dir, replace_synced
from protocol.http import MISSING_REPORT_ROUNDS

log = logging.getLogger("locoswarm.node")

_NAME = re.compile(r"^round-(\d{1,10})\.json$")
# Rounds back from the newest whose packets may still be asked for: the coordinator's window for
# missing reports (and so amendments), plus the round being applied.
KEPT_ROUNDS = MISSING_REPORT_ROUNDS + 1


@dataclass(frozen=True, slots=True)
class HeldPacket:
    """A packet this node submitted (or was about to), as read back from disk."""

    round: int
    payload: bytes
    digest: str  # sha256 hex of `payload`: what the coordinator's manifest names
    run_id: str
    peer_id: str
    base_digest: str  # the parameters the packet's update starts from (the round's start)
    train_loss: float
    compute_s: float


class OwnPackets:
    """The folder of this node's own packets (see the module docstring)."""

    def __init__(self, directory: Path):
        self.directory = directory

    @classmethod
    def beside(cls, checkpoint_dir: Path | str | None) -> OwnPackets | None:
        if checkpoint_dir is None:
            return None
        checkpoint_dir = Path(checkpoint_dir)
        return cls(checkpoint_dir.parent / f"{checkpoint_dir.name}-packets")

    def _paths(self, round: int) -> tuple[Path, Path]:
        stem = self.directory / f"round-{round:06d}"
        return stem.with_suffix(".pkt"), stem.with_suffix(".json")

    def keep(
        self,
        round: int,
        payload: bytes,
        *,
        run_id: str,
        peer_id: str,
        base_digest: str,
        train_loss: float,
        compute_s: float,
    ) -> str:
        """Write the packet of `round` durably (bytes, then meta, each fsynced and renamed into place);
        returns its digest. Raises OSError when the disk refuses (the caller decides)."""
        digest = hashlib.sha256(payload).hexdigest()
        data_path, meta_path = self._paths(round)
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "round": round,
            "digest": digest,
            "run_id": run_id,
            "peer_id": peer_id,
            "base_digest": base_digest,
            "train_loss": train_loss,
            "compute_s": compute_s,
            "size_bytes": len(payload),
        }
        replace_synced(data_path, payload)
        replace_synced(meta_path, json.dumps(meta, sort_keys=True).encode())
        fsync_dir(self.directory)
        return digest

    def load(self, round: int) -> HeldPacket | None:
        """The packet of `round`, if held intact (its bytes hash to the digest its meta names)."""
        data_path, meta_path = self._paths(round)
        try:
            meta = json.loads(meta_path.read_text())
            payload = data_path.read_bytes()
        except (OSError, ValueError):
            return None
        digest = hashlib.sha256(payload).hexdigest()
        if not isinstance(meta, dict) or meta.get("digest") != digest or meta.get("round") != round:
            log.warning("round %d: the packet kept in %s is damaged; not served", round, self.directory)
            return None
        try:
            return HeldPacket(
                round=round,
                payload=payload,
                digest=digest,
                run_id=str(meta["run_id"]),
                peer_id=str(meta["peer_id"]),
                base_digest=str(meta["base_digest"]),
                train_loss=float(meta["train_loss"]),
                compute_s=float(meta["compute_s"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def rounds(self) -> list[int]:
        """The rounds whose packet meta is on disk, ascending."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(int(m.group(1)) for name in names if (m := _NAME.match(name)))

    def held(self, run_id: str, peer_id: str) -> list[HeldPacket]:
        """Every intact packet of this run and publisher, ascending by round."""
        packets = (self.load(r) for r in self.rounds())
        return [p for p in packets if p is not None and p.run_id == run_id and p.peer_id == peer_id]

    def forget_before(self, round: int) -> None:
        """Delete the packets of rounds before `round` (final: see the module docstring)."""
        for r in self.rounds():
            if r >= round:
                break
            for path in self._paths(r)[::-1]:  # meta first: bytes without meta are ignored
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("round %d: cannot delete the kept packet %s: %s", r, path, e)
