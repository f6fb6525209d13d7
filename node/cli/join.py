"""`locoswarm node join`: a volunteer joins a run.

    locoswarm node join --coordinator URL [--run ID] [--token T] [--device cpu|cuda] [--data PATH]
    locoswarm node join --config node.toml [--device cuda:1 ...]   (flags override the file)

The flags are NodeConfig's fields (node/config.py), made by node/cli/config_flags.py, as the
doctor's are. What a volunteer can get wrong is refused before anything starts, in one line on
stderr with what to do, exit code 2 (a traceback only with `-v`): a bad config
(protocol/config_file.py), a device torch cannot use (the doctor's check, node/cli/doctor.py), a
clock too far from the coordinator's for hivemind's DHT (the doctor's measurement:
`clock_refusal`), a coordinator that never answers, a run that does not exist, is closed, or wants
a join token. Each is a `CannotStart` (node/errors.py) by the time it reaches `_join_checked`,
which prints it; `refusal_line` words the coordinator's (its refusals: node/round/refusals.py).

Stopping: the first Ctrl+C (or SIGTERM) says so at once and lets the node finish its step, tell
the coordinator it leaves and shut its exchange down; a second one quits now (the exchange is
still shut down, the leave is skipped, exit code 130). Either way the node prints a summary of
what it did (`summary_line`), and `--report FILE` gets the per-round reports after a clean stop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from node.cli import relay
from node.cli.config_flags import add_config_flags, config_overrides
from node.config import NodeConfig
from node.errors import CannotStart

EXIT_REFUSED = 2  # the volunteer's set-up or command line: fix it and start again
EXIT_INTERRUPTED = 130  # the second Ctrl+C: 128 + SIGINT, as a shell reports it
CLOCK_CHECK_TIMEOUT_S = 3.0  # per request; a coordinator that does not answer is the node's to report
QUIT_GRACE_S = 5.0  # after the second Ctrl+C, the exchange's shutdown gets this long before a hard exit
CANCEL_GRACE_S = 5.0  # a stopped node's leftover tasks get this long to finish once cancelled

log = logging.getLogger("locoswarm.node")


def register(subparsers) -> None:
    node = subparsers.add_parser("node", help="run a volunteer node")
    node_sub = node.add_subparsers(dest="node_command", metavar="COMMAND", required=True)
    join = node_sub.add_parser(
        "join",
        help="join a run and train until it ends or Ctrl+C",
        description="Join a run. Settings come from --config (a TOML file, see deploy/node.toml), then from "
        "these flags, which override the file; defaults are NodeConfig's (node/config.py). "
        "Check this machine first with `locoswarm doctor --coordinator URL` (it takes the same "
        "flags and says what to fix).",
        epilog="Ctrl+C once: finish the current step, leave the run and print a summary; twice: quit now.",
    )
    join.add_argument(
        "--config",
        default=None,
        help="node config file, TOML (deploy/node.toml: NodeConfig's sections); these flags override it",
    )
    add_config_flags(join, NodeConfig)  # one per NodeConfig field: None ("not given") unless passed
    join.add_argument("--report", default=None, help="write the per-round reports as JSON here on exit")
    join.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also the libraries' log lines (every HTTP request, hivemind), and a traceback with each refusal",
    )
    join.set_defaults(func=_join)
    relay.register(node_sub)


def _join(args: argparse.Namespace) -> int:
    from node.cli.logs import configure_logging

    configure_logging(verbose=args.verbose)
    try:
        return _join_checked(args)
    except KeyboardInterrupt:  # before the node's own handlers are in place (loading torch, the config)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _join_checked(args: argparse.Namespace, clock=time.time) -> int:
    """`_join` once logging is set up; `clock` (unix seconds) is what is compared with the
    coordinator's clock before joining (tests hand it a skewed one)."""
    try:
        return _start(args, clock)
    except CannotStart as e:
        return _refuse(str(e))


