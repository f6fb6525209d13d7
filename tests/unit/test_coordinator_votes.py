"""Agreed digests on the service, with a fake clock (coordinator/rules/votes.py, "Agreed digests"): only
the contributors of a round vote on its digest, one immutable report each per manifest version; a
lone vote is provisional; an agreed digest is never rewritten (only an amendment starts a new vote);
what trusts a digest (the join's parameter source, flags) trusts the agreed one."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from coordinator import errors
from coordinator.rules.votes import tally
from coordinator.service import CoordinatorService
from coordinator.storage import open_storage
from protocol.digest import CHUNK_BYTES
from protocol.http import (
    AppliedRequest,
    JoinRequest,
    LeaveRequest,
    MissingRequest,
    ParamsTree,
    SubmitRequest,
    peer_id_from_public_key,
)
from protocol.run_config import RunConfig
from protocol.signing import PeerKey
from tests.fixtures.coordinator import packet_digest, run_config

pytestmark = pytest.mark.timeout(30)

HONEST, FAKE, OTHER = "11" * 32, "ee" * 32, "22" * 32


class Coordinator:
    """The service on a SQLite file in tmp_path (or the database at `url`); peers are keys joined
    through it."""

    def __init__(self, tmp_path, clock, url: str | None = None):
        self.storage = open_storage(url or f"sqlite:///{tmp_path / 'coordinator.db'}")
        self.service = CoordinatorService(self.storage, clock=clock)
        self.clock = clock
        self.keys: dict[str, PeerKey] = {}

    def create_run(self, **overrides) -> str:
        return self.service.create_run(RunConfig.model_validate(run_config(overrides)))

    def join(self, run_id: str, count: int = 1, source: str = "10.0.0.1") -> list[str]:
        peer_ids = []
        for _ in range(count):
            key = PeerKey.generate()
            peer_id = peer_id_from_public_key(key.public_bytes)
            self.service.join(run_id, peer_id, JoinRequest(public_key=key.public_hex), source=source)
            self.keys[peer_id] = key
            peer_ids.append(peer_id)
        return peer_ids

    def rejoin(self, run_id: str, peer_id: str, source: str = "10.0.0.1"):
        return self.service.join(run_id, peer_id, JoinRequest(public_key=self.keys[peer_id].public_hex), source=source)

    def submit(self, run_id: str, round_index: int, *peer_ids: str) -> None:
        for peer_id in peer_ids:
            self.service.submit(
                run_id,
                round_index,
                peer_id,
                SubmitRequest(
                    packet_digest=packet_digest(peer_id, round_index), packet_size_bytes=1000, train_loss=3.0
                ),
            )

    def applied(self, run_id: str, round_index: int, peer_id: str, digest: str, version: int = 1):
        return self.service.applied(
            run_id, round_index, peer_id, AppliedRequest(params_digest=digest, manifest_version=version)
        )

    def round(self, run_id: str, round_index: int):
        self.service.advance(run_id)  # the coordinator's clock, as its tick would have run before a read
        return self.service.views.round_view(run_id, round_index)

    def status(self, run_id: str):
        self.service.advance(run_id)
        return self.service.views.status(run_id, now=self.clock())

    def credit(self, run_id: str, credit: dict[str, int]) -> None:
        """Give peers credit, as contribution scoring does (protocol/scoring.py, rule 5)."""
        for peer_id, value in credit.items():
            self.storage.update_peer(run_id, peer_id, credit=value)

    def flags(self, run_id: str) -> dict[str, list[str]]:
        return {p.peer_id: p.flags for p in self.status(run_id).peers}


@pytest.fixture
def coordinator(tmp_path, fake_clock):
    c = Coordinator(tmp_path, fake_clock)
    yield c
    c.storage.close()


def test_strangers_reports_never_vote_and_contributors_agree(coordinator):
    """Four keys that never trained join and report a made-up digest first: they set nothing, the
    two contributors' digest is agreed, the strangers are the ones flagged."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    strangers = c.join(run_id, 4, source="10.0.0.9")
    for stranger in strangers:
        answer = c.applied(run_id, 0, stranger, FAKE)
        assert (answer.vote, answer.num_votes, answer.majority_digest, answer.agreed_digest) == (False, 0, None, None)
    assert c.round(run_id, 0).majority_digest is None
    assert c.service.views.join_response(c.service.views.require_run(run_id), a).params.digest is None

    first = c.applied(run_id, 0, a, HONEST)
    assert (first.vote, first.num_votes, first.majority_digest, first.agreed_digest, first.provisional) == (
        True,
        1,
        HONEST,
        None,
        True,
    ), "a lone vote is provisional"
    assert c.status(run_id).history[0].agreed_digest is None
    second = c.applied(run_id, 0, b, HONEST)
    assert (second.agreed_digest, second.provisional, second.num_votes, second.num_reports) == (HONEST, False, 2, 6)

    view = c.round(run_id, 0)
    assert (view.agreed_digest, view.majority_digest, view.provisional, view.num_votes) == (HONEST, HONEST, False, 2)
    summary = c.status(run_id).history[0]
    assert (summary.agreed_digest, summary.num_votes, summary.num_applied) == (HONEST, 2, 6)
    flags = c.flags(run_id)
    assert flags[a] == flags[b] == []
    assert all(flags[s] == ["params_mismatch"] for s in strangers)
    params = c.service.join(run_id, *_newcomer()).params
    assert (params.round, params.digest) == (1, HONEST)
    assert sorted(h.peer_id for h in params.holders) == sorted([a, b])


