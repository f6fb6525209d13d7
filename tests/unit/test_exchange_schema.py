"""The DHT record schema of protocol/dht_records.py (keys, records, refusal of malformed records), the
reachability advice, and the `Exchange` protocol that P2PExchange implements."""

from __future__ import annotations

import hashlib
import inspect
import random
import subprocess
import sys

import msgpack
import pytest

from node.exchange.reachability import assess_reachability
from protocol.dht_records import Announcement, holders_key, make_record, packets_key, parse_record
from protocol.errors import MalformedPacket, OversizedPacket, ProtocolError

DIGEST = hashlib.sha256(b"packet").hexdigest()
MADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQsF5p9hSR9p8nwwe5tiBco3CcNSauVbT7jStrMnUpx45"
HOLDER = "12D3KooWQsF5p9hSR9p8nwwe5tiBco3CcNSauVbT7jStrMnUpx45"


def test_keys_are_the_documented_strings():
    assert packets_key("run-1", 0) == "locoswarm/run-1/round/0/packets"
    assert packets_key("run-1", 12) == "locoswarm/run-1/round/12/packets"
    assert holders_key("run-1", 12, "peer-a") == "locoswarm/run-1/round/12/holders/peer-a"


@pytest.mark.parametrize("run_id, round", [("a/b", 0), ("", 0), ("x\n", 0), ("r", -1), ("r", True), ("r", 1.0)])
def test_keys_refuse_bad_parts(run_id, round):
    with pytest.raises(ValueError):
        packets_key(run_id, round)


def test_holders_key_refuses_a_separator_in_the_peer_id():
    with pytest.raises(ValueError):
        holders_key("r", 0, "peer/../x")


def test_record_round_trips_through_msgpack():
    record = make_record(DIGEST, 850_000, [MADDR], HOLDER)
    assert record == {"digest": DIGEST, "size": 850_000, "maddrs": [MADDR], "holder": HOLDER}
    wire = msgpack.packb(record)
    assert len(wire) < 300  # a DHT value stays a few hundred bytes
    ann = parse_record("peer-a", 3, msgpack.unpackb(wire))
    assert ann == Announcement("peer-a", 3, DIGEST, 850_000, [MADDR], HOLDER)


def test_record_accepts_a_tuple_of_maddrs_from_hivemind_serializer():
    record = make_record(DIGEST, 1, [MADDR], HOLDER) | {"maddrs": (MADDR,)}
    assert parse_record("p", 0, record).multiaddrs == [MADDR]


GOOD = {"digest": DIGEST, "size": 10, "maddrs": [MADDR], "holder": HOLDER}
BAD_RECORDS = [
    None,
    b"bytes",
    [DIGEST, 10, [MADDR], HOLDER],
    {},
    GOOD | {"extra": 1},
    {k: v for k, v in GOOD.items() if k != "holder"},
    GOOD | {"digest": DIGEST.upper()},
    GOOD | {"digest": DIGEST[:-1]},
    GOOD | {"digest": bytes.fromhex(DIGEST)},
    GOOD | {"size": 0},
    GOOD | {"size": -5},
    GOOD | {"size": True},
    GOOD | {"size": 1.5},
    GOOD | {"size": "10"},
    GOOD | {"maddrs": MADDR},
    GOOD | {"maddrs": [MADDR] * 17},
    GOOD | {"maddrs": [b"/ip4/1.2.3.4"]},
    GOOD | {"maddrs": ["not-a-maddr"]},
    GOOD | {"maddrs": ["/" + "x" * 600]},
    GOOD | {"holder": ""},
    GOOD | {"holder": 5},
    GOOD | {"holder": "x" * 257},
]


@pytest.mark.parametrize("value", BAD_RECORDS)
def test_malformed_records_are_refused_with_a_protocol_error(value):
    with pytest.raises(MalformedPacket):
        parse_record("peer-a", 0, value)


def test_bad_subkey_is_refused():
    for subkey in ("", 7, None, "p" * 300):
        with pytest.raises(MalformedPacket):
            parse_record(subkey, 0, GOOD)


def test_oversized_announcement_is_refused_before_any_fetch():
    with pytest.raises(OversizedPacket):
        parse_record("peer-a", 0, GOOD | {"size": 1 << 30}, max_size_bytes=256 << 20)


def test_make_record_refuses_what_parse_would_refuse():
    with pytest.raises(ValueError):
        make_record("zz", 10, [MADDR], HOLDER)
    with pytest.raises(ValueError):
        make_record(DIGEST, 0, [MADDR], HOLDER)


