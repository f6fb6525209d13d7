"""What every step of a node's round loop works with: its collaborators, its run, its state.

A `Session` exists from the moment the node joined a run until it leaves. The steps
(node/round/steps.py), the prefetch (prefetch.py) and the catch-up (catchup.py) take it as their
first argument instead of a dozen loose ones; `Node` (loop.py) makes one and owns it. Its round
state (which round the parameters start, what the node is doing) is `state`, a `RoundState`
(node/round/state.py), which alone changes it; `training` is the `Training` protocol
(node/training/base.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node.exchange.base import Exchange
from node.faults import FaultInjector
from node.round.coordinator_client import CoordinatorClient, Refused
from node.round.own_packets import OwnPackets
from node.round.refusals import Action
from node.round.reports import RoundReport
from node.round.state import RoundState
from node.training.base import OuterStep, Training
from node.training.decode import EarlyDecodes
from protocol.http import JoinResponse
from protocol.run_config import RunConfig
from protocol.signing import PeerKey

if TYPE_CHECKING:
    from node.config import NodeConfig

log = logging.getLogger("locoswarm.node")

Clock = Callable[[], float]  # unix seconds


@dataclass(kw_only=True, slots=True)
class Session:
    config: NodeConfig
    client: CoordinatorClient
    exchange: Exchange
    key: PeerKey
    faults: FaultInjector
    clock: Clock
    run_id: str
    peer_id: str
    run: RunConfig
    training: Training
    rejoin: Callable[[], Awaitable[JoinResponse]]  # join again with the same key (keeps id and shard)
    stopping: asyncio.Event
    reachable: bool | None = None  # can peers dial this node (its join's answer; False: it pushes its packets)
    dialing: asyncio.Task | None = None  # dialling the peers a heartbeat answer listed (connection reversal)
    mend_dht: asyncio.Event = field(default_factory=asyncio.Event)  # set: enter the live members' DHT now (rejoin.py)
    heartbeat_interval_s: float = 15.0  # as the coordinator last told: longer in a bigger swarm
    state: RoundState = field(default_factory=RoundState)
    reports: list[RoundReport] = field(default_factory=list)  # the rounds this node trained (Node.reports)
    decoded: EarlyDecodes = field(default_factory=EarlyDecodes)  # packets decoded as they arrived
    encode_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # error feedback folds rounds in order
    buffers_lock: threading.Lock = field(default_factory=threading.Lock)  # held by an encode and a reset
    background: set[asyncio.Task] = field(default_factory=set)  # snapshot publications, mirror uploads
    own_packets: OwnPackets | None = None  # this node's packets on disk until final (own_packets.py)
    # This session's own packets by round while their rounds may still leave them out: their values
    # left the error buffers, and go back in if the packet is not applied (`steps.return_if_unsent`).
    sent: dict[int, bytes] = field(default_factory=dict)

    @property
    def outer(self) -> OuterStep:
        return self.training.outer

    async def signed(self, call, *args, **kwargs):
        """A signed coordinator call; if the coordinator dropped this node meanwhile, rejoin and retry once.

        A node paused (SIGSTOP, a suspended laptop) or cut off past heartbeat_timeout_s is marked
        gone; it keeps its id and shard when it rejoins, and the round loop catches up as usual.
        """
        try:
            return await call(*args, **kwargs)
        except Refused as e:
            if e.action is not Action.REJOIN:  # peer_gone: rejoin with the same key
                raise
            log.warning("the coordinator dropped this node (%s); rejoining", e.detail)
            self.heartbeat_interval_s = (await self.rejoin()).heartbeat_interval_s
            return await call(*args, **kwargs)

    async def heartbeat(self) -> None:
        """One heartbeat saying what `state.activity` says now (signed: rejoins if dropped); the
        peers its answer asks this node to dial (it is one nobody can dial) are dialled."""
        a = self.state.activity
        answer = await self.signed(
            self.client.heartbeat,
            a.round,
            a.state,
            train_loss=a.last_loss,
            bandwidth_mbps=a.bandwidth_mbps,
            inner_step=a.inner_step,
            detail=a.detail,
        )
        if answer.heartbeat_interval_s is not None:
            self.heartbeat_interval_s = answer.heartbeat_interval_s
        if answer.dial_peers and (self.dialing is None or self.dialing.done()):
            # Connection reversal: this node nobody can dial may hold the snapshot they are loading.
            # In the background, one at a time: a dial that hangs delays no heartbeat.
            self.dialing = self.spawn(self.exchange.dial_peers(answer.dial_peers))

    def spawn(self, coro) -> asyncio.Task:
        """A background task the session keeps a reference to until it ends."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def stop_background(self, wait_s: float = 5.0) -> None:
        """Cancel the background tasks still running and wait for them, at most `wait_s`: the node
        is leaving (a snapshot still being published, an upload no manifest needs any more)."""
        tasks = list(self.background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