def test_a_report_is_immutable(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    first = c.applied(run_id, 0, a, HONEST)
    assert c.applied(run_id, 0, a, HONEST) == first, "the same report again is answered as the first"
    with pytest.raises(errors.ConflictingReport, match="cannot be changed"):
        c.applied(run_id, 0, a, OTHER)
    assert [(r.peer_id, r.params_digest) for r in c.storage.list_applied(run_id, 0)] == [(a, HONEST)]
    assert c.round(run_id, 0).num_votes == 1


def test_without_credit_a_dispute_waits_and_credit_decides_it(coordinator):
    """A contributor that reports a bogus digest first only leads provisionally. While nobody has
    earned credit a dispute is not settled by a headcount, not even once the round settles; credit
    (as scoring gives it) decides it, and the liar is excluded with the dispute recorded."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3})
    liar, a, b = c.join(run_id, 3)
    c.submit(run_id, 0, liar, a, b)
    assert c.applied(run_id, 0, liar, FAKE).majority_digest == FAKE
    tie = c.applied(run_id, 0, a, HONEST)
    assert (tie.majority_digest, tie.agreed_digest, tie.agrees) == (FAKE, None, False), "a tie keeps the lead"
    last = c.applied(run_id, 0, b, HONEST)
    assert (last.majority_digest, last.agreed_digest, last.agrees) == (HONEST, None, True)
    c.submit(run_id, 1, liar, a, b)  # round 0 is settled: still no credit, still undecided
    assert c.round(run_id, 0).agreed_digest is None
    dispute = c.status(run_id).history[0].dispute
    assert not dispute.decided and [s.digest for s in dispute.sides] == [HONEST, FAKE]
    c.credit(run_id, {a: 1, b: 1})
    c.submit(run_id, 2, liar, a, b)  # round 1 closes: the rounds still undecided are weighed again
    assert c.round(run_id, 0).agreed_digest == HONEST
    assert c.flags(run_id)[liar] == ["params_mismatch"]
    view = next(p for p in c.status(run_id).peers if p.peer_id == liar)
    assert view.excluded and view.excluded_reason.startswith(f"wrong_digest: round 0: it reported digest {FAKE[:16]}")
    dispute = c.status(run_id).history[0].dispute
    assert dispute.decided and dispute.excluded == [liar] and "2 peer(s) of credit 2" in dispute.verdict
    with pytest.raises(errors.Excluded, match="wrong_digest"):
        c.submit(run_id, 3, liar)


def test_a_majority_of_keys_without_credit_never_owns_the_digest(coordinator):
    """Four contributors without credit report a made-up digest before the three honest ones that
    earned some: the made-up digest is never agreed, the honest one is as soon as two of them voted,
    and the four are excluded."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 7})
    honest, liars = c.join(run_id, 3), c.join(run_id, 4, source="10.0.0.9")
    c.submit(run_id, 0, *honest, *liars)
    c.credit(run_id, {p: 3 for p in honest})
    for liar in liars:
        answer = c.applied(run_id, 0, liar, FAKE)
        assert (answer.agreed_digest, answer.majority_digest) == (None, FAKE)
    assert c.applied(run_id, 0, honest[0], HONEST).agreed_digest is None, "one vote of credit: not yet"
    assert c.applied(run_id, 0, honest[1], HONEST).agreed_digest == HONEST
    assert c.applied(run_id, 0, honest[2], HONEST).agreed_digest == HONEST
    assert sorted(c.status(run_id).history[0].dispute.excluded) == sorted(liars)
    assert {p: f for p, f in c.flags(run_id).items() if f} == {p: ["params_mismatch"] for p in liars}
    params = c.service.join(run_id, *_newcomer()).params
    assert (params.round, params.digest) == (1, HONEST)


def test_a_late_vote_against_the_agreed_digest_is_excluded(coordinator):
    """A peer that trained (it has credit) and reports a different digest after the agreement loses
    its credit and is excluded; the agreed digest stays."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    a, b, turncoat, d = peers = c.join(run_id, 4)
    c.credit(run_id, {p: 4 for p in peers})
    c.submit(run_id, 0, *peers)
    c.applied(run_id, 0, a, HONEST)
    c.applied(run_id, 0, b, HONEST)
    assert c.applied(run_id, 0, d, HONEST).agreed_digest == HONEST
    late = c.applied(run_id, 0, turncoat, FAKE)
    assert (late.agreed_digest, late.agrees) == (HONEST, False)
    assert c.storage.get_peer(run_id, turncoat).credit == 0
    assert next(p for p in c.status(run_id).peers if p.peer_id == turncoat).excluded
    assert "1 peer(s) of credit 4 reported another digest" in c.status(run_id).history[0].dispute.verdict


def test_a_lie_is_caught_when_its_packet_missed_the_manifest(coordinator):
    """A peer with credit whose packet missed round 1's manifest (its report is no vote) still
    applied round 1 from the agreed start: a made-up digest is a lie, and it is excluded then. Its
    later reports are void (it forked), so the first lie is the one that must be caught."""
    c = coordinator
    run_id = c.create_run(
        **{
            "membership.min_peers": 3,
            "membership.heartbeat_timeout_s": 600.0,
            "deadline": {"kind": "fixed", "round_timeout_s": 60.0},
        }
    )
    a, b, liar = peers = c.join(run_id, 3)
    c.credit(run_id, {p: 2 for p in peers})
    c.submit(run_id, 0, *peers)
    for p in peers:
        c.applied(run_id, 0, p, HONEST)
    c.submit(run_id, 1, a, b)
    c.clock.advance(61)  # the liar is late: round 1 closes at its deadline without it
    c.service.advance(run_id)
    assert c.storage.manifest_peers(run_id, 1, 1) == {a, b}
    answer = c.applied(run_id, 1, liar, FAKE)
    assert answer.num_votes == 0, "a peer outside the manifest does not vote"
    c.applied(run_id, 1, a, OTHER)
    assert c.applied(run_id, 1, b, OTHER).agreed_digest == OTHER
    assert c.storage.get_peer(run_id, liar).credit == 0
    view = next(p for p in c.status(run_id).peers if p.peer_id == liar)
    assert view.excluded and view.excluded_reason.startswith(f"wrong_digest: round 1: it reported digest {FAKE[:16]}")
    dispute = c.status(run_id).history[1].dispute
    assert dispute.excluded == [liar] and "1 peer(s) of credit 2 reported another digest" in dispute.verdict


def test_a_dispute_keeps_the_credit_its_voters_had_when_counted(coordinator):
    """A liar excluded in a dispute has no credit afterwards; a vote that comes later adds to the
    record, which still says what the liar's credit was when its vote was counted."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    a, b, liar, d = peers = c.join(run_id, 4)
    c.credit(run_id, {a: 4, b: 4, liar: 3, d: 1})
    c.submit(run_id, 0, *peers)
    c.applied(run_id, 0, liar, FAKE)
    c.applied(run_id, 0, a, HONEST)
    assert c.applied(run_id, 0, b, HONEST).agreed_digest == HONEST  # 8 of 12
    c.applied(run_id, 0, d, HONEST)
    dispute = c.status(run_id).history[0].dispute
    assert [(s.peers, s.credit) for s in dispute.sides] == [(sorted([a, b, d]), 9), ([liar], 3)], dispute
    assert "1 peer(s) of credit 3 reported another digest" in dispute.verdict


def test_disputes_name_the_chunks_that_differ(coordinator):
    """Reports carry their digest's hash tree: the dispute names the chunks whose leaves differ."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3})
    a, b, liar = peers = c.join(run_id, 3)
    c.credit(run_id, {a: 2, b: 2})
    c.submit(run_id, 0, *peers)
    honest_leaves = [bytes([i]) * 32 for i in range(4)]
    lying_leaves = [honest_leaves[0], b"\xee" * 32, honest_leaves[2], b"\xef" * 32]
    honest_tree, lying_tree = _tree(honest_leaves), _tree(lying_leaves)
    for peer in (a, b):
        c.service.applied(run_id, 0, peer, AppliedRequest(params_digest=honest_tree.tree().hex, tree=honest_tree))
    c.service.applied(run_id, 0, liar, AppliedRequest(params_digest=lying_tree.tree().hex, tree=lying_tree))
    dispute = c.status(run_id).history[0].dispute
    assert [s.chunks for s in dispute.sides] == [[], [1, 3]] and dispute.excluded == [liar]
    assert dispute.verdict.startswith("chunk(s) 1, 3 recompute to the agreed leaves by 2 peer(s) of credit 4")
    with pytest.raises(ValidationError, match="not params_digest"):
        AppliedRequest(params_digest=HONEST, tree=honest_tree)


def test_an_agreed_digest_is_never_rewritten(coordinator):
    """Two of four contributors agree; once the next round closed it is agreed on their two votes,
    and the two later, different votes change neither the agreed digest nor the majority."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    peers = c.join(run_id, 4)
    c.submit(run_id, 0, *peers)
    for peer in peers[:2]:
        assert c.applied(run_id, 0, peer, HONEST).agreed_digest is None, "2 of 4 contributors: not yet"
    c.submit(run_id, 1, *peers)  # round 1 closes: round 0 is settled
    assert c.round(run_id, 0).agreed_digest == HONEST
    for peer in peers[2:]:
        late = c.applied(run_id, 0, peer, OTHER)
        assert (late.agreed_digest, late.majority_digest, late.vote) == (HONEST, HONEST, True)
    view = c.round(run_id, 0)
    assert (view.agreed_digest, view.majority_digest, view.num_votes) == (HONEST, HONEST, 4)
    assert {p: f for p, f in c.flags(run_id).items() if f} == {p: ["params_mismatch"] for p in peers[2:]}


def test_a_round_with_one_contributor_is_agreed_when_the_next_closes(coordinator):
    """The decision for a solo peer: its lone vote is provisional until the next round closes, then
    agreed, so it goes on and a newcomer catches up from it one round later."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 1})
    (solo,) = c.join(run_id)
    c.submit(run_id, 0, solo)
    assert c.applied(run_id, 0, solo, HONEST).provisional is True
    assert c.service.join(run_id, *_newcomer()).params.digest is None
    c.submit(run_id, 1, solo)  # the newcomer is on probation: round 1 closes on the solo packet
    assert c.round(run_id, 1).state == "closed"
    view = c.round(run_id, 0)
    assert (view.agreed_digest, view.provisional) == (HONEST, False)
    params = c.service.join(run_id, *_newcomer()).params
    assert (params.round, params.digest, [h.peer_id for h in params.holders]) == (1, HONEST, [solo])
    # Reported after its round settled, a lone vote is agreed at once.
    assert c.applied(run_id, 1, solo, OTHER).agreed_digest is None  # round 2 still open
    c.submit(run_id, 2, solo)
    assert c.round(run_id, 1).agreed_digest == OTHER


def test_with_overlap_a_lone_early_vote_waits_for_the_round_after_next(coordinator):
    """With the one-round-delayed outer step a node trains r+1 before it applies r, so round r+1
    can close before the others voted on r. A peer racing ahead (its packet later dropped, it kept
    the old manifest) must not have its lone vote agreed then: the others would be told they forked."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3, "outer.overlap": True})
    a, b, fast = peers = c.join(run_id, 3)
    c.credit(run_id, {p: 1 for p in peers})
    c.submit(run_id, 0, a, b, fast)
    c.applied(run_id, 0, fast, FAKE)  # alone, before a and b applied round 0
    c.submit(run_id, 1, a, b, fast)  # round 1 closes: with overlap, round 0 is not settled yet
    view = c.round(run_id, 0)
    assert (view.majority_digest, view.agreed_digest, view.provisional) == (FAKE, None, True)
    c.applied(run_id, 0, a, HONEST)
    c.applied(run_id, 0, b, HONEST)
    assert c.round(run_id, 0).agreed_digest == HONEST
    # A round whose votes stay lone is settled once the round after next has closed.
    c.applied(run_id, 1, a, OTHER)
    c.submit(run_id, 2, a, b)  # fast is excluded (its digest of round 0 was wrong)
    assert c.round(run_id, 1).agreed_digest is None
    c.submit(run_id, 3, a, b)
    assert c.round(run_id, 1).agreed_digest == OTHER


def test_a_tie_stays_provisional_when_settled(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    c.applied(run_id, 0, a, HONEST)
    c.applied(run_id, 0, b, OTHER)
    c.submit(run_id, 1, a, b)
    view = c.round(run_id, 0)
    assert (view.majority_digest, view.agreed_digest, view.provisional, view.num_votes) == (HONEST, None, True, 2)
    assert c.flags(run_id) == {a: [], b: []}, "no agreed digest: nobody is flagged"


def test_vote_after_rounds_needs_earlier_contributions(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2, "membership.vote_after_rounds": 1})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    assert c.applied(run_id, 0, a, HONEST).vote is False, "no earlier round in a manifest yet"
    c.submit(run_id, 1, a, b)
    assert c.applied(run_id, 1, a, HONEST).vote is True
    assert c.applied(run_id, 1, b, HONEST).agreed_digest == HONEST
    assert c.round(run_id, 0).num_votes == 0


def test_an_amendment_starts_a_new_vote_among_the_remaining_contributors(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4, "membership.heartbeat_timeout_s": 300.0})
    a, b, d, w = c.join(run_id, 4)
    c.credit(run_id, {a: 1, b: 1, d: 1, w: 1})
    c.submit(run_id, 0, a, b, d, w)
    for peer in (a, b, d):
        c.applied(run_id, 0, peer, HONEST)
    assert c.round(run_id, 0).agreed_digest == HONEST
    for peer in (a, b, d):
        c.service.report_missing(run_id, 0, peer, MissingRequest(peer_ids=[w]))
    view = c.round(run_id, 0)
    assert (view.manifest_version, view.agreed_digest, view.majority_digest, view.num_votes) == (2, None, None, 0)
    assert c.applied(run_id, 0, w, OTHER, version=2).vote is False, "its packet is not in version 2"
    assert c.applied(run_id, 0, a, OTHER, version=2).agreed_digest is None
    assert c.applied(run_id, 0, b, OTHER, version=2).agreed_digest == OTHER, "2 of the 3 contributors left"
    versions = {(r.peer_id, r.manifest_version): r.params_digest for r in c.storage.list_applied(run_id, 0)}
    assert versions[(a, 1)] == HONEST and versions[(a, 2)] == OTHER, "the version-1 report is kept as it was"


