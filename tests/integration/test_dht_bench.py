"""The DHT benchmark (tools/bench/dht.py) on a lab of 4 real DHT nodes (p2pd each) with 2
publishers: it runs, every lookup finds every record, the RPC counts are positive and consistent
with what each operation does, and every p2pd it started is gone afterwards."""

import json

import pytest

from locoswarm.cli import parse_args
from tools.bench.dht import RPC_NAMES, main

pytestmark = pytest.mark.timeout(240)

NODES, PUBLISHERS, FETCH = 4, 2, 1


def test_bench_dht_is_registered():
    args = parse_args(["bench", "dht", "--nodes", "4", "--json"])
    assert args.bench_command == "dht" and args.passthrough == ["--nodes", "4", "--json"]


def test_tiny_lab_counts_rpcs_per_operation(capsys):
    argv = ["--nodes", str(NODES), "--publishers", str(PUBLISHERS), "--fetch", str(FETCH)]
    assert main([*argv, "--rounds", "1", "--sizes", "16", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)

    assert report["lookups_complete"] == report["lookups"] == NODES
    assert report["table_min"] >= 1 and report["p2pd_left_alive"] == 0
    announce, lookup, hold = (report["phases"][p] for p in ("announce", "lookup", "hold"))
    assert (announce["ops"], lookup["ops"], hold["ops"]) == (PUBLISHERS, NODES, NODES)
    # An announcement stores its one key somewhere; a lookup asks for the packets key and FETCH
    # holders keys, each at least once, and stores nothing but cache copies; a holder stores FETCH keys.
    assert announce["rpcs_per_op"]["rpc_store"] >= 1 and announce["keys_per_op"]["rpc_store"] >= 1
    assert lookup["rpcs_per_op"]["rpc_find"] >= 1 and lookup["keys_per_op"]["rpc_find"] >= 1 + FETCH
    assert hold["keys_per_op"]["rpc_store"] >= FETCH
    for phase in (announce, lookup, hold):
        assert all(phase["keys_per_op"][name] >= 0 for name in RPC_NAMES)
        assert phase["keys_per_op"]["rpc_find"] >= phase["rpcs_per_op"]["rpc_find"]  # a find asks >= 1 key
        assert phase["max_rpcs_one_node"] <= phase["ops"] * sum(phase["rpcs_per_op"].values())
        assert 0 < phase["median_ms"] <= phase["p90_ms"]

    assert report["packets_key"]["records"] == PUBLISHERS
    assert report["holders_key"]["records"] >= 1
    assert 100 < report["packets_key"]["bytes"] / PUBLISHERS < 1000  # a record: digest, size, maddrs, holder
    (sweep,) = report["sizes"]
    assert sweep["stored"] == sweep["read_records"] == 16 and sweep["complete"] and sweep["error"] is None
