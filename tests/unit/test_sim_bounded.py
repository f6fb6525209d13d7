"""Bounded rounds in the simulator (tools/sim/engine.py, `max_contributors`): 5 peers, M = 2 beside
the unbounded run. Each bounded round applies exactly M packets, every peer gets in (newcomers first,
then the rotation), the peers still agree bit for bit, and a peer receives M packets' bytes a round
instead of N - 1. `decode_once` gives the same bits as every peer decoding for itself."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.unit.test_robust_aggregation import SIM

pytestmark = pytest.mark.timeout(240)

CONFIG = SIM | {"num_peers": 5, "inner_steps": 2, "num_rounds": 6, "eval_every_rounds": 6, "eval_batches": 2}


def _sim(**changes) -> dict:
    from tools.sim.engine import SimConfig, simulate

    return simulate(SimConfig(**(CONFIG | changes)), show_progress=False)["strategies"]


@pytest.fixture(scope="module")
def results() -> dict:
    return _sim(max_contributors=(2, 0))


def test_a_bounded_run_applies_m_packets_a_round_and_every_peer_gets_in(results):
    bounded, unbounded = results["sparseloco_m2"], results["sparseloco"]
    assert bounded["max_contributors"] == 2 and unbounded["max_contributors"] == 0
    assert sum(bounded["picks"].values()) == 2 * CONFIG["num_rounds"]
    assert all(n >= 1 for n in bounded["picks"].values()), bounded["picks"]
    assert set(unbounded["picks"].values()) == {CONFIG["num_rounds"]}
    assert bounded["digests_identical_every_round"] and bounded["refused"] == {}
    # A peer receives the others' picked packets: about 2 (or 1, its own picked) against 4.
    ratio = bounded["bytes_received_per_peer_per_round"] / unbounded["bytes_received_per_peer_per_round"]
    assert 0.25 < ratio < 0.5, ratio
    assert bounded["bytes_sent_per_peer_per_round"] == pytest.approx(
        unbounded["bytes_sent_per_peer_per_round"], rel=0.05
    )


def test_decoding_once_gives_the_same_bits(results):
    assert (
        _sim(max_contributors=(2,), decode_once=True)["sparseloco_m2"]["final_val_loss"]
        == (results["sparseloco_m2"]["final_val_loss"])
    )


def test_decoding_once_needs_scoring_off():
    from tools.sim.engine import SimConfig

    with pytest.raises(ValidationError, match="decode_once needs scoring off"):
        SimConfig(**(CONFIG | {"decode_once": True, "scoring": True}))