@pytest.mark.parametrize(
    ("votes", "contributors", "settled", "expected"),
    [
        (["x"], 1, False, ("x", None)),
        (["x"], 1, True, ("x", "x")),
        (["x", "x"], 3, False, ("x", "x")),
        (["x", "x"], 4, False, ("x", None)),
        (["x", "x"], 4, True, ("x", "x")),
        (["x", "y"], 2, True, ("x", None)),
        (["y", "x", "x"], 5, True, ("x", "x")),
        (["x", "y", "z"], 3, True, ("x", None)),
    ],
)
def test_tally_by_headcount_with_scoring_off(votes, contributors, settled, expected):
    assert tally([(v, 0) for v in votes], contributors, settled, None, None) == expected


@pytest.mark.parametrize(
    ("votes", "contributors", "settled", "expected"),
    [
        ([("x", 0), ("x", 0)], 3, False, ("x", None)),  # not every contributor voted yet
        ([("x", 0), ("x", 0), ("x", 0)], 3, False, ("x", "x")),
        ([("x", 0)], 1, False, ("x", None)),  # a lone vote waits for the round to settle
        ([("x", 0)], 1, True, ("x", "x")),
        ([("y", 0), ("y", 0), ("x", 0)], 3, True, ("y", None)),  # a dispute: credit decides it, not heads
    ],
)
def test_tally_before_anyone_earned_credit(votes, contributors, settled, expected):
    assert tally(votes, contributors, settled, None, 0) == expected


