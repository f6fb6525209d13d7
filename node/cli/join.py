"""`locoswarm node join`: a volunteer joins a run.

    locoswarm node join --coordinator URL [--run ID] [--token T] [--device cpu|cuda] [--data PATH]
    locoswarm node join --config node.toml [--device cuda:1 ...]   (flags override the file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path



def register(subparsers) -> None:
    node = subparsers.add_parser("node", help="run a volunteer node")
    node_sub = node.add_subparsers(dest="node_command", metavar="COMMAND", required=True)
    join = node_sub.add_parser(
        "join", help="join a run and train until it ends or Ctrl+C",
        description="Join a run. Settings come from --config (a TOML file, see deploy/node.toml), then from "
                    "these flags, which override the file; defaults are NodeConfig's (node/config.py).")
    # Defaults are None ("not given") so that a flag overrides the file only when it is passed;
    # node/config.py applies the real defaults and checks every value.
    join.add_argument("--config", default=None, help="node config file, TOML (keys: NodeConfig's fields)")
    join.add_argument("--coordinator", default=None, help="coordinator URL, http://host:port (required here or in --config)")
    join.add_argument("--run", dest="run_id", default=None, help="run id (default: the coordinator's only open run)")
    join.add_argument("--token", dest="join_token", default=None, help="join token, for runs that need one")
    join.add_argument("--device", default=None, help="auto (default: cuda if torch sees a GPU), cpu, cuda or cuda:N")
    join.add_argument("--data", default=None, help="text file, directory or .bin shards (default: the run's)")
    join.add_argument("--key", dest="key_path", default=None,
                      help="Ed25519 identity file, created if absent (default: ~/.locoswarm/peer.key)")
    join.add_argument("--host-maddrs", nargs="+", default=None,
                      help="libp2p listen addresses (default /ip4/127.0.0.1/tcp/0; a public node: /ip4/0.0.0.0/tcp/PORT)")
    join.add_argument("--announce-maddrs", nargs="*", default=None, help="addresses to advertise instead")
    join.add_argument("--initial-peers", nargs="*", default=None, help="DHT bootstrap multiaddrs")
    join.add_argument("--client-mode", action=argparse.BooleanOptionalAction, default=None,
                      help="behind NAT: do not serve the DHT")
    join.add_argument("--auto-relay", dest="use_auto_relay", action=argparse.BooleanOptionalAction, default=None,
                      help="behind NAT: be reachable through a relay")
    join.add_argument("--threads", type=int, default=None, help="torch CPU threads (0, the default: torch's choice)")
    join.add_argument("--uplink-mbps", type=float, default=None,
                      help="this link's upload rate in Mbps (a speed test's figure): the swarm has faster "
                           "uplinks forward more of each packet's copies; unset: counted as fast")
    join.add_argument("--max-rounds", type=int, default=None, help="leave after this many rounds")
    join.add_argument("--fetch-timeout", dest="fetch_timeout_s", type=float, default=None,
                      help="seconds to fetch a round's packets (default 60)")
    join.add_argument("--checkpoint-dir", default=None,
                      help="save the parameters and this node's state here, and resume from them on restart")
    join.add_argument("--checkpoint-every", dest="checkpoint_every_rounds", type=int, default=None,
                      help="rounds between checkpoints (default 1)")
    join.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="a progress bar for the inner steps (default on; --no-progress: logs only)")
    join.add_argument("--inject", action="append", default=None, metavar="FAULT",
                      help="inject a fault, for tests and demos (repeatable): crash@round=3,phase=training, "
                           "slow-upload@delay_s=5, corrupt-packet@round=1, poison@factor=1000, stale-submit@round=2 "
                           "(node/testing/faults.py)")
    join.add_argument("--report", default=None, help="write the per-round reports as JSON here on exit")
    join.set_defaults(func=_join)


# Flags of `node join` that set NodeConfig fields (argparse dest == field name).
JOIN_CONFIG_FLAGS = ("coordinator", "run_id", "join_token", "device", "data", "key_path", "host_maddrs",
                     "announce_maddrs", "initial_peers", "client_mode", "use_auto_relay", "threads", "uplink_mbps",
                     "max_rounds", "fetch_timeout_s", "checkpoint_dir", "checkpoint_every_rounds", "progress",
                     "inject")


def _join(args: argparse.Namespace) -> int:
    from node.config import format_node_config, load_node_config
    from protocol.config_file import ConfigError
    from node.round.loop import Node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    # LOCOSWARM_LOG_LEVEL=DEBUG adds a line per packet fetched (holder, bytes, latency, rate).
    level = os.environ.get("LOCOSWARM_LOG_LEVEL", "INFO").upper()
    for name in ("locoswarm", "node"):  # the round loop's logger, and the modules' own
        logging.getLogger(name).setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
    try:
        config = load_node_config(Path(args.config) if args.config else None,
                                  {name: getattr(args, name) for name in JOIN_CONFIG_FLAGS})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_node_config(config), file=sys.stderr, flush=True)
    node = Node(config)

    async def main() -> list:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        return await node.run()

    reports = asyncio.run(main())
    if args.report:
        _write_report(Path(args.report), node, reports)
    return 0


def _write_report(path: Path, node, reports) -> None:
    """Per-round reports as JSON, and the final parameters beside them (PATH.safetensors)."""
    from safetensors.torch import save_file

    from node.training.params import flat_named_params

    session = node.session  # None when the node never joined
    path.write_text(json.dumps({
        "peer_id": node.peer_id,
        "preset": session.run.model.preset if session else None,
        "rounds": [vars_of(r) | {"times": vars_of(r.times)} for r in reports],
        "resumed_from": node.resumed_from,  # the round its own checkpoint started, if it resumed
        "catch_ups": [vars_of(c) for c in node.catch_ups],
    }))
    if session:
        model = session.training.model
        save_file({n: p.detach().cpu().contiguous() for n, p in flat_named_params(model).items()},
                  str(path.with_suffix(".safetensors")))


def vars_of(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
