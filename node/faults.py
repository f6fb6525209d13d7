"""Fault injection for a node: crash, slow upload or compute, corrupt or poisoned packets, stale
submissions, withheld packets, lies about the digest.

    locoswarm node join ... --inject crash@round=3,phase=training --inject poison@factor=1000
    faults = FaultInjector.parse(["corrupt-packet@round=1"])       # what node.round.loop does

In the style of hivemind's FaultyAverager and torchft's EventInjector: a small enum of faults, each
armed for one round, for every round, or (lie) from a round on. Most are wrappers around the node's
collaborators, put in place once when the node starts: the coordinator client (stale-submit, lie),
the packet exchange (corrupt-packet; slow-upload as a subclass of the P2P exchange, whose stream
handler it stalls), and the peer's training (poison). Two are calls the round loop makes at its
phase boundaries (crash at a phase; slow-compute, which pads the inner steps' time). With no fault
configured every wrapper is the object itself and every call returns at once, so an honest node
runs exactly the code a faulty one runs, minus the fault.

Spec grammar: ``NAME[@key=value[,key=value...]]``; ``round`` absent means every round (a crash:
the first round that reaches the phase); ``from_round``: that round and every later one.

==============  =====================================  ===========================================
fault           keys (defaults)                        what the node does
==============  =====================================  ===========================================
crash           round, phase=training|published|       SIGKILL itself (no leave, no clean-up), at
                submitted|transfer|applied|            the `Phase` named (training: as the inner
                checkpoint, wait_s=30                  steps of the round begin). transfer: after it
                                                       fetched the round's packets, once some peer
                                                       announced a verified copy of its own packet
                                                       (at most wait_s later; 0: at once), so it
                                                       is in the manifest and a copy survives it.
slow-upload     delay_s=5                              every stream it serves (packets, snapshots)
                                                       waits delay_s before the first byte.
trickle         rate=20000                             every packet stream it serves, its own
                                                       packet's and those it forwards, goes at
                                                       `rate` bytes/s whatever the fetcher asked:
                                                       a holder that never falls silent.
corrupt-packet  round                                  flips one bit of its packet after signing;
                                                       it announces and submits the digest of the
                                                       corrupted bytes, so every peer fetches them
                                                       and refuses them at the signature check.
poison          round, factor=1000,                    before encoding, replaces its update (delta):
                mode=scale|sign-flip|random|overflow   scale: factor * delta; sign-flip: -factor *
                                                       delta; random: Gaussian values of factor
                                                       times the delta's std. A well-formed, signed
                                                       packet that only clipping bounds. overflow:
                                                       the honest update, but the signed packet's
                                                       tables say shift 1e30 and bin means +-3e38
                                                       (finite float32 each; two peers' sum is
                                                       inf): the decoders' value bound refuses it.
stale-submit    round                                  holds its submission until the round has
                                                       closed, then submits (refused as late).
slow-compute    round, min_s=10                        its inner steps take at least min_s seconds:
                                                       it idles (CPU free) for what is left, as a
                                                       slower accelerator would; compute_s counts
                                                       the whole. A straggler, or (on every peer)
                                                       accelerator time in the network lab.
withhold        round                                  submits its packet's digest but serves the
                                                       packet to nobody (it is neither stored nor
                                                       announced): peers report it missing and the
                                                       coordinator amends the round's manifest.
lie             from_round=0                           trains, fetches, applies and serves honestly
                                                       and keeps its real digest, but every applied
                                                       report of a round >= from_round names a
                                                       made-up digest with a tree that hashes to it
                                                       (`made_up_tree`: the real tree's header and
                                                       length, leaves derived from the round and
                                                       manifest version only), so every liar names
                                                       the same one: colluding Sybils. Restarted,
                                                       it repeats the same lie. The answer it acts
                                                       on says whether its real digest agrees.
copy            round, wait_s=30                       publishes and submits, instead of its own
                                                       packet, the first packet of the round another
                                                       peer announces (within wait_s), its header's
                                                       peer rewritten and signed with its own key:
                                                       a Sybil that sends others' work as its own.
undialable      (none)                                 serves no packet stream (closes each at once),
                                                       as a node behind NAT on loopback: its packets
                                                       reach peers only by push (--behind-nat).
==============  =====================================  ===========================================
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import signal
import struct
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from blake3 import blake3

from protocol.digest import Tree

log = logging.getLogger("locoswarm.faults")

POISON_MODES = ("scale", "sign-flip", "random", "overflow")
# poison@mode=overflow: every tensor's table (float32 shift, then the 4 bin means) in the packet it signs.
OVERFLOW_TABLE = (1e30, -3e38, -1e38, 1e38, 3e38)
# lie: leaf i of a made-up tree is BLAKE3(LIE_TAG || u64 round || u64 manifest version || u64 i), all
# little-endian; a made-up digest without a tree, BLAKE3(LIE_TAG || u64 round || u64 manifest version).
LIE_TAG = b"locoswarm.lie"
_LIE_LEAF, _LIE_BARE = struct.Struct("<QQQ"), struct.Struct("<QQ")


class Fault(enum.Enum):
    CRASH = "crash"
    SLOW_UPLOAD = "slow-upload"
    TRICKLE = "trickle"
    CORRUPT_PACKET = "corrupt-packet"
    POISON = "poison"
    STALE_SUBMIT = "stale-submit"
    WITHHOLD = "withhold"
    SLOW_COMPUTE = "slow-compute"
    LIE = "lie"
    COPY = "copy"
    UNDIALABLE = "undialable"


class Phase(enum.Enum):
    """Where in a round a crash fires, in the round's order."""

    TRAINING = "training"  # as the inner steps begin
    PUBLISHED = "published"  # the packet kept on disk and served, not submitted (nor announced) yet
    SUBMITTED = "submitted"  # the coordinator accepted (or refused) the submission
    TRANSFER = "transfer"  # the manifest's packets fetched (see wait_s), before the outer step
    APPLIED = "applied"  # after the outer step, before the applied report
    CHECKPOINT = "checkpoint"  # while the checkpoint is written: the old one set aside, the new not in place