def test_random_msgpack_values_raise_only_protocol_errors_and_valid_ones_parse_exactly():
    rng, good_rng = random.Random(0), random.Random(1)
    atoms = [0, -1, 2**40, 1.5, "", "x", b"", True, None, DIGEST, MADDR, [], {}]
    maddrs = [MADDR, "/ip4/10.0.0.1/tcp/1/p2p/" + HOLDER, "/ip6/::1/tcp/9/p2p/" + HOLDER]
    num_accepted = 0
    for _ in range(500):
        # A well-formed record among the hostile ones: read back exactly as written.
        good = make_record(
            good_rng.randbytes(32).hex(),
            good_rng.randint(1, 256 << 20),
            good_rng.sample(maddrs, good_rng.randint(0, 3)),
            good_rng.choice([HOLDER, "h" * 256]),
        )
        wire = msgpack.unpackb(msgpack.packb(good), raw=False)
        assert parse_record("p", 7, wire, 256 << 20) == Announcement(
            "p", 7, good["digest"], good["size"], good["maddrs"], good["holder"]
        )
        value = {rng.choice(["digest", "size", "maddrs", "holder", "other"]): rng.choice(atoms) for _ in range(4)}
        if rng.random() < 0.3:
            value = GOOD | {rng.choice(list(GOOD)): rng.choice(atoms + [[rng.choice(atoms)]])}
        try:
            ann = parse_record("p", 0, msgpack.unpackb(msgpack.packb(value), raw=False))
        except ProtocolError:
            continue
        # Accepted: a good record with one field swapped for another valid value, read back as written.
        num_accepted += 1
        assert ann == Announcement("p", 0, value["digest"], value["size"], list(value["maddrs"]), value["holder"])
    # The mutations of GOOD that keep it valid (a digest, a positive size, a list of multiaddrs, a
    # holder string) are accepted: 19 of the 500 with this seed.
    assert num_accepted >= 10


@pytest.mark.parametrize(
    "maddrs, reachable, loopback_only, advice_word",
    [
        (["/ip4/127.0.0.1/tcp/1/p2p/" + HOLDER], False, True, "loopback"),
        (["/ip4/192.168.1.5/tcp/1/p2p/" + HOLDER, "/ip4/127.0.0.1/tcp/1/p2p/" + HOLDER], False, False, "private"),
        (["/ip4/10.0.0.2/tcp/1/p2p/" + HOLDER, "/ip4/8.8.8.8/tcp/1/p2p/" + HOLDER], True, False, "public"),
        (["/ip4/8.8.8.8/tcp/1/p2p/" + HOLDER + "/p2p-circuit/p2p/" + HOLDER], True, False, "public"),
        (["/ip4/10.0.0.2/tcp/1/p2p/" + HOLDER + "/p2p-circuit/p2p/" + HOLDER], True, False, "relay"),
    ],
)
def test_reachability_is_classified_with_advice(maddrs, reachable, loopback_only, advice_word):
    report = assess_reachability(maddrs)
    assert report.reachable is reachable and report.loopback_only is loopback_only
    assert advice_word in report.advice


def test_p2p_exchange_implements_every_method_of_the_exchange_protocol():
    """The round loop is written against node.exchange.base.Exchange; P2PExchange must offer all of it."""
    from node.exchange.base import Exchange
    from node.exchange.p2p import P2PExchange

    members = [name for name in vars(Exchange) if not name.startswith("_")]
    assert {
        "publish",
        "fetch",
        "traffic",
        "publish_params",
        "params_holders",
        "fetch_params",
        "forget_before",
        "reachability_check",
        "visible_maddrs",
        "shutdown",
    } <= set(members)
    for name in members:
        expected, actual = getattr(Exchange, name), getattr(P2PExchange, name)
        if isinstance(expected, property):
            assert isinstance(actual, property), name
            continue
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected), name
        assert list(inspect.signature(actual).parameters) == list(inspect.signature(expected).parameters), name


def test_exchange_base_imports_no_transport():
    """An in-memory exchange can be written against node.exchange.base without hivemind."""
    code = (
        "import sys, node.exchange.base; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'hivemind']; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_relayed_address_is_encoded_as_p2pd_reads_it():
    """go-multiaddr reads /p2p/<id> as a length-prefixed multihash; hivemind writes a CID there."""
    import base58

    from node.exchange.reachability import circuit_address, is_relayed, p2pd_multiaddr

    relay_id = "12D3KooWHxfHibqyUtoLwvQhv38QzStimHAZdv5U78HQArRC4BXh"
    holder_id = "12D3KooWQ1Eahu9pBAf7gxxKBLVcogzPn6tqj4K8M1pBG1hWb7x6"
    relay = f"/ip4/127.0.0.1/tcp/1/p2p/{relay_id}"
    circuit = circuit_address(relay, holder_id)
    assert circuit == f"{relay}/p2p-circuit/p2p/{holder_id}" and is_relayed(circuit) and not is_relayed(relay)
    digest = base58.b58decode(relay_id)
    encoded = p2pd_multiaddr(circuit.removesuffix(f"/p2p/{holder_id}")).to_bytes()
    # ip4 127.0.0.1, tcp 1, p2p (0x01a5 as a varint) + length + multihash, p2p-circuit (0x0122 as a varint)
    assert encoded == bytes.fromhex("047f000001060001") + b"\xa5\x03" + bytes([len(digest)]) + digest + b"\xa2\x02"
    assert p2pd_multiaddr("/ip4/127.0.0.1/tcp/1").to_bytes() == bytes.fromhex("047f000001060001")
    with pytest.raises(ValueError, match="not relayed itself"):
        circuit_address(circuit, holder_id)


def test_a_relayed_address_is_the_holders_not_the_relays():
    from node.exchange.reachability import addresses_by_holder

    relay = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWHxfHibqyUtoLwvQhv38QzStimHAZdv5U78HQArRC4BXh"
    holder = "12D3KooWQ1Eahu9pBAf7gxxKBLVcogzPn6tqj4K8M1pBG1hWb7x6"
    circuit = f"{relay}/p2p-circuit/p2p/{holder}"
    assert addresses_by_holder([circuit, f"{relay}/p2p-circuit", "/ip4/1.2.3.4/tcp/5"]) == {holder: [circuit]}