def _start(args: argparse.Namespace, clock) -> int:
    """Check the set-up, then run the node; what stops it before it trains is a `CannotStart`."""
    from node.cli.doctor import FAIL, check_device, check_key, clock_refusal
    from node.config import format_node_config, load_node_config
    from protocol.config_file import ConfigError

    try:
        config = load_node_config(Path(args.config) if args.config else None, config_overrides(args, NodeConfig))
    except ConfigError as e:
        raise CannotStart(str(e)) from e
    training = config.training
    device = check_device(training.device)  # the doctor's check, before the node joins anything
    if device.status == FAIL:
        raise CannotStart(f"{device.detail} -> {device.fix}")
    # Mistyped paths stop it here, not after it joined the run (and found them while loading).
    data = training.data
    if data is not None and str(data) != "stdlib" and not Path(data).expanduser().exists():
        raise CannotStart(f"the training data {data} (--data): no such file or directory")
    key = check_key(config.key_path)  # a key not there yet is made as the node starts
    if key.status == FAIL:
        raise CannotStart(f"--key: {key.detail}" + (f" -> {key.fix}" if key.fix else ""))
    # Before the DHT starts: hivemind's bootstrap would crash on a bad clock (node/cli/doctor.py).
    if line := clock_refusal(config.coordinator, clock, timeout_s=CLOCK_CHECK_TIMEOUT_S):
        raise CannotStart(line)
    print(format_node_config(config), file=sys.stderr, flush=True)

    from node.training.distributed import Leader, start_ranks

    group = start_ranks(training.ranks, training.device, training.threads)  # None: a 1-rank node
    if group is not None and group.rank != 0:  # a torchrun rank: rank 0 does the networking
        return group.follow()
    leader = Leader(group) if group is not None else None
    try:
        return _run_node(args, config, leader)
    finally:
        if leader is not None:
            leader.close()


def _run_node(args: argparse.Namespace, config, leader) -> int:
    from node.round.coordinator_client import CoordinatorCallFailed
    from node.round.loop import Node
    from node.training.data import DataError
    from node.training.hf import WeightsError

    node = Node(config, ranks=leader)
    started = time.monotonic()
    try:
        reports, quit_now = run_until_stopped(node)
    except (CannotStart, CoordinatorCallFailed, DataError, WeightsError) as e:
        if args.verbose:
            traceback.print_exception(e)
        if node.session is not None:  # it had joined: say what it did before it stopped
            print(summary_line(node, time.monotonic() - started), flush=True)
        raise CannotStart(refusal_line(e, config.coordinator, config.run_id)) from e
    print(summary_line(node, time.monotonic() - started), flush=True)
    if quit_now:
        _hard_exit()
    if args.report:
        _write_report(Path(args.report), node, reports)
    return 0


