"""Memory benchmark: the bytes per parameter a node holds, by category, on the training device and the host.

    locoswarm bench memory [--preset 1b] [--device cuda] [--placement host|device] [--overlap]
                           [--micro-batch 1] [--seq-len 2048] [--device-memory-gb 24] [--measure] [--json]

It builds the node's real state for a preset on the meta device (no memory, so 8B costs nothing):
the model, AdamW stepped once so its moments exist, gradients, and the SparseLoCo outer step
(round start, error buffers) of node/training/outer.py, plus one aggregate per tensor as `prepare`
makes. Every tensor's bytes come from its shape and dtype; where it lives comes from the placement
the node uses on `--device` (default cuda, whatever machine this runs on): `state_placement_device`, and
the aggregate on the training device without overlap (made when the gradients are freed).

A node's memory has phases; the peak is the largest of them:
  inner   the H inner steps: parameters, gradients, AdamW moments, activations, resident outer state
  payload between rounds: the error feedback, staged a tensor at a time (about 4 of the largest tensor)
  apply   the outer step: the aggregate, and the staged round start and new tensor (2 of the largest),
          the round's packets and their decoded form (`--peers` of them, in host memory)

Baseline, in the same run: the first build's layout (everything on the training device, a second
round-start copy, the aggregate beside it, the kept start of node/round/amend.py cloned there too),
counted from the same tensors. Activations are an estimate for bf16 autocast (formula in
`activation_bytes`). `--measure` builds the real state of a small preset on the CPU (a real inner
step, a real packet and aggregate) and counts its tensors' storages, to check the accounting.
It ends with the largest preset that fits `--device-memory-gb` and the 8B budget on 8 x 80 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

import torch

from node.training.model import LOSS_CHUNK_TOKENS, PRESETS, ModelConfig, Transformer
from node.training.outer import SparseLoCoOuter, state_placement_device
from node.training.params import flat_named_params, tensor_nbytes
from protocol.run_config import OuterSection

PHASES = ("inner", "payload", "apply")
DEFAULT_PEERS = 8  # packets in a round, for the kept start of an amendable round
GIB = 1 << 30
DEFAULT_OVERHEAD_GB = 1.5  # CUDA context, cuBLAS workspaces, allocator slack: what a budget keeps back


@dataclass(frozen=True, kw_only=True, slots=True)
class Category:
    name: str  # params, grads, adam_moments, round_start, ...
    num_bytes: int
    device: bool  # on the training device (else host memory, or disk)
    phases: tuple[str, ...]  # the phases in which it is alive
    disk: bool = False  # in files the kernel may write out and reclaim (node/exchange/spool.py), not memory


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeState:
    """The tensors of a node's state, by category (bytes from shapes and dtypes)."""

    num_params: int
    params_bytes: int
    grads_bytes: int
    adam_bytes: int
    round_start_bytes: int
    local_round_start_bytes: int  # 0 when it is the round start itself (no overlap)
    error_buffer_bytes: int
    aggregate_bytes: int
    largest_tensor_bytes: int


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_nbytes(t)
    return total


def count_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: SparseLoCoOuter,
    aggregates: dict[str, torch.Tensor],
) -> NodeState:
    """Bytes per category of real (or meta) state; gradients are counted from `.grad` as they stand."""
    params = flat_named_params(model)
    moments = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return NodeState(
        num_params=sum(p.numel() for p in params.values()),
        params_bytes=_unique_bytes(params.values()),
        grads_bytes=_unique_bytes(p.grad for p in params.values() if p.grad is not None),
        adam_bytes=_unique_bytes(moments),
        round_start_bytes=_unique_bytes(outer.start.values()),
        local_round_start_bytes=0 if outer.local_start is outer.start else _unique_bytes(outer.local_start.values()),
        error_buffer_bytes=_unique_bytes(outer.error_buffers.values()),
        aggregate_bytes=_unique_bytes(aggregates.values()),
        largest_tensor_bytes=max(tensor_nbytes(p) for p in params.values()),
    )


