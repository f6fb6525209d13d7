"""ExchangeConfig (node/exchange/config.py): a node's exchange takes its network settings from
NodeConfig's network section by name, none copied by hand; and the exchange's modules import each
other one way (no cycle, the imports made for type checking included)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from node.config import load_node_config
from node.exchange.config import STRIPED_LINK_MBPS, ExchangeConfig
from protocol.stream import MAX_STRIPES

REPO = Path(__file__).resolve().parents[2]
# NetworkSection's fields the exchange does not take: the join's (uplink, behind NAT), the round loop's, and the two
# that `from_network` resolves into `spool_dir`.
NOT_THE_EXCHANGES = {
    "behind_nat",
    "push_packets",
    "fetch_timeout_s",
    "packet_spool_dir",
    "packets_in_memory",
}


def test_every_network_field_is_the_exchanges_or_named_here():
    from node.config import NetworkSection

    shared = set(NetworkSection.model_fields) & {f.name for f in fields(ExchangeConfig)}
    assert shared == set(NetworkSection.model_fields) - NOT_THE_EXCHANGES
    assert shared == {
        "host_maddrs",
        "announce_maddrs",
        "initial_peers",
        "client_mode",
        "use_auto_relay",
        "relay",
        "relay_via",
        "stripes",
        "uplink_mbps",
        "downlink_mbps",
    }


def test_from_network_takes_the_section_and_the_run(tmp_path):
    node = load_node_config(
        None,
        {
            "coordinator": "http://c:1",
            "network.host_maddrs": ["/ip4/0.0.0.0/tcp/31337"],
            "network.announce_maddrs": ["/ip4/8.8.8.8/tcp/31337"],
            "network.client_mode": True,
            "network.use_auto_relay": True,
            "network.initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/Qm"],
            "network.stripes": 2,
        },
    )
    config = ExchangeConfig.from_network(
        node.network,
        run_id="r1",
        initial_peers=("/ip4/5.6.7.8/tcp/1/p2p/Qm",),
        max_packet_bytes=4096,
        cache_dir=tmp_path,
    )
    assert config == ExchangeConfig(
        run_id="r1",
        host_maddrs=("/ip4/0.0.0.0/tcp/31337",),
        announce_maddrs=("/ip4/8.8.8.8/tcp/31337",),
        client_mode=True,
        use_auto_relay=True,
        stripes=2,
        initial_peers=("/ip4/5.6.7.8/tcp/1/p2p/Qm",),
        max_packet_bytes=4096,
        spool_dir=str(tmp_path / "spool"),
    )


def test_where_held_packets_live(tmp_path):
    def spool_dir(**network) -> str | None:
        node = load_node_config(None, {"coordinator": "http://c:1", **{f"network.{k}": v for k, v in network.items()}})
        return ExchangeConfig.from_network(
            node.network, run_id="r1", initial_peers=(), max_packet_bytes=4096, cache_dir=tmp_path / "cache"
        ).spool_dir

    assert spool_dir() == str(tmp_path / "cache" / "spool")
    assert spool_dir(packet_spool_dir=str(tmp_path / "disk")) == str(tmp_path / "disk")
    assert spool_dir(packet_spool_dir=str(tmp_path / "disk"), packets_in_memory=True) is None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):  # every import, under `if TYPE_CHECKING:` and in functions too
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_the_exchange_modules_import_each_other_one_way():
    modules = {f"node.exchange.{p.stem}": p for p in (REPO / "node" / "exchange").glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}
    order: list[str] = []  # a topological order exists exactly when there is no cycle
    while len(order) < len(graph):
        ready = sorted(name for name, deps in graph.items() if name not in order and deps <= set(order))
        assert ready, f"a cycle among {sorted(set(graph) - set(order))}"
        order += ready
    assert not graph["node.exchange.config"], "the config imports none of the exchange's parts"


def test_relay_roles_exclude_each_other_and_relays_are_named_by_id():
    import pytest
    from pydantic import ValidationError

    from node.config import NetworkSection

    relay = "/ip4/203.0.113.7/tcp/31338/p2p/12D3KooWHxfHibqyUtoLwvQhv38QzStimHAZdv5U78HQArRC4BXh"
    assert NetworkSection(relay_via=[f"{relay},{relay}"]).relay_via == (relay, relay)  # a comma list, as the flag takes
    with pytest.raises(ValidationError, match="exclude each other"):
        NetworkSection(relay=True, relay_via=[relay])
    with pytest.raises(ValidationError, match="/p2p/<its libp2p id>"):
        NetworkSection(relay_via=["/ip4/203.0.113.7/tcp/31338"])
    with pytest.raises(ValueError, match="not both"):
        ExchangeConfig(run_id="r", relay=True, relay_via=(relay,))


def test_a_slow_stated_link_fetches_over_one_stream():
    assert ExchangeConfig(run_id="r").fetch_stripes == 4  # unstated: fast
    assert ExchangeConfig(run_id="r", uplink_mbps=100.0, stripes=6).fetch_stripes == 6
    assert ExchangeConfig(run_id="r", uplink_mbps=STRIPED_LINK_MBPS - 1).fetch_stripes == 1
    # either rate: a slow downlink stated alone, paced, would hold each stripe at the floor rate
    assert ExchangeConfig(run_id="r", downlink_mbps=STRIPED_LINK_MBPS - 1).fetch_stripes == 1
    assert ExchangeConfig(run_id="r", uplink_mbps=100.0, downlink_mbps=2.0).fetch_stripes == 1
    assert ExchangeConfig(run_id="r", uplink_mbps=100.0, downlink_mbps=STRIPED_LINK_MBPS).fetch_stripes == 4
    for stripes in (0, MAX_STRIPES + 1):
        with pytest.raises(ValueError, match="stripes"):
            ExchangeConfig(run_id="r", stripes=stripes)
