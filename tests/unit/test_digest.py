"""The hash-tree parameter digest (protocol/digest.py) and the snapshot stream built on it
(protocol/snapshot.py, node/training/snapshot.py).

The fast path (tensors hashed in place, chunks in worker threads) is checked against a slow,
obvious reference written from the layout in protocol/digest.py's docstring; the same digest must
come from tensors, from a byte stream cut anywhere, from chunk-aligned shards, and from a
snapshot received unit by unit.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch
from blake3 import blake3

from node.training.params import param_digest, param_tree, tensor_header
from node.training.snapshot import Snapshot, SnapshotSink, StaleSnapshot
from protocol.digest import CHUNK_BYTES, ChunkHasher, Tree, encode_header, num_chunks, tree_of
from protocol.errors import MalformedPacket, ProtocolError, ShapeMismatch, TruncatedPacket
from protocol.snapshot import SectionLayout, SnapshotLayout, decode_prologue, snapshot_digest
from protocol.stream import DigestMismatch

pytestmark = pytest.mark.timeout(60)


def reference_digest(named: dict[str, torch.Tensor]) -> str:
    """The digest as the layout describes it, one step at a time."""
    header = b"locoswarm.tensors.v2" + struct.pack("<I", len(named))
    body = b""
    for name in sorted(named):
        t = named[name]
        for field in (name.encode(), str(t.dtype).encode(), struct.pack(f"<{t.ndim}Q", *t.shape)):
            header += struct.pack("<Q", len(field)) + field
        body += t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    leaves = [blake3(b"\x00" + body[i : i + CHUNK_BYTES]).digest() for i in range(0, len(body), CHUNK_BYTES)]
    root = blake3(b"\x01" + struct.pack("<Q", len(header)) + header + struct.pack("<Q", len(body)) + b"".join(leaves))
    return root.hexdigest()


def awkward_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """About 10.6 MB: chunk boundaries fall inside "b" and inside "d"; a chunk spans "c" and "d";
    a 1-element, an empty and a 0-d tensor among them."""
    g = torch.Generator().manual_seed(seed)
    return {
        "b": torch.randn(1000, 1500, generator=g),  # 6 MB: crosses the first boundary
        "a.one": torch.randn(1, generator=g),
        "c": torch.randn(7, 13, 11, generator=g),
        "d": torch.randn(1_000_003, generator=g),  # crosses the second boundary
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(3.5),
    }


def body_of(named: dict[str, torch.Tensor]) -> bytes:
    return b"".join(named[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n in sorted(named))


def test_the_digest_is_the_reference_layout_and_chunks_cross_tensor_boundaries():
    named = awkward_tensors()
    tree = param_tree(named)
    assert len(body_of(named)) == tree.body_bytes and tree.body_bytes > 2 * CHUNK_BYTES
    assert len(tree.leaves) == num_chunks(tree.body_bytes) == 3
    assert param_digest(named) == tree.hex == reference_digest(named)
    # Small tensors only (one chunk, or none): the same definition.
    for small in ({"x": torch.ones(3)}, {"x": torch.zeros(0)}, {}, {"w": torch.ones(2, 2, dtype=torch.bfloat16)}):
        assert param_digest(small) == reference_digest(small)


def test_the_same_digest_from_a_module_a_mapping_any_layout_and_a_byte_stream_cut_anywhere():
    named = awkward_tensors()
    body = body_of(named)
    expected = param_digest(named)
    # A non-contiguous tensor with the same values, and the mapping in another order.
    shuffled = dict(reversed(list(named.items())))
    shuffled["b"] = named["b"].t().contiguous().t()
    assert param_digest(shuffled) == expected
    # From a byte stream in pieces of random sizes (1 byte up to several chunks).
    rng = random.Random(1)
    hasher, at = ChunkHasher(), 0
    while at < len(body):
        size = rng.choice([1, 7, 4096, CHUNK_BYTES - 1, CHUNK_BYTES + 3, 3 * CHUNK_BYTES])
        hasher.update(body[at : at + size])
        at += size
    assert Tree(tensor_header(dict(sorted(named.items()))), len(body), hasher.finish()).hex == expected
    # A module's parameters.
    module = torch.nn.Linear(300, 200)
    assert (
        param_digest(module)
        == param_digest(dict(module.named_parameters()))
        == reference_digest({n: p.detach() for n, p in module.named_parameters()})
    )


def test_shards_on_chunk_boundaries_hash_their_own_chunks_to_the_same_digest():
    named = awkward_tensors()
    body, header = body_of(named), tensor_header(dict(sorted(named.items())))
    cuts = [0, CHUNK_BYTES, 2 * CHUNK_BYTES, len(body)]  # three ranks, each owning whole chunks
    leaves = []
    for lo, hi in zip(cuts, cuts[1:]):
        shard = ChunkHasher()
        shard.update(memoryview(body)[lo:hi])
        leaves += shard.finish()
    assert Tree(header, len(body), tuple(leaves)).hex == param_digest(named)


def test_names_dtypes_shapes_and_values_all_change_the_digest():
    base = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    digest = param_digest(base)
    for other in (
        {"a": torch.ones(3, 2), "b": torch.zeros(4)},
        {"a": torch.ones(2, 3), "c": torch.zeros(4)},
        {"a": torch.ones(2, 3, dtype=torch.float64), "b": torch.zeros(4)},
        {"a": torch.ones(2, 3), "b": torch.tensor([0.0, 0.0, 0.0, 1e-30])},
    ):
        assert param_digest(other) != digest
    with pytest.raises(ValueError):
        Tree(b"", CHUNK_BYTES + 1, (b"\0" * 32,))  # two chunks need two leaves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tensors_on_a_gpu_give_the_cpu_digest():
    named = awkward_tensors()
    assert param_digest({k: v.cuda() for k, v in named.items()}) == param_digest(named)


# -- snapshots ----------------------------------------------------------------------------------


def stream_into(snapshot: Snapshot, sink: SnapshotSink, tamper=lambda i, data: data) -> None:
    """Move units from source to sink as a stream would, `tamper(unit number, bytes)` on the way."""
    number = 0
    while not sink.done:
        unit = sink.next_unit()
        start, data = snapshot.read_unit(unit.start)
        sink.accept(tamper(number, bytes(data[unit.start - start :])))
        number += 1


def state_of(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"outer_momentum.{n}": t * -0.5 for n, t in params.items()}


def test_a_snapshot_received_unit_by_unit_hashes_to_the_parameter_digest_and_loads():
    params = awkward_tensors()
    snapshot = Snapshot.from_tensors(params, state_of(params))
    assert snapshot.params_digest == param_digest(params)
    assert snapshot.digest == snapshot_digest([param_tree(params), param_tree(state_of(params))])
    targets = {n: torch.zeros_like(t) for n, t in params.items()}
    state = {n: torch.zeros_like(t) for n, t in state_of(params).items()}
    sink = SnapshotSink(targets, state, snapshot.params_digest)
    assert sink.total_bytes == snapshot.size_bytes
    sink.expect(snapshot.digest)
    stream_into(snapshot, sink)
    assert param_digest(targets) == snapshot.params_digest
    assert all(torch.equal(state[n], t) for n, t in state_of(params).items())
    assert sink.trees[0].hex == snapshot.params_digest


def test_units_are_the_prologue_then_whole_chunks_of_each_section():
    layout = SnapshotLayout([SectionLayout(b"h0", 2 * CHUNK_BYTES + 5), SectionLayout(b"h1", 0)])
    p = layout.prologue_bytes
    assert layout.unit_at(0).end == p and layout.unit_at(p - 1).section == -1
    assert (layout.unit_at(p).start, layout.unit_at(p).end) == (p, p + CHUNK_BYTES)
    last = layout.unit_at(layout.total_bytes - 1)
    assert (last.start, last.end, last.section) == (p + 2 * CHUNK_BYTES, layout.total_bytes, 0)
    both = SnapshotLayout([SectionLayout(b"", 0), SectionLayout(b"h1", 10)])
    assert both.unit_at(both.prologue_bytes).section == 1
    with pytest.raises(ValueError):
        layout.unit_at(layout.total_bytes)


def test_a_wrong_chunk_is_refused_unwritten_and_the_transfer_resumes_at_it():
    params = awkward_tensors()
    snapshot = Snapshot.from_tensors(params, {})
    targets = {n: torch.zeros_like(t) for n, t in params.items()}
    sink = SnapshotSink(targets, {}, snapshot.params_digest)
    sink.expect(snapshot.digest)

    def flip_second_chunk(number: int, data: bytes) -> bytes:
        return data[:-1] + bytes([data[-1] ^ 1]) if number == 2 else data

    with pytest.raises(DigestMismatch):
        stream_into(snapshot, sink, flip_second_chunk)
    assert sink.offset == sink.layout.prologue_bytes + CHUNK_BYTES  # the prologue and chunk 0
    assert sink.written_bytes == CHUNK_BYTES  # nothing of the refused chunk
    assert torch.count_nonzero(targets["d"]) == 0  # which lies past it
    stream_into(snapshot, sink)  # "the next holder", from the offset
    assert param_digest(targets) == snapshot.params_digest


@pytest.mark.parametrize("case", ["truncated", "magic", "header", "body-length", "leaf", "other-model"])
def test_hostile_prologues_are_refused_with_typed_errors(case):
    params = {"w": torch.randn(300, 300), "v": torch.randn(5)}
    snapshot = Snapshot.from_tensors(params, {})
    prologue = bytearray(snapshot.prologue)
    sink = SnapshotSink({n: torch.zeros_like(t) for n, t in params.items()}, {}, snapshot.params_digest)
    sink.expect(snapshot.digest)
    header_at = 8 + 8  # after magic/version/count and the first header's length
    if case == "truncated":
        with pytest.raises(TruncatedPacket):
            decode_prologue(sink.layout, bytes(prologue[:-1]))
        return
    if case == "magic":
        prologue[0] ^= 0xFF
        expected = MalformedPacket
    elif case == "header":
        prologue[header_at + 30] ^= 0xFF
        expected = ShapeMismatch
    elif case == "body-length":
        length_at = header_at + len(tensor_header(dict(sorted(params.items()))))
        prologue[length_at] ^= 0x01
        expected = MalformedPacket
    elif case == "leaf":
        empty_section = 3 * 8 + len(tensor_header({}))  # the second section: no tensors, no leaves
        prologue[-empty_section - 16] ^= 0xFF  # in the first section's last leaf
        expected = DigestMismatch
    else:  # a snapshot of another model: refused at its prologue, before any body byte
        other = Snapshot.from_tensors({"w": torch.randn(300, 300), "v": torch.randn(5)}, {})
        prologue, expected = bytearray(other.prologue), DigestMismatch
    with pytest.raises(expected):
        sink.accept(bytes(prologue))
    assert issubclass(expected, ProtocolError) and sink.offset == 0 and sink.written_bytes == 0


def test_a_snapshot_of_tensors_that_moved_on_refuses_to_serve_them():
    params = awkward_tensors()
    snapshot = Snapshot.from_tensors(params, {})
    start, _ = snapshot.read_unit(snapshot.layout.prologue_bytes)
    params["b"].add_(1.0)  # the next outer step
    with pytest.raises(StaleSnapshot):
        snapshot.read_unit(start)
    assert snapshot.read_unit(0)[1] == snapshot.prologue  # the prologue is its own, kept


def test_a_checkpoint_serves_the_same_snapshot_as_the_tensors_it_holds(tmp_path):
    from node.training.checkpoint import save_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(700, 900), torch.nn.Linear(900, 1300))  # 6.3 MB: 2 chunks
    momentum = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    digest = save_checkpoint(tmp_path / "c", 7, model, outer_momentum=momentum)
    from_file = Snapshot.from_checkpoint(tmp_path / "c")
    from_tensors = Snapshot.from_tensors(
        dict(model.named_parameters()), {f"outer_momentum.{n}": m for n, m in momentum.items()}
    )
    assert from_file.params_digest == digest and from_file.digest == from_tensors.digest
    offset = 0
    while offset < from_file.size_bytes:
        start, unit = from_file.read_unit(offset)
        assert bytes(unit) == bytes(from_tensors.read_unit(offset)[1])
        offset = start + len(unit)
    from_file.close()


def test_encode_header_sorts_and_describes_every_tensor():
    assert encode_header([("b", "torch.float32", (2,)), ("a", "torch.int8", ())]) == encode_header(
        [("a", "torch.int8", ()), ("b", "torch.float32", (2,))]
    )
    assert tree_of(b"h", [b"x" * 10, b"y"]).body_bytes == 11


def test_a_request_carries_its_resume_offset_and_bad_offsets_are_refused():
    import msgpack

    from protocol.stream import PacketRequest, decode_request, encode_request

    request = PacketRequest(run="r", round=3, publisher="params", digest="ab" * 32, offset=5 * CHUNK_BYTES)
    assert decode_request(encode_request(request)[4:]) == request
    plain = PacketRequest(run="r", round=3, publisher="p", digest="ab" * 32)
    assert b"offset" not in encode_request(plain)  # packet requests are the bytes they always were
    for offset in (-1, True, 1.5, "7"):
        body = msgpack.packb({"run": "r", "round": 3, "peer": "p", "digest": "ab" * 32, "offset": offset})
        with pytest.raises(MalformedPacket):
            decode_request(body)