def meta_state(cfg: ModelConfig, overlap: bool) -> NodeState:
    """The node's state for `cfg`, built on the meta device: real objects, no memory."""
    with torch.device("meta"):
        model = Transformer(cfg)
    params = flat_named_params(model)
    for p in params.values():
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(list(params.values()), foreach=False)
    optimizer.step()  # creates the moments, as the first inner step does
    outer = SparseLoCoOuter(params, OuterSection(overlap=overlap))
    aggregates = {name: torch.empty(p.shape, dtype=torch.float32, device="meta") for name, p in params.items()}
    return count_state(model, optimizer, outer, aggregates)


def kept_start_bytes(num_params: int, num_peers: int, overlap: bool, cfg: OuterSection = OuterSection()) -> int:
    """node/training/round_start.py's `StartPatch`: a bit per coordinate and an fp32 value for each coordinate
    the round's aggregate moved, about the union of `num_peers` Top-k selections (k of each
    chunk_size^2 tile, peers' choices taken as independent); a dense copy above MAX_PATCH_FRACTION.
    Nothing with overlap."""
    from node.training.round_start import MAX_PATCH_FRACTION

    if overlap:
        return 0
    moved = 1.0 - (1.0 - cfg.top_k / cfg.chunk_size**2) ** num_peers
    return int(num_params * (4 if moved > MAX_PATCH_FRACTION else 1 / 8 + 4 * moved))


PACKET_BITS_PER_VALUE = 8.7  # a packet's bytes * 8 / values sent at top_k 64 (`locoswarm bench codec`: 8.68)
DECODED_BYTES_PER_VALUE = 3  # kernels/sparse.py `PacketSelections`: int16 position in its chunk, uint8 code
# kernels/chunking.py `PacketLayout`, cached where packets are decoded: int32 code_offsets and
# symbol_row_offsets per value a packet sends, and an int32 byte_code_offsets per four
LAYOUT_BYTES_PER_VALUE = 4 + 4 + 1


def round_packet_bytes(num_params: int, num_peers: int, cfg: OuterSection = OuterSection()) -> tuple[int, int]:
    """(bytes, decoded bytes) of a round's `num_peers` packets: each sends top_k of every chunk_size^2."""
    values = num_peers * num_params * cfg.top_k / cfg.chunk_size**2
    return int(values * PACKET_BITS_PER_VALUE / 8), int(values * DECODED_BYTES_PER_VALUE)


def packet_layout_bytes(num_params: int, cfg: OuterSection = OuterSection()) -> int:
    """The per-value constants of the model's `PacketLayout`: one packet's worth of values."""
    return int(num_params * cfg.top_k / cfg.chunk_size**2 * LAYOUT_BYTES_PER_VALUE)


