"""The volunteer node's round loop: join, train H steps, publish, aggregate, step, repeat.

    node = Node(NodeConfig(coordinator="http://host:8000"))
    asyncio.run(node.run())

One round r, as DESIGN.md describes it: snapshot theta_r, run H inner AdamW steps (in a worker
thread, so the exchange keeps serving and heartbeats keep flowing), fold the delta into the error
buffers and encode a signed packet, publish it (DHT announcement + libp2p stream), submit its
digest to the coordinator, wait for the round's manifest, fetch every listed packet (from the
publisher or any verified holder; each as soon as its publisher submitted it, from the start of
this node's own training), decode, aggregate, take the outer step, report the new parameter
digest. Every peer applies the same manifest to the same start, so every digest agrees.

Decisions at the boundaries, each logged:
- a submission refused as late or stale: the round goes on without this packet; the node still
  applies the manifest (its own update stays in its error buffer for the next round);
- a manifest packet that cannot be fetched in time: the node cannot reproduce the round, so it
  catches up instead: it fetches the parameters that start round r+1 from peers, checks them
  against the coordinator's majority digest, and resets its error feedback;
- a packet that fails to verify or decode is left out (deterministically, by every honest peer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from node.testing.faults import FaultInjector, Phase

log = logging.getLogger("locoswarm.node")

MAX_REFUSED = 64  # refused packets reported per round (AppliedRequest's bound)
MAX_REASON_CHARS = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    coordinator: str  # base URL of the coordinator, http://host:port
    run_id: str | None = None  # None: the coordinator's only running (or waiting) run
    join_token: str | None = None  # for runs with join_policy "token"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    data: str | None = None  # corpus path; None: the run's, else the stdlib sources
    key_path: Path = Path.home() / ".locoswarm" / "peer.key"  # Ed25519 identity, created if absent
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where the libp2p daemon listens
    announce_maddrs: tuple[str, ...] = ()  # addresses to advertise (port forwarding)
    initial_peers: tuple[str, ...] = ()  # DHT bootstrap; default: the run's dht_bootstrap
    client_mode: bool = False  # join the DHT without serving it (behind NAT)
    use_auto_relay: bool = False  # behind NAT: be reachable through a relay
    threads: int = 0  # torch CPU threads; 0 = torch's default
    uplink_mbps: float | None = None  # this link's upload rate, stated at join: faster uplinks forward more
    max_rounds: int | None = None  # leave after this many rounds (demos, tests)
    fetch_timeout_s: float = 60.0  # per round, for the manifest's packets
    checkpoint_dir: Path | None = None  # save parameters and state here after every round
    progress: bool = True  # a progress bar for the inner steps on stderr
    inject: tuple[str, ...] = ()  # faults to inject, for tests and demos (node/testing/faults.py): "crash@round=3"


@dataclass(slots=True)
class RoundTimes:
    compute_s: float = 0.0
    encode_s: float = 0.0
    wait_s: float = 0.0
    transfer_s: float = 0.0
    aggregate_s: float = 0.0
    hidden_wait_s: float = 0.0  # with overlap: waiting for the previous round's manifest, behind compute
    hidden_transfer_s: float = 0.0  # with overlap: fetching the previous round's packets, behind compute
    hidden_aggregate_s: float = 0.0  # with overlap: verifying and aggregating them, behind compute
    hidden_encode_s: float = 0.0  # with overlap: encoding and sending this round's packet, behind compute


@dataclass(slots=True)
class RoundReport:
    round: int
    train_loss: float
    digest: str
    num_packets: int
    refused: dict[str, str] = field(default_factory=dict)
    times: RoundTimes = field(default_factory=RoundTimes)
    submitted: bool = True
    caught_up: bool = False
    packet_bytes: int = 0
    downloaded_bytes: int = 0  # stream bytes this node fetched for the round it applied
    fetching_s: float = 0.0  # wall time with one of that round's fetches in progress (early ones included)
    uploaded_bytes: int = 0  # stream bytes it served to others for its own round
    started_at: float = 0.0  # unix time the round's inner steps began
    ended_at: float = 0.0  # unix time its outer step (or, with overlap, the previous round's) was applied
    applied_round: int = -1  # the round whose aggregate this report's digest follows (r, or r-1 with overlap)


@dataclass(slots=True)
class _Watch:
    """A round's submissions being watched, and the fetches started for them by (peer, digest)."""

    task: asyncio.Task
    early: dict[tuple[str, str], asyncio.Task]

    @classmethod
    def start(cls, watch: Callable[[dict], Awaitable]) -> "_Watch":
        early: dict[tuple[str, str], asyncio.Task] = {}
        return cls(asyncio.create_task(watch(early)), early)

    def cancel(self) -> None:
        self.task.cancel()
        for fetch in self.early.values():
            fetch.cancel()


