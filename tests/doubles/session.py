"""A node's `Session` as the round loop holds one, for tests that drive a step without a `Node`.

    s = node_session(tmp_path, run, client=coordinator, exchange=swarm.exchange("node"), training=t)

The config is a node's on the CPU with one thread and no progress bar; `network` and
`checkpoints` are NodeConfig sections to override, the rest `Session` fields (`state`,
`reachable`, ...). A test that drives no training passes `training=None`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from node.config import NodeConfig
from node.faults import FaultInjector
from node.round.session import Session
from protocol.run_config import RunConfig
from protocol.signing import PeerKey

PEER_ID = "p" + "a" * 16


def node_session(
    tmp_path: Path,
    run: RunConfig,
    *,
    client,
    exchange,
    training,
    run_id: str = "run",
    peer_id: str = PEER_ID,
    key: PeerKey | None = None,
    coordinator: str = "http://coordinator.test",
    clock=time.time,
    network: dict | None = None,
    checkpoints: dict | None = None,
    **fields,
) -> Session:
    key_path = tmp_path / "node.key"
    return Session(
        config=NodeConfig(
            coordinator=coordinator,
            run_id=run_id,
            key_path=key_path,
            training={"device": "cpu", "threads": 1},
            debug={"progress": False},
            network=network or {},
            checkpoints=checkpoints or {},
        ),
        client=client,
        exchange=exchange,
        key=key or PeerKey.load_or_create(key_path),
        faults=FaultInjector(),
        clock=clock,
        run_id=run_id,
        peer_id=peer_id,
        run=run,
        training=training,
        rejoin=None,
        stopping=asyncio.Event(),
        **fields,
    )
