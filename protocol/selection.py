"""Bounded rounds: which of a round's submissions its manifest takes (`outer.max_contributors` M).

Pure and torch-free, one rule for every side: the coordinator builds each closed round's manifest
with it (coordinator/rules/rounds.py), any peer can recompute it from the round view (which lists
every submission with the inputs below), and the simulator (tools/sim/engine.py) applies it in
process. M = 0 means unbounded: every submission is picked, as before bounded rounds existed.

Inputs, all public: the round's seed (`round_seed`: the run, the round and the newest agreed
digest of an earlier round), and per candidate (`Candidate`) whether it is proven and how many
rounds it has waited.

- *Proven*: a packet of its is in an earlier manifest and its updates earned credit once judged
  (protocol/scoring.py rule 5; not judged yet counts as proven): the standing a key earns only by
  useful work. Fresh keys, and keys whose packets earned nothing, are unproven.
- *Waited*: rounds since its packet was last in a manifest (a peer never picked: since it became a
  member). A pick resets it to 0.

The rule (`select`): each tier is ordered by waited, longest first, then by the seeded hash
H(seed || peer id) (`tie_break`). Of the submissions, the unproven tier gets
``u = min(unproven submitted, max(F, M - proven submitted))`` places, taken in its order, and the
proven tier the other M - u, in its order; F (`newcomer_floor`) is M // 4, at least 1 for M >= 2.
So:

1. *Rotation.* With P proven members that submit every round, the proven tier takes at least
   M - F of them per round, the longest-waiting first: round robin, so each is picked at least
   once every ceil(P / (M - F)) rounds; once no newcomer submits, every ceil(P / M) rounds.
2. *A Sybil flood cannot crowd honest peers out.* Fresh keys are unproven, so however many there
   are they compete only for the newcomer places, F of them while proven members fill the rest:
   the proven members' rotation is untouched. Among newcomers, waiting orders the queue, so a
   flood that joins later queues behind the honest newcomers already waiting; a key that gets in
   and sends nothing useful earns no credit and stays unproven, at the back of the queue again.
3. *Newcomers get in.* At least F places a round go to newcomers while any submits (with M = 1,
   only when no proven member submits), so an honest newcomer becomes proven after a wait of about
   its place in the newcomer queue over F rounds.
4. *Unbounded is the identity.* M = 0, or M at least the number of submissions, picks them all.
5. *Nobody can steer it.* The seed is an agreed digest, unknown before the round before ended, so
   no key can be made in advance to win the hash; the hash only breaks ties in waiting anyway.

Early close (`settled`): a bounded round may close as soon as the picks among the submissions
cannot change by a submission it still waits for: `select` over the submitted peers plus the
waited-for ones that have not submitted (coordinator/rules/standing.py), as if these submitted
too, picks only peers that did submit. Peers nobody waits for cannot hold a round open, as in an
unbounded round. Shown: when those picks all submitted, `select` over the submissions alone picks
the same peers (each tier's count depends only on how many of that tier submitted, and those
outnumber or equal the picks).

A peer left out applies the round without its packet and puts what the packet carried back into
its error buffer (DESIGN.md, "A packet that misses its round keeps its mass"): nothing it trained
is lost, only delayed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

# The newcomer places of a bounded round: M // NEWCOMER_SHARE, at least 1 (`newcomer_floor`).
NEWCOMER_SHARE = 4
SEED_DOMAIN = b"locoswarm.selection.v1"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One member's public inputs to the rule, as of the round's close."""

    peer_id: str
    proven: bool  # a packet in an earlier manifest, and credit once judged
    waited_rounds: int  # rounds since its packet was last in a manifest (never: since it joined)


