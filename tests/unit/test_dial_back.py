"""The coordinator's dial-back at join (coordinator/reachability.py), against sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

from coordinator.reachability import MAX_PORTS, dial_back, tcp_ports


def test_tcp_ports_are_read_from_multiaddrs_first_seen_first_and_bounded():
    maddrs = [
        "/ip4/10.0.0.1/tcp/4001/p2p/12D3Koo",
        "/ip6/::1/tcp/4001",
        "/ip4/1.2.3.4/udp/9/quic",
        "/ip4/1.2.3.4/tcp/0",
        "/ip4/1.2.3.4/tcp/70000",
        "/dns4/example.org/tcp/5000",
        *(f"/ip4/1.2.3.4/tcp/{p}" for p in range(6000, 6010)),
    ]
    assert tcp_ports(maddrs) == [4001, 5000, 6000, 6001][:MAX_PORTS]
    assert tcp_ports(["not a multiaddr", "/tcp"]) == []


def test_a_listening_port_is_reachable_a_closed_one_is_not_and_no_address_cannot_tell():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = server.sockets[0].getsockname()[1]
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        closed_port = closed.getsockname()[1]
        try:
            assert await dial_back("127.0.0.1", [f"/ip4/192.168.1.7/tcp/{open_port}"]) is True
            assert await dial_back("127.0.0.1", [f"/ip4/127.0.0.1/tcp/{closed_port}"]) is False
            both = [f"/ip4/127.0.0.1/tcp/{closed_port}", f"/ip4/127.0.0.1/tcp/{open_port}"]
            assert await dial_back("127.0.0.1", both) is True
            assert await dial_back("testclient", both) is None  # not an address
            assert await dial_back(None, both) is None
            assert await dial_back("127.0.0.1", ["/ip4/127.0.0.1/udp/9/quic"]) is None
        finally:
            server.close()
            await server.wait_closed()
            closed.close()

    asyncio.run(scenario())


def test_relayed_addresses_name_no_port_of_the_node():
    relay = "/ip4/203.0.113.7/tcp/31338/p2p/12D3KooWHxfHibqyUtoLwvQhv38QzStimHAZdv5U78HQArRC4BXh"
    circuit = f"{relay}/p2p-circuit/p2p/12D3KooWQ1Eahu9pBAf7gxxKBLVcogzPn6tqj4K8M1pBG1hWb7x6"
    assert tcp_ports([circuit]) == []
    assert tcp_ports([circuit, "/ip4/10.0.0.2/tcp/4001"]) == [4001]
