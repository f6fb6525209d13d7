"""The network lab with a host behind NAT, for real: 3 peers, h3 behind a NAT router namespace of its
own (and a spare relay host), 2 rounds of the tiny preset on 50/100 Mbps links with 20 ms one-way
delay. Checks that the lab's probe finds inbound connections to the NAT'd host blocked and its
outbound ones masqueraded, that the JSON says for every peer whether it was behind NAT and in how
many closed rounds' manifests its packet was, and that nothing the lab made is left afterwards
(namespaces, links, nftables rules), also after Ctrl+C once the NAT is up.

Whether the NAT'd peer's packet reaches the manifests is what the lab measures, not asserted here.
Needs root, working `ip netns` and nft; skips with the reason otherwise.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.netlab_leftovers import left_behind, root_links, root_rules
from tools.netlab.nat import firewall_available
from tools.netlab.topology import LAB_PREFIX, lab_available, lab_namespaces

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
LAB_ARGS = [
    "--peers",
    "3",
    "--nat",
    "1",
    "--relay-host",
    "--rounds",
    "2",
    "--rate-mbps",
    "50,100",
    "--delay-ms",
    "20",
    "--preset",
    "tiny",
    "--inner-steps",
    "3",
    "--batch-size",
    "4",
]


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    for ok, reason in (lab_available(), firewall_available()):
        if not ok:
            pytest.skip(reason)


def test_a_peer_behind_nat_is_unreachable_and_reported(tmp_path):
    links_before, rules_before = root_links(), root_rules()
    done = subprocess.run(
        [sys.executable, "-m", "tools.netlab", *LAB_ARGS, "--json", "--workdir", str(tmp_path), "--timeout", "80"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=110,
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["teardown_errors"] == [], result["teardown_errors"]
    prefix = result["namespace_prefix"]

    assert result["nat"]["hosts"] == ["h3"] and result["nat"]["client_mode"]
    router = result["nat"]["routers"]["h3"]
    assert router["namespace"] == f"{prefix}nat3" and router["private_ip"] == "192.168.3.2"
    relay = result["relay_host"]
    assert relay["namespace"] == f"{prefix}relay" and relay["ip"] == result["subnet"].rsplit(".", 1)[0] + ".5"

    # Nobody dials in: refused at the router's address, dropped on the way to the private one even
    # with a route to it; the NAT'd host dials out, from the router's address.
    (probe,) = result["link_check"]["nat"]
    assert probe["host"] == "h3" and probe["prober"] == "h1", probe
    assert probe["inbound_to_public_ip"] in ("refused", "timeout"), probe
    assert probe["inbound_to_private_ip"] in ("refused", "timeout", "unreachable"), probe
    assert probe["outbound"] == "connected" and probe["outbound_seen_from"] == router["public_ip"], probe
    assert probe["inbound_blocked"] and probe["outbound_masqueraded"]
    assert result["link_check"]["receiver"] == "h2"  # the rate probe's receiver must be dialable

    peers = result["per_peer"]
    assert [(p["host"], p["behind_nat"]) for p in peers] == [("h1", False), ("h2", False), ("h3", True)]
    for peer in peers:
        assert peer["peer_id"], peer
        assert peer["rounds"] == len(result["per_round"]) and 0 <= peer["rounds_in_manifest"] <= peer["rounds"]
    # The coordinator's dial-back finds h3 unreachable; h3 pushes each packet to a reachable peer,
    # and each is in its round's manifest (node/round/push.py).
    assert [p["reachable"] for p in peers] == [True, True, False], peers
    nat = peers[2]
    assert nat["rounds_in_manifest"] == nat["rounds"] == nat["rounds_pushed"] > 0, nat
    # The plain-TCP baseline reaches h3 all the same: h3 dials both senders and pulls their bytes,
    # and pushes its own to them; with one host behind NAT every pair has a path.
    (replay,) = result["tcp_alltoall"]["rounds"]  # round 1's submissions
    assert replay["received"] == [2, 2, 2] and replay["no_path"] == [], replay
    assert all(s > 0 for s in replay["busy_s"]), replay

    assert left_behind(prefix) == []
    assert root_links() <= links_before
    assert root_rules() == rules_before


def test_a_peer_behind_nat_is_fetched_through_the_labs_relay(tmp_path):
    """With --relay, h3 joins with --relay-via the relay host's `locoswarm node relay`: the
    coordinator's dial-back cannot tell (it does not dial relayed addresses), h3 pushes nothing, and
    its packet is in every round's manifest."""
    args = [*LAB_ARGS, "--relay", "--no-nat-client-mode"]
    done = subprocess.run(
        [sys.executable, "-m", "tools.netlab", *args, "--json", "--workdir", str(tmp_path), "--timeout", "80"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=110,
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["teardown_errors"] == [], result["teardown_errors"]
    assert result["relay"]["relayed_hosts"] == ["h3"] and "/p2p/" in result["relay"]["maddr"]
    nat = result["per_peer"][2]
    assert (nat["host"], nat["path"], nat["reachable"], nat["rounds_pushed"]) == ("h3", "relay", None, 0), nat
    assert nat["rounds_in_manifest"] == nat["rounds"] == len(result["per_round"]) > 0, nat
    assert result["summary"]["digests_agree_every_round"]
    # Peers may also fetch h3's packet over a connection h3 opened to them (libp2p reuses it), so
    # the relay's bytes are not bounded below by the packets; it carried the reservation at least.
    relay_bytes = next(b for b in result["interface_bytes"] if b["host"] == "relay")
    assert relay_bytes["rx_bytes"] > 0 and relay_bytes["tx_bytes"] > 0, relay_bytes
    assert left_behind(result["namespace_prefix"]) == []


def test_ctrl_c_once_the_nat_is_up_tears_everything_down(tmp_path):
    links_before, rules_before = root_links(), root_rules()
    lab = subprocess.Popen(
        [sys.executable, "-m", "tools.netlab", *LAB_ARGS, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        lines = []
        for line in lab.stdout:  # the NAT check's line: routers, rules and the NAT'd host are all up
            lines.append(line)
            if line.startswith("NAT check h3"):
                break
        else:
            pytest.fail("the lab ended before its NAT check:\n" + "".join(lines))
        prefix = next(line.split()[1].removesuffix("*:") for line in lines if line.startswith("lab "))
        assert prefix.startswith(LAB_PREFIX) and f"{prefix}nat3" in lab_namespaces(prefix)
        lab.send_signal(signal.SIGINT)
        rest, _ = lab.communicate(timeout=60)
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
    assert lab.returncode == 130, "".join(lines) + rest
    assert left_behind(prefix) == []
    assert root_links() <= links_before
    assert root_rules() == rules_before