def _refuse(line: str) -> int:
    print(f"error: {line}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def refusal_line(error: Exception, coordinator: str, run_id: str | None) -> str:
    """What the volunteer reads when the node stops on `error` (a `CannotStart`, a coordinator
    that cannot be used, data or weights that are not the run's), in one line."""
    from node.round.coordinator_client import CoordinatorUnavailable, CoordinatorUnreachable, Refused
    from node.round.refusals import STOP_LINES

    coordinator = coordinator.rstrip("/")
    if isinstance(error, CoordinatorUnreachable):  # it names the address and `locoswarm doctor`
        return str(error)
    if isinstance(error, CoordinatorUnavailable):
        return f"the coordinator at {coordinator} stopped answering: {error}"
    if isinstance(error, Refused):
        line = STOP_LINES.get(error.code, "the coordinator at {coordinator} refused: {error}")
        return line.format(
            run=f"run {run_id}" if run_id else "the run",
            coordinator=coordinator,
            error=error,
            detail=error.detail,
            runs_hint=f"list the runs with `locoswarm run list --coordinator {coordinator}`",
        )
    return str(error)  # CannotStart, and shards or init weights that are not the run's: each says the fix


# -- running and stopping ---------------------------------------------------------------------


class Interrupts:
    """Ctrl+C and SIGTERM while the node runs: the first asks it to stop after its step (and says
    so at once), the second quits now, a third exits without waiting for anything."""

    def __init__(self, stop, quit, say=None):
        self.stop, self.quit = stop, quit
        self.say = say or _say
        self.count = 0

    @property
    def quitting(self) -> bool:
        return self.count >= 2

    def __call__(self) -> None:
        self.count += 1
        if self.count == 1:
            self.say("stopping after this step; Ctrl+C again to quit now")
            self.stop()
        elif self.count == 2:
            self.say("quitting now")
            self.quit()
        else:
            _hard_exit()


def run_until_stopped(node) -> tuple[list, bool]:
    """`node.run()` on an event loop of its own, with `Interrupts` on SIGINT and SIGTERM; returns
    (the round reports, whether the volunteer asked to quit now)."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(node.run())

    def quit_now() -> None:
        task.cancel()  # the node's `finally` still shuts its exchange (and the p2pd daemon) down
        loop.call_later(QUIT_GRACE_S, _hard_exit)

    interrupts = Interrupts(node.stop, quit_now)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupts)
    try:
        return loop.run_until_complete(task), False
    except asyncio.CancelledError:
        if not interrupts.quitting:
            raise
        return node.reports, True
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved here (a SystemExit leaves the loop before run_until_complete does)
        if not interrupts.quitting:
            # Quitting skips this: it would wait for the inner steps still running in a worker thread.
            _cancel_the_rest(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def _cancel_the_rest(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks the node left behind and let them finish, within CANCEL_GRACE_S, as
    `asyncio.run` does: a task still pending when the loop closes is logged as an error ("Task
    was destroyed but it is pending"), one line pair each, at the end of every run."""
    if rest := [t for t in asyncio.all_tasks(loop) if not t.done()]:
        for task in rest:
            task.cancel()
        loop.run_until_complete(asyncio.wait(rest, timeout=CANCEL_GRACE_S))
        for task in rest:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.debug("a task ended with %r as the node stopped", task.exception())


def _say(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)  # above the progress bar, which redraws below it


def _hard_exit() -> None:
    """Exit now: a round's inner steps may still run in a worker thread, which a normal exit waits for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


# -- the summary ------------------------------------------------------------------------------


def summary_line(node, elapsed_s: float) -> str:
    """What the node did, from its reports: rounds, first and last loss, bytes sent (served to
    peers) and received (fetched from them), and time.

        summary: 12 rounds (3-14) in 4m10s, loss 5.8123 -> 4.9011, sent 41.3 MB, received 83.0 MB
    """
    from node.round.coordinator_client import format_duration

    reports = node.reports
    if not reports:
        return f"summary: no round completed in {format_duration(elapsed_s)}"
    first, last = reports[0], reports[-1]
    span_s = last.ended_at - first.started_at if first.started_at and last.ended_at else elapsed_s
    rounds = f"{first.round}" if len(reports) == 1 else f"{first.round}-{last.round}"
    loss = f"loss {first.train_loss:.4f}" + (f" -> {last.train_loss:.4f}" if len(reports) > 1 else "")
    parts = [
        f"{plural(len(reports), 'round')} ({rounds}) in {format_duration(span_s)}",
        loss,
        f"sent {format_bytes(sum(r.uploaded_bytes for r in reports))}",
        f"received {format_bytes(sum(r.downloaded_bytes for r in reports))}",
    ]
    if node.resumed_from is not None:
        parts.append(f"resumed from its checkpoint at round {node.resumed_from}")
    caught_up = sum(c.method != "none" for c in node.catch_ups)
    if caught_up:
        parts.append(f"caught up {plural(caught_up, 'time')}")
    return "summary: " + ", ".join(parts)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_bytes(num_bytes: int) -> str:
    """1.2 MB, 812 kB, 90 B: decimal units, as link speeds are quoted."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _write_report(path: Path, node, reports) -> None:
    """Per-round reports as JSON, and the final parameters beside them (PATH.safetensors)."""
    from safetensors.torch import save_file

    from node.training.params import flat_named_params

    session = node.session  # None when the node never joined
    path.write_text(
        json.dumps(
            {
                "peer_id": node.peer_id,
                "preset": session.run.model.preset if session else None,
                "rounds": [vars_of(r) | {"times": vars_of(r.times)} for r in reports],
                "resumed_from": node.resumed_from,  # the round its own checkpoint started, if it resumed
                "catch_ups": [vars_of(c) for c in node.catch_ups],
            }
        )
    )
    if session:
        model = session.training.model
        save_file(
            {n: p.detach().cpu().contiguous() for n, p in flat_named_params(model).items()},
            str(path.with_suffix(".safetensors")),
        )


def vars_of(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
