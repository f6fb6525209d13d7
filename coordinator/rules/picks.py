"""Bounded rounds on the coordinator (``outer.max_contributors`` M > 0): a round's pick and its early
close. The rule is protocol/selection.py's, which any peer can recompute; this module only hands it
the public facts and writes down what it decided.

- The facts, as of the round's close, per member (`candidates`): proven (its ``last_contributed_round``
  is set and its standing, once judged, has credit) and waited (rounds since that round, or since
  it became a member). The seed (`seed`): the newest agreed digest of a round before r, which
  never changes once agreed; the round row records which round that was (``seed_round``).
- The pick (`pick`): when a bounded round closes, every submission gets a ``selections`` row with
  its inputs, its rank and whether it was picked; the view ``manifest_entries`` leaves the others
  out, so everything that reads manifests (votes, standing, round views, amendments) sees the
  pick. Nothing is refused: a submission that is not picked was accepted and is shown with why.
- Early close (`settled`): a bounded round closes once `protocol.selection.settled` holds for its
  submissions, the peers it waits for (coordinator/rules/standing.py) and the proven members whose
  turn it is (`due`), besides the unbounded rule (every waited-for peer submitted).
"""

from __future__ import annotations

import math
from collections.abc import Collection

from coordinator.storage import PeerRow, SelectionRow, Storage
from protocol import selection
from protocol.selection import Candidate


def bounded(max_contributors: int) -> bool:
    return max_contributors > 0


def candidate(peer: PeerRow, round_index: int) -> Candidate:
    """A member's public inputs to the rule at round r (see the module docstring)."""
    last = peer.last_contributed_round
    proven = last is not None and (peer.standing is None or peer.credit > 0)
    waited = round_index - 1 - last if last is not None else round_index - peer.member_since_round
    return Candidate(peer.peer_id, proven, max(0, waited))


def candidates(storage: Storage, run_id: str, round_index: int, peer_ids: Collection[str]) -> list[Candidate]:
    wanted = set(peer_ids)
    return [candidate(p, round_index) for p in storage.list_peers(run_id) if p.peer_id in wanted]


def seed(storage: Storage, run_id: str, round_index: int) -> tuple[bytes, int | None]:
    """Round r's seed and the round whose agreed digest it takes (None: nothing agreed yet)."""
    agreed = storage.latest_agreed_round(run_id)
    if agreed is not None and agreed.round < round_index:
        return selection.round_seed(run_id, round_index, agreed.agreed_digest), agreed.round
    return selection.round_seed(run_id, round_index, None), None


def settled(
    storage: Storage, run_id: str, round_index: int, max_contributors: int, window_rounds: int, waited: dict[str, bool]
) -> bool:
    """Whether the bounded round's picks can no longer change by a submission it waits for: the
    waited-for peers, and the proven members whose turn it is (`due`)."""
    submitted = {s.peer_id for s in storage.list_submissions(run_id, round_index)}
    members = {
        p.peer_id: candidate(p, round_index)
        for p in storage.list_peers(run_id)
        if p.peer_id in submitted or _may_be_waited_for(p, round_index)
    }
    pending = {p for p, done in waited.items() if not done} | (
        due(members.values(), max_contributors, window_rounds) - submitted
    )
    pool = [members[p] for p in submitted | pending if p in members]
    round_seed, _ = seed(storage, run_id, round_index)
    return selection.settled(pool, submitted, pending, max_contributors, round_seed)


def _may_be_waited_for(peer: PeerRow, round_index: int) -> bool:
    """A live member of round r that is neither excluded nor flagged (coordinator/rules/standing.py)."""
    return (
        peer.status == "live"
        and peer.member_since_round <= round_index
        and peer.excluded_round is None
        and peer.withheld_round is None
    )


def due(members: Collection[Candidate], max_contributors: int, window_rounds: int) -> set[str]:
    """The proven members a bounded round waits for besides its contributors: those left out by the
    rotation rather than by missing rounds. The standing rule waits for a packet in the last
    ``max_missed_rounds`` (K) manifests, but a member the pick left out has none there through no
    fault of its own, and it is first in line: closing on the others' packets would leave it out
    again. So a proven member is due while it has waited fewer rounds than the rotation takes
    (ceil(P / (M - F)), P the proven members) plus K: one that then still does not submit has
    missed K turns, and no round waits for it any more, as in an unbounded run."""
    proven = [c for c in members if c.proven]
    places = max(1, max_contributors - selection.newcomer_floor(max_contributors))
    rotation = math.ceil(len(proven) / places)
    return {c.peer_id for c in proven if c.waited_rounds < rotation + window_rounds}


def pick(storage: Storage, run_id: str, round_index: int, max_contributors: int) -> None:
    """Round r closes: in a bounded run, rank its submissions and record each with whether it is in
    the manifest; before anything reads the closed round's manifest."""
    if not bounded(max_contributors):
        return
    submitted = [s.peer_id for s in storage.list_submissions(run_id, round_index)]
    round_seed, seed_round = seed(storage, run_id, round_index)
    chosen = selection.select(
        candidates(storage, run_id, round_index, submitted), submitted, max_contributors, round_seed
    )
    storage.insert_selections(
        [
            SelectionRow(
                run_id=run_id,
                round=round_index,
                peer_id=peer_id,
                proven=int(r.candidate.proven),
                waited_rounds=r.candidate.waited_rounds,
                rank=r.rank,
                tier_size=r.tier_size,
                tier_places=r.tier_places,
                picked=int(r.picked),
            )
            for peer_id, r in sorted(chosen.ranks.items())
        ]
    )
    storage.update_round(run_id, round_index, seed_round=seed_round)
