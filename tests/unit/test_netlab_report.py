"""tools/netlab/report.py on hand-made node reports: the ratios, the idle time, digest agreement."""

import pytest

from tools.netlab.helpers import _union_s
from tools.netlab.report import format_table, replay_over_ideal, summarize


def _round(k, *, compute, transfer, packet_bytes, digest="d", wait=0.5):
    return {
        "round": k,
        "digest": digest,
        "num_packets": 2,
        "packet_bytes": packet_bytes,
        "times": {"compute_s": compute, "encode_s": 0.1, "wait_s": wait, "transfer_s": transfer, "aggregate_s": 0.2},
    }


def test_ratios_per_round_and_steady_state_summary():
    # Two peers, 8 Mbps = 1 MB/s: each downloads the other's 1 MB packet, ideal 1 s.
    reports = [
        {
            "rounds": [
                _round(0, compute=5.0, transfer=2.0, packet_bytes=1_000_000),
                _round(1, compute=3.0, transfer=1.5, packet_bytes=1_000_000),
            ]
        },
        {
            "rounds": [
                _round(0, compute=5.0, transfer=2.0, packet_bytes=1_000_000),
                _round(1, compute=3.0, transfer=1.2, packet_bytes=1_000_000),
            ]
        },
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
    reports = [
        {"rounds": [_round(0, compute=1.0, transfer=0.1, packet_bytes=10, digest="a")]},
        {"rounds": [_round(0, compute=1.0, transfer=0.1, packet_bytes=10, digest="b")]},
    ]
    result = summarize(reports, [], rate_mbps=0.0)
    row = result["per_round"][0]
    assert not row["digests_agree"] and not result["summary"]["digests_agree_every_round"]
    assert row["ideal_transfer_s"] is None and row["transfer_over_ideal"] is None
    assert "DIFFER" in format_table(result)


def test_fetching_time_start_to_start_rounds_and_the_part_after_the_close():
    """Reports from current nodes: the ratio uses the time any fetch was in progress (early fetches
    included), a round runs until the same node's next one starts, and the part of the transfer
    left after the close gets its own ratio. With overlap, a first round that fetched nothing has
    no ratio rather than 0."""

    def timed(k, start, fetching, transfer):
        r = _round(k, compute=4.0, transfer=transfer, packet_bytes=1_000_000)
        return r | {"started_at": start, "ended_at": start + 5.0, "fetching_s": fetching}

    reports = [{"rounds": [timed(0, 100.0, 1.6, 0.4), timed(1, 106.0, 1.2, 0.3), timed(2, 112.0, 1.4, 0.5)]}]
    reports.append({"rounds": [timed(0, 100.0, 1.6, 0.4), timed(1, 106.0, 1.2, 0.3), timed(2, 112.0, 1.4, 0.5)]})
    result = summarize(reports, [], rate_mbps=8.0)  # ideal: 1 s for the other peer's 1 MB
    first, second, last = result["per_round"]
    assert second["fetching_s"] == pytest.approx(1.2) and second["transfer_over_ideal"] == pytest.approx(1.2)
    assert second["after_close_over_ideal"] == pytest.approx(0.3)
    assert first["round_s"] == pytest.approx(6.0) and second["round_s"] == pytest.approx(6.0)  # start to start
    assert last["round_s"] == pytest.approx(5.0)  # the last round: to the end of its outer step
    assert second["compute_utilization"] == pytest.approx(4.0 / 6.0)
    assert "close/ideal" in format_table(result)

    overlapped = [{"rounds": [timed(0, 100.0, 0.0, 0.0)]} for _ in range(2)]  # applied nothing yet
    row = summarize(overlapped, [], rate_mbps=8.0)["per_round"][0]
    assert row["ideal_transfer_s"] == pytest.approx(1.0) and row["transfer_over_ideal"] is None


def test_links_of_several_rates_bound_each_peer_by_its_downlink_or_the_slowest_uplink():
    """Three peers with 1 MB packets: one on 8 Mbps (1 MB/s), two on 80 Mbps. The slow peer needs
    2 s to download two packets; a fast one needs 0.2 s on its own link, but the slow peer's packet
    cannot leave its uplink in under 1 s, so 1 s is its ideal. `by_rate` splits the means."""
    reports = [
        {"rounds": [_round(k, compute=4.0, transfer=t, packet_bytes=1_000_000) for k in (0, 1)]}
        for t in (3.0, 1.5, 2.0)
    ]
    result = summarize(reports, [], rate_mbps=[8.0, 80.0, 80.0])
    row = result["per_round"][1]
    assert row["download_bytes"] == 2_000_000
    assert row["ideal_transfer_s"] == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    assert row["transfer_over_ideal"] == pytest.approx((3.0 / 2.0 + 1.5 + 2.0) / 3)
    slow, fast = result["summary"]["by_rate"]
    assert (slow["rate_mbps"], slow["num_peers"], fast["rate_mbps"], fast["num_peers"]) == (8.0, 1, 80.0, 2)
    assert slow["ideal_transfer_s"] == pytest.approx(2.0) and slow["transfer_over_ideal"] == pytest.approx(1.5)
    assert fast["ideal_transfer_s"] == pytest.approx(1.0) and fast["transfer_over_ideal"] == pytest.approx(1.75)
    assert fast["download_bytes"] == 2_000_000
    assert "by_rate" not in summarize(reports, [], rate_mbps=8.0)["summary"]
    with pytest.raises(ValueError, match="2 rates for 3 reports"):
        summarize(reports, [], rate_mbps=[8.0, 80.0])


def test_each_peers_own_steady_means_and_how_its_packet_left_it():
    from tools.netlab.report import peer_rows, summarize_peers

    reports = [
        {
            "rounds": [
                _round(0, compute=5.0, transfer=9.0, packet_bytes=1_000_000),
                _round(1, compute=3.0, transfer=transfer, packet_bytes=1_000_000),
            ]
        }
        for transfer in (1.5, 3.0)
    ]
    reports[1]["rounds"][1]["pushed_to"] = "holder"
    history = [{"round": 0, "closed_at": 100.0}, {"round": 1, "closed_at": 105.5}]
    means = summarize_peers(reports, history, rate_mbps=8.0)
    # Round 0 (start-up) left out; each peer's ideal is the other's 1 MB at 1 MB/s.
    assert [m["transfer_over_ideal"] for m in means] == [pytest.approx(1.5), pytest.approx(3.0)]
    assert means[0]["compute_utilization"] == pytest.approx(3.0 / (3.0 + 0.1 + 0.5 + 1.5 + 0.2))
    rounds = {k: {"state": "closed", "manifest": [{"peer_id": "a"}, {"peer_id": "b"}]} for k in (0, 1)}
    rows = peer_rows(["a", "b"], [True, True], rounds, reports, relayed=[True, False])
    assert [(r["path"], r["rounds_in_manifest"], r["rounds_pushed"]) for r in rows] == [("relay", 2, 0), ("push", 2, 1)]


MB = 1_000_000


@pytest.mark.parametrize(
    ("packets", "downlink", "busy_s"),
    [
        ([(0.0, MB, 1e12), (0.0, MB, 1e12)], MB, 2.0),  # ready together: the downlink carries both
        ([(0.0, MB, 1e12), (0.5, MB, 1e12)], MB, 2.0),  # the second while the first still arrives
        ([(0.0, MB, MB), (5.0, MB, MB)], 10 * MB, 2.0),  # apart, each at its 1 MB/s uplink: 1 s each
        ([(0.0, MB, MB), (0.0, 4 * MB, 1e12)], 2 * MB, 2.5),  # max-min: 1 + 1 MB/s for 1 s, then 2 MB/s
        ([], MB, 0.0),
    ],
)
def test_the_fluid_ideal_is_the_downlinks_busy_time_given_the_submissions(packets, downlink, busy_s):
    from tools.netlab.report import _fluid_busy_s

    assert _fluid_busy_s(packets, downlink) == pytest.approx(busy_s)


def test_submission_times_give_the_ideal_a_spread_swarm_can_reach():
    """Three peers with 1 MB packets submitted 10 s apart. On 80 Mbps (10 MB/s) each packet takes
    0.1 s alone: 0.2 s for two, as with every packet ready at once. With h1 on 8 Mbps, a fast peer
    takes h1's packet in 1 s and the other's in 0.1 s, apart: 1.1 s, where at once 1 s would do."""
    reports = [
        {
            "rounds": [
                _round(k, compute=4.0, transfer=0.5, packet_bytes=MB)
                | {"submitted_at": 100.0 * k + 10.0 * i, "fetching_s": 0.3}
                for k in (0, 1)
            ]
        }
        for i in range(3)
    ]
    row = summarize(reports, [], rate_mbps=80.0)["per_round"][1]
    assert row["ideal_transfer_s"] == pytest.approx(0.2) and row["ideal_all_ready_s"] == pytest.approx(0.2)
    assert row["transfer_over_ideal"] == pytest.approx(1.5)
    result = summarize(reports, [], rate_mbps=[8.0, 80.0, 80.0])
    fast = result["summary"]["by_rate"][1]
    assert fast["ideal_transfer_s"] == pytest.approx(1.1) and fast["ideal_all_ready_s"] == pytest.approx(1.0)
    assert fast["transfer_over_all_ready"] > fast["transfer_over_ideal"]


def test_a_plain_tcp_replay_is_held_to_the_same_ideal_over_the_senders_it_could_reach():
    # 8 Mbps = 1 MB/s. h1 and h2 submit 1 MB at 0 s and 1 s, h3 (behind NAT, like h4) 1 MB at 0.5 s.
    schedule = {1: (0.0, 1_000_000), 2: (1.0, 1_000_000), 3: (0.5, 1_000_000), 4: (0.5, 1_000_000)}
    rates = {1: 8.0, 2: 8.0, 3: 8.0, 4: 0.0}
    # h1's packets: h2's, h3's and h4's, overlapping from 0.5 s: 3 MB through 1 MB/s from 0.5 s.
    ratios = replay_over_ideal(schedule, rates, {1: 6.0, 2: 3.5, 3: 4.0, 4: 1.0}, no_path={(4, 3), (3, 4)})
    assert ratios[1] == pytest.approx(6.0 / 3.0)
    # h3 had no path from h4: its ideal counts h1's (from 0 s) and h2's (from 1 s) only, 2 s busy.
    assert ratios[3] == pytest.approx(4.0 / 2.0)
    assert ratios[4] is None  # unshaped: no ideal
    assert replay_over_ideal(schedule, rates, {2: 0.0})[2] is None  # received nothing


def test_union_of_the_intervals_a_packet_was_on_its_way():
    assert _union_s([]) == 0.0
    assert _union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