@pytest.mark.parametrize(
    ("votes", "total", "settled", "expected"),
    [
        ([("f", 0)] * 10 + [("x", 1), ("x", 1)], 3, False, ("x", "x")),  # ten keys without credit weigh nothing
        ([("f", 0)] * 10 + [("x", 2)], 3, False, ("x", None)),  # one vote of credit is not enough early
        ([("f", 0)] * 10 + [("x", 2)], 3, True, ("x", "x")),  # ... but is once the round settled
        ([("f", 0)] * 10, 3, True, ("f", None)),  # no vote of credit: never agreed
        ([("x", 1), ("x", 1), ("y", 8)], 10, False, ("y", None)),  # credit, not heads, leads
        ([("x", 1), ("x", 1), ("y", 8)], 10, True, ("y", None)),  # one key of high credit against two: undecided
        ([("y", 8), ("y", 1), ("x", 1)], 10, True, ("y", "y")),
        ([("x", 3), ("y", 3)], 6, True, ("x", None)),  # a tie of credit stays undecided
        ([("y", 8), ("x", 2), ("x", 2), ("z", 0)], 12, False, ("y", None)),
    ],
)
def test_tally_by_credit(votes, total, settled, expected):
    assert tally(votes, len(votes), settled, None, total) == expected


def _tree(leaves: list[bytes]) -> ParamsTree:
    body_bytes = (len(leaves) - 1) * CHUNK_BYTES + 1
    return ParamsTree(header=base64.b64encode(b"header").decode(), body_bytes=body_bytes, leaves=b"".join(leaves).hex())


