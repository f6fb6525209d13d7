"""A fuzz run of the packet decoder: mutated real packets, each decoded under a time bound.

    python -m tools.fuzz --count 100000 --seconds 600 [--seed 0] [--per-input-s 2]

Base packets are real: signed SparseLoCo packets encoded from random pseudo-gradients for a few
model specs of awkward shapes (1-element, odd, non-divisible tensors; top_k 64 and 128; codes
zstd-compressed and raw). Each input applies one to four mutations, chosen at random:

- bytes: flip bits, set a byte, truncate, insert random bytes, delete a range, duplicate a range,
  splice the head of one packet onto the tail of another;
- framing: magic, wire version, header length;
- header fields (the header is re-packed, the framing rebuilt): run, round (a replay), peer,
  base digest, density, code coder and length, and per tensor name, shape, dtype, Rice parameter,
  stream lengths and the quantization table (NaN, Inf, values past the run's bound);

and is then re-signed by the member's key (an attacker inside the swarm, the worst case) or left
with its old signature (a corrupted transfer), half and half. Every input is decoded as a peer
would: against the model spec, the run and round expected, and a key lookup that refuses
non-members. An accepted packet must be well-formed (indices inside their chunks, finite
values within the default `outer.max_abs_value`); a refusal must be a `ProtocolError`. Anything else -- another exception, a decode past
`--per-input-s` (SIGALRM), an accepted packet that is not well-formed -- is a crash: the run
prints it and exits 1. The summary is one JSON object:

    {"inputs", "accepted", "refused_by_type", "crashes", "hangs", "max_decode_ms", "peak_rss_mb", ...}
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import signal
import struct
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import msgpack
import torch

from locoswarm_kernels.sparse import error_feedback_step
from protocol.errors import ProtocolError
from protocol.packet import MAGIC, PREFIX, WIRE_VERSION, ModelSpec, decode_packet, encode_packet, read_header
from protocol.run_config import DEFAULT_MAX_ABS_VALUE
from protocol.signing import SIGNATURE_BYTES, PeerKey

RUN_ID, ROUND, PEER_ID = "run-fuzz", 7, "pfuzz000000000000"
KEY = PeerKey.from_seed(b"fuzz-member")
STRANGER = PeerKey.from_seed(b"fuzz-stranger")
SPECS = (
    ModelSpec({"a.weight": (64, 64), "b.weight": (67, 130), "c.bias": (64,), "d.scalar": (1,)}, top_k=64),
    ModelSpec({"embed.weight": (256, 32), "norm.weight": (32,), "odd": (3, 5, 7)}, top_k=128),
    ModelSpec({"big.weight": (512, 384), "big.bias": (1000,)}, top_k=128),  # ~10 KB packets
)


class DecodeTimeout(Exception):
    """A decode ran past the per-input bound."""


@dataclass(slots=True)
class Base:
    spec: ModelSpec
    data: bytes


def make_bases(seed: int) -> list[Base]:
    """Real packets: several seeds per spec, large and tiny values (so zstd and raw codes both occur)."""
    generator = torch.Generator().manual_seed(seed)
    bases = []
    for spec in SPECS:
        layouts = spec.layouts()
        for scale in (1.0, 1e-6, 1e2):  # 1e2: large, within the default bound (1e4) at 4 sigma
            tensors = {
                name: error_feedback_step(
                    torch.zeros(shape), torch.randn(shape, generator=generator) * scale, layouts[name], 0.95, 1.0
                )
                for name, shape in spec.shapes.items()
            }
            bases.append(Base(spec, encode_packet(RUN_ID, ROUND, PEER_ID, bytes(range(32)), spec, tensors, KEY)))
    return bases


# -- mutations --------------------------------------------------------------------------------


def _header_edit(rng: random.Random, data: bytes) -> bytes:
    try:
        header, offset = read_header(data)
    except ProtocolError:
        return data
    evil_ints = [-1, 0, 1, 2, 3, 63, 64, 65, 4096, 2**31, 2**32 + 1, 2**63 - 1, -(2**63)]
    field = rng.choice(["run", "round", "peer", "base", "top_k", "chunk", "codes", "tensors", "extra", "drop"])
    if field == "run":
        header["run"] = rng.choice(["", "run-other", RUN_ID + "\x00", "x" * 4000])
    elif field == "round":
        header["round"] = rng.choice([ROUND - 1, ROUND + 1, -1, 2**40, "7", None, True])  # replays, types
    elif field == "peer":
        header["peer"] = rng.choice(["pstranger", "", PEER_ID.upper(), 12])
    elif field == "base":
        header["base"] = rng.choice([b"", b"\0" * 31, b"\0" * 33, "x" * 32])
    elif field in ("top_k", "chunk"):
        header[field] = rng.choice(evil_ints + [1.5, "64"])
    elif field == "codes":
        header["codes"] = rng.choice([[rng.choice([0, 1, 2, -1]), rng.choice(evil_ints)], [0], [], "zstd", [0, 1, 2]])
    elif field == "extra":
        header["extra"] = 1
    elif field == "drop":
        header.pop(rng.choice(sorted(header)))
    elif header["tensors"]:
        sections = header["tensors"]
        i = rng.randrange(len(sections))
        section = sections[i]
        j = rng.randrange(8)
        if j == 7:
            rng.choice([sections.pop, lambda _: sections.append(list(section)), lambda _: sections.reverse()])(i)
        elif j == 0:
            section[0] = rng.choice(["", "a.weight", section[0] + "x"])
        elif j == 1:
            section[1] = rng.choice([[], [0], [2**40, 2**40], [-1, 64], [64, 64, 1], "64"])
        elif j == 2:
            section[2] = rng.choice(["float64", "int8", "", 5])
        elif j == 4:
            nan, inf = struct.pack("<f", float("nan")), struct.pack("<f", float("inf"))
            big = struct.pack("<f", 3e38)
            pos = 4 * rng.randrange(5)
            table = bytearray(section[4])
            table[pos : pos + 4] = rng.choice([nan, inf, big, b"\xff\xff\xff\xff"])
            section[4] = rng.choice([bytes(table), bytes(table[:19]), bytes(table) + b"\0", None])
        else:
            section[j] = rng.choice(evil_ints + [None, 1.0])
    raw = msgpack.packb(header)
    return PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + data[offset:]


def _framing_edit(rng: random.Random, data: bytes) -> bytes:
    body = bytearray(data)
    which = rng.randrange(3)
    if which == 0:
        body[0:4] = rng.choice([b"LSWQ", b"\0\0\0\0", MAGIC[::-1]])
    elif which == 1:
        body[4:6] = struct.pack("<H", rng.choice([0, 2, WIRE_VERSION + 1, 0xFFFF]))
    else:
        body[6:10] = struct.pack("<I", rng.choice([0, 1, len(data), len(data) * 2, 4 << 20, (4 << 20) + 1, 2**32 - 1]))
    return bytes(body)


def mutate(rng: random.Random, bases: list[Base], base: Base) -> tuple[bytes, str]:
    """One to four mutations of `base`'s signed body; re-signed by the member half the time."""
    body = base.data[:-SIGNATURE_BYTES]
    names = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(
            ["flip", "set", "truncate", "insert", "delete", "duplicate", "splice", "framing", "header", "header"]
            if body
            else ["insert", "splice"]
        )
        names.append(op)
        b = bytearray(body)
        pos = rng.randrange(max(1, len(b)))
        if op == "flip":
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == "set":
            b[pos : pos + 1] = bytes([rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])])
        elif op == "truncate":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = rng.randbytes(rng.choice([1, 2, 7, 64, 1000]))
        elif op == "delete":
            del b[pos : pos + rng.randint(1, 64)]
        elif op == "duplicate":
            b[pos:pos] = b[pos : pos + rng.randint(1, 256)]
        elif op == "splice":
            other = rng.choice(bases).data[:-SIGNATURE_BYTES]
            b = b[:pos] + bytearray(other[rng.randrange(len(other)) :])
        elif op == "framing":
            b = bytearray(_framing_edit(rng, bytes(b)))
        else:
            b = bytearray(
                _header_edit(rng, bytes(b) + b"\0" * SIGNATURE_BYTES)[:-SIGNATURE_BYTES] if len(b) >= PREFIX.size else b
            )
        body = bytes(b)
    resigned = rng.random() < 0.5
    signer = STRANGER if rng.random() < 0.05 else KEY
    data = body + (signer.sign(body) if resigned else base.data[-SIGNATURE_BYTES:])
    if rng.random() < 0.02:
        data = data[: rng.randrange(len(data) + 1)]  # a transfer cut short, signature and all
    return data, "+".join(names) + (" (re-signed)" if resigned else "")


