"""Amended manifests on the node: packets nobody serves, and rounds applied from an older version.

DESIGN.md, "Manifests can be amended, never forked"; the coordinator's rules are in
coordinator/service.py and protocol/http.py ("Amended manifests"). node/round/steps.py
(`apply_manifest`) calls what is here at two moments:

- Some manifest entries could not be fetched within the fetch time-out (`await_amendment`): the
  node reports them (``POST rounds/{r}/missing``) and long-polls the round for a newer manifest
  version, for up to ``fetch_timeout_s`` more. When an amended manifest no longer lists what it
  lacks, it aggregates that one (fetching nothing new) and reports its digest with the version;
  otherwise the round loop catches up (`CatchUpNeeded`) as before.
- The node had every packet and applied a version that is amended later (`KeptRound`): at each
  outer step it keeps the round's start (the global model before the step, on its device, and
  DiLoCo's outer momentum) and the round's packet bytes, until the next round's outer step.
  Before that step it looks at the kept round's latest view, read while the next round's packets
  were fetched (`watch_kept`, so the common case waits for nothing); when the version grew, it
  puts the start back and commits the amended set (`recompute`: outer.prepare on the remaining
  packets, then commit), reports the new digest with the version and republishes its snapshot.
  The coordinator's answer to an applied report carries the round's latest version too: an
  amendment that came between this node's fetch and its report is recomputed at once.
- The coordinator's answer to every applied report also lists the recent rounds that were
  amended (`Amendments.outdated`). A round this node applied at an older version that is no
  longer the kept one (the amendment came after the next round's outer step, as it can with
  overlap, whose next round is submitted before this one lands) cannot be recomputed: the node
  raises `CatchUpNeeded` and loads the swarm's parameters from a snapshot instead of staying
  forked.

Costs: one round of packet bytes held per round, and what puts the start back: for SparseLoCo only
the coordinates the aggregate moved (an outer step `theta - aggregate` leaves every other coordinate
exactly as it was, so the start is the current round start with those coordinates restored: a bit
per coordinate and 4 bytes for each of about R x k/chunk of the model for R packets, on the training
device, `StartPatch`), for DiLoCo (dense) a copy of the global model
and its momentum. A recompute decodes the kept packets again (it is rare). The checkpoint written after the older version is
not rewritten: on a restart the coordinator disagrees with its digest and the node catches up.

With overlap (outer.overlap) the parameters have run a round ahead of the global model when a
round lands, so no start is kept: a node that learns that a round it applied was amended raises
`CatchUpNeeded` and loads the swarm's parameters from a snapshot. Reporting missing packets and
applying the amended manifest work the same with overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node.round.coordinator_client import Refused
from protocol.http import MAX_LONG_POLL_S, MAX_REFUSED, MISSING_REPORT_ROUNDS, RoundView

if TYPE_CHECKING:
    import torch

    from node.round.session import Session
    from node.training.outer import ApplyResult

log = logging.getLogger("locoswarm.node")


@dataclass(frozen=True, slots=True)
class Recomputed:
    """A round this node applied again because its manifest was amended."""

    round: int
    from_version: int
    to_version: int
    digest: str  # of the global model after the amended round


# Above this share of a tensor's coordinates moved, a patch (1 bit per coordinate + 4 bytes per moved
# one) saves too little over a dense copy (4 bytes per coordinate) to be worth its restore.
MAX_PATCH_FRACTION = 0.75
_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as uint8, eight to a byte, first in the high bit (zero-padded)."""
    import torch

    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask.reshape(-1)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` bits as a flat bool tensor."""
    import torch

    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(1) & weights).bool().reshape(-1)[:count]


@dataclass(frozen=True, slots=True)
class StartPatch:
    """A SparseLoCo round start kept as the coordinates its outer step changed: name -> (bitmask of
    the moved coordinates, their values before the step, in index order), or a dense copy where
    too much of the tensor moved. The patch lives on `device` (the training device: the host then
    holds only the round start and the error buffer); dense copies stay beside the start."""

    coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor]

    @classmethod
    def before(
        cls,
        start: dict[str, torch.Tensor],
        aggregates: dict[str, torch.Tensor] | None,
        device: torch.device | str | None = None,
    ) -> StartPatch:
        """What `start` holds where `aggregates` is non-zero (nothing moves where it is zero: x - 0 == x)."""
        coordinates, dense = {}, {}
        for name, value in start.items():
            if aggregates is None:
                continue  # no aggregate: the outer step changes nothing
            aggregate = aggregates[name]
            if aggregate.numel() != value.numel():  # a multi-rank node's rank 0 holds its own rows only
                dense[name] = value.clone()
                continue
            moved = aggregate.reshape(-1) != 0
            index = moved.nonzero().squeeze(1).to(value.device)  # (M,), ascending
            if index.numel() > MAX_PATCH_FRACTION * value.numel():
                dense[name] = value.clone()
                continue
            target = device if device is not None else value.device
            coordinates[name] = (pack_bits(moved).to(target), value.reshape(-1)[index].to(target))
        return cls(coordinates, dense)

    def restored(self, name: str, after: torch.Tensor) -> torch.Tensor:
        """Tensor `name` before the step, from the same tensor after it (`after` is not changed)."""
        if name in self.dense:
            return self.dense[name]
        before = after.clone()
        if name in self.coordinates:
            bits, values = self.coordinates[name]
            moved = unpack_bits(bits.to(after.device), after.numel())
            before.view(-1)[moved] = values.to(after.device)  # boolean index: ascending order, as kept
        return before

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes + v.nbytes for b, v in self.coordinates.values()) + sum(
            t.nbytes for t in self.dense.values()
        )


@dataclass(slots=True)
class KeptRound:
    """The last round this node applied, as needed to apply an amended version of it instead."""

    round: int
    manifest_version: int  # the version applied
    start: dict[str, torch.Tensor] | StartPatch  # the global model before the round's outer step ({} with overlap)
    outer_state: dict[str, torch.Tensor]  # DiLoCo's outer momentum before the step ({} otherwise)
    payloads: dict[str, bytes]  # the applied manifest's packets, by publisher ({} with overlap)
    public_keys: dict[str, bytes]
    latest: asyncio.Task | None = None  # a read of the round's view, started by `watch_kept`


@dataclass(slots=True)
class Amendments:
    """A session's kept round, the manifest versions of the rounds its parameters follow, and the
    recomputes it made (tests and reports read them)."""

    kept: KeptRound | None = None
    applied_versions: dict[int, int] = field(default_factory=dict)  # round -> manifest version applied
    recomputed: list[Recomputed] = field(default_factory=list)

    def forget(self) -> None:
        """The kept round cannot be recomputed any more (a later round was applied on top)."""
        if self.kept is not None and self.kept.latest is not None:
            self.kept.latest.cancel()
        self.kept = None

    def reset(self) -> None:
        """The parameters follow none of the rounds applied here (a snapshot was loaded)."""
        self.forget()
        self.applied_versions.clear()

    def outdated(self, amended: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Rounds the parameters follow at an older manifest version than the latest (from the
        coordinator's recent `amended` rounds): round -> (version applied, latest version)."""
        return {
            r: (self.applied_versions[r], v)
            for r, v in sorted(amended.items())
            if r in self.applied_versions and self.applied_versions[r] < v
        }


async def await_amendment(s: Session, round: int, view: RoundView, missing: list[str]) -> RoundView | None:
    """Report the entries this node could not fetch and wait (up to fetch_timeout_s) for a manifest
    version without them; that view, or None (then the node catches up)."""
    s.activity.state = "awaiting_amendment"
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


def keep(
    s: Session, round: int, view: RoundView, payloads: dict[str, bytes], aggregates: dict[str, torch.Tensor] | None
) -> None:
    """Keep what recomputing `round` needs; called just before its outer step commits the
    `aggregates` (node/training/outer.py `Prepared.aggregates`)."""
    s.amendments.forget()
    versions = s.amendments.applied_versions
    versions[round] = view.manifest_version
    for old in [r for r in versions if r < round - MISSING_REPORT_ROUNDS - 2]:
        del versions[old]  # the coordinator amends no round that old
    if s.run.outer.overlap:  # nothing to put back (see the module docstring): only the version
        s.amendments.kept = KeptRound(round, view.manifest_version, {}, {}, {}, {})
        return
    momentum = getattr(s.outer, "momentum", None) or {}  # DiLoCo's; SparseLoCo keeps none
    s.amendments.kept = KeptRound(
        round=round,
        manifest_version=view.manifest_version,
        start=(
            {name: t.clone() for name, t in s.outer.start.items()}
            if momentum
            else StartPatch.before(s.outer.start, aggregates, device=getattr(s.outer, "param_device", None))
        ),
        outer_state={name: m.clone() for name, m in momentum.items()},
        payloads={e.peer_id: payloads[e.peer_id] for e in view.manifest},
        public_keys={e.peer_id: bytes.fromhex(e.public_key) for e in view.manifest},
    )


def watch_kept(s: Session) -> None:
    """Start reading the kept round's view (its latest manifest version) in the background."""
    kept = s.amendments.kept
    if kept is not None and kept.latest is None:
        kept.latest = asyncio.create_task(s.client.round(kept.round))


async def latest_view(s: Session, kept: KeptRound) -> RoundView:
    """The kept round's view: the read `watch_kept` started, or a new one."""
    task, kept.latest = kept.latest, None
    return await task if task is not None else await s.client.round(kept.round)


async def recompute(s: Session, view: RoundView) -> ApplyResult | None:
    """Apply `view` (a newer version of the kept round) instead of the version applied: put the
    kept start back and commit the amended set. None when that is not possible (overlap)."""
    import torch

    kept = s.amendments.kept
    assert kept is not None and view.round == kept.round
    if s.run.outer.overlap or not {e.peer_id for e in view.manifest} <= set(kept.payloads):
        return None  # an amendment only removes entries, so only overlap gets here
    payloads = {e.peer_id: kept.payloads[e.peer_id] for e in view.manifest}
    prepared = await asyncio.to_thread(
        s.outer.prepare, payloads, kept.public_keys.__getitem__, run_id=s.run_id, round=kept.round
    )
    with torch.no_grad():
        for name, p in s.outer.params.items():  # one tensor at a time: no second copy of the model
            p.copy_(
                kept.start.restored(name, s.outer.start[name])
                if isinstance(kept.start, StartPatch)
                else kept.start[name]
            )
        for name, m in (getattr(s.outer, "momentum", None) or {}).items():
            m.copy_(kept.outer_state[name])
    s.outer.reset_to_params()  # the kept start is the global model again
    applied = s.outer.commit(prepared)
    from_version, kept.manifest_version = kept.manifest_version, view.manifest_version
    s.amendments.applied_versions[kept.round] = view.manifest_version
    kept.payloads = payloads
    from node.training.params import param_tree

    s.tree = await asyncio.to_thread(param_tree, s.outer.start)
    s.digest = s.tree.hex
    s.amendments.recomputed.append(Recomputed(kept.round, from_version, view.manifest_version, s.digest))
    log.warning(
        "round %d: manifest amended from version %d to %d (dropped %s); recomputed from the kept "
        "round start: digest %s",
        kept.round,
        from_version,
        view.manifest_version,
        ", ".join(sorted(view.dropped)),
        s.digest[:12],
    )
    return applied
