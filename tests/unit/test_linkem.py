"""The userspace link emulator's arithmetic (tools/netlab/linkem.py) without devices: when a packet
leaves its sender's uplink, how long it travels, when the receiver's downlink delivers it, what is
dropped, and how offloaded segments are counted. tests/integration/test_netlab.py runs it for real."""

import heapq
import struct

import pytest

from tools.netlab.linkem import ETHERNET_OVERHEAD, QUEUE_LIMIT_S, VNET_HDR, LinkEmulator

HOSTS = [("ns-a", "10.9.0.1"), ("ns-b", "10.9.0.2"), ("ns-c", "10.9.0.3")]


def ipv4_packet(dest: str, payload_bytes: int, gso_size: int = 0, hdr_len: int = 40) -> bytes:
    vnet = VNET_HDR.pack(0, 1 if gso_size else 0, hdr_len if gso_size else 0, gso_size, 0, 0)
    header = bytearray(20)
    header[0] = 0x45
    header[16:20] = bytes(int(x) for x in dest.split("."))
    return vnet + bytes(header) + bytes(20 + payload_bytes)  # IP header, TCP header, payload


def emulator(rate_mbps: float = 8.0, rates_mbps: list[float] | None = None, **kwargs) -> LinkEmulator:
    rates = rates_mbps or [rate_mbps] * len(HOSTS)
    return LinkEmulator(
        [(ns, ip, rate) for (ns, ip), rate in zip(HOSTS, rates)],
        **({"delay_ms": 20.0, "loss_pct": 0.0} | kwargs),
        seed=0,
    )


def drain(em: LinkEmulator) -> list[tuple[float, int, bytes]]:
    """Run the event queue to its end; return (time, host, packet) for each delivery."""
    delivered = []
    while em.events:
        due, _, kind, host, size, packet = heapq.heappop(em.events)
        if kind == 0:
            em.arrived(host, size, packet, due)
        else:
            delivered.append((due, host, packet))
    return delivered


def test_a_packet_pays_serialization_on_both_links_and_the_delay_once():
    em = emulator()  # 8 Mbps: one byte per microsecond
    packet = ipv4_packet("10.9.0.2", 960)  # 1000 bytes of IP packet
    em.sent(0, packet, now=100.0)
    delivered = drain(em)
    wire = 1000 + ETHERNET_OVERHEAD
    assert [(host, p) for _, host, p in delivered] == [(1, packet)]
    assert delivered[0][0] == pytest.approx(100.0 + wire * 1e-6 + 0.020 + wire * 1e-6)


def test_back_to_back_packets_queue_on_the_uplink_and_arrive_spaced_by_the_rate():
    em = emulator()
    for _ in range(3):
        em.sent(0, ipv4_packet("10.9.0.3", 960), now=0.0)
    delivered = drain(em)
    times = [t for t, _, _ in delivered]
    gap = (1000 + ETHERNET_OVERHEAD) * 1e-6
    assert times[1] - times[0] == pytest.approx(gap) and times[2] - times[1] == pytest.approx(gap)


def test_each_host_has_its_own_rate_on_its_uplink_and_downlink():
    em = emulator(rates_mbps=[8.0, 80.0, 0.8])  # a byte per 1, 0.1 and 10 microseconds
    wire = 1000 + ETHERNET_OVERHEAD
    em.sent(0, ipv4_packet("10.9.0.2", 960), now=0.0)  # slow-ish uplink, fast downlink
    em.sent(1, ipv4_packet("10.9.0.3", 960), now=0.0)  # fast uplink, slow downlink
    (t_b, host_b, _), (t_c, host_c, _) = sorted(drain(em))
    assert (host_b, host_c) == (1, 2)
    assert t_b == pytest.approx(wire * 1e-6 + 0.020 + wire * 0.1e-6)
    assert t_c == pytest.approx(wire * 0.1e-6 + 0.020 + wire * 10e-6)


def test_two_senders_share_the_receivers_downlink():
    em = emulator()
    em.sent(0, ipv4_packet("10.9.0.3", 960), now=0.0)
    em.sent(1, ipv4_packet("10.9.0.3", 960), now=0.0)  # both arrive together; the downlink serializes them
    delivered = drain(em)
    gap = (1000 + ETHERNET_OVERHEAD) * 1e-6
    assert delivered[1][0] - delivered[0][0] == pytest.approx(gap)


def test_a_full_queue_drops_the_tail_and_counts_it():
    em = emulator()
    size = 1000 + ETHERNET_OVERHEAD
    fits = int(QUEUE_LIMIT_S / (size * 1e-6)) + 1  # packets whose queueing stays within the limit
    for _ in range(fits + 5):
        em.sent(0, ipv4_packet("10.9.0.2", 960), now=0.0)
    assert em.hosts[0].counters.dropped_uplink == 5
    assert len(em.events) == fits


def test_unroutable_and_non_ipv4_packets_are_dropped():
    em = emulator()
    em.sent(0, ipv4_packet("10.9.0.9", 100), now=0.0)  # no such host
    em.sent(0, ipv4_packet("10.9.0.1", 100), now=0.0)  # to itself
    ipv6 = bytearray(ipv4_packet("10.9.0.2", 100))
    ipv6[VNET_HDR.size] = 0x60
    em.sent(0, bytes(ipv6), now=0.0)
    em.sent(0, b"\0" * 12, now=0.0)  # too short to carry an IPv4 header
    assert em.hosts[0].counters.dropped_unroutable == 4 and not em.events


def test_loss_drops_about_the_given_fraction():
    em = emulator(rate_mbps=0.0, loss_pct=10.0)
    for _ in range(5000):
        em.sent(0, ipv4_packet("10.9.0.2", 100), now=0.0)
    assert 400 < em.hosts[0].counters.dropped_loss < 600
    assert not em.offload  # with loss, every packet is an MTU-sized one, as netem sees them


def test_offloaded_segments_are_counted_as_the_packets_they_become():
    em = emulator()
    # 10 segments of 1448 payload bytes behind a 52-byte IP+TCP header, handed over as one.
    packet = ipv4_packet("10.9.0.2", 10 * 1448 + 12, gso_size=1448, hdr_len=52)
    length = len(packet) - VNET_HDR.size
    assert em.wire_bytes(packet) == length + 9 * 52 + 10 * ETHERNET_OVERHEAD
    assert em.wire_bytes(ipv4_packet("10.9.0.2", 100)) == 140 + ETHERNET_OVERHEAD
    assert struct.calcsize("<BBHHHH") == VNET_HDR.size == 10


def test_unshaped_links_add_only_the_delay():
    em = emulator(rate_mbps=0.0)
    em.sent(0, ipv4_packet("10.9.0.2", 5000), now=1.0)
    delivered = drain(em)
    assert delivered[0][0] == pytest.approx(1.020)