def member_key(peer_id: str) -> bytes:
    if peer_id != PEER_ID:
        raise ProtocolError(f"peer {peer_id!r} is not a member of the run")
    return KEY.public_bytes


def _well_formed(packet) -> bool:
    for sparse in packet.tensors.values():
        if sparse.positions.numel() and int(sparse.positions.max()) >= sparse.layout.chunk_len:
            return False
        values = sparse.values()
        if not bool(torch.isfinite(values).all()) or float(values.abs().max()) > DEFAULT_MAX_ABS_VALUE:
            return False
    return True


# -- the run ----------------------------------------------------------------------------------


def _on_alarm(signum, frame):
    raise DecodeTimeout()


def fuzz(count: int, seconds: float, seed: int = 0, per_input_s: float = 2.0, verbose: bool = False) -> dict:
    """Decode `count` mutated packets (or as many as fit in `seconds`); return the summary."""
    rng = random.Random(seed)
    bases = make_bases(seed)
    refused: Counter[str] = Counter()
    crashes: list[dict] = []
    accepted = hangs = inputs = 0
    max_decode_s = 0.0
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    start = time.monotonic()
    try:
        while inputs < count and time.monotonic() - start < seconds:
            base = rng.choice(bases)
            data, how = mutate(rng, bases, base)
            inputs += 1
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, per_input_s)
            try:
                packet = decode_packet(data, base.spec, member_key, run_id=RUN_ID, round=ROUND)
                ok = _well_formed(packet)
            except ProtocolError as e:
                refused[type(e).__name__] += 1
                continue
            except DecodeTimeout:
                hangs += 1
                crashes.append({"input": inputs, "mutation": how, "error": f"decode ran past {per_input_s} s"})
                continue
            except Exception as e:  # the finding this tool exists for
                crashes.append(
                    {
                        "input": inputs,
                        "mutation": how,
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(limit=4) if verbose else None,
                    }
                )
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                max_decode_s = max(max_decode_s, time.perf_counter() - t0)
            if ok:
                accepted += 1
            else:
                crashes.append({"input": inputs, "mutation": how, "error": "accepted a packet that is not well-formed"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed_s = time.monotonic() - start
    return {
        "inputs": inputs,
        "accepted": accepted,
        "refused_by_type": dict(sorted(refused.items())),
        "crashes": len(crashes),
        "hangs": hangs,
        "max_decode_ms": round(max_decode_s * 1e3, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds": round(elapsed_s, 1),
        "inputs_per_s": round(inputs / max(elapsed_s, 1e-9), 1),
        "base_packets": len(bases),
        "base_packet_bytes": sorted({len(b.data) for b in bases}),
        "seed": seed,
        "first_crashes": crashes[:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=100_000, help="mutated packets to decode")
    parser.add_argument("--seconds", type=float, default=600.0, help="stop early after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-input-s", type=float, default=2.0, help="a decode slower than this is a hang")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of the first crashes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    summary = fuzz(args.count, args.seconds, args.seed, args.per_input_s, args.verbose)
    print(json.dumps(summary))
    return 1 if summary["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
