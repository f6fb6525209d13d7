"""The memory layout: the bench's accounting equals a real CPU state, the 1B budget, and the outer
state's placement gives the same digests whichever memory it lives in."""

from __future__ import annotations

import argparse

import pytest
import torch

from node.training.model import build_model
from node.training.outer import make_outer, state_placement_device
from node.training.params import flat_named_params, param_digest
from protocol.run_config import OuterSection
from protocol.signing import PeerKey
from tools.bench.memory import PRESETS, measured_state, meta_state, report

pytestmark = pytest.mark.usefixtures("single_thread")


def _args(**overrides) -> argparse.Namespace:
    values = dict(
        preset="1b",
        device="cuda",
        placement="host",
        overlap=False,
        micro_batch=1,
        seq_len=2048,
        device_memory_gb=24.0,
        overhead_gb=1.5,
        measure=False,
        measure_preset="tiny",
        peers=8,
    )
    return argparse.Namespace(**(values | overrides))


def test_accounting_equals_a_real_cpu_state():
    real = measured_state("tiny")
    assert real == meta_state(PRESETS["tiny"], overlap=False)
    assert real.local_round_start_bytes == 0  # without overlap the round start serves both
    assert real.params_bytes == 4 * real.num_params and real.adam_bytes >= 8 * real.num_params


def test_packet_layout_constants_are_counted_as_built():
    from locoswarm_kernels.chunking import packet_layout
    from protocol.packet import ModelSpec
    from tools.bench.memory import packet_layout_bytes

    params = flat_named_params(build_model("tiny", seed=0))
    cfg = OuterSection()
    layout = packet_layout(tuple(ModelSpec.from_named_tensors(params, cfg.top_k, cfg.chunk_size).layouts().values()))
    built = sum(
        t.numel() * t.element_size() for t in (layout.code_offsets, layout.symbol_row_offsets, layout.byte_code_offsets)
    )
    counted = packet_layout_bytes(sum(p.numel() for p in params.values()), cfg)
    assert abs(built - counted) < 0.05 * built  # (k rounds per tensor)


def test_1b_fits_a_24_gb_gpu_with_the_outer_state_on_the_host():
    r = report(_args())
    assert r["device_bytes_per_param"] <= 18.0 < r["baseline_device_bytes_per_param"]
    # The host holds the round start and the error buffer (8 B/param); the round's packets are in the
    # spool's files, and decoded where the aggregate is made, on the GPU.
    assert r["host_categories"] == {"round_start": 4.0, "error_buffer": 4.0} and r["host_bytes_per_param"] == 8.0
    assert set(r["disk_categories"]) == {"kept_packets", "round_packets"}
    assert 0.1 < r["disk_categories"]["round_packets"] < 0.2
    assert 0 < r["device_categories"]["decoded_packets"] < 1.0
    assert 0 < r["device_categories"]["packet_layout"] < 0.2
    assert r["largest_preset_that_fits"]["checkpointed"] == "1b"
    assert r["fsdp_8b_on_8x80gb"]["device_total_gb"] < 80
    # The kept start of an amendable round is a patch of the coordinates the step moved, not a copy.
    assert 0 < r["device_categories"]["kept_round_start"] < 1.0
    on_device = report(_args(placement="device"))
    assert on_device["host_bytes_per_param"] == 0  # the packets are on disk and on the device
    assert on_device["device_bytes_per_param"] > 18.0


def test_state_placement_for_each_device():
    assert state_placement_device("cuda:1", "host") == (torch.device("cpu"), True)
    assert state_placement_device("cuda", "device") == (torch.device("cuda"), False)
    assert state_placement_device("cpu", "host") == (torch.device("cpu"), False)
    with pytest.raises(ValueError):
        state_placement_device("cpu", "disk")


def _swarm_digests(placement: str, overlap: bool, strategy: str = "sparseloco") -> list[str]:
    peers = ["p0", "p1"]
    keys = {p: PeerKey.from_seed(p.encode()) for p in peers}
    models = [build_model("tiny", seed=0) for _ in peers]
    cfg = OuterSection(strategy=strategy, overlap=overlap, momentum=0.9 if strategy == "diloco" else 0.0)
    outers = [make_outer(flat_named_params(m), cfg, state_placement=placement) for m in models]
    digests = []
    for round in range(3):
        payloads = {}
        for i, (model, outer) in enumerate(zip(models, outers)):
            outer.begin_round()
            gen = torch.Generator().manual_seed(10 * round + i)
            with torch.no_grad():
                for p in flat_named_params(model).values():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
            payloads[peers[i]] = outer.make_payload(
                run_id="r", round=round, peer_id=peers[i], base_digest="00" * 32, key=keys[peers[i]]
            )
        for outer in outers:
            outer.commit(outer.prepare(payloads, lambda p: keys[p].public_bytes, run_id="r", round=round))
        digests.append(param_digest(outers[0].start))
        assert param_digest(outers[1].start) == digests[-1]
    return digests


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_placement_gives_identical_digests(overlap, strategy):
    assert _swarm_digests("host", overlap, strategy) == _swarm_digests("device", overlap, strategy)