def categories(
    state: NodeState,
    device: str,
    placement: str,
    overlap: bool,
    *,
    baseline: bool = False,
    num_peers: int = DEFAULT_PEERS,
) -> list[Category]:
    """Where each category lives and when, for training on `device` with the outer state at `placement`
    in a round of `num_peers` packets; `baseline`: the first build's layout (all on the device, two round
    starts, a dense kept start, no staging)."""
    if baseline:
        state_on_device = aggregate_on_device = True
    else:
        state_device, _ = state_placement_device(device, placement)
        state_on_device = state_device.type == torch.device(device).type
        aggregate_on_device = state_on_device or not overlap
    aggregate_phases = PHASES if overlap else ("apply",)  # with overlap it is prepared beside training
    local_start = state.round_start_bytes if baseline else state.local_round_start_bytes
    out = [
        Category(name="params", num_bytes=state.params_bytes, device=True, phases=PHASES),
        Category(name="grads", num_bytes=state.grads_bytes, device=True, phases=("inner",)),
        Category(name="adam_moments", num_bytes=state.adam_bytes, device=True, phases=PHASES),
        Category(name="round_start", num_bytes=state.round_start_bytes, device=state_on_device, phases=PHASES),
        Category(name="local_round_start", num_bytes=local_start, device=state_on_device, phases=PHASES),
        Category(name="error_buffer", num_bytes=state.error_buffer_bytes, device=state_on_device, phases=PHASES),
        Category(
            name="aggregate", num_bytes=state.aggregate_bytes, device=aggregate_on_device, phases=aggregate_phases
        ),
        # node/round/amend.py keeps the round start (the first build: a dense clone) until the manifest is
        # final, as a patch on the training device.
        Category(
            name="kept_round_start",
            device=True,
            phases=PHASES,
            num_bytes=state.round_start_bytes if baseline else kept_start_bytes(state.num_params, num_peers, overlap),
        ),
    ]
    # The round's packets: the kept round's bytes until the next outer step (node/round/amend.py) and
    # the applied round's, held and served from the spool's mapped files (node/exchange/spool.py; the
    # first build: the heap), and those decoded, as they arrive, where the aggregate is made (the first
    # build: on the CPU). Peers faster than this node send theirs while it still trains: decoded
    # packets may meet the inner steps' gradients.
    packet_bytes, decoded_bytes = round_packet_bytes(state.num_params, num_peers)
    out += [
        Category(name="kept_packets", num_bytes=packet_bytes, device=False, phases=PHASES, disk=not baseline),
        Category(
            name="round_packets", num_bytes=packet_bytes, device=False, phases=("inner", "apply"), disk=not baseline
        ),
        Category(
            name="decoded_packets",
            num_bytes=decoded_bytes,
            device=aggregate_on_device and not baseline,
            phases=("inner", "apply"),
        ),
    ]
    if not baseline:  # made at the first decode and kept (the first build decoded without one)
        out.append(
            Category(
                name="packet_layout",
                num_bytes=packet_layout_bytes(state.num_params),
                device=aggregate_on_device,
                phases=PHASES,
            )
        )
    if not baseline and not state_on_device:
        out += [
            Category(name="staging", num_bytes=4 * state.largest_tensor_bytes, device=True, phases=("payload",)),
            Category(name="staging", num_bytes=2 * state.largest_tensor_bytes, device=True, phases=("apply",)),
        ]
    return out


def peak_bytes(cats: list[Category], on_device: bool) -> int:
    """The largest total over the phases of what lives in memory on the device (or the host)."""
    return max(
        sum(c.num_bytes for c in cats if c.device == on_device and not c.disk and phase in c.phases) for phase in PHASES
    )


def activation_bytes(
    cfg: ModelConfig, micro_batch: int, seq_len: int, checkpointing: bool, loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
) -> int:
    """Estimated bytes the autograd graph keeps for one micro-batch under bf16 autocast.

    Per token and block, without checkpointing: the two RMSNorms keep fp32 input and output
    (16 C), the attention its bf16 input, q/k/v and rotated q/k, output and o_proj input
    (2 * (5 C + 3 Ckv)), the SwiGLU its input, gate, up, silu and product (2 C + 8 F); SDPA's
    flash/efficient kernels keep O(T), not O(T^2). With checkpointing a block keeps its fp32 input
    (4 C) and one block at a time is recomputed. The head keeps the final norm (8 C) and the
    logits of one loss chunk: bf16 logits, fp32 copy and its gradient (10 V per token).
    """
    C, F, L, V = cfg.hidden, cfg.intermediate, cfg.num_layers, cfg.vocab_size
    Ckv = cfg.num_kv_heads * cfg.head_dim
    tokens = micro_batch * seq_len
    per_block = (16 * C + 2 * (5 * C + 3 * Ckv) + 2 * C + 8 * F) * tokens
    blocks = L * 4 * C * tokens + per_block if checkpointing else L * per_block
    head = 8 * C * tokens + min(tokens, loss_chunk_tokens) * V * 10
    return blocks + head


def largest_fitting(
    device_memory_gb: float,
    device: str,
    placement: str,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    overhead_gb: float,
) -> str | None:
    """The preset with the most parameters whose peak (state + activations + overhead) fits."""
    fits = []
    for name, cfg in PRESETS.items():
        state = meta_state(cfg, overlap=False)
        cats = categories(state, device, placement, overlap=False)
        inner_extra = activation_bytes(cfg, micro_batch, min(seq_len, cfg.max_seq_len), checkpointing)
        need = max(
            sum(c.num_bytes for c in cats if c.device and phase in c.phases) + (inner_extra if phase == "inner" else 0)
            for phase in PHASES
        )
        if need + overhead_gb * GIB <= device_memory_gb * GIB:
            fits.append((state.num_params, name))
    return max(fits)[1] if fits else None


