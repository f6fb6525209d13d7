"""A short run of the packet-decoder fuzzer (tools/fuzz.py): mutated real packets, every one
refused with a ProtocolError or accepted well-formed, none slow. The 100 000-input run is
`python -m tools.fuzz --count 100000`."""

import pytest

from tools.fuzz import fuzz

pytestmark = pytest.mark.timeout(120)


def test_three_thousand_mutated_packets_crash_nothing():
    summary = fuzz(count=3000, seconds=60, seed=1, per_input_s=2.0, verbose=True)
    assert summary["crashes"] == 0, summary["first_crashes"]
    assert summary["inputs"] == 3000
    assert summary["hangs"] == 0 and summary["max_decode_ms"] < 2000
    refused = summary["refused_by_type"]
    # the mutations reach every layer of the decoder, not just the framing
    for kind in ("BadSignature", "TruncatedPacket", "MalformedPacket", "WrongRound", "UnsupportedVersion"):
        assert refused.get(kind, 0) > 0, refused
    assert summary["accepted"] + sum(refused.values()) == summary["inputs"]


def test_zstd_frame_claiming_a_huge_content_size_is_refused_not_allocated():
    """Found by the 100 000-input run: a re-signed packet whose zstd frame header declares 4e18
    bytes made python-zstandard raise MemoryError despite max_output_size."""
    import struct

    import msgpack

    from protocol.errors import MalformedPacket
    from protocol.packet import MAGIC, PREFIX, WIRE_VERSION, decode_packet, read_header
    from tools.fuzz import KEY, ROUND, RUN_ID, SPECS, make_bases, member_key

    base = make_bases(0)[0]
    header, offset = read_header(base.data)
    streams = base.data[offset : offset + sum(t[5] + t[6] for t in header["tensors"])]
    # zstd frame: magic, descriptor 0xE0 (single segment, 8-byte content size), the size, a last raw block
    frame = b"\x28\xb5\x2f\xfd" + b"\xe0" + struct.pack("<Q", 4349749363775702282) + b"\x01\x00\x00"
    header["codes"] = [1, len(frame)]
    raw = msgpack.packb(header)
    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + streams + frame
    with pytest.raises(MalformedPacket, match="claims"):
        decode_packet(body + KEY.sign(body), SPECS[0], member_key, run_id=RUN_ID, round=ROUND)
