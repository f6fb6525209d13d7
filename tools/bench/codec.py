"""Codec benchmark: packet size and speed against the plain path (torch.topk + int64 + uint8).

    locoswarm bench codec [--json] [--device cpu|cuda] [--repeats 5] [--peers 16]

On a LLaMA-shaped set of tensors of about 50M parameters (hidden 640, 8 layers, intermediate
1728, vocabulary 8192, untied), with Gaussian pseudo-gradients of a different scale per tensor,
it measures, median over repeats:

- bits_per_value at top_k 64 and 128: packet bytes * 8 / values sent, everything counted;
- encode_gbps: fp32 pseudo-gradient bytes per second through error feedback + chunking + top-k +
  quantize + entropy-code + pack + sign;
- decode_aggregate_s: what a node does with a round of `--peers` packets
  (node/training/outer.py, SparseLoCoOuter.prepare): verify and decode each packet, then the
  median-clip scales (the node's default aggregation) and the clipped scatter-mean of every tensor;

Ours runs on `--device` end to end: the Rice coder and the 2-bit packing are torch ops
(kernels/entropy_torch.py), decoding happens on the device after the size checks and yields each
selected value's place in its chunk, and the aggregation takes whole packets at once
(kernels/sparse.py, `aggregate_packets`: on the CPU, runs of chunks with every packet's values of a
chunk side by side, one scatter_add_ along the chunks in peer order, runs spread over the
`decode_aggregate_workers` threads, over which the packets are decoded too, as a node decodes
them; ours is also timed with one worker for both); only the packet bytes cross to and from the
host.

and the same for the plain path in the same run (`baseline_*`): chunking by copy, torch.topk,
the local reconstruction through a dense scatter_reduce, int64 indices and uint8 codes on the
wire (what the SparseLoCo authors' code sends), aggregation by one scatter_reduce over all peers'
values. The plain path is built from this project's chunking and quantizer, not from the
authors' code: it measures the wire format and the aggregation, not their implementation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from locoswarm_kernels.chunking import ChunkLayout, from_chunks, num_workers, pool_map, to_chunks
from locoswarm_kernels.quantize import quantize
from locoswarm_kernels.sparse import aggregate_packets, error_feedback_step, packet_clip_scales

BETA, OUTER_LR = 0.95, 1.0


def llama_shapes(hidden=640, num_layers=8, intermediate=1728, vocab=8192) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a LLaMA decoder (untied embeddings), sorted by name."""
    shapes = {"embed.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "norm.weight": (hidden,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (hidden,), p + "mlp_norm.weight": (hidden,)}
        shapes |= {p + f"attn.{n}.weight": (hidden, hidden) for n in ("wq", "wk", "wv", "wo")}
        shapes |= {
            p + "mlp.w1.weight": (intermediate, hidden),
            p + "mlp.w3.weight": (intermediate, hidden),
            p + "mlp.w2.weight": (hidden, intermediate),
        }
    return dict(sorted(shapes.items()))


def _paired_medians(ours, baseline, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of each, their runs interleaved so that load from elsewhere hits both alike."""
    return tuple(_interleaved_medians([ours, baseline], repeats, device))


def _interleaved_medians(fns, repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each of `fns`, their runs interleaved."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def baseline_encode(error_buffer: torch.Tensor, delta: torch.Tensor, layout: ChunkLayout) -> bytes:
    """The plain path for one tensor: int64 indices and uint8 codes, as an all-gather would send them."""
    error_buffer.mul_(BETA).add_(delta, alpha=OUTER_LR)
    chunks = to_chunks(error_buffer, layout).clone()  # rearrange copies
    idx = torch.topk(chunks.abs(), layout.k, dim=-1, largest=True, sorted=False).indices
    codes, table = quantize(torch.gather(chunks, -1, idx))
    recon = torch.zeros_like(chunks)
    recon.scatter_reduce_(-1, idx, table.decode(codes), reduce="mean", include_self=False)
    error_buffer.sub_(from_chunks(recon, layout))
    extra = np.array([table.shift, *table.lookup.tolist()], dtype=np.float32)
    return idx.to(torch.int64).cpu().numpy().tobytes() + codes.cpu().numpy().tobytes() + extra.tobytes()


def baseline_decode_aggregate(packets: list[list[bytes]], layouts: dict[str, ChunkLayout], device) -> None:
    for t, layout in enumerate(layouts.values()):
        n = layout.num_selected
        idx_all, val_all = [], []
        for packet in packets:
            raw = packet[t]
            idx = torch.frombuffer(bytearray(raw[: 8 * n]), dtype=torch.int64).view(layout.num_chunks, layout.k)
            codes = torch.frombuffer(bytearray(raw[8 * n : 9 * n]), dtype=torch.uint8).view(layout.num_chunks, layout.k)
            shift, *lookup = np.frombuffer(raw[9 * n :], dtype=np.float32).tolist()
            values = torch.tensor(lookup, device=device)[codes.to(device).long()] + shift
            idx_all.append(idx.to(device))
            val_all.append(values)
        out = torch.zeros(layout.num_chunks, layout.chunk_len, device=device)
        out.scatter_reduce_(-1, torch.cat(idx_all, -1), torch.cat(val_all, -1), reduce="mean", include_self=False)
        from_chunks(out, layout)


def run(top_k: int, device: torch.device, repeats: int, num_peers: int) -> dict:
    from protocol.packet import ModelSpec, decode_packet, encode_packet
    from protocol.signing import PeerKey

    spec = ModelSpec(llama_shapes(), top_k)
    layouts = spec.layouts()
    gen = torch.Generator().manual_seed(top_k)
    deltas = {
        n: (torch.randn(s, generator=gen) * float(torch.rand((), generator=gen) * 1e-2 + 1e-4)).to(device)
        for n, s in spec.shapes.items()
    }
    numel = sum(layout.numel for layout in layouts.values())
    values_sent = sum(layout.num_selected for layout in layouts.values())
    keys = [PeerKey.from_seed(bytes([i])) for i in range(num_peers)]

    buffers = {n: torch.zeros_like(d) for n, d in deltas.items()}

    def encode(key=keys[0], peer="p00"):
        sparse = {n: error_feedback_step(buffers[n], deltas[n], layouts[n], BETA, OUTER_LR) for n in spec.shapes}
        return encode_packet("bench", 0, peer, bytes(32), spec, sparse, key)

    base_buffers = {n: torch.zeros_like(d) for n, d in deltas.items()}

    def baseline():
        return [baseline_encode(base_buffers[n], deltas[n], layouts[n]) for n in spec.shapes]

    encode(), baseline()  # warm-up
    encode_s, baseline_s = _paired_medians(encode, baseline, repeats, device)
    packets = [encode(keys[i], f"p{i:02d}") for i in range(num_peers)]
    base_packets = [baseline() for _ in range(num_peers)]

    def decode_aggregate(num_threads=None):  # what a node does (node/training/outer.py, SparseLoCoOuter.prepare)
        # Packets decode `num_workers` at once on the pool (node/training/decode.py: `decode_all`, and
        # `EarlyDecodes` as they arrive).
        def decode(i):  # and its norms taken on the decoding worker, as node.training.outer.decode_sparse does
            tensors = decode_packet(packets[i], spec, keys[i].public_bytes, device=device).tensors
            tensors.squared_norms()
            return tensors

        workers = num_workers(num_threads, device)
        decoded = pool_map(decode, range(num_peers), workers)
        # median_clip, the node's default aggregation
        aggregate_packets(decoded, device=device, peer_scales=packet_clip_scales(decoded), num_threads=num_threads)

    # Ours with the aggregation's default workers (locoswarm_kernels.chunking.num_workers) and with one, for the record.
    decode_s, decode_single_s, baseline_decode_s = _interleaved_medians(
        [
            decode_aggregate,
            lambda: decode_aggregate(num_threads=1),
            lambda: baseline_decode_aggregate(base_packets, layouts, device),
        ],
        repeats,
        device,
    )
    return {
        "num_parameters": numel,
        "values_sent": values_sent,
        "density": values_sent / numel,
        "packet_bytes": len(packets[0]),
        "bits_per_value": len(packets[0]) * 8 / values_sent,
        "encode_s": encode_s,
        "encode_gbps": numel * 4 / encode_s / 1e9,
        "decode_aggregate_s": decode_s,
        "decode_aggregate_workers": num_workers(None, device),
        "decode_aggregate_single_worker_s": decode_single_s,
        "baseline_packet_bytes": sum(map(len, base_packets[0])),
        "baseline_bits_per_value": sum(map(len, base_packets[0])) * 8 / values_sent,
        "baseline_encode_s": baseline_s,
        "baseline_encode_gbps": numel * 4 / baseline_s / 1e9,
        "baseline_decode_aggregate_s": baseline_decode_s,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--top-k", type=int, nargs="+", default=[64, 128])


def run_cli(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    results = {f"top_k_{k}": run(k, device, args.repeats, args.peers) for k in args.top_k}
    first = results[f"top_k_{args.top_k[0]}"]
    summary = {
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "peers": args.peers,
        "num_parameters": first["num_parameters"],
        **{f"bits_per_value_top_k_{k}": results[f"top_k_{k}"]["bits_per_value"] for k in args.top_k},
        "encode_gbps": first["encode_gbps"],
        "decode_aggregate_s": first["decode_aggregate_s"],
        "baseline_bits_per_value": first["baseline_bits_per_value"],
        "baseline_encode_gbps": first["baseline_encode_gbps"],
        "baseline_decode_aggregate_s": first["baseline_decode_aggregate_s"],
        "size_ratio_baseline_over_ours": first["baseline_packet_bytes"] / first["packet_bytes"],
        "encode_speedup_over_baseline": first["baseline_encode_s"] / first["encode_s"],
        "decode_aggregate_speedup_over_baseline": first["baseline_decode_aggregate_s"] / first["decode_aggregate_s"],
        "decode_aggregate_workers": first["decode_aggregate_workers"],
        "decode_aggregate_single_worker_speedup_over_baseline": first["baseline_decode_aggregate_s"]
        / first["decode_aggregate_single_worker_s"],
        "per_top_k": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"codec benchmark: {first['num_parameters'] / 1e6:.1f}M parameters on {device}, "
        f"{torch.get_num_threads()} threads, {first['decode_aggregate_workers']} decode/aggregate workers "
        f"(1w: one), medians of {args.repeats}"
    )
    print(
        f"{'top_k':>6} {'':>9} {'bits/value':>11} {'packet MB':>10} {'encode s':>9} {'encode GB/s':>12} "
        f"{'dec+agg s':>10}"
    )
    for k in args.top_k:
        r = results[f"top_k_{k}"]
        print(
            f"{k:>6} {'ours':>9} {r['bits_per_value']:>11.2f} {r['packet_bytes'] / 1e6:>10.3f} {r['encode_s']:>9.3f} "
            f"{r['encode_gbps']:>12.3f} {r['decode_aggregate_s']:>10.3f}"
        )
        print(
            f"{'':>6} {'baseline':>9} {r['baseline_bits_per_value']:>11.2f} {r['baseline_packet_bytes'] / 1e6:>10.3f} "
            f"{r['baseline_encode_s']:>9.3f} {r['baseline_encode_gbps']:>12.3f} {r['baseline_decode_aggregate_s']:>10.3f}"
        )
        print(
            f"{'':>6} {'ratio':>9} {r['baseline_packet_bytes'] / r['packet_bytes']:>10.1f}x {'':>10} "
            f"{r['baseline_encode_s'] / r['encode_s']:>8.2f}x {'':>12} "
            f"{r['baseline_decode_aggregate_s'] / r['decode_aggregate_s']:>9.2f}x"
        )
        print(
            f"{'':>6} {'ours 1w':>9} {'':>11} {'':>10} {'':>9} {'':>12} {r['decode_aggregate_single_worker_s']:>10.3f}"
        )
        print(
            f"{'':>6} {'ratio 1w':>9} {'':>11} {'':>10} {'':>9} {'':>12} "
            f"{r['baseline_decode_aggregate_s'] / r['decode_aggregate_single_worker_s']:>9.2f}x"
        )
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
