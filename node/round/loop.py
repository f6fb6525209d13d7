"""The volunteer node: join a run, take part in its rounds, leave.

    node = Node(NodeConfig(coordinator="http://host:8000"))
    asyncio.run(node.run())

`Node` is handed its collaborators, with production defaults: the coordinator client
(node/round/coordinator_client.py), the packet exchange (node/exchange/, the `Exchange`
protocol; by default a P2PExchange on hivemind's DHT and libp2p streams), and a clock. Tests hand
it an in-memory exchange and a client on an in-process coordinator app.

One round r (README.md, "A round"): snapshot theta_r, run H inner AdamW steps (in a
worker thread, so the exchange keeps serving and heartbeats keep flowing), fold the delta into
the error buffers and encode a signed packet, publish it, submit its digest to the coordinator,
wait for the round's manifest, fetch every listed packet (each as soon as its publisher
submitted it, from the start of this node's own training: node/round/prefetch.py), decode,
aggregate, take the outer step, report the new parameter digest. Every peer applies the same
manifest to the same start, so every digest agrees. The steps are node/round/steps.py; falling
behind is node/round/catchup.py; the one-round-delayed outer step is node/round/overlap.py; which
round the parameters start and what the node is doing is the session's `RoundState`
(node/round/state.py; docs/design-round.md, "A round's state has one owner").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable

from node.config import NodeConfig
from node.errors import CannotStart
from node.exchange.base import Exchange
from node.faults import FaultInjector
from node.round import resume
from node.round.catchup import RunEnded, catch_up
from node.round.coordinator_client import CoordinatorCallFailed, CoordinatorClient, CoordinatorUnavailable, Refused
from node.round.overlap import Pipeline
from node.round.own_packets import KEPT_ROUNDS, HeldPacket, OwnPackets
from node.round.prefetch import Prefetch
from node.round.push import accept_push, push_kept
from node.round.refusals import Action
from node.round.rejoin import live_member_addresses, start_mending
from node.round.reports import CatchUpReport, RoundReport, RoundTimes
from node.round.session import Clock, Session
from node.round.state import Doing, RoundState
from node.round.steps import (
    CatchUpNeeded,
    ToApply,
    apply_and_report,
    apply_manifest,
    collect,
    send,
    train,
    wait_open,
)
from protocol.http import JoinResponse, peer_id_from_public_key
from protocol.signing import PeerKey

log = logging.getLogger("locoswarm.node")

# The exchange's part of a round's work in flight: its task (view, payloads, prepared) and times.
InFlight = tuple[asyncio.Task, RoundTimes]
MAX_BOOTSTRAP = 16  # DHT bootstrap addresses tried at start (node/exchange/host.py skips dead ones)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    return device


class Node:
    """One volunteer: joins a run, trains its rounds, leaves.

    `client`: the coordinator client (default: one on `config.coordinator`, signing with the key
    at `config.key_path`). `exchange`: the packet exchange (default: a P2PExchange bootstrapped
    from the run's DHT bootstrap or its live members). `clock`: unix seconds, for reports.
    """

    def __init__(
        self,
        config: NodeConfig,
        *,
        client: CoordinatorClient | None = None,
        exchange: Exchange | None = None,
        clock: Clock = time.time,
        faults: FaultInjector | None = None,
        ranks=None,
    ):
        self.config = config
        self.ranks = ranks  # node.training.distributed.Leader of a multi-rank node (rank 0); None: 1 rank
        self.faults = faults if faults is not None else FaultInjector.parse(config.debug.inject)
        self.reports: list[RoundReport] = []  # the session's: a recompute updates the report of its round
        self.catch_ups: list[CatchUpReport] = []
        self.resumed_from: int | None = None  # the round whose start this node's checkpoint held
        self.session: Session | None = None
        self._client, self._exchange, self._clock = client, exchange, clock
        self._stopping = asyncio.Event()
        self._pipeline: Pipeline[InFlight] = Pipeline(overlap=False)
        self._active_client: CoordinatorClient | None = None  # the one `run` talks through

    def stop(self) -> None:
        """Ask the loop to leave after the current step (signal handlers call this); a step that
        waits out a coordinator outage ends at once (`CoordinatorClient.stop_retrying`)."""
        self._stopping.set()
        if self._active_client is not None:
            self._active_client.stop_retrying()

    @property
    def peer_id(self) -> str | None:
        return self.session.peer_id if self.session else None

    @property
    def training(self):
        return self.session.training if self.session else None

    async def run(self) -> list[RoundReport]:
        import torch

        cfg = self.config
        if cfg.training.threads:
            torch.set_num_threads(cfg.training.threads)
        key = PeerKey.load_or_create(cfg.key_path)
        client = self._active_client = self._client or CoordinatorClient(cfg.coordinator, key)
        if self._stopping.is_set():
            client.stop_retrying()
        client = self.faults.wrap_client(client)
        exchange = self._exchange
        if self.faults:
            log.warning("fault injection armed: %s", self.faults.describe())
        try:
            run_id = cfg.run_id or await self._pick_run(client)
            if exchange is None:
                exchange = await self._open_exchange(client, run_id)
            exchange = self.faults.wrap_exchange(exchange)
            reach = await exchange.reachability_check()
            log.info("reachability: %s", reach.advice)

            def rejoin() -> Awaitable[JoinResponse]:  # also for a node the coordinator dropped (paused, partitioned)
                return client.join(
                    run_id,
                    join_token=cfg.join_token,
                    device=_device_name(cfg.training.device),
                    multiaddrs=exchange.visible_maddrs,
                    uplink_mbps=cfg.network.uplink_mbps,
                    state=self._held_state(run_id),
                    reachable=False if cfg.network.behind_nat else None,
                )

            try:
                joined = await rejoin()
            except Refused as e:
                held = resume.held_state(cfg, run_id)
                if e.action is not Action.RUN_OVER or held is None:
                    raise
                # A member back after the run ended (a crash, a reboot, a service manager's restart):
                # nothing to do, which is no failure to restart it for.
                log.warning(
                    "run %s ended while this node was away (%s); its checkpoint holds the start of round %d",
                    run_id,
                    e.detail,
                    held[0],
                )
                return self.reports
            log.info(
                "joined run %s as %s (index %d, shard %d/%d) at round %d",
                run_id,
                joined.peer_id,
                joined.peer_index,
                joined.data_shard,
                joined.num_shards,
                joined.current_round,
            )
            # Before the model is built: peers replaying a round may be waiting for these packets now.
            own_packets = OwnPackets.beside(cfg.checkpoints.checkpoint_dir)
            kept_rounds = await serve_kept_packets(exchange, own_packets, joined)
            s = self.session = await self._start_session_beating(client, exchange, key, joined, rejoin)
            s.own_packets = own_packets
            s.reachable = joined.reachable
            if joined.reachable is False:
                log.warning(
                    "peers cannot dial this node (%s): it pushes its packets to reachable peers",
                    "network.behind_nat"
                    if cfg.network.behind_nat
                    else "the coordinator's dial-back found no open port",
                )
            push_kept(s, kept_rounds)  # served again above, but nobody can fetch them here
            exchange.accept_pushes(functools.partial(accept_push, s))
            heartbeat = asyncio.create_task(self._heartbeats(s))
            # Nodes restarted together each start a DHT of their own: merge them (node/round/rejoin.py).
            mender = start_mending(s, joined.config.membership.heartbeat_timeout_s)
            try:
                try:
                    await self._rounds(s, joined)
                except CoordinatorUnavailable as e:
                    if not self._stopping.is_set():
                        raise
                    log.warning("stopped during a coordinator outage: %s", e)
                if self._pipeline.in_flight and not self._stopping.is_set():
                    await self._drain(s)
                if self.reports and not self._stopping.is_set():
                    await self._linger(s, self.reports[-1].round)
            finally:
                heartbeat.cancel()
                if mender is not None:
                    mender.cancel()
                await s.stop_background()
            try:
                await client.leave("finished" if not self._stopping.is_set() else "stopped by the volunteer")
            except Exception as e:  # leaving is a courtesy; the coordinator times us out anyway
                log.warning("leave failed: %s", e)
        finally:
            if exchange is not None and self._exchange is None:  # we opened it: we close it
                await exchange.shutdown()
            if self._client is None:
                await client.close()
        return self.reports

    def _held_state(self, run_id: str) -> tuple[int, str] | None:
        """The round start this node holds, told at (re)join: its session's, else its checkpoint's."""
        s = self.session
        if s is not None:
            held = s.state
            return (held.params_round, held.digest) if held.params_round and held.digest else None
        return resume.held_state(self.config, run_id)

    async def _open_exchange(self, client: CoordinatorClient, run_id: str) -> Exchange:
        """The production exchange: hivemind's DHT and libp2p streams, entering the swarm through
        the run's DHT bootstrap addresses, or else its live members."""
        from node.exchange.config import ExchangeConfig
        from node.exchange.p2p import P2PExchange
        from node.training.data import default_cache_dir

        network = self.config.network
        run_info = await client.run_info(run_id)
        bootstrap = network.initial_peers
        if not bootstrap:  # the run's fixed bootstrap peers and its live members: any that answers will do
            status = await client.status(run_id, history=0)
            members = live_member_addresses(  # not this node's own entry, from before a restart
                status,
                exclude_peer=peer_id_from_public_key(client.key.public_bytes),
                fresh_s=run_info.config.membership.heartbeat_timeout_s / 2,
            )
            bootstrap = tuple(dict.fromkeys([*run_info.config.exchange.dht_bootstrap, *members]))[:MAX_BOOTSTRAP]
        return await self.faults.exchange_class(P2PExchange).create(
            ExchangeConfig.from_network(
                network,
                run_id=run_id,
                initial_peers=bootstrap,
                max_packet_bytes=run_info.config.exchange.max_packet_bytes,
                cache_dir=default_cache_dir(),
            )
        )

    async def _start_session_beating(self, client, exchange, key, joined: JoinResponse, rejoin) -> Session:
        """`_start_session` in a worker thread, heartbeating meanwhile: building the model and
        loading the data take seconds (many on a busy host, with several nodes starting at once),
        and a node silent past the heartbeat timeout would be marked gone right after joining (a
        whole swarm restarting would pause its run again)."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(max(0.5, joined.heartbeat_interval_s))
                try:
                    await client.heartbeat(joined.current_round, "joining")
                except CoordinatorCallFailed as e:
                    log.debug("heartbeat while starting failed: %s", e)

        if self.ranks is not None:  # the ranks build together, collectives included: keep it on this thread
            return self._start_session(client, exchange, key, joined, rejoin)
        beating = asyncio.create_task(beat())
        try:
            return await asyncio.to_thread(self._start_session, client, exchange, key, joined, rejoin)
        finally:
            beating.cancel()

    def _start_session(self, client, exchange, key, joined: JoinResponse, rejoin) -> Session:
        from node.training.data import load_corpus
        from node.training.peer import PeerTraining

        run = joined.config
        if run.outer.strategy == "ddp":
            raise CannotStart("the ddp baseline syncs every step and runs in the simulator only")
        if self.ranks is not None:  # N ranks, FSDP2 inside (node/training/ranked.py)
            from node.training.ranked import RankedTraining

            training = RankedTraining.build(
                self.ranks,
                run,
                device=self.config.training.device,
                data=self.config.training.data or run.model.data,
                shard_index=joined.data_shard % joined.num_shards,
                num_shards=joined.num_shards,
                evaluate=bool(self.config.training.eval_every_rounds),
            )
        else:
            corpus = load_corpus(self.config.training.data or run.model.data)
            shard = corpus.train.shard(joined.data_shard % joined.num_shards, joined.num_shards)
            training = PeerTraining.build(
                run,
                self.config.training.device,
                shard,
                val=corpus.val if self.config.training.eval_every_rounds else None,
                node=self.config,
            )
        self._pipeline = Pipeline(overlap=run.outer.overlap)
        return Session(
            config=self.config,
            client=client,
            exchange=exchange,
            key=key,
            faults=self.faults,
            clock=self._clock,
            run_id=joined.run_id,
            peer_id=joined.peer_id,
            run=run,
            training=self.faults.wrap_training(training),
            rejoin=rejoin,
            stopping=self._stopping,
            heartbeat_interval_s=joined.heartbeat_interval_s,
            state=RoundState.at_join(swarm_has_params=joined.params.digest is not None),
            reports=self.reports,
        )

    async def _pick_run(self, client: CoordinatorClient) -> str:
        runs = [r for r in (await client.runs()).runs if r.state in ("waiting", "running")]
        listing = f"list the runs with `locoswarm run list --coordinator {client.base_url}`"
        if not runs:
            raise CannotStart(f"no open run on {client.base_url}: ask the operator to create one, or {listing}")
        if len(runs) > 1:
            names = ", ".join(f"{r.run_id} ({r.name})" for r in runs)
            raise CannotStart(f"{len(runs)} open runs ({names}): pass --run ID; {listing}")
        return runs[0].run_id

    async def _heartbeats(self, s: Session) -> None:
        while True:
            await asyncio.sleep(max(0.5, s.heartbeat_interval_s))
            try:
                await s.heartbeat()
            except CoordinatorCallFailed as e:  # an outage is logged once a minute by the client
                log.log(
                    logging.DEBUG if s.client.unreachable_for_s is not None else logging.WARNING,
                    "heartbeat failed: %s",
                    e,
                )

    async def _rounds(self, s: Session, joined: JoinResponse) -> None:
        round, rounds_done = joined.current_round, 0
        if await resume.restore(s):  # this node's own state, where the swarm agrees with it
            self.resumed_from = s.state.params_round
        while not self._stopping.is_set():
            if self.config.training.max_rounds is not None and rounds_done >= self.config.training.max_rounds:
                break
            if s.run.max_rounds is not None and round >= s.run.max_rounds:
                log.info("the run is complete after %d rounds", s.run.max_rounds)
                break
            s.state.begin(round)
            # With overlap and the previous round in flight, this round's inner steps need nothing from
            # the swarm: train at once; the packet waits for the round to open (steps.send).
            early = self._pipeline.in_flight is not None and s.state.params_round == round
            try:
                view = await (s.client.round(round) if early else wait_open(s, round))
            except Refused as e:
                if e.action is Action.RUN_OVER:
                    log.info("the run is over (%s)", e.detail)
                    break
                raise
            if view is None:
                break
            if view.state == "closed" or s.state.params_round != round:
                # Behind: the round closed without us, or our parameters are not its start.
                self._drop_in_flight()
                try:
                    caught_up = await catch_up(s)
                except RunEnded as e:
                    log.warning("%s", e)
                    break
                self.catch_ups.append(caught_up)
                round = caught_up.to_round
                continue
            try:
                report = await self._one_round(s, round, opened=view.state != "pending")
            except CatchUpNeeded as e:
                log.warning("round %d: %s; catching up from peers", round, e)
                s.state.params_unknown()
                continue
            report.caught_up = bool(self.catch_ups) and self.catch_ups[-1].to_round == round
            self.reports.append(report)
            t = report.times
            log.info(
                "round %d: loss %.4f, %d packet%s%s, digest %s | compute %.2fs encode %.2fs wait %.2fs "
                "transfer %.2fs aggregate %.2fs",
                round,
                report.train_loss,
                report.num_packets,
                "" if report.num_packets == 1 else "s",
                f" ({len(report.refused)} refused)" if report.refused else "",
                report.digest[:12],
                t.compute_s,
                t.encode_s,
                t.wait_s,
                t.transfer_s,
                t.aggregate_s,
            )
            # Others' packets after two rounds; this node's own while a replay or an amendment may
            # ask for them (a node a few rounds behind replays rather than loads a whole snapshot).
            await s.exchange.forget_before(round - 2, keep_publisher=s.peer_id)
            await s.exchange.forget_before(round - KEPT_ROUNDS)
            await forget_final(s, round)
            round += 1
            rounds_done += 1

    async def _one_round(self, s: Session, round: int, opened: bool = True) -> RoundReport:
        """Train round r, send its packet, and apply a round: r itself, or with overlap r-1 (round
        r's packet is then encoded, sent and its round collected while round r+1 trains)."""
        from node.training.params import param_digest

        overlap = self._pipeline.overlap
        base_digest = await asyncio.to_thread(param_digest, s.outer.start)  # reads every parameter: off the loop
        report = RoundReport(round, 0.0, "", 0, started_at=s.clock())
        s.outer.begin_round()
        held = None if overlap else await asyncio.to_thread(held_packet, s, round, base_digest)
        # Others' packets are fetched as they are submitted, from the start of our own training:
        # the last peer to finish then has only its own packet left to spread.
        prefetch = Prefetch.start(s, round)
        try:
            if held is None:
                report.train_loss = await train(s, round, report.times)
            else:  # trained before a restart: its packet goes as it was (steps.send)
                report.kept_packet = True
                report.train_loss = s.state.activity.last_loss = held.train_loss
                report.times.compute_s = held.compute_s
        except BaseException:
            prefetch.cancel()
            raise
        # With overlap, the update is taken now, before round r-1's aggregate lands on the parameters.
        deltas = {name: delta.float().clone() for name, delta in s.outer.deltas()} if overlap else None
        times = RoundTimes() if overlap else report.times
        exchange = asyncio.create_task(
            self._send_and_collect(
                s, round, base_digest, report, opened, deltas, times, prefetch, foreground=not overlap, held=held
            )
        )
        landed = self._pipeline.land(round, (exchange, times))
        if landed is None:  # overlap's first round: nothing lands yet
            s.state.trained(round)
            report.ended_at = s.clock()
            return report
        _, (task, landed_times) = landed
        view, payloads, prepared = await task  # of the round that lands: r, or with overlap r-1
        if overlap:
            report.times.hidden_wait_s, report.times.hidden_transfer_s = landed_times.wait_s, landed_times.transfer_s
            report.times.hidden_aggregate_s = landed_times.aggregate_s
        report = await apply_and_report(s, report, view, payloads, prepared)
        s.state.trained(round)  # with overlap: the start of round r+1, with round r still to land on it
        return report

    async def _send_and_collect(
        self,
        s: Session,
        round: int,
        base_digest: str,
        report: RoundReport,
        opened: bool,
        deltas: dict | None,
        times: RoundTimes,
        prefetch: Prefetch,
        foreground: bool,
        held: HeldPacket | None = None,
    ):
        """Everything of round r after its training: in the foreground, or with overlap beside
        round r+1's training."""
        try:
            await send(s, round, base_digest, report, opened, deltas, foreground, held)
        except BaseException:
            prefetch.cancel()
            raise
        return await collect(s, round, times, prefetch, foreground)

    def _drop_in_flight(self) -> None:
        """Whatever was in flight belongs to rounds a catch-up skips."""
        if (landed := self._pipeline.drain()) is not None:
            landed[1][0].cancel()

    async def _drain(self, s: Session) -> None:
        """With overlap, land the last round's aggregate before leaving."""
        landed = self._pipeline.drain()
        if landed is None:
            return
        view, payloads, prepared = await landed[1][0]
        try:
            await apply_manifest(s, ToApply(view=view, payloads=payloads, prepared=prepared), RoundTimes())
        except CatchUpNeeded as e:  # leaving anyway: no catch-up for a model nobody trains on
            log.warning("round %d: the last in-flight aggregate does not follow the swarm (%s)", view.round, e)
            return
        s.outer.finish()
        log.info("round %d: applied the last in-flight aggregate, digest %s", view.round, s.state.digest[:12])

    async def _linger(self, s: Session, round: int) -> None:
        """Keep serving until every live peer applied our last round (at most fetch_timeout_s).

        Leaving at once would take this node's packet with it while slower peers still fetch it;
        when it is the only holder, nobody could apply the round.
        """
        s.state.doing(Doing.SERVING)
        deadline = time.monotonic() + self.config.network.fetch_timeout_s
        while time.monotonic() < deadline:
            try:
                status = await s.client.status(retry_for_s=5.0)
            except CoordinatorCallFailed:
                return
            # Peers on probation are not waited for: a key that joined and only heartbeats must not
            # hold every node here for the whole time-out (coordinator/service.py, "Standing").
            num_live = sum(p.status == "live" and p.standing != "probation" for p in status.peers)
            num_applied = next((h.num_applied for h in status.history if h.round == round), 0)
            if num_applied >= num_live:
                return
            await asyncio.sleep(0.5)
        log.info("leaving with round %d applied by fewer than all live peers", round)


async def serve_kept_packets(exchange: Exchange, own_packets: OwnPackets | None, joined: JoinResponse) -> list[int]:
    """Serve again the packets this node kept on disk for rounds that may still be applied (after a
    restart, the only copies there may be: node/round/own_packets.py); their rounds."""
    if own_packets is None:
        return []
    kept = await asyncio.to_thread(own_packets.held, joined.run_id, joined.peer_id)
    served = [p for p in kept if p.round >= joined.current_round - KEPT_ROUNDS]
    for packet in served:
        await exchange.publish(packet.round, joined.peer_id, packet.payload)
    if served:
        log.info(
            "serving this node's packet%s of round%s %s again, kept on disk",
            "" if len(served) == 1 else "s",
            "" if len(served) == 1 else "s",
            ", ".join(str(p.round) for p in served),
        )
    return [p.round for p in served]


def held_packet(s: Session, round: int, base_digest: str) -> HeldPacket | None:
    """The packet this node kept for `round` before a restart, if it was made from these parameters:
    it was encoded from error buffers a checkpoint does not hold (they are the round start's), so
    the round is not trained again and its packet goes as it was. The buffers keep the
    checkpoint's values: what of them the packet carried may be sent a second time, one round's
    share at most, rather than a round's training lost."""
    if s.own_packets is None or round in s.sent:  # made in this session: its values left the buffers here
        return None
    held = s.own_packets.load(round)
    if held is None or (held.run_id, held.peer_id, held.base_digest) != (s.run_id, s.peer_id, base_digest):
        return None
    return held


async def forget_final(s: Session, applied_round: int) -> None:
    """Drop what only an amendment of a round could need, once the round is past the coordinator's
    window for amendments: this session's sent packets and the packets kept on disk."""
    oldest = applied_round - KEPT_ROUNDS
    for r in [r for r in s.sent if r < oldest]:
        del s.sent[r]
    if s.own_packets is not None:
        await asyncio.to_thread(s.own_packets.forget_before, oldest)
