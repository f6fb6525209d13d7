"""The `locoswarm` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that implements it and is wired in through that module's
`register(subparsers)`, which adds a parser and sets `func` to a callable taking the parsed
arguments and returning an exit code. Those modules keep their top-level imports light (no torch,
no hivemind) so that `locoswarm --help` answers at once; the heavy imports happen inside `func`.
"""

from __future__ import annotations

import argparse
import sys

from coordinator import cli as coordinator_cli
from node.cli import bench, codec_demo, data, demo, doctor, export, join, sim

# Modules that contribute subcommands, in the order --help lists them.
COMMAND_MODULES = (codec_demo, coordinator_cli, sim, join, demo, doctor, bench, data, export)

EPILOG = """\
first steps:
  volunteer  locoswarm doctor --coordinator URL      check this machine; every problem with its fix
             locoswarm node join --coordinator URL   then join the coordinator's run
  operator   locoswarm coordinator serve, then run create --config deploy/run.toml, then status --watch
  try it     locoswarm demo                          a coordinator and 3 nodes on this machine

`locoswarm COMMAND --help` lists a command's flags; -v on node join, demo and coordinator serve
adds the libraries' log lines."""


def _version(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        print(f"locoswarm {version('locoswarm')}")
    except PackageNotFoundError:
        print("locoswarm (not installed as a package)")
    from protocol.packet import WIRE_VERSION

    print(f"packet wire version {WIRE_VERSION}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="locoswarm",
        description="Train one language model together over the internet with SparseLoCo.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    version_parser = subparsers.add_parser("version", help="print the version and wire version")
    version_parser.set_defaults(func=_version)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a subcommand with a parser of its own (`bench codec --help`)
    gets the arguments after its name in `args.passthrough`."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if hasattr(args, "passthrough"):
        args.passthrough = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "func"):
        parser.print_help()
        raise SystemExit(2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
