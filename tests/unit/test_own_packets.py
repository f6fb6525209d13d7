"""A node's own packets on disk (node/round/own_packets.py): kept beside the checkpoint, read back
only when intact, forgotten once final."""

from __future__ import annotations

import hashlib

from node.round.own_packets import OwnPackets


def keep(packets: OwnPackets, round: int, payload: bytes, **fields) -> str:
    return packets.keep(
        round,
        payload,
        **(
            {"run_id": "run", "peer_id": "peer", "base_digest": "ab" * 16, "train_loss": 3.5, "compute_s": 1.25}
            | fields
        ),
    )


def test_kept_beside_the_checkpoint_not_inside_it(tmp_path):
    packets = OwnPackets.beside(tmp_path / "ckpt")
    assert packets.directory == tmp_path / "ckpt-packets"  # a checkpoint is replaced as a whole folder
    assert OwnPackets.beside(None) is None


def test_a_kept_packet_reads_back_with_its_meta(tmp_path):
    packets = OwnPackets.beside(tmp_path / "ckpt")
    payload = bytes(range(256)) * 10
    digest = keep(packets, 5, payload)
    assert digest == hashlib.sha256(payload).hexdigest()
    held = packets.load(5)
    assert held is not None and held.payload == payload and held.digest == digest
    assert (held.round, held.run_id, held.peer_id, held.base_digest) == (5, "run", "peer", "ab" * 16)
    assert (held.train_loss, held.compute_s) == (3.5, 1.25)
    assert packets.load(6) is None
    assert [p.round for p in packets.held("run", "peer")] == [5]
    assert packets.held("other-run", "peer") == [] and packets.held("run", "other-peer") == []


def test_damaged_or_half_written_packets_are_not_served(tmp_path):
    packets = OwnPackets.beside(tmp_path / "ckpt")
    keep(packets, 1, b"a" * 100)
    keep(packets, 2, b"b" * 100)
    keep(packets, 3, b"c" * 100)
    (packets.directory / "round-000001.pkt").write_bytes(b"a" * 99 + b"x")  # a flipped byte
    (packets.directory / "round-000002.json").unlink()  # a crash between the bytes and the meta
    (packets.directory / "round-000003.json").write_text("{not json")
    assert packets.load(1) is None and packets.load(2) is None and packets.load(3) is None
    assert packets.held("run", "peer") == []


def test_forget_before_drops_only_final_rounds(tmp_path):
    packets = OwnPackets.beside(tmp_path / "ckpt")
    for r in (3, 4, 7, 12):
        keep(packets, r, bytes([r]) * 10)
    packets.forget_before(7)
    assert packets.rounds() == [7, 12]
    assert sorted(p.name for p in packets.directory.iterdir()) == [
        "round-000007.json",
        "round-000007.pkt",
        "round-000012.json",
        "round-000012.pkt",
    ]
    OwnPackets(tmp_path / "never-made").forget_before(100)  # nothing kept yet: nothing to do
