"""`locoswarm codec-demo`: one SparseLoCo packet round trip on a real model preset's tensors.

Builds the preset's parameter shapes, takes a pseudo-gradient (Gaussian, one scale per tensor),
runs error feedback, encodes and signs a packet, decodes and verifies it, and prints what was
sent: values, bytes, bits per value, and how close the dequantized update is to the dense one.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("codec-demo", help="encode and decode one packet on a model preset's shapes")
    parser.add_argument("--preset", default="small", help="model preset (tiny, small, 512m, 1b)")
    parser.add_argument("--top-k", type=int, default=64, help="values kept per 4096-element chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from locoswarm_kernels.sparse import decompress, error_feedback_step
    from node.training.model import llama_tensor_shapes, num_parameters
    from protocol.packet import ModelSpec, decode_packet, encode_packet, packet_digest
    from protocol.signing import PeerKey

    shapes = llama_tensor_shapes(args.preset)
    spec = ModelSpec(dict(sorted(shapes.items())), args.top_k)
    layouts = spec.layouts()
    gen = torch.Generator().manual_seed(args.seed)
    key = PeerKey.from_seed(b"codec-demo")
    deltas = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in spec.shapes.items()}
    buffers = {n: torch.zeros(s) for n, s in spec.shapes.items()}
    sparse = {n: error_feedback_step(buffers[n], deltas[n], layouts[n], 0.95, 1.0) for n in spec.shapes}
    data = encode_packet("demo", 0, "p-demo", bytes(32), spec, sparse, key)
    packet = decode_packet(data, spec, key.public_bytes, run_id="demo", round=0)
    sent = sum(layout.num_selected for layout in layouts.values())
    numel = sum(layout.numel for layout in layouts.values())
    exact = all(torch.equal(decompress(packet.tensors[n]), decompress(sparse[n])) for n in spec.shapes)
    residual = sum(float(buffers[n].square().sum()) for n in spec.shapes) ** 0.5
    total = sum(float(deltas[n].square().sum()) for n in spec.shapes) ** 0.5
    print(f"preset {args.preset}: {num_parameters(args.preset):,} parameters in {len(shapes)} tensors")
    print(
        f"sent {sent:,} values ({sent / numel:.3%}) in {len(data):,} bytes: {len(data) * 8 / sent:.2f} bits/value "
        f"(dense fp32 would be {numel * 4:,} bytes, {numel * 4 / len(data):.0f}x more)"
    )
    print(
        f"decoded packet equals the encoded selection: {exact}; signature verified; digest {packet_digest(data)[:16]}"
    )
    print(f"error feedback keeps {residual / total:.1%} of the update's norm for later rounds")
    return 0 if exact else 1
