"""deploy/netlab_report.py on hand-made node reports: the ratios, the idle time, digest agreement."""

import pytest

from deploy.netlab_report import format_table, summarize


def _round(k, *, compute, transfer, packet_bytes, digest="d", wait=0.5):
    return {"round": k, "digest": digest, "num_packets": 2, "packet_bytes": packet_bytes,
            "times": {"compute_s": compute, "encode_s": 0.1, "wait_s": wait, "transfer_s": transfer,
                      "aggregate_s": 0.2}}


def test_ratios_per_round_and_steady_state_summary():
    # Two peers, 8 Mbps = 1 MB/s: each downloads the other's 1 MB packet, ideal 1 s.
    reports = [
        {"rounds": [_round(0, compute=5.0, transfer=2.0, packet_bytes=1_000_000),
                    _round(1, compute=3.0, transfer=1.5, packet_bytes=1_000_000)]},
        {"rounds": [_round(0, compute=5.0, transfer=2.0, packet_bytes=1_000_000),
                    _round(1, compute=3.0, transfer=1.2, packet_bytes=1_000_000)]},
    ]
    history = [{"round": 0, "closed_at": 100.0}, {"round": 1, "closed_at": 105.5}]
    result = summarize(reports, history, rate_mbps=8.0)
    row = result["per_round"][1]
    assert row["download_bytes"] == 1_000_000
    assert row["ideal_transfer_s"] == pytest.approx(1.0)
    assert row["transfer_over_ideal"] == pytest.approx(1.35)
    assert row["transfer_max_s"] == pytest.approx(1.5)
    round_s = [3.0 + 0.1 + 0.5 + t + 0.2 for t in (1.5, 1.2)]
    assert row["round_s"] == pytest.approx(sum(round_s) / 2)
    assert row["idle_s"] == pytest.approx(0.5 + 1.35)  # wait + transfer
    assert row["compute_utilization"] == pytest.approx(sum(3.0 / r for r in round_s) / 2)
    assert row["swarm_cycle_s"] == pytest.approx(5.5)
    assert result["per_round"][0]["swarm_cycle_s"] is None
    assert result["summary"]["rounds_averaged"] == [1]  # round 0 carries start-up
    assert result["summary"]["transfer_over_ideal"] == pytest.approx(1.35)
    assert result["summary"]["digests_agree_every_round"]
    table = format_table(result)
    assert "xfer/ideal" in table and "1.4x" in table and "mean" in table


def test_a_diverged_round_and_an_unshaped_link():
    reports = [{"rounds": [_round(0, compute=1.0, transfer=0.1, packet_bytes=10, digest="a")]},
               {"rounds": [_round(0, compute=1.0, transfer=0.1, packet_bytes=10, digest="b")]}]
    result = summarize(reports, [], rate_mbps=0.0)
    row = result["per_round"][0]
    assert not row["digests_agree"] and not result["summary"]["digests_agree_every_round"]
    assert row["ideal_transfer_s"] is None and row["transfer_over_ideal"] is None
    assert "DIFFER" in format_table(result)