class FaultSpecError(ValueError):
    """An --inject string that does not parse; the message names the bad part."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    fault: Fault
    round: int | None = None  # the round it fires in; None: every round (crash: the first)
    phase: Phase = Phase.TRAINING  # crash: when in the round
    wait_s: float = 30.0  # crash in transfer: longest wait for a peer to hold our packet
    delay_s: float = 5.0  # slow-upload: seconds before each served stream's first byte
    rate: float = 20000.0  # trickle: bytes/s of each served packet stream
    factor: float = 1000.0  # poison: scale of the update
    mode: str = "scale"  # poison: one of POISON_MODES
    min_s: float = 10.0  # slow-compute: the inner steps of a round take at least this long
    from_round: int = 0  # lie: the first round whose applied reports lie

    def fires(self, round: int) -> bool:
        if self.fault is Fault.LIE:
            return round >= self.from_round
        return self.round is None or self.round == round

    def __str__(self) -> str:
        keys = {
            Fault.CRASH: ("round", "phase", "wait_s"),
            Fault.SLOW_UPLOAD: ("delay_s",),
            Fault.TRICKLE: ("rate",),
            Fault.CORRUPT_PACKET: ("round",),
            Fault.POISON: ("round", "factor", "mode"),
            Fault.STALE_SUBMIT: ("round",),
            Fault.SLOW_COMPUTE: ("round", "min_s"),
            Fault.WITHHOLD: ("round",),
            Fault.LIE: ("from_round",),
            Fault.COPY: ("round", "wait_s"),
            Fault.UNDIALABLE: (),
        }[self.fault]
        values = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        args = ",".join(f"{k}={v.value if isinstance(v, Phase) else v}" for k, v in values.items())
        return self.fault.value + (f"@{args}" if args else "")


_KEYS = {
    Fault.CRASH: {"round", "phase", "wait_s"},
    Fault.SLOW_UPLOAD: {"delay_s"},
    Fault.TRICKLE: {"rate"},
    Fault.CORRUPT_PACKET: {"round"},
    Fault.POISON: {"round", "factor", "mode"},
    Fault.STALE_SUBMIT: {"round"},
    Fault.SLOW_COMPUTE: {"round", "min_s"},
    Fault.WITHHOLD: {"round"},
    Fault.LIE: {"from_round"},
    Fault.COPY: {"round", "wait_s"},
    Fault.UNDIALABLE: set(),
}


def parse_fault(text: str) -> FaultSpec:
    """`crash@round=3,phase=training` -> FaultSpec; FaultSpecError naming the bad part otherwise."""
    name, _, args = text.strip().partition("@")
    try:
        fault = Fault(name)
    except ValueError:
        raise FaultSpecError(
            f"unknown fault {name!r} in {text!r} (known: {', '.join(f.value for f in Fault)})"
        ) from None
    values: dict = {}
    for part in filter(None, args.split(",")):
        key, eq, raw = part.partition("=")
        if not eq or key not in _KEYS[fault]:
            raise FaultSpecError(f"{text!r}: {fault.value} takes {', '.join(sorted(_KEYS[fault]))}; got {part!r}")
        try:
            if key in ("round", "from_round"):
                values[key] = int(raw)
                if values[key] < 0:
                    raise ValueError
            elif key == "phase":
                values[key] = Phase(raw)
            elif key == "mode":
                if raw not in POISON_MODES:
                    raise ValueError
                values[key] = raw
            else:
                values[key] = float(raw)
                if not 0 <= values[key] < float("inf") or (key == "rate" and not values[key]):
                    raise ValueError
        except ValueError:
            raise FaultSpecError(f"{text!r}: bad value for {key}: {raw!r}") from None
    return FaultSpec(fault=fault, **values)


class FaultInjector:
    """The faults armed in one node, and the hooks the round loop calls (no-ops when none fire)."""

    def __init__(self, specs: Iterable[FaultSpec] = ()):
        self.specs = tuple(specs)
        self._key = None  # copy: this peer's key, from its outer step's first make_payload

    @classmethod
    def parse(cls, texts: Iterable[str]) -> "FaultInjector":
        return cls(parse_fault(t) for t in texts)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def describe(self) -> str:
        return ", ".join(map(str, self.specs)) or "none"

    def _firing(self, fault: Fault, round: int) -> list[FaultSpec]:
        return [s for s in self.specs if s.fault is fault and s.fires(round)]

    # -- hooks, in the order a round calls them ------------------------------------------------

    async def at_phase(self, phase: Phase, round: int, *, exchange=None, peer_id: str | None = None) -> None:
        """crash: SIGKILL this process at `phase` of `round`."""
        for spec in self._firing(Fault.CRASH, round):
            if spec.phase is not phase:
                continue
            if phase is Phase.TRANSFER and exchange is not None and peer_id is not None:
                await self._wait_for_copy(exchange, round, peer_id, spec.wait_s)
            _crash(f"in round {round}, phase {phase.value}")

    @staticmethod
    async def _wait_for_copy(exchange, round: int, peer_id: str, wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while loop.time() < deadline:
            if await exchange.holders(round, peer_id):
                return
            await asyncio.sleep(0.2)

    def checkpoint_hook(self, round: int):
        """crash at the checkpoint phase: a callable the checkpoint writer calls midway (None if unarmed)."""
        if not any(spec.phase is Phase.CHECKPOINT for spec in self._firing(Fault.CRASH, round)):
            return None

        return lambda: _crash(f"in round {round} while writing the checkpoint")

    async def pad_compute(self, round: int, compute_s: float) -> float:
        """slow-compute: idle until the inner steps took min_s; return the round's compute time."""
        floors = [s.min_s for s in self._firing(Fault.SLOW_COMPUTE, round)]
        if not floors or compute_s >= max(floors):
            return compute_s
        await asyncio.sleep(max(floors) - compute_s)
        return max(floors)

    @staticmethod
    def _tamper_update(spec: FaultSpec, round: int, outer) -> None:
        """poison: rewrite the local parameters so that `outer.deltas()` yields the poisoned update."""
        import torch

        if spec.mode == "overflow":  # the update stays; the packet is rewritten (`_overflow_packet`)
            return
        log.warning("fault injection: poisoning the update of round %d (%s x%g)", round, spec.mode, spec.factor)
        generator = torch.Generator().manual_seed(round)
        with torch.no_grad():
            for name, p in outer.params.items():
                start = outer.local_start[name].to(p.device)  # pinned host memory under CUDA placement
                delta = start - p  # what outer.deltas() yields
                if spec.mode in ("scale", "sign-flip"):
                    poisoned = delta * (spec.factor if spec.mode == "scale" else -spec.factor)
                else:
                    spread = delta.float().std() if delta.numel() > 1 else delta.abs().max()
                    poisoned = torch.randn(delta.shape, generator=generator).to(delta) * spread * spec.factor
                p.copy_(start - poisoned)

    @staticmethod
    def _overflow_packet(data: bytes, key) -> bytes:
        """poison@mode=overflow: `data` with every tensor's table replaced by OVERFLOW_TABLE, signed
        again with the peer's own key (a member lying, not a corrupted transfer). A DiLoCo payload
        (dense safetensors, unsigned) becomes deltas of 3e38 everywhere."""
        import msgpack
        import torch
        from safetensors.torch import load, save

        from protocol.packet import MAGIC, PREFIX, TABLE, WIRE_VERSION, read_header
        from protocol.signing import SIGNATURE_BYTES

        if not data.startswith(MAGIC):
            return save({name: torch.full_like(t, OVERFLOW_TABLE[-1]) for name, t in load(data).items()})
        header, offset = read_header(data)
        for section in header["tensors"]:
            section[4] = TABLE.pack(*OVERFLOW_TABLE)
        raw = msgpack.packb(header)
        body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + data[offset:-SIGNATURE_BYTES]
        return body + key.sign(body)

    # -- wrappers around the node's collaborators -----------------------------------------------

    def wrap_training(self, training):
        """poison: the peer's training, whose rounds end with the update replaced, and whose outer
        step signs rewritten packets (mode=overflow)."""
        if not any(s.fault in (Fault.POISON, Fault.COPY) for s in self.specs):
            return training
        injector = self

        class OverflowingOuter(_Proxy):
            def make_payload(self, *, round: int, key, **kwargs) -> bytes:
                injector._key = key  # copy: the exchange re-signs another peer's packet with it
                data = self._inner.make_payload(round=round, key=key, **kwargs)
                if any(s.mode == "overflow" for s in injector._firing(Fault.POISON, round)):
                    log.warning("fault injection: signing a packet of overflowing values in round %d", round)
                    data = injector._overflow_packet(data, key)
                return data

        class PoisonedTraining(_Proxy):
            def __init__(self, inner):
                super().__init__(inner)
                self.outer = OverflowingOuter(inner.outer)

            def train_round(self, round: int, on_step=None, on_step_queued=None):
                result = self._inner.train_round(round, on_step, on_step_queued)
                for spec in injector._firing(Fault.POISON, round):
                    injector._tamper_update(spec, round, self._inner.outer)
                return result

        return PoisonedTraining(training)

    def wrap_exchange(self, exchange):
        """corrupt-packet: an exchange that flips one bit in the middle of the signed packet before
        publishing it (the announced digest is the corrupted bytes'). withhold: one that answers
        `publish` with the announcement it would make, but serves and announces nothing: the
        packet stays with this node's own outer step only."""
        if not any(s.fault in (Fault.CORRUPT_PACKET, Fault.WITHHOLD, Fault.COPY) for s in self.specs):
            return exchange
        injector = self

        class FaultyExchange(_Proxy):
            def __init__(self, inner):
                super().__init__(inner)
                self._withheld: dict[tuple[int, str], tuple[str, bytes]] = {}

            async def fetch(self, round: int, wanted: dict[str, str], *args, **kwargs) -> dict[str, bytes]:
                own = {}  # its own withheld packet: for its own outer step only
                for publisher, digest in wanted.items():
                    kept = self._withheld.get((round, publisher))
                    if kept is not None and kept[0] == digest:
                        own[publisher] = kept[1]
                rest = {p: d for p, d in wanted.items() if p not in own}
                return own | (await self._inner.fetch(round, rest, *args, **kwargs) if rest else {})

            async def announce(self, round: int, peer_id: str) -> None:
                if (round, peer_id) not in self._withheld:  # a withheld packet is announced by nobody
                    await self._inner.announce(round, peer_id)

            async def publish(self, round: int, peer_id: str, data: bytes, announce: bool = True):
                for spec in injector._firing(Fault.COPY, round):
                    data = await injector._copy_of_another(self._inner, round, peer_id, data, spec.wait_s)
                if injector._firing(Fault.CORRUPT_PACKET, round):
                    corrupted = bytearray(data)
                    corrupted[len(corrupted) // 2] ^= 0x01
                    log.warning("fault injection: corrupting the packet of round %d after signing", round)
                    data = bytes(corrupted)
                if injector._firing(Fault.WITHHOLD, round):
                    from protocol.dht_records import Announcement

                    log.warning("fault injection: withholding the packet of round %d (submitted, never served)", round)
                    digest = hashlib.sha256(data).hexdigest()
                    self._withheld[round, peer_id] = (digest, data)
                    return Announcement(
                        peer_id=peer_id,
                        round=round,
                        digest=digest,
                        size_bytes=len(data),
                        multiaddrs=list(self._inner.visible_maddrs),
                        holder=getattr(self._inner, "holder_id", ""),
                    )
                return await self._inner.publish(round, peer_id, data, announce)

        return FaultyExchange(exchange)

    async def _copy_of_another(self, exchange, round: int, peer_id: str, data: bytes, wait_s: float) -> bytes:
        """copy: the first packet of round r another peer announces within wait_s, its header's peer
        rewritten to this one and signed with this peer's key (a Sybil that sends others' work as its
        own); this node's own packet when nobody announced one."""
        import msgpack

        from protocol.packet import MAGIC, PREFIX, WIRE_VERSION, read_header
        from protocol.signing import SIGNATURE_BYTES

        deadline = asyncio.get_running_loop().time() + wait_s
        while asyncio.get_running_loop().time() < deadline:
            others = {p: a for p, a in (await exchange.announcements(round)).items() if p != peer_id}
            for other, announcement in sorted(others.items()):
                fetched = await exchange.fetch(
                    round, {other: announcement.digest}, {other: list(announcement.multiaddrs)}, timeout_s=10
                )
                if other in fetched:
                    header, offset = read_header(fetched[other])
                    header["peer"] = peer_id
                    raw = msgpack.packb(header)
                    body = PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw + fetched[other][offset:-SIGNATURE_BYTES]
                    log.warning("fault injection: round %d: sending %s's packet as this peer's own", round, other)
                    return body + self._key.sign(body)
            await asyncio.sleep(0.2)
        log.warning("fault injection: round %d: no other packet to copy within %g s", round, wait_s)
        return data

    def wrap_client(self, client):
        """stale-submit: a coordinator client that holds a submission until its round has closed.
        lie: one whose applied reports name a made-up digest and tree (`made_up_report`) and whose
        answers say what they would say of the real digest (`_real_answer`)."""
        if not any(s.fault in (Fault.STALE_SUBMIT, Fault.LIE) for s in self.specs):
            return client
        injector = self

        class FaultyClient(_Proxy):
            async def submit(self, round: int, **fields):
                if injector._firing(Fault.STALE_SUBMIT, round):
                    log.warning("fault injection: holding the submission of round %d until the round closes", round)
                    while (await self._inner.round(round, wait_s=30)).state != "closed":
                        pass
                return await self._inner.submit(round, **fields)

            async def applied(
                self,
                round: int,
                params_digest: str,
                refused=None,
                manifest_version: int = 1,
                *,
                tree: Tree | None = None,
                **fields,
            ):
                if not injector._firing(Fault.LIE, round):
                    return await self._inner.applied(
                        round, params_digest, refused=refused, manifest_version=manifest_version, tree=tree, **fields
                    )
                lie, lie_tree = made_up_report(
                    round, manifest_version, tree if tree is not None and tree.hex == params_digest else None
                )
                log.warning(
                    "fault injection: reporting the made-up digest %s for round %d version %d (mine: %s)",
                    lie[:12],
                    round,
                    manifest_version,
                    params_digest[:12],
                )
                response = await self._inner.applied(
                    round, lie, refused=refused, manifest_version=manifest_version, tree=lie_tree, **fields
                )
                return _real_answer(response, params_digest, manifest_version)

        return FaultyClient(client)

    def exchange_class(self, base: type) -> type:
        """slow-upload: a subclass of the exchange whose stream handler stalls before answering.
        undialable: one whose handler closes every packet stream at once, as if nobody could dial
        this node (it still dials out, fetches and pushes; run it with --behind-nat)."""
        if any(s.fault is Fault.UNDIALABLE for s in self.specs):

            class UndialableExchange(base):
                async def _serve(self, stream_info, reader, writer):
                    writer.close()

            base = UndialableExchange
        if trickle := [s for s in self.specs if s.fault is Fault.TRICKLE]:
            from node.exchange.pace import Pacer

            rate = trickle[0].rate

            class TrickleExchange(base):
                async def _serve(self, stream_info, reader, writer):
                    server = self._server
                    if not hasattr(server, "trickle_pacers"):  # its writes go at `rate`, one pacer a stream
                        server.trickle_pacers = weakref.WeakKeyDictionary()
                        write = server._write

                        async def trickled(payload, stream, traffic, pacer=None):
                            pacer = server.trickle_pacers.setdefault(stream, Pacer(rate))
                            await write(payload, stream, traffic, pacer)

                        server._write = trickled
                    await super()._serve(stream_info, reader, writer)

            base = TrickleExchange
        slow = [s for s in self.specs if s.fault is Fault.SLOW_UPLOAD]
        if not slow:
            return base
        spec = slow[0]

        class SlowUploadExchange(base):
            async def _serve(self, stream_info, reader, writer):
                try:
                    await asyncio.sleep(spec.delay_s)
                except asyncio.CancelledError:  # shutting down: drop the stream as _serve would
                    writer.close()
                    return
                await super()._serve(stream_info, reader, writer)

        return SlowUploadExchange


def made_up_tree(real: Tree, round: int, manifest_version: int) -> Tree:
    """A tree with `real`'s header and body length whose leaves depend on nothing but the round, the
    manifest version and the chunk index: every liar holding the same model layout makes the same
    one, and a liar that restarts makes it again."""
    leaves = tuple(
        blake3(LIE_TAG + _LIE_LEAF.pack(round, manifest_version, i)).digest() for i in range(len(real.leaves))
    )
    return Tree(real.header, real.body_bytes, leaves)


def made_up_report(round: int, manifest_version: int, real: Tree | None) -> tuple[str, Tree | None]:
    """The digest and tree a liar reports for `manifest_version` of round `round`: `made_up_tree`
    and its root; without the real tree (a digest this node holds no tree of), a bare made-up digest
    of the round and version alone, reported with no tree."""
    if real is None:
        return blake3(LIE_TAG + _LIE_BARE.pack(round, manifest_version)).hexdigest(), None
    tree = made_up_tree(real, round, manifest_version)
    return tree.hex, tree


def _real_answer(response, real_digest: str, manifest_version: int):
    """The coordinator's answer to a lie with `agrees` said of the digest the liar holds, as the
    coordinator says it of a report: of the latest manifest version, and the majority digest. The
    rest stays as answered: the round's majority and agreed digests (which the node compares with
    its real digest, as an honest node does), its manifest version and amendments (which do not
    depend on the digest reported)."""
    agrees = response.manifest_version == manifest_version and response.majority_digest == real_digest
    return response.model_copy(update={"agrees": agrees})


class _Proxy:
    """Stands in for a collaborator: every attribute not overridden is the wrapped object's."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _crash(where: str) -> None:
    """SIGKILL this process, its log flushed first (the line says where it died)."""
    log.warning("fault injection: crash (SIGKILL) %s", where)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