@dataclass(frozen=True, slots=True)
class Ranked:
    """Where a candidate stands: its rank in its tier (1 = first), the tier's size, the tier's
    places, and whether it was picked."""

    candidate: Candidate
    rank: int
    tier_size: int
    tier_places: int
    picked: bool

    def reason(self) -> str:
        """Why it was picked or not, for the round view and the status page."""
        c = self.candidate
        tier = "proven" if c.proven else "newcomer"
        why = f"{tier} rank {self.rank} of {self.tier_size}, waited {c.waited_rounds} rounds, {self.tier_places} {tier} places"
        return ("picked: " if self.picked else "not picked: ") + why


@dataclass(frozen=True, slots=True)
class Selection:
    """A round's picks among its submissions, in priority order, and every candidate's rank."""

    picked: tuple[str, ...]
    ranks: dict[str, Ranked]


def round_seed(run_id: str, round_index: int, agreed_digest: str | None) -> bytes:
    """Round r's seed: the run, r, and the newest agreed digest of a round before r (None: none
    yet, early in a run)."""
    material = f"{run_id}\n{round_index}\n{agreed_digest or ''}".encode()
    return hashlib.sha256(SEED_DOMAIN + b"\n" + material).digest()


def tie_break(seed: bytes, peer_id: str) -> bytes:
    """H(seed || peer id): orders candidates that waited equally long, differently every round."""
    return hashlib.sha256(seed + peer_id.encode()).digest()


def priority(candidates: Sequence[Candidate], seed: bytes) -> list[Candidate]:
    """One tier's order: longest waited first, then the seeded hash."""
    return sorted(candidates, key=lambda c: (-c.waited_rounds, tie_break(seed, c.peer_id), c.peer_id))


def newcomer_floor(max_contributors: int) -> int:
    """The places newcomers get a round while any submits: M // 4, and 1 for 2 <= M < 8 (with
    M = 1 the one place is the proven members' whenever one submits)."""
    return max(1, max_contributors // NEWCOMER_SHARE) if max_contributors > 1 else 0


def newcomer_places(max_contributors: int, proven_submitted: int, unproven_submitted: int) -> int:
    """How many of M places the unproven tier takes (rule in the module docstring)."""
    floor = max(newcomer_floor(max_contributors), max_contributors - proven_submitted)
    return min(unproven_submitted, floor)


def select(
    candidates: Sequence[Candidate], submitted: Collection[str], max_contributors: int, seed: bytes
) -> Selection:
    """The picks among the candidates that `submitted` (at most `max_contributors`; 0: all), and
    each candidate's rank; candidates that did not submit are ranked but never picked."""
    proven = priority([c for c in candidates if c.proven], seed)
    unproven = priority([c for c in candidates if not c.proven], seed)
    in_proven = [c for c in proven if c.peer_id in submitted]
    in_unproven = [c for c in unproven if c.peer_id in submitted]
    if max_contributors <= 0 or len(in_proven) + len(in_unproven) <= max_contributors:
        places_unproven, places_proven = len(in_unproven), len(in_proven)
    else:
        places_unproven = newcomer_places(max_contributors, len(in_proven), len(in_unproven))
        places_proven = max_contributors - places_unproven
    picked = [c.peer_id for c in in_proven[:places_proven]] + [c.peer_id for c in in_unproven[:places_unproven]]
    chosen = set(picked)
    ranks = {}
    for tier, places in ((proven, places_proven), (unproven, places_unproven)):
        for rank, c in enumerate(tier, start=1):
            ranks[c.peer_id] = Ranked(c, rank, len(tier), places, c.peer_id in chosen)
    return Selection(tuple(picked), ranks)


def settled(
    candidates: Sequence[Candidate],
    submitted: Collection[str],
    waited: Collection[str],
    max_contributors: int,
    seed: bytes,
) -> bool:
    """Whether a bounded round's picks are final: no waited-for peer that has not submitted yet
    could take a place (see the module docstring, "Early close"). Needs at least one submission."""
    if not submitted:
        return False
    could = set(submitted) | set(waited)
    pool = [c for c in candidates if c.peer_id in could]
    return set(select(pool, could, max_contributors, seed).picked) <= set(submitted)
