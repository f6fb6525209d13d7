"""Standing: who a round waits for (DESIGN.md, "Strangers are on probation").

A peer is on probation until one of its packets is in a manifest: no round waits for it, though
it may submit like anyone. Round r waits for its contributors: the live members since r opened,
neither flagged ``withheld_round`` (coordinator/rules/amendments.py) nor excluded by scoring
(coordinator/scoring.py), with a packet in the manifest of one of the
``membership.max_missed_rounds`` (K) rounds before r. A contributor that misses K rounds in a row
is no longer waited for (it stays a member; its next packet in a manifest makes it a contributor
again). Nor is a contributor whose updates were judged and earned no credit (empty, noise, copies,
harm: protocol/scoring.py rule 5) while any contributor has credit: a key sending empty packets
cannot hold rounds to their deadlines by skipping every other one. So a key that joins and only
heartbeats, or stalls after contributing, costs no round its deadline.

A forming swarm: while fewer live members are contributors than ``membership.min_peers`` (round 0,
where there are none, so it is not closed on its first packet; a swarm whose contributors left;
peers dropped as silent at start and back since) the round waits for every live member that was
one when it opened, flagged and excluded ones excepted: the operator said the run needs that many
peers. A silent member can thus hold rounds until their deadlines only while the live contributors
are fewer than ``min_peers``. A peer slower than the contributors every round stays on probation
(nobody waits for it), the price of not letting strangers set the pace.

This module is the one place the rule is written. `waited_for` decides it for a round (the rounds
close early once all have submitted, coordinator/rules/rounds.py; the status counts them);
`standing_of` says it per peer, with why, for the status; `is_contributor` reads the same window
from a peer's ``last_contributed_round``. The database only fetches the facts
(`Storage.members_of_round`).
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.storage import MemberRow, PeerRow, Storage


def waited_for(
    storage: Storage, run_id: str, round_index: int, window_rounds: int, min_contributors: int
) -> dict[str, bool]:
    """The live peers round r waits for, each with whether it submitted to r; `window_rounds` is
    ``membership.max_missed_rounds``, `min_contributors` ``membership.min_peers``."""
    return choose_waited(storage.members_of_round(run_id, round_index, window_rounds), min_contributors)


def choose_waited(members: Sequence[MemberRow], min_contributors: int) -> dict[str, bool]:
    """Of round r's live members, those it waits for (see the module docstring), in order."""
    eligible = [m for m in members if m.withheld_round is None and m.excluded_round is None]
    contributors = [m for m in eligible if m.contributor]
    credited = [m for m in contributors if not m.judged or m.credit > 0]
    forming = not contributors or len(contributors) < min_contributors
    waited = eligible if forming else (credited or contributors)
    return {m.peer_id: m.submitted for m in waited}


def is_contributor(peer: PeerRow, round_index: int, window_rounds: int) -> bool:
    """Whether a manifest of one of the `window_rounds` rounds before r holds a packet of `peer`."""
    last = peer.last_contributed_round
    return last is not None and last >= round_index - window_rounds


def standing_of(peer: PeerRow, open_round: int, window_rounds: int, waited: bool) -> tuple[str, str]:
    """A peer's standing and why, for the status: ``probation``, ``contributor`` or ``not_waited``;
    `waited`: the open round waits for it."""
    last = peer.last_contributed_round
    if last is None:
        return "probation", (
            "no packet in a manifest yet; waited for while the swarm forms (fewer live"
            " contributors than membership.min_peers)"
            if waited
            else "no packet in a manifest yet: no round waits for it"
        )
    if peer.excluded_round is not None:
        return "not_waited", f"excluded by contribution scoring after round {peer.excluded_round} (excluded_reason)"
    if peer.withheld_round is not None:
        return "not_waited", (
            f"its packet of round {peer.withheld_round} was dropped as unfetchable: not waited"
            " for until a later packet of its is applied"
        )
    if not is_contributor(peer, open_round, window_rounds):
        missed = open_round - 1 - last
        return "not_waited", (
            f"no packet in the last {missed} rounds (membership.max_missed_rounds {window_rounds});"
            f" its last in round {last}"
        )
    if not waited and peer.standing is not None and peer.credit == 0:
        return "not_waited", (
            f"its packet is in round {last}'s manifest, but its updates earned no credit (empty,"
            " noise, copies or harm): no round waits for it while others have some"
        )
    return "contributor", f"its packet is in round {last}'s manifest"