def _newcomer() -> tuple[str, JoinRequest]:
    key = PeerKey.generate()
    return peer_id_from_public_key(key.public_bytes), JoinRequest(public_key=key.public_hex)


def test_a_liars_exclusion_voids_its_votes_in_rounds_still_undecided(coordinator):
    """Round 0 ties (one vote of credit each side) and stays undecided once settled. In round 1 the
    same key lies again, against two: excluded, its credit gone, round 0 is weighed again and agreed
    on the other vote."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3})
    a, b, liar = peers = c.join(run_id, 3)
    c.credit(run_id, {p: 1 for p in peers})
    c.submit(run_id, 0, *peers)
    c.applied(run_id, 0, a, HONEST)
    c.applied(run_id, 0, liar, FAKE)
    c.submit(run_id, 1, *peers)  # round 0 settled: 1 against 1
    assert c.round(run_id, 0).agreed_digest is None
    c.applied(run_id, 1, a, OTHER)
    c.applied(run_id, 1, b, OTHER)
    c.applied(run_id, 1, liar, FAKE)
    assert c.round(run_id, 1).agreed_digest == OTHER
    assert c.round(run_id, 0).agreed_digest == HONEST, "the liar's vote in round 0 weighs nothing now"


def test_a_finished_runs_last_round_is_agreed_once_its_contributors_reported(coordinator):
    """No round closes after a run's last, so nothing settles it at a close. Its contributors: a,
    with credit, and b, without. Agreed early needs two votes of credit, so before the last rounds
    settled on their votes this round stayed undecided for good, every node holding its digest."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3, "membership.heartbeat_timeout_s": 60.0, "max_rounds": 2})
    a, b, late = c.join(run_id, 3)
    c.credit(run_id, {a: 2})
    c.submit(run_id, 0, a, b, late)
    for peer in (a, b, late):
        c.applied(run_id, 0, peer, HONEST)
    c.submit(run_id, 1, a, b)  # `late` misses the deadline: the run finishes on a and b's packets
    c.clock.advance(31.0)
    assert c.status(run_id).run.state == "finished"
    c.applied(run_id, 1, late, OTHER)  # it applied the manifest, not a contributor: no vote
    assert c.applied(run_id, 1, a, OTHER).agreed_digest is None  # b's vote is still to come
    assert c.applied(run_id, 1, b, OTHER).agreed_digest == OTHER
    view = c.round(run_id, 1)
    assert (view.agreed_digest, view.provisional, view.num_votes) == (OTHER, False, 2)


