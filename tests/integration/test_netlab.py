"""The network lab for real: namespaces, shaped links (tc, or the userspace emulator on kernels
without netem), a coordinator and 3 nodes, 2 rounds on links of 50 and 100 Mbps (h1 and h3 at 50,
h2 and the coordinator's h0 at 100) with 20 ms one-way delay. Checks
that the swarm completes with agreeing digests, that the links really carry no more than the rate
(a TCP probe, and every peer's packet fetches take at least the ideal time for their bytes), that
the round trip is the delay's, and that nothing the lab made is left afterwards, also after
Ctrl+C mid-run.

Needs root and working `ip netns`; skips with the reason otherwise.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.netlab_leftovers import left_behind, root_links
from tools.netlab.topology import LAB_PREFIX, lab_available, lab_namespaces

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
RATE_MBPS = 50.0  # the probe's path, h1 -> h2, is bound by h1's link
FAST_MBPS = 100.0
# mini at top_k 2048 sends ~1 MB packets: each peer downloads ~2 MB a round, ~0.33 s at 50 Mbps,
# well above the few tens of milliseconds the same transfer takes on an unshaped veth.
DELAY_MS = 20.0
LAB_ARGS = [
    "--peers",
    "3",
    "--rounds",
    "2",
    "--rate-mbps",
    f"{RATE_MBPS},{FAST_MBPS}",
    "--delay-ms",
    str(DELAY_MS),
    "--preset",
    "mini",
    "--top-k",
    "2048",
    "--inner-steps",
    "3",
    "--batch-size",
    "4",
]


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    ok, reason = lab_available()
    if not ok:
        pytest.skip(reason)


def test_three_peers_two_rounds_on_shaped_links(tmp_path):
    links_before = root_links()
    done = subprocess.run(
        [sys.executable, "-m", "tools.netlab", *LAB_ARGS, "--json", "--workdir", str(tmp_path), "--timeout", "150"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)

    assert result["completed"] and result["teardown_errors"] == []
    for key in ("per_round", "summary", "link", "link_check", "overlap", "interface_bytes", "namespace_prefix"):
        assert key in result, key
    for key in (
        "compute_s",
        "transfer_s",
        "idle_s",
        "round_s",
        "packet_bytes",
        "download_bytes",
        "ideal_transfer_s",
        "transfer_over_ideal",
        "compute_utilization",
        "digests_agree",
    ):
        assert all(key in row for row in result["per_round"]), key
    assert [row["round"] for row in result["per_round"]] == [0, 1]
    link = result["link"]
    assert link["rate_mbps"] == [RATE_MBPS, FAST_MBPS] and link["shaper"] in ("tc", "userspace")
    assert link["host_rates_mbps"] == [FAST_MBPS, RATE_MBPS, FAST_MBPS, RATE_MBPS]
    assert [(g["rate_mbps"], g["num_peers"]) for g in result["summary"]["by_rate"]] == [(RATE_MBPS, 2), (FAST_MBPS, 1)]
    # netem where the kernel has it, the userspace emulator where not: either way the delay is real.
    assert link["delay_applied"], link
    rtt_ms = result["link_check"]["rtt_ms"]
    assert 2 * DELAY_MS <= rtt_ms < 2 * DELAY_MS + 40, result["link_check"]
    if link["shaper"] == "userspace":
        counters = link["emulator_counters"]
        assert sorted(counters) == sorted(f"{result['namespace_prefix']}h{i}" for i in range(4))
        assert all(c["packets"] > 0 for c in counters.values())
        # While the nodes ran: a part of the whole run's counts (the checks and the TCP replay are not in it).
        nodes = link["emulator_counters_nodes"]
        assert sorted(nodes) == sorted(counters) and all(c["packets"] > 0 for c in nodes.values())
        assert all(0 <= nodes[ns][k] <= counters[ns][k] for ns in counters for k in counters[ns])
        assert sum(c["packets"] for c in nodes.values()) < sum(c["packets"] for c in counters.values())

    # Every peer holds the same parameters after every round (read from the nodes' own reports).
    reports = [json.loads(p.read_text())["rounds"] for p in sorted(tmp_path.glob("node*.report.json"))]
    assert len(reports) == 3
    for k in range(2):
        assert len({next(r["digest"] for r in rep if r["round"] == k) for rep in reports}) == 1
        assert all(next(r for r in rep if r["round"] == k)["num_packets"] == 3 for rep in reports)

    # The shaper holds: a bulk TCP stream gets at most the link rate (and most of it), and no peer
    # moves its round's packets faster than its link allows.
    assert 0.6 * RATE_MBPS < result["link_check"]["mbps"] < 1.05 * RATE_MBPS, result["link_check"]
    for row in result["per_round"]:
        assert row["download_bytes"] > 1_500_000, row  # packets big enough for the rate to show
        assert row["fetching_s"] >= row["ideal_transfer_s"], row  # the link's time, early fetches included
        assert row["transfer_over_ideal"] >= 1.0, row
    # The reference (each steady round's packets over plain TCP, each sent to every host at its
    # submission) cannot beat the links either; every host got both others' bytes in each replay.
    baseline = result["tcp_alltoall"]
    assert 1.0 <= baseline["over_ideal"] < 6.0, baseline
    assert [r["round"] for r in baseline["rounds"]] == result["summary"]["rounds_averaged"], baseline
    assert all(r["received"] == [2, 2, 2] and r["no_path"] == [] for r in baseline["rounds"]), baseline
    # The bytes really went through the lab's interfaces: each node received at least its downloads.
    assert result["summary"]["interface_rx_bytes_per_peer_round"] >= result["summary"]["download_bytes"]

    assert left_behind(result["namespace_prefix"]) == []
    assert root_links() <= links_before


def test_ctrl_c_tears_everything_down(tmp_path):
    links_before = root_links()
    lab = subprocess.Popen(
        [sys.executable, "-m", "tools.netlab", *LAB_ARGS, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        lines = []
        # Interrupt once nodes run: namespaces, shapers, the coordinator and node processes all up. The
        # lab prints its first progress line ("round 0 ...") once the first node joined from inside its
        # namespace and the other nodes were started.
        for line in lab.stdout:
            lines.append(line)
            if line.startswith("round "):
                break
        else:
            pytest.fail("the lab ended before its first node joined:\n" + "".join(lines))
        prefix = next(line.split()[1].removesuffix("*:") for line in lines if line.startswith("lab "))
        assert prefix.startswith(LAB_PREFIX) and lab_namespaces(prefix)
        lab.send_signal(signal.SIGINT)
        rest, _ = lab.communicate(timeout=60)
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
    assert lab.returncode == 130, "".join(lines) + rest
    assert "torn down" in rest
    assert left_behind(prefix) == []
    assert root_links() <= links_before
    # No process of the lab survives: nothing runs from its working directory any more.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert leftovers == []
