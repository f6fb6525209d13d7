"""Digest benchmark: the hash-tree parameter digest against the single SHA-256 it replaced.

    locoswarm bench digest [--json] [--preset 512m] [--device cpu|cuda] [--repeats 3]

On the parameters of a model preset (shapes from the model, values filled per tensor: hashing
speed does not depend on them), it times, median over repeats taken in turn (sha256, digest,
sha256, ...), in the same run and on the same tensors:

- `sha256`: the first build's digest, one hashlib SHA-256 over each tensor's header fields and
  bytes in sorted-name order (reproduced here as the baseline);
- `digest`: `node.training.params.param_digest`, BLAKE3 leaves over 4 MiB chunks of the same
  bytes hashed in `HASH_THREADS` worker threads, then the root (protocol/digest.py).

and prints GB/s of each (fp32 parameter bytes per second) and `speedup_over_sha256`. Tensors on
a GPU (`--device cuda`) are copied to the host by both, as the node's digest does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import struct
import time

import torch

from node.training.params import param_digest
from protocol.digest import CHUNK_BYTES, HASH_THREADS


def sha256_digest(named: dict[str, torch.Tensor]) -> str:
    """The first build's parameter digest: one SHA-256 over everything, on the calling thread."""
    hasher = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name].detach()
        for field in (name.encode(), str(tensor.dtype).encode(), struct.pack(f"<{tensor.ndim}Q", *tensor.shape)):
            hasher.update(struct.pack("<Q", len(field)) + field)
        flat = tensor.to("cpu").contiguous().reshape(-1)
        hasher.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return hasher.hexdigest()


def preset_tensors(preset: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The preset's parameters, by name: shapes from the model (built on the meta device)."""
    from node.training.model import PRESETS, Transformer

    with torch.device("meta"):
        model = Transformer(PRESETS[preset])
    return {
        name: torch.empty(p.shape, device=device).fill_(0.001 * i)
        for i, (name, p) in enumerate(sorted(model.named_parameters()))
    }


def timed(fn, named) -> tuple[float, str]:
    start = time.perf_counter()
    result = fn(named)
    return time.perf_counter() - start, result


def run(preset: str, device: torch.device, repeats: int) -> dict:
    named = preset_tensors(preset, device)
    num_bytes = sum(t.numel() * t.element_size() for t in named.values())
    timed(param_digest, named)  # warm the thread pool and the caches
    sha_times, tree_times = [], []
    for _ in range(repeats):  # interleaved, so that both see the same machine (a shared one varies)
        sha_times.append(timed(sha256_digest, named)[0])
        elapsed, digest = timed(param_digest, named)
        tree_times.append(elapsed)
    sha_s, tree_s = statistics.median(sha_times), statistics.median(tree_times)
    return {
        "preset": preset,
        "device": str(device),
        "num_parameters": sum(t.numel() for t in named.values()),
        "bytes": num_bytes,
        "hash_threads": HASH_THREADS,
        "chunk_bytes": CHUNK_BYTES,
        "repeats": repeats,
        "sha256_s": sha_s,
        "sha256_gbps": num_bytes / sha_s / 1e9,
        "digest_s": tree_s,
        "digest_gbps": num_bytes / tree_s / 1e9,
        "speedup_over_sha256": sha_s / tree_s,
        "digest": digest,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", default="512m", help="model preset whose parameters are hashed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = run(args.preset, torch.device(args.device), args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"digest benchmark: {result['num_parameters'] / 1e6:.1f}M fp32 parameters ({result['bytes'] / 1e9:.2f} GB) "
        f"on {result['device']}, {result['hash_threads']} hash threads, medians of {args.repeats}"
    )
    print(f"{'':>22} {'s':>8} {'GB/s':>8}")
    print(f"{'sha256 (baseline)':>22} {result['sha256_s']:>8.3f} {result['sha256_gbps']:>8.2f}")
    print(f"{'hash tree (BLAKE3)':>22} {result['digest_s']:>8.3f} {result['digest_gbps']:>8.2f}")
    print(f"{'speedup':>22} {result['speedup_over_sha256']:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