def test_a_finished_runs_last_round_settles_when_a_silent_contributor_passed_its_limit(coordinator):
    """A contributor killed after the last close never reports, and no tick marks a member of an
    ended run gone: the other's lone vote of credit is agreed once the silent one has been silent
    past its limit (the heartbeat timeout, 20 s here), by the tick; a leave counts at once."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2, "max_rounds": 1})
    a, dead = c.join(run_id, 2)
    c.credit(run_id, {a: 2, dead: 2})
    c.submit(run_id, 0, a, dead)  # both submitted: round 0 closes and the run finishes
    assert c.status(run_id).run.state == "finished"
    c.applied(run_id, 0, a, HONEST)
    c.clock.advance(10.0)
    c.service.tick()
    assert c.round(run_id, 0).agreed_digest is None, "dead is silent for 10 s only"
    c.clock.advance(11.0)
    c.service.tick()
    assert c.round(run_id, 0).agreed_digest == HONEST

    # A contributor that leaves without reporting settles it at its leave.
    run_id = c.create_run(**{"membership.min_peers": 2, "max_rounds": 1})
    a, leaver = c.join(run_id, 2)
    c.credit(run_id, {a: 2, leaver: 2})
    c.submit(run_id, 0, a, leaver)
    c.applied(run_id, 0, a, HONEST)
    assert c.round(run_id, 0).agreed_digest is None
    c.service.leave(run_id, leaver, LeaveRequest(reason="finished"))
    assert c.round(run_id, 0).agreed_digest == HONEST
