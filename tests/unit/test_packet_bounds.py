"""Bounded packets: a member's signed packet whose quantization tables are finite but decode to
absurd or overflowing values is refused, per tensor, with a typed error, before anything sized by
the packet is decompressed; the dense DiLoCo payload is bounded the same way."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch

from locoswarm_kernels.sparse import error_feedback_step
from protocol import errors
from protocol.packet import MAGIC, PREFIX, TABLE, WIRE_VERSION, ModelSpec, decode_packet, encode_packet, read_header
from protocol.run_config import DEFAULT_MAX_ABS_VALUE, MAX_ABS_VALUE_LIMIT, OuterSection
from protocol.signing import PeerKey

SHAPES = {"a.weight": (64, 64), "b.weight": (67, 130), "c.bias": (64,), "d.scalar": (1,)}
KEY = PeerKey.from_seed(b"bounds-member")
BOUND = 1e4  # the default bound, exactly representable in float32 and float16


def make_packet(scale: float = 1e-2) -> tuple[ModelSpec, bytes]:
    generator = torch.Generator().manual_seed(0)
    spec = ModelSpec(dict(sorted(SHAPES.items())), 64)
    layouts = spec.layouts()
    tensors = {
        name: error_feedback_step(
            torch.zeros(shape), torch.randn(shape, generator=generator) * scale, layouts[name], 0.95, 1.0
        )
        for name, shape in spec.shapes.items()
    }
    return spec, encode_packet("run", 0, "p-a", bytes(32), spec, tensors, KEY)


def with_table(
    data: bytes, shift: float, entries, *, dtype: str | None = None, tensor: int = 0, codes: bytes | None = None
) -> bytes:
    """The packet with one tensor's table (and dtype) replaced, signed again by the member: an
    attacker inside the swarm. `codes` replaces the code stream (raw)."""
    header, offset = read_header(data)
    section = header["tensors"][tensor]
    section[4] = TABLE.pack(shift, *entries)
    if dtype is not None:
        section[2] = dtype
    streams = data[offset : offset + sum(t[5] + t[6] for t in header["tensors"])]
    if codes is None:
        codes = data[offset + len(streams) : -64]
    else:
        header["codes"] = [1, len(codes)]  # claims zstandard: only a decoder that reaches it fails on it
    raw = msgpack.packb(header)
    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + streams + codes
    return body + KEY.sign(body)


def decode(data: bytes, spec: ModelSpec, **kwargs):
    return decode_packet(data, spec, KEY.public_bytes, **kwargs)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_above(x: float) -> float:
    """The next float32 above x (x a positive float32)."""
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def test_the_default_bound_is_the_run_configs_and_honest_packets_pass_it():
    assert OuterSection().max_abs_value == DEFAULT_MAX_ABS_VALUE == BOUND
    spec, data = make_packet()
    packet = decode(data, spec)
    assert all(float(t.values().abs().max()) < 1 for t in packet.tensors.values())
    # large honest values pass a bound that admits them, and are refused under the default
    spec, big = make_packet(scale=1e5)
    assert decode(big, spec, max_abs_value=1e7).tensors
    with pytest.raises(errors.ValueOutOfRange):
        decode(big, spec)


def test_an_absurd_shift_is_refused():
    """The attack: every field finite, shift 1e30."""
    spec, data = make_packet()
    with pytest.raises(errors.ValueOutOfRange, match=r"'a.weight'.*shift or table entry exceeds max_abs_value 10000"):
        decode(with_table(data, 1e30, (0, 0, 0, 0)), spec)
    with pytest.raises(errors.ValueOutOfRange):  # whichever tensor carries it
        decode(with_table(data, -1e30, (0, 0, 0, 0), tensor=3), spec)


def test_table_entries_at_the_bound_pass_and_one_ulp_over_is_refused():
    spec, data = make_packet()
    at = decode(with_table(data, 0.0, (-BOUND, -1.0, 1.0, BOUND)), spec)
    assert float(at.tensors["a.weight"].values().abs().max()) <= BOUND
    over = f32_above(BOUND)
    for entries in [(-over, 0, 0, 0), (0, 0, 0, over)]:
        with pytest.raises(errors.ValueOutOfRange):
            decode(with_table(data, 0.0, entries), spec)
    with pytest.raises(errors.ValueOutOfRange):
        decode(with_table(data, over, (0, 0, 0, 0)), spec)


def test_a_decoded_value_over_the_bound_is_refused_though_each_field_is_within():
    spec, data = make_packet()
    with pytest.raises(errors.ValueOutOfRange, match="a decoded value exceeds max_abs_value 10000 in float32"):
        decode(with_table(data, 0.75 * BOUND, (0, 0, 0, 0.5 * BOUND)), spec)
    # the same fields decode to 0.25 * BOUND and 1.25 * BOUND with opposite signs: still refused
    with pytest.raises(errors.ValueOutOfRange):
        decode(with_table(data, -0.75 * BOUND, (-0.5 * BOUND, 0, 0, 0.5 * BOUND)), spec)


def test_float16_overflow_is_refused_in_the_declared_dtype():
    spec, data = make_packet()
    loose = 1e6  # a bound float16 cannot hold: the dtype check must catch what the bound lets by
    with pytest.raises(errors.NonFiniteValue, match="shift overflows float16"):
        decode(with_table(data, 1e5, (0, 0, 0, 0), dtype="float16"), spec, max_abs_value=loose)
    with pytest.raises(errors.NonFiniteValue, match="a decoded value overflows float16"):
        decode(with_table(data, 6e4, (0, 0, 0, 1e4), dtype="float16"), spec, max_abs_value=loose)
    fine = decode(with_table(data, 6e4, (-1e3, 0, 0, 5e3), dtype="float16"), spec, max_abs_value=loose)
    assert fine.tensors["a.weight"].values().dtype == torch.float16
    assert bool(torch.isfinite(fine.tensors["a.weight"].values()).all())


def test_bfloat16_rounding_past_the_bound_and_overflow_are_refused():
    spec, data = make_packet()
    # 10020 is a float32 within a bound of 10020; in bfloat16 (8 significant bits) it rounds to 10048.
    bound = 10020.0
    assert float(torch.tensor(bound).to(torch.bfloat16)) > bound
    with pytest.raises(errors.ValueOutOfRange, match="in bfloat16"):
        decode(with_table(data, 0.0, (0, 0, 0, bound), dtype="bfloat16"), spec, max_abs_value=bound)
    assert decode(with_table(data, 0.0, (0, 0, 0, bound), dtype="float32"), spec, max_abs_value=bound).tensors
    # with no bound but finiteness (inf), the float32 sum of two finite fields overflows
    with pytest.raises(errors.NonFiniteValue, match="overflows float32"):
        decode(with_table(data, 3e38, (0, 0, 0, 3e38), dtype="bfloat16"), spec, max_abs_value=float("inf"))


@pytest.mark.parametrize("field", [0, 1, 4])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_fields_are_refused(field, value):
    spec, data = make_packet()
    table = [0.0] * 5
    table[field] = value
    with pytest.raises(errors.NonFiniteValue, match="NaN or Inf"):
        decode(with_table(data, table[0], table[1:]), spec, max_abs_value=float("inf"))


def test_tables_are_checked_before_the_code_stream_is_decompressed():
    """A table out of range and a code stream that would be expensive or broken: the table is
    refused first, so nothing sized by the packet is allocated for a packet already known bad."""
    import zstandard

    spec, data = make_packet()
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (8 << 20))
    with pytest.raises(errors.ValueOutOfRange):
        decode(with_table(data, 1e30, (0, 0, 0, 0), tensor=3, codes=bomb), spec)
    with pytest.raises(errors.MalformedPacket):  # the same stream with a sound table: refused by size
        decode(with_table(data, 0.0, (0, 0, 0, 0), tensor=3, codes=bomb), spec)


def test_the_bound_argument_is_checked():
    spec, data = make_packet()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            decode(data, spec, max_abs_value=bad)


def test_run_config_bounds_the_bound():
    assert OuterSection(max_abs_value=MAX_ABS_VALUE_LIMIT).max_abs_value == 1e30
    for bad in (0.0, -1.0, 2e30, float("inf"), float("nan")):
        with pytest.raises(Exception, match="max_abs_value"):
            OuterSection(max_abs_value=bad)


# -- the dense (DiLoCo) payload ---------------------------------------------------------------------


def _diloco(max_abs_value: float = BOUND):
    from node.training.model import build_model
    from node.training.outer import make_outer
    from node.training.params import flat_named_params

    model = build_model("tiny", 0)
    return make_outer(flat_named_params(model), OuterSection(strategy="diloco", max_abs_value=max_abs_value))


def _dense_payload(outer, fill: dict[str, float]) -> bytes:
    from safetensors.torch import save

    deltas = {name: torch.zeros_like(p) for name, p in outer.params.items()}
    for name, value in fill.items():
        deltas[name].view(-1)[0] = value
    return save({name: d.contiguous() for name, d in deltas.items()})


def test_dense_payloads_over_the_bound_or_not_finite_are_refused():
    outer = _diloco()
    name = sorted(outer.params)[0]
    accepted = outer.decode(_dense_payload(outer, {name: -BOUND}))
    assert float(accepted[name].abs().max()) == BOUND
    with pytest.raises(errors.ValueOutOfRange, match=name):
        outer.decode(_dense_payload(outer, {name: f32_above(BOUND)}))
    with pytest.raises(errors.ValueOutOfRange):
        outer.decode(_dense_payload(outer, {name: 3e38}))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(errors.NonFiniteValue):
            outer.decode(_dense_payload(outer, {name: bad}))
    # refused payloads are left out of the round, by the same path as a bad packet
    ok, bad = _dense_payload(outer, {name: 1e-3}), _dense_payload(outer, {name: 1e30})
    prepared = outer.prepare({"p0": ok, "p1": bad, "p2": ok})
    assert prepared.result.accepted == ["p0", "p2"] and prepared.result.refused["p1"].startswith("ValueOutOfRange")
    assert all(bool(torch.isfinite(a).all()) for a in prepared.aggregates.values())
    assert f32(1e-3) == float(prepared.aggregates[name].view(-1)[0])
