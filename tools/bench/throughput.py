"""Inner-loop throughput: tokens per second and model FLOPs utilization of a preset on one device.

    python -m tools.bench.throughput [--preset 1b] [--device cuda] [--steps 5]
        [--warmup-steps 2] [--batch-size 8] [--seq-len 2048] [--micro-batch-size 0]
        [--no-activation-checkpointing] [--compile] [--peak-tflops T] [--out FILE]

Runs the node's own inner loop (node.training.inner.run_inner_steps: AdamW, bf16 autocast on
CUDA, gradient clipping, the chunked cross-entropy, activation checkpointing per block by default)
on random tokens, first `--warmup-steps` untimed steps (allocator, autotuning, compile), then
`--steps` timed ones, and prints one JSON object:

    {"preset", "device", "device_name", "num_parameters", "tokens_per_s", "step_s",
     "model_tflops", "peak_tflops", "mfu", "max_memory_allocated_bytes", ...}

MFU = 6 * N * tokens_per_s / peak FLOP/s (the PaLM convention without the attention term), N the
model's parameters (the input embedding included, though a lookup does no multiply: at 1B it is
6 % of N, so the figure is slightly generous). The peak is dense bf16 tensor throughput, looked
up from the CUDA device's name (PEAK_BF16_TFLOPS) or given by `--peak-tflops`; unknown, `mfu` is
null. Parameters are initialised on the device with plain normal draws, not the seeded
`build_model` (which draws on the CPU): throughput does not depend on their values.

`--out FILE` (or, when $OUT is set, $OUT/throughput.json) also writes the JSON to a file;
deploy/gpu_check.sh runs this on the 1b preset, and tests/unit run it on `tiny` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from node.training.inner import ExecutionConfig, make_inner_optimizer, prepare_model, run_inner_steps
from node.training.model import Transformer, num_parameters, resolve_config
from protocol.run_config import InnerSection

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets; the first
# key found in the device name wins, so longer names come first.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


def peak_tflops_for(device_name: str) -> float | None:
    """The bf16 peak of a device by its name, or None when the table does not know it."""
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


def _model_on(preset: str, device: torch.device) -> Transformer:
    """The preset's model allocated on `device` directly (no CPU copy of a 1B model)."""
    cfg = resolve_config(preset)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_rope()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    return model


def _random_batches(vocab_size: int, batch_size: int, seq_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)  # (B, T + 1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def measure(
    preset: str,
    device: torch.device,
    steps: int,
    warmup_steps: int,
    batch_size: int,
    seq_len: int,
    execution: ExecutionConfig,
    peak_tflops: float | None,
) -> dict:
    cfg = resolve_config(preset)
    seq_len = min(seq_len, cfg.max_seq_len)
    model = prepare_model(_model_on(preset, device), execution)
    inner = InnerSection(warmup_steps=0, total_steps=warmup_steps + steps, batch_size=batch_size, seq_len=seq_len)
    optimizer = make_inner_optimizer(model, inner)
    batches = _random_batches(cfg.vocab_size, batch_size, seq_len)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if warmup_steps:
        run_inner_steps(model, optimizer, batches, 0, warmup_steps, inner, device, execution=execution)
    timed = run_inner_steps(model, optimizer, batches, warmup_steps, steps, inner, device, execution=execution)
    n = num_parameters(model)
    tokens_per_s = timed.num_tokens / timed.compute_s
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = peak_tflops_for(device_name)
    model_tflops = 6 * n * tokens_per_s / 1e12
    return {
        "preset": preset,
        "device": str(device),
        "device_name": device_name,
        "num_parameters": n,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "micro_batch_size": execution.micro_batch_size or batch_size,
        "activation_checkpointing": execution.activation_checkpointing,
        "compile": execution.compile,
        "autocast": "bf16" if device.type == "cuda" else "none",
        "steps": steps,
        "warmup_steps": warmup_steps,
        "mean_loss": timed.mean_loss,
        "tokens_per_s": tokens_per_s,
        "step_s": timed.compute_s / steps,
        "model_tflops": model_tflops,
        "peak_tflops": peak_tflops,
        "mfu": model_tflops / peak_tflops if peak_tflops else None,
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048, help="clamped to the preset's max_seq_len")
    parser.add_argument("--micro-batch-size", type=int, default=0, help="0: the whole batch at once")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (slow first step)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak, if not looked up")
    parser.add_argument("--out", default=None, help="also write the JSON here (default $OUT/throughput.json)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be >= 1 and --warmup-steps >= 0")
    execution = ExecutionConfig(
        micro_batch_size=args.micro_batch_size,
        compile=args.compile,
        activation_checkpointing=not args.no_activation_checkpointing,
    )
    start_s = time.perf_counter()
    result = measure(
        args.preset,
        torch.device(args.device),
        args.steps,
        args.warmup_steps,
        args.batch_size,
        args.seq_len,
        execution,
        args.peak_tflops,
    )
    result["wall_s"] = time.perf_counter() - start_s
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or (str(Path(os.environ["OUT"]) / "throughput.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
