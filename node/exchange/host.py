"""The libp2p daemon and DHT node the exchange runs on, and what hivemind 1.1.12 does not do for us.

    host = await Host.start(config)                  # p2pd child process + DHTNode, in this loop
    await host.serve(handler)                        # the packet stream (protocol/stream.py)
    await host.connect(peer, dial_addresses(holder_id, maddrs))
    reached = await host.dial(maddrs, timeout_s, what="connection reversal")   # several peers at once
    reader, writer = await host.open_stream(peer)      # over any connection to peer, whoever opened it
    joined = await host.rejoin(member_maddrs, 5.0)   # enter the DHT of peers not in the routing table
    await host.shutdown()                            # stops the DHT node, then p2pd (bounded)

Everything runs in the caller's asyncio loop: one `hivemind.p2p.P2P` (which starts and owns one
p2pd libp2p daemon process) and one `hivemind.dht.DHTNode` on top of it. Not the `hivemind.DHT`
wrapper: it runs the node in a forked process and passes values through a pipe, which crashes on
values above ~16 KB; in-loop, nothing is pickled and the daemon is a child of the node process.

Things hivemind 1.1.12 does not do for us, and how this module copes:

- `P2P` has no public `connect()`: the daemon client's is used, once per holder, to hand p2pd the
  holder's announced addresses, without their /p2p/<id> suffix (p2pd takes the id apart). hivemind
  encodes a /p2p/ part as a CID, which p2pd refuses ("length greater than remaining number of
  bytes in buffer"); a relayed address keeps its relay's /p2p/<id>, so addresses are encoded by
  `reachability.p2pd_multiaddr`.
- Circuit relays (libp2p circuit relay v2; p2pd 0.5.0.hivemind1). A p2pd with relay enabled runs
  two relay v2 services on one protocol, and the one that registers its handler last answers:
  p2pd's own (`EnableRelayV2`: go-libp2p's `relay.New` with its default resources, 128 KiB each
  way and 2 minutes per relayed connection: a packet does not fit), registered from p2pd's main
  goroutine just after the host is built; and go-libp2p's relay manager, which carries
  -relayDataLimit/-relayTimeLimit (4 GiB, 30 min by default) but builds its relay from a goroutine
  of its own once autonat says the node is public. No p2pd flag leaves the configured one alone
  (-relayService=0 drops it, -relay=0 both). So a node with `relay` forces public reachability
  (autonat says so while the host is built, before the main goroutine registers the default
  relay), starts p2pd without its own DHT (hivemind's runs over streams, not p2pd's) and with
  Go settings that keep its main goroutine running until it registered the default
  (`RELAY_DAEMON_ENV`): GOMAXPROCS=1, one thread of Go code, so the manager's goroutine runs only
  when the main one yields; and no garbage collection before the heap nears 512 MiB (GOGC=off,
  GOMEMLIMIT=512MiB), since a collection during start-up is such a yield. The configured relay
  then registers last. In the network lab's relay host, GOMAXPROCS=1 alone won 10 of 22 starts,
  both won 36 of 36. Still not a guarantee by construction, so node/cli/relay.py checks the
  relay it starts and restarts one that lost; `node join --relay` does not check. The cost: that
  p2pd runs Go code on one core, and holds up to 512 MiB of garbage before it collects. tests/integration/test_relay.py moves 1 MiB over one relayed connection. A node
  behind NAT becomes dialable through a relay only once it holds a reservation there, which p2pd
  makes through autorelay: with `relay_via` the daemon starts with autorelay, these relays as its
  static relays, relay discovery off (with it on, p2pd waits out libp2p's boot delay, minutes,
  before it reserves a slot at a single relay) and private reachability forced, and the host keeps
  a connection to each relay open (`RELAY_CHECK_S`). p2pd does not list the circuit address it is
  reachable at among its own addresses, so the host writes it (`reachability.circuit_address`)
  and announces only those: a node behind NAT has no address of its own that others can dial.
- `P2P.create` turns UPnP/NAT-PMP on by default, which multicasts on the LAN; it is left off when
  every listen address is loopback (tests, local swarms).
- hivemind's msgpack serializer writes tuples as an extension type a plain msgpack reader does
  not know; records are built from lists only (protocol/dht_records.py).
- The p2pd pid is only reachable through `P2P._child` (`daemon_pid`, for tests that check it dies).
- `P2P.create` starts p2pd in the node's process group, so a terminal's Ctrl+C (SIGINT to the
  whole foreground group) killed p2pd at once, while the node, told to stop after its step, went
  on with no daemon: its own packet unserved, and the step waiting out its fetch time-out (a node
  with two peers on loopback took 61 s to stop). p2pd now starts through `DAEMON_LAUNCHER`, which
  puts it in a process group of its own and asks the kernel to SIGKILL it when the node dies
  (Linux's parent-death signal), then execs it: the pid is p2pd's. Only the node stops p2pd (on
  its way out, `shutdown`), or its death does: a SIGKILL of the node's group still ends p2pd, a
  SIGSTOP no longer stops it.
- Bootstrap cannot crash a node. Given initial peers, `P2P.create` runs p2pd with `-b`: p2pd dials
  them one after another (5 s each for an address that drops packets, 60 s in all) and exits when
  none answers, which `P2P.create` raises as `P2PDaemonError("Daemon failed to start: ... failed
  to connect to bootstrap peers")`; and `DHTNode.create` raises `RuntimeError("DHTNode bootstrap
  failed: none of the initial_peers responded to a ping ...")` when p2pd reached a peer but no DHT
  node answered there (a p2pd that outlived its node for a moment). So p2pd starts without them and
  the host dials every initial peer itself, in parallel, each within `bootstrap_timeout_s`; the
  DHTNode bootstraps from those that answered. When none answered, or none of their DHT nodes did,
  the node starts a DHT of its own (a swarm of one) and says so: others join it through the
  addresses it gives the coordinator. What p2pd's `-b` did beyond dialling is left out: tagging
  the peers for its connection manager, redialling them every 15 min while it has fewer than 4
  connections, an early refresh of its routing table (which it fills from the connections anyway).
- A DHT of its own is an island for good: hivemind never looks for peers it was not given. After
  a whole-swarm restart every node finds the dead addresses it was given and starts one, all at
  the same moment. `rejoin` mends it: peers that are not in this node's routing table (the live
  members the coordinator lists; node/round/rejoin.py) are dialled and their DHT nodes pinged
  (`DHTProtocol.call_ping`, which puts each side in the other's routing table, and hands the new
  node the records it should store), then a lookup of this node's own id fills the table from
  their neighbours, as `DHTNode.create` does after its pings.
- `P2P.shutdown` and `DHTNode.shutdown` wait for p2pd forever once it died under them (the
  handler removal is written to a dead control socket and its answer never comes): each step is
  bounded, and a daemon still there after it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from node.exchange.config import ExchangeConfig
from node.exchange.reachability import circuit_address, is_loopback, p2pd_multiaddr
from protocol.stream import PROTOCOL_NAME

log = logging.getLogger(__name__)

StreamHandler = Callable[..., Awaitable[None]]  # (stream_info, reader, writer)
SHUTDOWN_TIMEOUT_S = 5.0  # each of the DHT node's and p2pd's shutdown, before what is left is killed
RELAY_CHECK_S = 5.0  # a node reachable through relays checks its connections to them this often
# one thread of Go code in a relay's p2pd, so that its configured relay registers after its default
# one (module docstring, "Circuit relays")
RELAY_DAEMON_ENV = {"GOMAXPROCS": "1", "GOGC": "off", "GOMEMLIMIT": "512MiB"}
# `python -c DAEMON_LAUNCHER NODE_PID PROGRAM ARGS...`: PROGRAM (p2pd, or `env` running it) in a
# process group of its own, SIGKILLed when the node dies (PR_SET_PDEATHSIG, Linux; elsewhere left
# out), exec'd in place. A node already gone by then is not waited for: the launcher exits.
DAEMON_LAUNCHER = """\
import ctypes, os, signal, sys
os.setpgid(0, 0)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except AttributeError:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("p2pd launcher: the node is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


class Host:
    """One p2pd daemon (through `hivemind.P2P`) and one `DHTNode` on it; start with `Host.start`."""

    def __init__(self, p2p: P2P, dht: DHTNode, relay_via: tuple[str, ...] = ()):
        self.p2p, self.dht = p2p, dht
        self.relay_via = relay_via  # relays (multiaddrs with /p2p/<id>) this node is reachable through
        self._relay_keeper: asyncio.Task | None = None

    @classmethod
    async def start(cls, config: ExchangeConfig) -> Host:
        """p2pd, then the DHT node, joined through the initial peers that answer (or alone); with
        `relay_via`, connected to those relays, and kept connected until shutdown."""
        host = await cls._start(config)
        if host.relay_via:
            reached = await _dial_initial_peers(host.p2p, host.relay_via, config.bootstrap_timeout_s, what="relay")
            if not reached:
                log.warning(
                    "relay: none of %s answered yet; retrying every %g s", ", ".join(host.relay_via), RELAY_CHECK_S
                )
            host._relay_keeper = asyncio.create_task(host._keep_relays(config.bootstrap_timeout_s))
        return host

    @classmethod
    async def _start(cls, config: ExchangeConfig) -> Host:
        p2p = await start_daemon(config)
        try:
            answered = await _dial_initial_peers(p2p, config.initial_peers, config.bootstrap_timeout_s)
            dht = await _start_dht(p2p, config, answered) if answered or not config.initial_peers else None
        except BaseException:
            await p2p.shutdown()
            raise
        if dht is not None:
            return cls(p2p, dht, config.relay_via)
        if answered:  # the failed DHTNode's RPC handlers stay registered on this daemon: start afresh
            await p2p.shutdown()
            p2p = await start_daemon(config)
        try:
            dht = await _start_dht(p2p, config, [])
            maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        except BaseException:
            await p2p.shutdown()
            raise
        why = (
            "reached, but no DHT node answered there"
            if answered
            else f"none answered within {config.bootstrap_timeout_s:g} s"
        )
        log.warning(
            "bootstrap: initial peers %s: %s; started a DHT of its own, which others join through "
            "the addresses this node gives the coordinator: %s",
            ", ".join(config.initial_peers),
            why,
            ", ".join(maddrs),
        )
        return cls(p2p, dht, config.relay_via)

    @property
    def holder_id(self) -> str:
        """This node's libp2p peer id (base58)."""
        return self.p2p.peer_id.to_base58()

    @property
    def daemon_pid(self) -> int | None:
        """Process id of this node's p2pd child (hivemind keeps it in a private attribute)."""
        child = getattr(self.p2p, "_child", None)
        return child.pid if child is not None else None

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """The multiaddrs (with /p2p/<id>) others can dial: through the relays with `relay_via`,
        else those p2pd lists (`latest` asks it again)."""
        if self.relay_via:
            return [circuit_address(relay, self.holder_id) for relay in self.relay_via]
        return [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]

    async def _keep_relays(self, timeout_s: float) -> None:
        """Redial each relay this node has no connection to, every RELAY_CHECK_S (autorelay renews
        the reservation on a live connection, but does not redial a relay that restarted)."""
        relay_ids = {maddr.rpartition("/p2p/")[2]: maddr for maddr in self.relay_via}
        while True:
            await asyncio.sleep(RELAY_CHECK_S)
            try:
                connected = {info.peer_id.to_base58() for info in await self.p2p._client.list_peers()}
            except Exception as e:  # the daemon's control socket: try again next time
                log.debug("relay: listing connections failed: %r", e)
                continue
            lost = tuple(maddr for relay_id, maddr in relay_ids.items() if relay_id not in connected)
            if lost and await _dial_initial_peers(self.p2p, lost, timeout_s, what="relay"):
                log.info("relay: reconnected to %s", ", ".join(lost))

    async def serve(self, handler: StreamHandler, protocol: str = PROTOCOL_NAME) -> None:
        """Answer streams of `protocol` (packet streams by default) with `handler(stream_info, reader, writer)`."""
        await self.p2p.add_binary_stream_handler(protocol, handler)

    async def connect(self, peer: PeerID, maddrs: list[Multiaddr]) -> None:
        """Tell p2pd where `peer` listens. P2P has no public connect(); the daemon client's does it."""
        await self.p2p._client.connect(peer, maddrs)

    async def dial(self, maddrs: Iterable[str], timeout_s: float, what: str) -> list[str]:
        """Connect to the peers at `maddrs` (ending in /p2p/<id>), each within `timeout_s`, all at
        once; the addresses that answered (those that did not are logged as `what`). A peer already
        connected answers at once: p2pd dials nobody it has a connection to."""
        return await _dial_initial_peers(self.p2p, tuple(maddrs), timeout_s, what=what)

    async def open_stream(
        self, peer: PeerID, protocol: str = PROTOCOL_NAME
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream of `protocol` (a packet stream by default) to `peer` (p2pd dials it if needed)."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer, protocol)
        return reader, writer

    @property
    def dht_peers(self) -> set[str]:
        """libp2p ids (base58) of the DHT nodes in this node's routing table (not itself)."""
        return {peer.to_base58() for peer in self.dht.protocol.routing_table.peer_id_to_uid}

    async def rejoin(self, maddrs: Iterable[str], timeout_s: float) -> list[str]:
        """Enter the DHT of the peers at `maddrs` (multiaddrs ending in /p2p/<id>) that are not in
        this node's routing table yet: each is dialled and its DHT node pinged within `timeout_s`,
        all at once; with any new one in the table, a lookup of this node's own id (at most
        `timeout_s`) fills it from their neighbours. Returns the libp2p ids that joined the table;
        those that did not answer are skipped (they are tried again on the next call)."""
        known, own = self.dht_peers, self.holder_id
        fresh = tuple(m for m in maddrs if m.rpartition("/p2p/")[2] not in known | {own, ""})
        if not fresh:
            return []
        answered = await _dial_initial_peers(self.p2p, fresh, timeout_s, what="DHT rejoin")
        peers = list(dict.fromkeys(PeerID.from_base58(m.rpartition("/p2p/")[2]) for m in answered))
        pings = await asyncio.gather(
            *(asyncio.wait_for(self.dht.protocol.call_ping(peer), timeout_s) for peer in peers), return_exceptions=True
        )
        joined = [peer for peer, node_id in zip(peers, pings) if isinstance(node_id, DHTID)]
        if joined:
            with contextlib.suppress(Exception):  # the pings already joined; this only widens the table
                await asyncio.wait_for(self.dht.find_nearest_nodes([self.dht.node_id]), timeout_s)
        return [peer.to_base58() for peer in joined]

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the DHT node, then p2pd, each within `timeout_s`; a p2pd that died under the node
        is not waited for, and one that does not exit in time is killed."""
        child = getattr(self.p2p, "_child", None)
        if self._relay_keeper is not None:
            self._relay_keeper.cancel()
        try:
            # A daemon that exits meanwhile (killed under us) ends the wait: its handlers went with it.
            stopping = asyncio.ensure_future(self.dht.shutdown())
            exited = asyncio.ensure_future(child.wait()) if child is not None else None
            done, pending = await asyncio.wait(
                [f for f in (stopping, exited) if f is not None], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            for future in pending:
                future.cancel()
            if stopping in done:
                stopping.result()  # raises what the shutdown raised
            elif not done:
                raise asyncio.TimeoutError(f"no answer within {timeout_s:g} s")
        except Exception as e:  # the daemon's control socket broke, or nothing answered in time
            log.warning("DHT node shutdown did not finish (%r); stopping p2pd", e)
        finally:
            self.dht.is_alive = False  # ends its routing-table refresh, whatever happened above
            try:
                await asyncio.wait_for(self.p2p.shutdown(), timeout_s)  # terminates p2pd, waits for it
            except asyncio.TimeoutError:
                if child is not None and child.returncode is None:
                    log.warning("p2pd (pid %d) did not exit within %g s of SIGTERM: killing it", child.pid, timeout_s)
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()
                    await child.wait()


def dial_addresses(holder_id: str, maddrs: list[str]) -> list[Multiaddr]:
    """A holder's announced multiaddrs as p2pd takes them: it takes the peer id separately and
    refuses addresses that still end in /p2p/<id>."""
    suffix = f"/p2p/{holder_id}"
    return [p2pd_multiaddr(m.removesuffix(suffix)) for m in maddrs]


class _LaunchedP2P(P2P):
    """`P2P` whose p2pd starts through `DAEMON_LAUNCHER` (a process group of its own, killed with
    the node), with flags `P2P.create` has no parameter for (`DAEMON_FLAGS`) and environment
    variables of its own (`DAEMON_ENV`, through `env`); every program on the way execs the next in
    its own process, so the pid stays p2pd's. Flags and environment are set on a subclass made per
    start by `_daemon_class`."""

    DAEMON_FLAGS: dict[str, bool] = {}
    DAEMON_ENV: dict[str, str] = {}

    def _make_process_args(self, *args, **kwargs) -> list[str]:  # P2P.create calls it on the new instance
        p2pd_args = P2P._make_process_args(*args, **kwargs | self.DAEMON_FLAGS)
        if self.DAEMON_ENV:
            p2pd_args = ["env", *(f"{name}={value}" for name, value in self.DAEMON_ENV.items()), *p2pd_args]
        return [sys.executable, "-c", DAEMON_LAUNCHER, str(os.getpid()), *p2pd_args]


def _daemon_class(flags: dict[str, bool], env: dict[str, str]) -> type[P2P]:
    return type("P2P", (_LaunchedP2P,), {"DAEMON_FLAGS": flags, "DAEMON_ENV": env})


async def start_daemon(config: ExchangeConfig, idle_timeout_s: float = 30.0) -> P2P:
    """p2pd, without bootstrap peers (Host.start dials them itself); a relay client with `relay_via`.
    `idle_timeout_s`: p2pd exits when no client holds a persistent connection to it this long (0:
    never; a relay alone, node/cli/relay.py, holds none)."""
    loopback_only = all(is_loopback(Multiaddr(m)) for m in config.host_maddrs)
    nat_port_map = (not loopback_only) if config.nat_port_map is None else config.nat_port_map
    relayed = bool(config.relay_via)
    flags = {"relayDiscovery": False} if relayed else {"dhtServer": False} if config.relay else {}
    env = RELAY_DAEMON_ENV if config.relay else {}
    return await _daemon_class(flags, env).create(
        host_maddrs=list(config.host_maddrs),
        announce_maddrs=list(config.announce_maddrs) or None,
        use_relay=config.use_relay or relayed,
        use_auto_relay=config.use_auto_relay or relayed,
        trusted_relays=list(config.relay_via) or None,
        force_reachability="private" if relayed else "public" if config.relay else None,
        dht_mode="client" if config.client_mode else "server",
        nat_port_map=nat_port_map,
        startup_timeout=config.startup_timeout_s,
        idle_timeout=idle_timeout_s,
    )


async def _start_dht(p2p: P2P, config: ExchangeConfig, initial_peers: list[str]) -> DHTNode | None:
    """The DHT node on `p2p`, bootstrapped from `initial_peers` (none: a swarm of one); None when
    none of them answered its ping."""
    try:
        return await DHTNode.create(
            p2p=p2p,
            initial_peers=initial_peers or None,
            client_mode=config.client_mode,
            wait_timeout=config.dht_wait_timeout_s,
        )
    except RuntimeError as e:  # hivemind says "none answered" with a bare RuntimeError only
        if initial_peers and str(e).startswith("DHTNode bootstrap failed"):
            return None
        raise


async def _dial_initial_peers(
    p2p: P2P, initial_peers: tuple[str, ...], timeout_s: float, what: str = "bootstrap"
) -> list[str]:
    """The initial peers (multiaddrs ending in /p2p/<id>) p2pd connected to, each given `timeout_s`,
    all at once; addresses of one peer are dialled together. Those that did not answer are logged."""
    by_peer: dict[str, list[str]] = {}
    for maddr in initial_peers:
        by_peer.setdefault(maddr.rpartition("/p2p/")[2], []).append(maddr)

    async def dial(holder_id: str, maddrs: list[str]) -> bool:
        try:
            peer = PeerID.from_base58(holder_id)
            await asyncio.wait_for(p2p._client.connect(peer, dial_addresses(holder_id, maddrs)), timeout_s)
            return True
        except Exception as e:  # refused, timed out, wrong peer id at that address, no /p2p/<id>: skip it
            log.debug("%s: %s did not answer: %r", what, ", ".join(maddrs), e)
            return False

    answered = await asyncio.gather(*(dial(holder_id, maddrs) for holder_id, maddrs in by_peer.items()))
    skipped = [m for ok, maddrs in zip(answered, by_peer.values()) if not ok for m in maddrs]
    if skipped and any(answered):
        log.info("%s: skipped initial peers that did not answer within %g s: %s", what, timeout_s, ", ".join(skipped))
    return [m for ok, maddrs in zip(answered, by_peer.values()) if ok for m in maddrs]