class CatchUpNeeded(Exception):
    """This node cannot reproduce a round exactly and must load the swarm's parameters."""


def torch_no_grad():
    import torch

    return torch.no_grad()


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    return device


class Node:
    """One volunteer: owns the model, the optimizers, the exchange and the coordinator client."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.faults = FaultInjector.parse(config.inject)  # no-ops unless --inject armed a fault
        self.reports: list[RoundReport] = []
        self._stopping = asyncio.Event()
        self._in_flight: asyncio.Task | None = None  # with overlap: the previous round's manifest and packets
        self._in_flight_times = RoundTimes()
        self._background: set[asyncio.Task] = set()  # snapshot publications
        self._encode_lock = asyncio.Lock()  # with overlap, round r+1's encoding waits for round r's
        self._decoding: dict[int, dict[tuple[str, str], asyncio.Task]] = {}  # round -> (peer, digest) -> decode
        self._decode_slot = asyncio.Semaphore(1)
        self._buffers_lock = threading.Lock()  # the error buffers: held by an encode and by a reset
        self._state, self._round, self._last_loss = "joining", 0, None
        self._bandwidth_mbps: float | None = None  # measured on the last round's packet downloads

    def stop(self) -> None:
        """Ask the loop to leave after the current step (signal handlers call this)."""
        self._stopping.set()

    async def run(self) -> list[RoundReport]:
        import torch

        from node.round.coordinator_client import CoordinatorClient
        from node.exchange.p2p import ExchangeConfig, P2PExchange
        from protocol.signing import PeerKey

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        key = PeerKey.load_or_create(cfg.key_path)
        client = CoordinatorClient(cfg.coordinator, key)
        exchange = None
        try:
            run_id = cfg.run_id or await self._pick_run(client)
            run_info = await client.run_info(run_id)
            bootstrap = cfg.initial_peers or tuple(run_info["config"].get("dht_bootstrap", []))
            if not bootstrap:  # no fixed bootstrap: enter the swarm through the live members
                status = await client.status(run_id)
                bootstrap = tuple(m for peer in status["peers"] if peer["status"] == "live"
                                  for m in peer["listen_multiaddrs"])[:16]
            if self.faults:
                log.warning("fault injection armed: %s", self.faults.describe())
            exchange = await self.faults.exchange_class(P2PExchange).create(ExchangeConfig(
                run_id=run_id, host_maddrs=cfg.host_maddrs, announce_maddrs=cfg.announce_maddrs,
                initial_peers=bootstrap, client_mode=cfg.client_mode, use_auto_relay=cfg.use_auto_relay,
                max_packet_bytes=run_info["config"]["max_packet_bytes"],
            ))
            reach = await exchange.reachability_check()
            log.info("reachability: %s", reach.advice if hasattr(reach, "advice") else reach)
            # Kept for rejoining: a node the coordinator dropped (paused, partitioned) joins again.
            self._join = lambda: client.join(run_id, join_token=cfg.join_token, device=_device_name(cfg.device),
                                             multiaddrs=exchange.visible_maddrs, uplink_mbps=cfg.uplink_mbps)
            joined = await self._join()
            self.peer_id = joined.peer_id
            log.info("joined run %s as %s (index %d, shard %d/%d) at round %d", run_id, joined.peer_id,
                     joined.peer_index, joined.data_shard, joined.num_shards, joined.current_round)
            self._setup_training(joined)
            heartbeat = asyncio.create_task(self._heartbeats(client, joined.heartbeat_interval_s))
            try:
                await self._loop(client, exchange, joined, key)
                if self.overlap and not self._stopping.is_set():
                    await self.drain_in_flight(client, exchange)
                if self.reports and not self._stopping.is_set():
                    await self._linger(client, self.reports[-1].round)
            finally:
                heartbeat.cancel()
            try:
                await client.leave("finished" if not self._stopping.is_set() else "stopped by the volunteer")
            except Exception as e:  # leaving is a courtesy; the coordinator times us out anyway
                log.warning("leave failed: %s", e)
        finally:
            if exchange is not None:
                await exchange.shutdown()
            await client.close()
        return self.reports

    async def _linger(self, client, round: int) -> None:
        """Keep serving until every live peer applied our last round (at most fetch_timeout_s).

        Leaving at once would take this node's packet with it while slower peers still fetch it;
        when it is the only holder, nobody could apply the round.
        """
        from node.round.coordinator_client import CoordinatorError

        self._state = "serving"
        deadline = time.monotonic() + self.config.fetch_timeout_s
        while time.monotonic() < deadline:
            try:
                status = await client.status(retry_for_s=5.0)
            except CoordinatorError:
                return
            num_live = sum(p["status"] == "live" for p in status["peers"])
            num_applied = next((h["num_applied"] for h in status["history"] if h["round"] == round), 0)
            if num_applied >= num_live:
                return
            await asyncio.sleep(0.5)
        log.info("leaving with round %d applied by fewer than all live peers", round)

    async def _pick_run(self, client) -> str:
        runs = [r for r in (await client.runs()).runs if r.state in ("waiting", "running")]
        if len(runs) != 1:
            names = ", ".join(f"{r.run_id} ({r.name})" for r in runs) or "none"
            raise SystemExit(f"the coordinator has {len(runs)} open runs ({names}); pass --run")
        return runs[0].run_id

    def _setup_training(self, joined) -> None:
        import torch

        from node.training.data import load_corpus
        from node.training.inner import InnerConfig, make_inner_optimizer
        from node.training.model import build_model
        from node.training.outer import OuterConfig, make_outer
        from node.training.params import flat_named_params

        run = joined.config
        if run.strategy == "ddp":
            raise SystemExit("the ddp baseline syncs every step and runs in the simulator only")
        self.run_config = run
        self.overlap = run.overlap
        self.device = torch.device(self.config.device)
        self.model = build_model(run.preset, run.seed).to(self.device)
        self.inner = InnerConfig(lr=run.inner_lr, betas=tuple(run.inner_betas), weight_decay=run.inner_weight_decay,
                                 grad_clip=run.grad_clip, warmup_steps=run.warmup_steps, total_steps=run.total_steps,
                                 min_lr_ratio=run.min_lr_ratio, batch_size=run.batch_size, seq_len=run.seq_len)
        self.optimizer = make_inner_optimizer(self.model, self.inner)
        self.outer = make_outer(flat_named_params(self.model), OuterConfig(
            strategy=run.strategy, outer_lr=run.outer_lr, outer_momentum=run.outer_momentum, nesterov=run.nesterov,
            top_k=run.top_k, chunk_size=run.chunk_size, error_decay=run.error_decay, overlap=run.overlap,
            clip_to_median_norm=run.clip_to_median_norm, max_packet_bytes=run.max_packet_bytes))
        self.corpus = load_corpus(self.config.data or run.data)
        self.shard = self.corpus.train.shard(joined.data_shard % joined.num_shards, joined.num_shards)

    async def _heartbeats(self, client, interval_s: float) -> None:
        from node.round.coordinator_client import CoordinatorError

        while True:
            await asyncio.sleep(max(0.5, interval_s))
            try:
                await self._signed(client.heartbeat, self._round, self._state, train_loss=self._last_loss,
                                   bandwidth_mbps=self._bandwidth_mbps)
            except CoordinatorError as e:
                log.warning("heartbeat failed: %s", e)

    async def _signed(self, call, *args, **kwargs):
        """A signed coordinator call; if the coordinator dropped this node meanwhile, rejoin and retry once.

        A node paused (SIGSTOP, a suspended laptop) or cut off past heartbeat_timeout_s is marked
        gone; it keeps its id and shard when it rejoins, and the round loop catches up as usual.
        """
        from node.round.coordinator_client import Refused

        try:
            return await call(*args, **kwargs)
        except Refused as e:
            if e.code != "peer_gone":
                raise
            log.warning("the coordinator dropped this node (%s); rejoining", e.detail)
            await self._join()
            return await call(*args, **kwargs)

    async def _wait_open(self, client, round: int):
        """The round's view once it is open (or closed); None if the node is stopping."""
        delay_s, previous_closed = 0.1, round == 0
        while not self._stopping.is_set():
            view = await client.round(round)
            if view.state != "pending":
                return view
            if not previous_closed:  # round r opens when r-1 closes: long-poll for that moment
                previous_closed = (await client.round(round - 1, wait_s=30)).state == "closed"
                continue
            await asyncio.sleep(delay_s)  # r-1 closed and r not open yet (a run's start): poll
            delay_s = min(delay_s * 1.5, 2.0)
        return None

    async def _loop(self, client, exchange, joined, key) -> None:
        from node.round.coordinator_client import Refused

        # The parameters this node holds are the start of `self.params_round` (None: unknown).
        self.params_round = 0 if joined.params.digest is None else None
        round, rounds_done = joined.current_round, 0
        while not self._stopping.is_set():
            if self.config.max_rounds is not None and rounds_done >= self.config.max_rounds:
                break
            if self.run_config.max_rounds is not None and round >= self.run_config.max_rounds:
                log.info("the run is complete after %d rounds", self.run_config.max_rounds)
                break
            self._round, self._state = round, "waiting"
            # With overlap and the previous round in flight, this round's inner steps need nothing from
            # the swarm: train at once; the packet waits for the round to open (_one_round).
            early = self.overlap and self._in_flight is not None and self.params_round == round
            try:
                view = await (client.round(round) if early else self._wait_open(client, round))
            except Refused as e:
                if e.code in ("round_not_found", "run_closed"):
                    log.info("the run is over (%s)", e.detail)
                    break
                raise
            if view is None:
                break
            if view.state == "closed" or self.params_round != round:
                # Behind: the round closed without us, or our parameters are not its start.
                round = await self._catch_up(client, exchange)
                continue
            try:
                report = await self._one_round(client, exchange, round, key, opened=view.state != "pending")
            except CatchUpNeeded as e:
                log.warning("round %d: %s; catching up from peers", round, e)
                self.params_round = None
                continue
            self.reports.append(report)
            t = report.times
            log.info("round %d: loss %.4f, %d packets%s, digest %s | compute %.2fs encode %.2fs wait %.2fs "
                     "transfer %.2fs aggregate %.2fs", round, report.train_loss, report.num_packets,
                     f" ({len(report.refused)} refused)" if report.refused else "", report.digest[:12],
                     t.compute_s, t.encode_s, t.wait_s, t.transfer_s, t.aggregate_s)
            await exchange.forget_before(round - 2)
            round += 1
            rounds_done += 1

    async def _catch_up(self, client, exchange) -> int:
        round = await self._catch_up_to_open_round(client, exchange)
        # Whatever local progress ran ahead of the global model (overlap) is dropped with the rounds skipped.
        self.outer.finish()
        self.outer.reset_to_params()
        return round

    async def _catch_up_to_open_round(self, client, exchange) -> int:
        """Bring the parameters to the start of the coordinator's open round; return that round.

        Closed rounds whose packets are still served are replayed (fetch the manifest, apply it:
        exact, and cheap); otherwise the newest parameter snapshot whose digest the coordinator
        recorded as the majority is fetched from peers and checked. Error feedback restarts at
        zero after a snapshot (the update it held is lost, not sent twice).
        """
        self._state = "catching_up"
        if self._in_flight is not None:  # whatever was in flight belongs to rounds we are skipping
            self._in_flight.cancel()
            self._in_flight = None
        while not self._stopping.is_set():
            status = await client.status()
            current = status["current_round"]["round"] if status.get("current_round") else status["run"]["current_round"]
            majority = {h["round"] + 1: h["majority_digest"] for h in status["history"] if h["majority_digest"]}
            if self.params_round is not None and self.params_round < current:
                try:
                    for r in range(self.params_round, current):
                        await self._replay(client, exchange, r)
                    return current
                except CatchUpNeeded as e:
                    log.info("replay stopped: %s; loading a snapshot", e)
            if self.params_round == current:
                return current
            for start_round in sorted((r for r in majority if r <= current), reverse=True)[:3]:
                if await self._load_snapshot(exchange, start_round, majority[start_round]):
                    break
            else:
                if current == 0 or not majority:
                    self.params_round = 0  # nothing applied yet: the seeded initialisation is the start
                    return current
                await asyncio.sleep(1.0)  # snapshots not announced yet: peers are still applying
        return self.params_round or 0

    async def _replay(self, client, exchange, round: int) -> None:
        """Apply a closed round's manifest without having trained in it."""
        view = await client.round(round)
        if view.state != "closed":
            raise CatchUpNeeded(f"round {round} is not closed")
        await self._apply_manifest(client, exchange, round, view, RoundTimes())
        log.info("round %d: replayed the manifest (%d packets)", round, len(view.manifest))

    async def _load_snapshot(self, exchange, round: int, params_digest: str) -> bool:
        """Fetch peers' snapshot of the parameters that start `round`; keep it if its digest matches."""
        from collections import Counter

        from safetensors.torch import load

        from node.training.params import flat_named_params, param_digest

        holders = await exchange.params_holders(round)
        for blob_digest, _ in Counter(h.digest for h in holders).most_common():
            data = await exchange.fetch_params(round, blob_digest, timeout_s=self.config.fetch_timeout_s)
            if data is None:
                continue
            try:
                tensors = load(data)
            except Exception as e:  # hostile bytes: safetensors raises its own types
                log.warning("round %d: snapshot %s does not load: %s", round, blob_digest[:12], e)
                continue
            params = flat_named_params(self.model)
            if any(name not in tensors or tensors[name].shape != p.shape for name, p in params.items()):
                log.warning("round %d: snapshot %s does not fit the model", round, blob_digest[:12])
                continue
            if param_digest({n: tensors[n] for n in params}) != params_digest:
                log.warning("round %d: snapshot %s is not the coordinator's parameters", round, blob_digest[:12])
                continue
            with torch_no_grad():
                for name, p in params.items():
                    p.copy_(tensors[name])
            await asyncio.to_thread(self._load_outer_state, tensors)
            self.params_round = round
            log.info("round %d: loaded parameters %s from peers (%d bytes)", round, params_digest[:12], len(data))
            return True
        return False

    def _load_outer_state(self, tensors) -> None:
        with self._buffers_lock:  # an encode cancelled by the catch-up may still be running
            self.outer.load_snapshot_state(tensors)

    def _save_checkpoint(self, run_id: str, round: int) -> None:
        """Parameters and state after applying `round`; a failure is logged and training goes on."""
        from node.training.checkpoint import CheckpointError, save_checkpoint

        try:
            save_checkpoint(self.config.checkpoint_dir, round + 1, self.model, self.optimizer,
                            getattr(self.outer, "error_buffers", None),
                            {"run_id": run_id, "applied_round": round, "peer_id": self.peer_id},
                            outer_momentum=getattr(self.outer, "momentum", None))
        except CheckpointError as e:  # disk full, unwritable: the swarm does not need our copy to go on
            log.error("round %d: checkpoint not saved, training goes on: %s", round, e)

    def _snapshot_bytes(self) -> bytes:
        from safetensors.torch import save

        from node.training.params import flat_named_params

        # The global model (equal to the parameters, except with overlap, where they run ahead).
        tensors = {n: self.outer.start[n].detach().cpu().contiguous() for n in flat_named_params(self.model)}
        tensors |= self.outer.snapshot_state()
        return save(tensors)

    async def _one_round(self, client, exchange, round: int, key, opened: bool = True) -> RoundReport:
        """Train round r, send its packet, and apply a round: r itself, or with overlap r-1 (round r's
        packet is then encoded, sent and its round collected while round r+1 trains)."""
        from node.training.params import param_digest

        base_digest = param_digest(self.outer.start)
        report = RoundReport(round, 0.0, "", 0, started_at=time.time())
        self.outer.begin_round()
        # Others' packets are fetched as they are submitted, from the start of our own training:
        # the last peer to finish then has only its own packet left to spread.
        watch = _Watch.start(lambda early: self._watch_submissions(client, exchange, round, early))
        try:
            report.train_loss = await self._train(round, report.times)
            self.faults.tamper_update(round, self.outer)
            if not self.overlap:
                await self._send(client, exchange, round, key, base_digest, report, opened)
                view, payloads = await self._collect(exchange, round, report.times, watch)
                return await self._apply_and_report(client, exchange, report, round, view, payloads)
        except BaseException:
            watch.cancel()
            raise

        deltas = {name: delta.float().clone() for name, delta in self.outer.deltas()}  # before r-1 lands
        pending, pending_times = self._in_flight, self._in_flight_times
        self._in_flight_times = RoundTimes()
        self._in_flight = asyncio.create_task(self._send_and_collect(
            client, exchange, round, key, base_digest, report, opened, deltas, self._in_flight_times, watch))
        if pending is None:
            self.params_round = round + 1
            report.ended_at = time.time()
            return report
        view, payloads, prepared = await pending
        times = report.times
        times.hidden_wait_s, times.hidden_transfer_s = pending_times.wait_s, pending_times.transfer_s
        times.hidden_aggregate_s = pending_times.aggregate_s
        report = await self._apply_and_report(client, exchange, report, round - 1, view, payloads, prepared)
        self.params_round = round + 1  # the start of round r+1, with round r still to land on it
        return report

    async def _train(self, round: int, times: RoundTimes) -> float:
        """The round's H inner steps, in a worker thread; returns the mean loss."""
        from node.training.inner import run_inner_steps

        self._state = "training"
        H = self.run_config.inner_steps
        batches = self.shard.batches(self.inner.batch_size, self.inner.seq_len, self.run_config.seed, self.device,
                                     start_step=round * H)
        bar = self._progress_bar(round, H)
        await self.faults.at_phase(Phase.TRAINING, round)
        result = await asyncio.to_thread(
            run_inner_steps, self.model, self.optimizer, batches, round * H, H, self.inner, self.device,
            (lambda step, loss, tps: bar.update(1) or bar.set_postfix_str(f"loss {loss:.3f} {tps:,.0f} tok/s"))
            if bar else None)
        if bar:
            bar.close()
        times.compute_s = await self.faults.pad_compute(round, result.compute_s)
        self._last_loss = result.mean_loss
        return result.mean_loss

    async def _send(self, client, exchange, round: int, key, base_digest: str, report: RoundReport, opened: bool,
                    deltas: dict | None = None) -> None:
        """Encode the round's update (the given deltas, or the parameters' since the round began),
        publish the packet and submit it. With `deltas` it runs beside the next round's training."""
        from node.round.coordinator_client import Refused

        foreground = deltas is None
        if foreground:
            self._state = "encoding"
        start = time.perf_counter()

        def encode() -> bytes:
            with self._buffers_lock:  # a catch-up resetting the buffers waits for a running encode
                return self.outer.make_payload(run_id=client.run_id, round=round, peer_id=self.peer_id,
                                               base_digest=base_digest, key=key, deltas=deltas)

        async with self._encode_lock:  # error feedback folds rounds in order
            payload = await asyncio.to_thread(encode)
        payload = self.faults.tamper_packet(round, payload)
        announcement = await exchange.publish(round, self.peer_id, payload)
        encode_s = time.perf_counter() - start
        if foreground:
            report.times.encode_s = encode_s
            self._state = "submitting"
        else:
            report.times.hidden_encode_s = encode_s
        report.packet_bytes = len(payload)
        if not opened:  # trained ahead of the round's opening (overlap): submit once it opens
            await self._wait_open(client, round)
        await self.faults.before_submit(round, client)
        try:
            await self._signed(client.submit, round, packet_digest=announcement.digest,
                                packet_size_bytes=len(payload), train_loss=report.train_loss,
                                compute_s=report.times.compute_s, encode_s=encode_s,
                                multiaddrs=announcement.multiaddrs)
        except Refused as e:
            if e.code not in ("late", "stale_round", "round_not_open"):
                raise
            report.submitted = False
            log.warning("round %d: submission refused (%s); applying the round without this packet", round, e.code)

    async def _send_and_collect(self, client, exchange, round: int, key, base_digest: str, report: RoundReport,
                                opened: bool, deltas: dict, times: RoundTimes, watch: "_Watch"):
        """With overlap: everything of round r after its training, beside round r+1's."""
        try:
            await self._send(client, exchange, round, key, base_digest, report, opened, deltas)
        except BaseException:
            watch.cancel()
            raise
        return await self._collect_and_prepare(client, exchange, round, times, watch)

    async def _apply_and_report(self, client, exchange, report: RoundReport, applied_round: int, view, payloads,
                                prepared=None) -> RoundReport:
        times = report.times
        applied = await self._apply_manifest(client, exchange, applied_round, view, times, payloads, prepared)
        traffic = exchange.traffic(applied_round)
        report.digest, report.num_packets, report.refused = self._digest, len(applied.accepted), applied.refused
        report.downloaded_bytes, report.fetching_s = traffic.downloaded_bytes, traffic.fetching_s()
        # Over the time any fetch ran: with early fetches, the bytes span more than the transfer timer.
        if traffic.downloaded_bytes and report.fetching_s > 0.01:  # goes to the coordinator with the heartbeats
            self._bandwidth_mbps = min(1e7, traffic.downloaded_bytes * 8 / report.fetching_s / 1e6)
        report.uploaded_bytes = exchange.traffic(report.round).uploaded_bytes
        report.ended_at, report.applied_round = time.time(), applied_round
        return report

    async def _watch_submissions(self, client, exchange, round: int,
                                 early: dict[tuple[str, str], asyncio.Task]):
        """Fetch each of the round's packets as soon as it is submitted, into `early`, until the
        round closes; returns the closed round's view.

        The coordinator's long-poll answers at every new submission, so packets move while the
        slower peers (and this node) still train; only the last ones are left for after the close.
        """
        from node.exchange.topology import tree_parent

        members, uplinks = await self._live_members(client)
        view = await client.round(round, wait_s=30, submitted_gt=0)
        while True:
            # A closed round lists its packets in the manifest only: the last submission is seen
            # there, and its fetch starts here too, beside those still running.
            for e in view.manifest if view.state == "closed" else view.submitted:
                if e.peer_id != self.peer_id and (e.peer_id, e.packet_digest) not in early:
                    # Each packet spreads down its own tree of the members, each copy forwarded
                    # as it arrives; this node asks its parent there first.
                    parent = tree_parent(round, e.peer_id, self.peer_id, members, self.run_config.tree_fanout,
                                         uplinks)
                    parent_maddrs = e.multiaddrs if parent == e.peer_id else members.get(parent, [])
                    early[e.peer_id, e.packet_digest] = asyncio.create_task(self._fetch_early(
                        client, exchange, round, e, {e.peer_id: parent_maddrs} if parent_maddrs else None))
            if view.state == "closed":
                return view
            view = await client.round(round, wait_s=30, submitted_gt=view.num_submitted)

    async def _fetch_early(self, client, exchange, round: int, entry, parents) -> dict[str, bytes]:
        """One submitted packet, fetched; its decoding starts at once, off the round's critical path."""
        got = await exchange.fetch(round, {entry.peer_id: entry.packet_digest}, {entry.peer_id: entry.multiaddrs},
                                   timeout_s=self.config.fetch_timeout_s, parents=parents)
        if (payload := got.get(entry.peer_id)) is not None:
            decoding = self._decoding.setdefault(round, {})
            decoding[entry.peer_id, entry.packet_digest] = asyncio.create_task(self._decode(
                payload, entry.peer_id, bytes.fromhex(entry.public_key), client.run_id, round))
        return got

    async def _decode(self, payload: bytes, peer_id: str, public_key: bytes, run_id: str, round: int):
        """What outer.decode makes of one payload, or the refusal it raised (for outer.prepare)."""
        async with self._decode_slot:  # one at a time: decoding shares the CPU with training
            try:
                return await asyncio.to_thread(self.outer.decode, payload, public_key, peer_id=peer_id,
                                               run_id=run_id, round=round)
            except self.outer.refusable as e:
                return e

    async def _live_members(self, client) -> tuple[dict[str, list[str]], dict[str, float | None]]:
        """The run's live peers (this node included): their addresses and their stated uplink rates,
        by peer id; ({}, {}) if the coordinator does not answer (packets are then fetched without
        a tree)."""
        try:
            status = await client.status(history=0)  # the members only: no round history
        except Exception as e:  # the tree is an optimisation; fetching works without it
            log.debug("reading the run's members failed: %r", e)
            return {}, {}
        live = [p for p in status["peers"] if p["status"] == "live"]
        members = {p["peer_id"]: p["listen_multiaddrs"] for p in live}
        uplinks = {p["peer_id"]: p.get("uplink_mbps") for p in live}
        return members | {self.peer_id: members.get(self.peer_id, [])}, uplinks

    async def _collect(self, exchange, round: int, times: RoundTimes, watch: "_Watch"):
        """Wait for the round's manifest (the watch fetching packets as they come), then fetch
        whatever the manifest lists that is not in hand yet (a subset if some holder failed)."""
        self._state = "waiting"
        start = time.perf_counter()
        try:
            view = await watch.task
            times.wait_s = time.perf_counter() - start
            return view, await self._fetch_manifest(exchange, round, view, times, watch.early)
        finally:
            watch.cancel()  # fetches of packets that did not make the manifest, or a stop

    async def _fetch_manifest(self, exchange, round: int, view, times: RoundTimes,
                              early: dict[tuple[str, str], asyncio.Task] | None = None) -> dict[str, bytes]:
        self._state = "transferring"
        start = time.perf_counter()
        payloads: dict[str, bytes] = {}
        for e in view.manifest:
            if (task := (early or {}).get((e.peer_id, e.packet_digest))) is not None:
                payloads |= await task
        rest = [e for e in view.manifest if e.peer_id not in payloads]
        if rest:
            payloads |= await exchange.fetch(round, {e.peer_id: e.packet_digest for e in rest},
                                             {e.peer_id: e.multiaddrs for e in rest},
                                             timeout_s=self.config.fetch_timeout_s)
        times.transfer_s = time.perf_counter() - start
        return payloads

    async def _collect_and_prepare(self, client, exchange, round: int, times: RoundTimes, watch: "_Watch"):
        """With overlap, all of a round's outer work that needs no parameter, beside the next round's training."""
        view, payloads = await self._collect(exchange, round, times, watch)
        prepared = None
        if {e.peer_id for e in view.manifest} <= set(payloads):
            start = time.perf_counter()
            prepared = await self._prepare(client, view, payloads)
            times.aggregate_s = time.perf_counter() - start
        return view, payloads, prepared

    async def _prepare(self, client, view, payloads: dict[str, bytes]):
        """Verify, decode and aggregate the manifest's packets, in a worker thread; no parameter changes.
        Packets decoded as they arrived are not decoded again."""
        public_keys = {e.peer_id: bytes.fromhex(e.public_key) for e in view.manifest}
        decoding = self._decoding.pop(view.round, {})
        for r in [r for r in self._decoding if r < view.round]:  # rounds left behind (a catch-up)
            del self._decoding[r]
        decoded = {e.peer_id: await task for e in view.manifest
                   if (task := decoding.get((e.peer_id, e.packet_digest))) is not None}
        return await asyncio.to_thread(self.outer.prepare, payloads, public_keys.__getitem__,
                                       run_id=client.run_id, round=view.round, decoded=decoded)

    async def drain_in_flight(self, client, exchange) -> None:
        """With overlap, land the last round's aggregate before leaving."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return
        view, payloads, prepared = await pending
        await self._apply_manifest(client, exchange, view.round, view, RoundTimes(), payloads, prepared)
        self.outer.finish()
        log.info("round %d: applied the last in-flight aggregate, digest %s", view.round, self._digest[:12])

    async def _apply_manifest(self, client, exchange, round: int, view, times: RoundTimes, payloads=None,
                              prepared=None):
        """Verify and aggregate the round's manifest (fetching and aggregating it unless given); take
        the outer step; report the digest of the global model; serve a snapshot of it."""
        from node.training.params import param_digest

        if payloads is None:
            payloads = await self._fetch_manifest(exchange, round, view, times)
        await self.faults.at_phase(Phase.TRANSFER, round, exchange=exchange, peer_id=self.peer_id)
        missing = sorted({e.peer_id for e in view.manifest} - set(payloads))
        if missing:
            # Aggregating a subset would fork this peer from the swarm: catch up instead.
            raise CatchUpNeeded(f"round {round}: no holder served the packets of {', '.join(missing)}")

        self._state = "aggregating"
        start = time.perf_counter()
        if prepared is None:
            prepared = await self._prepare(client, view, payloads)
        applied = self.outer.commit(prepared)
        self._digest = await asyncio.to_thread(param_digest, self.outer.start)
        self.params_round = round + 1
        times.aggregate_s = time.perf_counter() - start
        # What this node left out, and why, goes on the coordinator's status page.
        refused = {peer: reason[:MAX_REASON_CHARS] for peer, reason in sorted(applied.refused.items())[:MAX_REFUSED]}
        response = await self._signed(client.applied, round, self._digest, refused=refused)
        if not response.agrees:
            log.error("round %d: my digest %s disagrees with the majority %s", round, self._digest[:12],
                      response.majority_digest[:12])
        if self.config.checkpoint_dir is not None:
            await asyncio.to_thread(self._save_checkpoint, client.run_id, round)
        snapshot = await asyncio.to_thread(self._snapshot_bytes)
        task = asyncio.create_task(self._publish_snapshot(exchange, round + 1, snapshot))  # off the critical path
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return applied

    async def _publish_snapshot(self, exchange, round: int, snapshot: bytes) -> None:
        try:
            await exchange.publish_params(round, snapshot)
        except Exception as e:  # serving snapshots helps others; failing to must not stop this node
            log.warning("round %d: could not publish a parameter snapshot: %s", round, e)

    def _progress_bar(self, round: int, total: int):
        if not self.config.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=f"round {round}", unit="step", leave=False)