def fsdp_budget(cfg: ModelConfig, num_ranks: int, micro_batch: int, seq_len: int) -> dict:
    """Per-rank figures of `cfg` sharded over `num_ranks` GPUs (FSDP2: parameters, gradients, moments
    and the outer state sharded; one block's parameters and gradients gathered at a time, twice for
    prefetch), with checkpointing."""
    state = meta_state(cfg, overlap=False)
    cats = categories(state, "cuda", "host", overlap=False)
    block_bytes = (
        4 * (state.num_params - cfg.vocab_size * cfg.hidden * (1 if cfg.tie_embeddings else 2)) // cfg.num_layers
    )
    device_state = peak_bytes(cats, True) // num_ranks + 2 * 2 * block_bytes
    activations = activation_bytes(cfg, micro_batch, min(seq_len, cfg.max_seq_len), checkpointing=True)
    return {
        "ranks": num_ranks,
        "device_state_gb": device_state / GIB,
        "activations_gb": activations / GIB,
        "device_total_gb": (device_state + activations) / GIB,
        "host_gb": peak_bytes(cats, False) / num_ranks / GIB,
    }


def measured_state(preset: str) -> NodeState:
    """The real state of `preset` on the CPU after a real inner step, packet and aggregate."""
    from node.training.inner import make_inner_optimizer, run_inner_steps
    from node.training.model import build_model, lm_loss
    from protocol.run_config import InnerSection
    from protocol.signing import PeerKey

    model = build_model(preset, seed=0)
    cfg = InnerSection(warmup_steps=0, total_steps=1, batch_size=1, seq_len=16)
    optimizer = make_inner_optimizer(model, cfg)
    outer = SparseLoCoOuter(flat_named_params(model), OuterSection(aggregation="mean"))
    tokens = torch.randint(0, model.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    run_inner_steps(model, optimizer, iter([(tokens[:, :-1], tokens[:, 1:])]), 0, 1, cfg, "cpu")
    key = PeerKey.from_seed(b"memory")
    payload = outer.make_payload(run_id="m", round=0, peer_id="p", base_digest="00" * 32, key=key)
    prepared = outer.prepare({"p": payload}, lambda _: key.public_bytes, run_id="m", round=0)
    lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()  # gradients as they stand mid-step
    return count_state(model, optimizer, outer, prepared.aggregates)


def report(args) -> dict:
    cfg = PRESETS[args.preset]
    state = meta_state(cfg, overlap=args.overlap)
    after = categories(state, args.device, args.placement, args.overlap, num_peers=args.peers)
    before = categories(state, args.device, args.placement, args.overlap, baseline=True)
    n = state.num_params

    def by_category(cats: list[Category], on_device: bool, disk: bool = False) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in cats:
            if c.device == on_device and c.disk == disk and c.num_bytes:
                out[c.name] = max(out.get(c.name, 0.0), c.num_bytes / n)
        return out

    seq_len = min(args.seq_len, cfg.max_seq_len)
    result = {
        "preset": args.preset,
        "num_params": n,
        "device": args.device,
        "placement": args.placement,
        "overlap": args.overlap,
        "peers": args.peers,
        "device_bytes_per_param": peak_bytes(after, True) / n,
        "host_bytes_per_param": peak_bytes(after, False) / n,
        "baseline_device_bytes_per_param": peak_bytes(before, True) / n,
        "baseline_host_bytes_per_param": peak_bytes(before, False) / n,
        "device_categories": by_category(after, True),
        "host_categories": by_category(after, False),
        "disk_categories": by_category(after, False, disk=True),
        "baseline_device_categories": by_category(before, True),
        "activations": {
            "micro_batch": args.micro_batch,
            "seq_len": seq_len,
            "bytes_checkpointed": activation_bytes(cfg, args.micro_batch, seq_len, True),
            "bytes_plain": activation_bytes(cfg, args.micro_batch, seq_len, False),
        },
        "device_memory_gb": args.device_memory_gb,
        "overhead_gb": args.overhead_gb,
        "largest_preset_that_fits": {
            ckpt: largest_fitting(
                args.device_memory_gb,
                args.device,
                args.placement,
                args.micro_batch,
                args.seq_len,
                ckpt == "checkpointed",
                args.overhead_gb,
            )
            for ckpt in ("checkpointed", "plain")
        },
        "fsdp_8b_on_8x80gb": fsdp_budget(PRESETS["8b"], 8, args.micro_batch, args.seq_len),
    }
    if args.measure:
        real = measured_state(args.measure_preset)
        counted = meta_state(PRESETS[args.measure_preset], overlap=False)
        result["measured"] = {
            "preset": args.measure_preset,
            "real": dataclasses.asdict(real),
            "accounting_matches": real == counted,
        }
    return result


def print_table(r: dict) -> None:
    n = r["num_params"]
    print(
        f"memory: preset {r['preset']} ({n / 1e9:.2f}B params), training on {r['device']}, outer state "
        f"placement {r['placement']}, overlap {r['overlap']}"
    )
    print(f"{'category':<20}{'before dev B/p':>16}{'after dev B/p':>16}{'after host B/p':>16}{'after disk B/p':>16}")
    names = dict.fromkeys(
        [*r["baseline_device_categories"], *r["device_categories"], *r["host_categories"], *r["disk_categories"]]
    )
    for name in names:
        print(
            f"{name:<20}{r['baseline_device_categories'].get(name, 0):>16.2f}"
            f"{r['device_categories'].get(name, 0):>16.2f}{r['host_categories'].get(name, 0):>16.2f}"
            f"{r['disk_categories'].get(name, 0):>16.2f}"
        )
    print(
        f"{'peak over phases':<20}{r['baseline_device_bytes_per_param']:>16.2f}"
        f"{r['device_bytes_per_param']:>16.2f}{r['host_bytes_per_param']:>16.2f}"
    )
    print(f"ratio after/before (device): {r['device_bytes_per_param'] / r['baseline_device_bytes_per_param']:.3f}")
    a = r["activations"]
    print(
        f"activations (estimate, bf16, micro-batch {a['micro_batch']} x {a['seq_len']}): "
        f"{a['bytes_checkpointed'] / GIB:.2f} GiB with checkpointing, {a['bytes_plain'] / GIB:.2f} GiB without"
    )
    fit = r["largest_preset_that_fits"]
    print(
        f"largest preset in {r['device_memory_gb']:g} GB (keeping {r['overhead_gb']:g} GB back): "
        f"{fit['checkpointed']} with checkpointing, {fit['plain']} without"
    )
    f = r["fsdp_8b_on_8x80gb"]
    print(
        f"8b on 8 x 80 GB (FSDP, sharded by 8), per rank: device {f['device_state_gb']:.1f} GB state + "
        f"{f['activations_gb']:.1f} GB activations = {f['device_total_gb']:.1f} GB of 80; host {f['host_gb']:.1f} GB"
    )
    if "measured" in r:
        m = r["measured"]
        print(f"check: real state of {m['preset']} on the CPU equals the accounting: {m['accounting_matches']}")


def main(argv=None, prog=None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda", help="the training device whose placement is counted")
    parser.add_argument("--placement", default="host", choices=("host", "device"), help="outer state placement")
    parser.add_argument("--overlap", action="store_true", help="one-round-delayed outer step")
    parser.add_argument("--peers", type=int, default=DEFAULT_PEERS, help="packets per round (the kept start's size)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device-memory-gb", type=float, default=24.0)
    parser.add_argument("--overhead-gb", type=float, default=DEFAULT_OVERHEAD_GB)
    parser.add_argument("--measure", action="store_true", help="also count a real CPU state (--measure-preset)")
    parser.add_argument("--measure-preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = report(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
