"""The round loop's view of the training (node/training/base.py): every outer step implements the
`OuterStep` protocol and every training object the `Training` protocol, by name and by signature;
an outer step's round start comes back bit for bit (`keep_start`, `restore_start`) and its own
state survives `state_dict` / `load_state_dict`; a hostile DiLoCo payload is refused as a
`ProtocolError`, whatever safetensors makes of it."""

from __future__ import annotations

import inspect
import json
import struct
from types import SimpleNamespace

import pytest
import torch

from node.training.base import OuterStep, Training
from node.training.model import build_model
from node.training.outer import DiLoCoOuter, SparseLoCoOuter, make_outer
from node.training.params import flat_named_params, param_digest
from node.training.peer import PeerTraining
from node.training.ranked import RankedOuter, RankedTraining
from protocol.errors import ProtocolError
from protocol.packet import ModelSpec
from protocol.run_config import OuterSection
from protocol.signing import PeerKey

PEERS = ["p0", "p1"]
KEYS = {p: PeerKey.from_seed(p.encode()) for p in PEERS}


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(value)
        for name, value in vars(protocol).items()
        if callable(value) and not name.startswith("_")
    }


def _accepts(implementation: inspect.Signature, declared: inspect.Signature) -> bool:
    """Does `implementation` take every parameter `declared` names (by name, or through **kwargs)?"""
    params = implementation.parameters
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return all(
        name in params or (var_keyword and p.kind is p.KEYWORD_ONLY)
        for name, p in declared.parameters.items()
        if name != "self"
    )


@pytest.mark.parametrize(
    "protocol, implementations",
    [(OuterStep, [SparseLoCoOuter, DiLoCoOuter, RankedOuter]), (Training, [PeerTraining, RankedTraining])],
)
def test_every_implementation_has_the_protocols_methods(protocol, implementations):
    for cls in implementations:
        for name, declared in _methods(protocol).items():
            assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
            assert _accepts(inspect.signature(getattr(cls, name)), declared), f"{cls.__name__}.{name}{declared}"
        if protocol is Training:  # dataclasses: their fields are declared
            assert set(protocol.__annotations__) <= set(cls.__dataclass_fields__), cls.__name__


def test_every_outer_step_holds_the_protocols_attributes():
    params = flat_named_params(build_model("tiny", seed=0))
    leader = SimpleNamespace(
        state=SimpleNamespace(outer=SimpleNamespace(spec=ModelSpec.from_named_tensors(params, 64, 64)))
    )
    outers = [
        make_outer(params, OuterSection()),
        make_outer(params, OuterSection(strategy="diloco")),
        RankedOuter(leader, params, OuterSection(), 1 << 20),
    ]
    for outer in outers:
        for name in OuterStep.__annotations__:
            assert hasattr(outer, name), f"{type(outer).__name__} lacks {name}"


def _trained(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flat_named_params(model).values():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_a_kept_round_start_comes_back_and_the_same_step_gives_the_same_bits(strategy):
    cfg = OuterSection(strategy=strategy, momentum=0.9 if strategy == "diloco" else 0.0)
    models = [build_model("tiny", seed=0) for _ in PEERS]
    outers = [make_outer(flat_named_params(m), cfg) for m in models]
    public = {p: k.public_bytes for p, k in KEYS.items()}.__getitem__
    for round in range(2):  # the second round starts with momentum (DiLoCo)
        payloads = {}
        for i, (model, outer) in enumerate(zip(models, outers)):
            outer.begin_round()
            _trained(model, 10 * round + i)
            payloads[PEERS[i]] = outer.make_payload(
                run_id="r", round=round, peer_id=PEERS[i], base_digest="00" * 32, key=KEYS[PEERS[i]]
            )
        outer = outers[0]
        before = param_digest(outer.start)
        prepared = outer.prepare(payloads, public, run_id="r", round=round)
        kept = outer.keep_start(prepared)
        outer.commit(prepared)
        after, state = (
            param_digest(outer.start),
            {k: {n: t.clone() for n, t in v.items()} for k, v in outer.state_dict().items()},
        )
        outer.restore_start(kept)
        assert param_digest(outer.start) == param_digest(flat_named_params(models[0])) == before
        outer.commit(outer.prepare(payloads, public, run_id="r", round=round))
        assert param_digest(outer.start) == after
        assert all(torch.equal(outer.state_dict()[k][n], t) for k, v in state.items() for n, t in v.items())
        outers[1].commit(outers[1].prepare(payloads, public, run_id="r", round=round))


def test_the_outer_state_comes_back_from_its_state_dict_and_what_it_lacks_is_zero():
    params = flat_named_params(build_model("tiny", seed=0))
    for cfg, section in ((OuterSection(), "error_buffers"), (OuterSection(strategy="diloco"), "outer_momentum")):
        outer = make_outer(params, cfg)
        saved = {name: torch.full_like(t, 0.5) for name, t in outer.state_dict()[section].items()}
        first = next(iter(saved))
        outer.load_state_dict({section: {n: t for n, t in saved.items() if n != first}})
        state = outer.state_dict()[section]
        assert torch.count_nonzero(state[first]) == 0
        assert all(torch.equal(state[n], saved[n]) for n in saved if n != first)


def _safetensors_with(dtype: str, shape: list[int], num_bytes: int) -> bytes:
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, num_bytes]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(num_bytes)


def test_a_hostile_diloco_payload_is_refused_as_a_protocol_error():
    outer = make_outer(flat_named_params(build_model("tiny", seed=0)), OuterSection(strategy="diloco"))
    assert outer.refusable == (ProtocolError,)
    hostile = [
        b"",
        b"\xff" * 64,
        _safetensors_with("F32", [4], 16)[:-3],  # cut short
        _safetensors_with("F4", [2], 1),  # a dtype safetensors reads and torch has no name for
        _safetensors_with("F32", [4], 16),  # not the model's tensors
        _safetensors_with("F16", [4], 8),
    ]
    for payload in hostile:
        with pytest.raises(ProtocolError):
            outer.decode(payload)
    small = make_outer(outer.params, OuterSection(strategy="diloco"), max_packet_bytes=1024)
    with pytest.raises(ProtocolError, match="size limit"):
        small.decode(b"\x00" * 1025)
