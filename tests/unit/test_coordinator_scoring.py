"""Contribution scoring on the coordinator service, with a fake clock (coordinator/scoring.py): the
scores sent with the contributors' applied reports judge a round once its votes are in; a peer
whose updates hurt twice is refused `excluded` from then on, no round waits for it, and the status
shows why with its running score; scores of keys that never contributed count for nothing; one bad
round excludes nobody; an exclusion lapses after `scoring.exclusion_rounds`; scoring off, nothing."""

from __future__ import annotations

import pytest

from coordinator import errors
from coordinator.terminal import render_status
from protocol.http import AppliedRequest, PeerScoreReport
from tests.unit.test_coordinator_votes import HONEST, Coordinator

pytestmark = pytest.mark.timeout(30)

GOOD, BAD = PeerScoreReport(loss_delta=-0.1, cosine=0.8), PeerScoreReport(loss_delta=0.1, cosine=-0.8)


@pytest.fixture
def coordinator(tmp_path, fake_clock):
    c = Coordinator(tmp_path, fake_clock)
    yield c
    c.storage.close()


def play_round(
    c: Coordinator, run_id: str, r: int, submitters: list[str], bad: set[str], reporters: list[str] | None = None
) -> None:
    """The submitters submit (the round closes when all waited-for peers did; the `bad` ones first:
    a peer whose updates earned no credit is not waited for), then each reporter reports the honest
    digest with scores of the others: GOOD, or BAD for the peers in `bad`."""
    c.submit(run_id, r, *sorted(submitters, key=lambda p: p not in bad))
    assert c.round(run_id, r).state == "closed"
    for peer in reporters if reporters is not None else submitters:
        scores = {p: BAD if p in bad else GOOD for p in submitters if p != peer}
        c.service.applied(run_id, r, peer, AppliedRequest(params_digest=HONEST, scores=scores))


def peer_view(c: Coordinator, run_id: str, peer_id: str):
    return next(p for p in c.status(run_id).peers if p.peer_id == peer_id)


def test_a_peer_whose_updates_hurt_twice_is_refused_and_shown_excluded(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    a, b, d, e = peers = c.join(run_id, 4)
    play_round(c, run_id, 0, peers, bad={e})
    # Every contributor reported: round 0 is judged before round 1 closes.
    assert c.storage.get_round(run_id, 0).scored == 1
    view = peer_view(c, run_id, e)
    assert not view.excluded and view.score.num_hurt == 1 and view.score.loss_delta == pytest.approx(0.1)
    assert peer_view(c, run_id, a).score.num_hurt == 0
    play_round(c, run_id, 1, peers, bad={e})
    view = peer_view(c, run_id, e)
    assert view.excluded and view.excluded_until_round is None
    assert view.excluded_reason.startswith("hurting_updates: its updates hurt in 2 of its last 2 scored rounds (0, 1")
    assert view.standing == "not_waited" and "excluded" in view.standing_reason and not view.waited_for
    assert (view.score.num_rounds, view.score.num_hurt) == (2, 2)
    with pytest.raises(errors.Excluded, match="excluded"):
        c.submit(run_id, 2, e)
    # Round 2 waits for the three others only: it closes on their packets, e's is not in it.
    c.submit(run_id, 2, a, b, d)
    round_2 = c.round(run_id, 2)
    assert round_2.state == "closed" and {m.peer_id for m in round_2.manifest} == {a, b, d}
    assert all(not peer_view(c, run_id, p).excluded for p in (a, b, d))
    # `locoswarm status` renders the same JSON.
    text = render_status(c.status(run_id).model_dump(mode="json"), now=c.clock())
    line = next(line for line in text.splitlines() if line.startswith(e))
    assert "dloss 0.100 cos -0.80 2/2 hurt" in line and "excluded: hurting_updates: its updates hurt" in line


def test_one_bad_round_and_strangers_scores_exclude_nobody(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    peers = c.join(run_id, 4)
    victim = peers[0]
    strangers = c.join(run_id, 6, source="10.0.0.9")
    for r in range(4):
        # peers[3] first: after its bad round it has no credit, and no round waits for it.
        play_round(c, run_id, r, [peers[3], *peers[:3]], bad={peers[3]} if r == 0 else set())
        for stranger in strangers:  # never contributed: their reports are no votes, their scores no judgements
            c.service.applied(run_id, r, stranger, AppliedRequest(params_digest=HONEST, scores={p: BAD for p in peers}))
    views = {p: peer_view(c, run_id, p) for p in peers}
    assert not any(v.excluded for v in views.values())
    assert views[peers[3]].score.num_hurt == 1 and views[victim].score.num_hurt == 0
    assert all(v.score.num_rounds == 4 for v in views.values())


def test_a_round_with_reports_missing_is_judged_when_it_settles(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    peers = c.join(run_id, 4)
    play_round(c, run_id, 0, peers, bad={peers[3]}, reporters=peers[:3])  # peers[3] never reports
    assert c.storage.get_round(run_id, 0).scored == 0
    c.submit(run_id, 1, *peers)  # round 1 closes: round 0 is settled
    assert c.storage.get_round(run_id, 0).scored == 1
    assert peer_view(c, run_id, peers[3]).score.num_hurt == 1


def test_an_exclusion_lapses_after_exclusion_rounds(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4, "scoring.exclusion_rounds": 2})
    a, b, d, e = peers = c.join(run_id, 4)
    play_round(c, run_id, 0, peers, bad={e})
    play_round(c, run_id, 1, peers, bad={e})
    assert peer_view(c, run_id, e).excluded_until_round == 4
    for r in (2, 3):
        with pytest.raises(errors.Excluded):
            c.submit(run_id, r, e)
        play_round(c, run_id, r, [a, b, d], bad=set())
    play_round(c, run_id, 4, [e, a, b, d], bad=set())  # accepted again (first: nobody waits for it yet)
    view = peer_view(c, run_id, e)
    assert not view.excluded and view.excluded_reason is None
    assert e in {m.peer_id for m in c.round(run_id, 4).manifest}


def test_scoring_off_judges_nothing(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4, "scoring.enabled": False})
    peers = c.join(run_id, 4)
    for r in range(3):
        play_round(c, run_id, r, peers, bad={peers[3]})
    assert all(peer_view(c, run_id, p).score is None for p in peers)
    assert c.storage.get_round(run_id, 0).scored == 1  # taken, with nothing to take


def test_a_key_whose_updates_earned_no_credit_is_not_waited_for(coordinator):
    """e's updates are empty (its judges see no loss change, no cosine): it earns no credit, and
    round 1 closes on the three others' packets without waiting for e to skip it to the deadline."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 4})
    a, b, d, e = peers = c.join(run_id, 4)
    c.submit(run_id, 0, *peers)
    empty = PeerScoreReport(loss_delta=0.0, cosine=0.0)
    for peer in peers:
        scores = {p: empty if p == e else GOOD for p in peers if p != peer}
        c.service.applied(run_id, 0, peer, AppliedRequest(params_digest=HONEST, scores=scores))
    view = peer_view(c, run_id, e)
    assert (view.credit, view.score.last_verdict, view.waited_for) == (0, "not_useful", False), view
    assert view.standing == "not_waited" and "earned no credit" in view.standing_reason
    assert peer_view(c, run_id, a).credit == 1 and peer_view(c, run_id, a).waited_for
    c.submit(run_id, 1, a, b, d)
    assert c.round(run_id, 1).state == "closed"
