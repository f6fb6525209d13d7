#!/usr/bin/env bash
# The GPU check of issue 18: on a CUDA machine, in under 5 minutes, what the CPU runs cannot show.
#
#   OUT=/tmp/gpu deploy/gpu_check.sh        (from anywhere; PYTHON=... to pick the interpreter)
#
# 1. the card: nvidia-smi's name, memory and driver, and torch's view of it;
# 2. the codec bench on cuda (tools/bench/codec.py): bits per value, encode and decode+aggregate of
#    16 packets against the plain path, medians of 3;
# 3. the memory bench of the 1b preset on cuda (tools/bench/memory.py), if this build has it;
# 4. the 1b inner loop's tokens/s and MFU (tools/bench/throughput.py: bf16 autocast,
#    activation checkpointing, 2 warm-up and 5 timed steps of 8 x 2048 tokens).
#
# 5. the opt-in Triton scatter-mean against the torch path on the card, bit for bit;
# 6. a node's packet path on the card (packets decoded on the GPU, median-clipped and aggregated
#    there, as a CUDA node does): the same positions and the same aggregate bits as on the CPU.
#
# Each step has its own time limit (together 300 s) and writes its JSON to $OUT (a fresh temporary
# folder when unset); a step that fails is reported and the others still run. Exit status: 0 when
# every step ran, 1 when one failed, 2 when there is no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run, keep stdout as $OUT/NAME.json, stderr as $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    if timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"; then
        echo "== $name: ok in $((SECONDS - start)) s"
    else
        echo "== $name: FAILED (exit $?) after $((SECONDS - start)) s; last lines of $OUT/$name.log:"
        tail -n 5 "$OUT/$name.log"
        failed=1
    fi
}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is false)" >&2
    exit 2
fi
echo "gpu_check: writing to $OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/card.csv" 2>/dev/null || true
"$PYTHON" -c "import json, torch, sys; p = torch.cuda.get_device_properties(0); json.dump({'name': p.name, \
'memory_bytes': p.total_memory, 'capability': f'{p.major}.{p.minor}', 'torch': torch.__version__, \
'cuda': torch.version.cuda}, sys.stdout)" >"$OUT/card.json"
cat "$OUT/card.json"; echo

step codec 80 "$PYTHON" -m locoswarm bench codec --device cuda --repeats 3 --json
if "$PYTHON" -c "import tools.bench.memory" 2>/dev/null; then
    step memory 60 "$PYTHON" -m locoswarm bench memory --preset 1b --device cuda --json
else
    echo "== memory: skipped, this build has no tools/bench/memory.py (locoswarm bench memory)"
fi
# The Triton scatter-mean (opt-in, LOCOSWARM_TRITON=1) must sum bit for bit as the torch path does.
step triton 40 "$PYTHON" - <<'PY'
import json, os, torch
from locoswarm_kernels.chunking import chunk_layout
from locoswarm_kernels.sparse import compress, scatter_mean
layout = chunk_layout((4096, 4096), top_k=64)
gen = torch.Generator().manual_seed(0)
selections = [compress(torch.randn(4096, 4096, generator=gen), layout) for _ in range(16)]
out = {}
for choice in ("0", "1"):
    os.environ["LOCOSWARM_TRITON"] = choice
    out[choice] = scatter_mean(selections, device="cuda").cpu()
print(json.dumps({"triton_bit_identical": bool(torch.equal(out["0"].view(torch.int32), out["1"].view(torch.int32)))}))
PY
# A CUDA node decodes and aggregates its round's packets on the GPU: every node must get the same bits.
step packets 30 "$PYTHON" - <<'PY'
import json, torch
from locoswarm_kernels.sparse import aggregate_packets, error_feedback_step, packet_clip_scales
from tools.bench.codec import llama_shapes
from protocol.packet import ModelSpec, decode_packet, encode_packet
from protocol.signing import PeerKey
spec = ModelSpec(llama_shapes(hidden=256, num_layers=2, intermediate=704, vocab=4096), 64)
layouts, gen = spec.layouts(), torch.Generator().manual_seed(0)
keys = [PeerKey.from_seed(bytes([i])) for i in range(8)]
packets = [encode_packet("gpu", 0, f"p{i}", bytes(32), spec, {
    n: error_feedback_step(torch.zeros(s), torch.randn(s, generator=gen) * 1e-3, layouts[n], 0.95, 1.0)
    for n, s in spec.shapes.items()}, key) for i, key in enumerate(keys)]
result = {}
for device in ("cpu", "cuda"):
    decoded = [decode_packet(p, spec, k.public_bytes, device=device).tensors for p, k in zip(packets, keys)]
    means = aggregate_packets(decoded, device=device, peer_scales=packet_clip_scales(decoded))
    result[device] = ([d.positions.cpu() for d in decoded], {n: t.cpu() for n, t in means.items()})
(cpu_index, cpu_means), (gpu_index, gpu_means) = result["cpu"], result["cuda"]
print(json.dumps({"decoded_positions_identical": all(torch.equal(a, b) for a, b in zip(cpu_index, gpu_index)),
                  "aggregate_bit_identical": all(torch.equal(cpu_means[n].view(torch.int32), gpu_means[n].view(torch.int32))
                                                 for n in cpu_means)}))
PY
step throughput 90 "$PYTHON" -m tools.bench.throughput --preset 1b --device cuda --out "$OUT/throughput.json"

"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
card, codec, throughput, triton = load("card"), load("codec"), load("throughput"), load("triton")
packets = load("packets")
print("card:", card and card["name"], "memory GB:", card and round(card["memory_bytes"] / 1e9, 1))
if codec:
    print("codec: decode+aggregate speed-up over the plain path %.2fx, encode %.2fx, bits/value %.2f" % (
        codec["decode_aggregate_speedup_over_baseline"], codec["encode_speedup_over_baseline"],
        codec["bits_per_value_top_k_64"]))
if triton:
    print("triton scatter-mean bit-identical to the torch path:", triton["triton_bit_identical"])
if packets:
    print("packets decoded and aggregated on the GPU, identical to the CPU:", packets)
if throughput:
    mfu = throughput["mfu"]
    print("1b inner loop: %.0f tokens/s, %.1f model TFLOP/s, MFU %s" % (
        throughput["tokens_per_s"], throughput["model_tflops"], "%.1f %%" % (100 * mfu) if mfu else "unknown"))
PY
exit $failed
