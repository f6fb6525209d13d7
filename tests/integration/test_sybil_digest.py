"""Modified nodes against the agreed digest, with real processes on 127.0.0.1 (coordinator, nodes,
their p2pd daemons, SQLite), port 0, tiny preset: tests/integration/sybil_lab.py runs the swarm and
reads the result from the coordinator's status and the nodes' reports.

- Four keys of seven send empty updates and report one made-up digest in every applied report
  (the attack that owned 12 of 12 rounds when a contributor's vote counted one): no round is agreed
  on it, no honest node is flagged, the four are excluded, and a newcomer that joins mid-run ends
  every round on the honest digest.
- One key trains honestly for three rounds (earning credit) and then lies: it is excluded in the
  round it lies, nothing is captured.

The lab runs more (`python -m tests.integration.sybil_lab`): 10 of 13, noise at the honest scale,
an honest minority of one.
"""

from __future__ import annotations

import pytest

from tests.integration.sybil_lab import SCENARIOS, run

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
def test_four_of_seven_empty_update_liars_own_no_round(tmp_path):
    result = run(SCENARIOS["empty_4_of_7"], tmp_path)
    rounds = SCENARIOS["empty_4_of_7"].rounds
    print(result.row(), result.disputes)
    assert result.exit_codes == [0] * len(result.exit_codes)
    assert result.captured == [] and result.honest_agreed == list(range(rounds)), result
    assert result.honest_flagged == {}, result
    assert result.attackers_excluded == 4 and set(result.attacker_credit) == {0}, result
    assert min(result.honest_credit) >= 2, result
    assert result.newcomer_on_honest is True
    verdict = result.disputes[0]
    assert "recompute to the agreed leaves by 3 peer(s)" in verdict and "4 peer(s) of credit 0" in verdict, verdict


@pytest.mark.timeout(300)
def test_keys_that_earned_credit_or_sent_copies_and_then_lie_are_excluded(tmp_path):
    """One key trains honestly for three rounds (earning credit), one sends re-signed copies of
    other packets (which would be judged useful, were they not copies); both lie from round 3 on,
    whether or not their packet made round 3's manifest: the copier earned nothing by copying, the
    other loses what it earned; both are excluded in round 3."""
    result = run(SCENARIOS["credit_then_lie"], tmp_path)
    print(result.row(), result.disputes, result.attacker_verdicts, result.sent_own)
    assert result.exit_codes == [0] * len(result.exit_codes)
    assert result.captured == [] and result.undecided == [] and result.honest_flagged == {}, result
    assert result.attackers_excluded == 2 and result.attacker_credit == [0, 0], result
    assert sorted(result.disputes) == [3], "they lied from round 3 on, and were excluded then"
    assert "2 peer(s) of credit" in result.disputes[3], result.disputes
    # The copier (attacker 1) is useful only in rounds it found nothing to copy and sent its own.
    copier_useful = int(result.attacker_verdicts[1].split("/")[0])
    assert copier_useful <= result.sent_own[1], (result.attacker_verdicts, result.sent_own)
