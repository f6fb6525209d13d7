"""The `locoswarm` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that implements it and is wired in through that module's
`register(subparsers)`, which adds a parser and sets `func` to a callable taking the parsed
arguments and returning an exit code. Those modules keep their top-level imports light (no torch,
no hivemind) so that `locoswarm --help` answers at once; the heavy imports happen inside `func`.

Every parser of the command line is a `SuggestingParser`, so a typo anywhere is answered with the
closest known name:

    locoswarm: error: argument COMMAND: invalid choice: 'nod' (did you mean 'node'?)
    locoswarm node join: error: unrecognized arguments: --coordinatr URL (did you mean --coordinator?)
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable

from coordinator import cli as coordinator_cli
from node.cli import codec_demo, data, demo, doctor, export, generate, join
from tools.bench import cli as bench
from tools.sim import cli as sim

# Modules that contribute subcommands, in the order --help lists them.
COMMAND_MODULES = (codec_demo, coordinator_cli, sim, join, demo, doctor, bench, data, export, generate)

EPILOG = """\
first steps:
  volunteer  locoswarm doctor --coordinator URL      check this machine; every problem with its fix
             locoswarm node join --coordinator URL   then join the coordinator's run
  operator   locoswarm coordinator serve, then run create --config deploy/run.toml, then status --watch
  try it     locoswarm demo                          a coordinator and 3 nodes on this machine

`locoswarm COMMAND --help` lists a command's flags; -v on node join, demo and coordinator serve
adds the libraries' log lines."""


# difflib's similarity ratio a known name needs to be offered: "nod" -> "node" scores 0.86 and
# "codc" -> "codec" 0.89, while a word that merely shares a letter or two stays below 0.5.
SUGGEST_CUTOFF = 0.6


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser that answers a misspelt subcommand, choice or flag with the closest known one.

    argparse builds subparsers with their parent's class, so a root parser of this class makes every
    level suggest (Python 3.11 has no `suggest_on_error`; 3.14's does this for choices only).
    """

    def _check_value(self, action: argparse.Action, value) -> None:
        # argparse decides what is invalid; only its message gains the suggestion.
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            close = _closest(value, action.choices)
            if close is None:
                raise
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (did you mean {close!r}?)") from None

    def parse_known_args(self, args=None, namespace=None):
        # Kept for `error`: argparse refuses a missing required flag before it returns the unknown ones,
        # and the unknown one is then often the required flag misspelt.
        self._arg_strings = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        pairs = (
            _flag_suggestions(_unknown_flags(getattr(self, "_arg_strings", []), self), [self])
            if message.startswith("the following arguments are required")
            else []
        )
        if pairs:
            message += f" (unrecognized: {', '.join(flag for flag, _ in pairs)}; {_did_you_mean(pairs)})"
        super().error(message)

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        """argparse's, except that a subcommand that passes its arguments on to a parser of its own
        (`bench codec`, whose defaults hold `passthrough`) gets the ones this parser does not know in
        `args.passthrough`, and that any other unknown flag is refused with the closest known one."""
        namespace, unknown = self.parse_known_args(args, namespace)
        if hasattr(namespace, "passthrough"):
            namespace.passthrough = unknown
        elif unknown:
            chosen = _chosen_parsers(self, namespace)
            pairs = _flag_suggestions(unknown, chosen)
            hint = f" ({_did_you_mean(pairs)})" if pairs else ""
            # The innermost parser reports: its usage line lists the flags that were meant.
            chosen[0].error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return namespace


def _closest(word, known: Iterable | None) -> str | None:
    """The known name nearest `word`, or None when none is near enough to be the one meant."""
    if not isinstance(word, str) or known is None:
        return None
    names = [name for name in known if isinstance(name, str)]
    matches = difflib.get_close_matches(word, names, n=1, cutoff=SUGGEST_CUTOFF)
    return matches[0] if matches else None


def _flag_suggestions(unknown: list[str], parsers: list[argparse.ArgumentParser]) -> list[tuple[str, str]]:
    """(unknown flag, closest flag of `parsers`) for each flag among `unknown` that is close to one."""
    options = [option for parser in parsers for option in parser._option_string_actions]
    return [
        (flag, suggestion)
        for flag in unknown
        if flag.startswith("-")
        if (suggestion := _closest_flag(flag, options)) is not None
    ]


def _did_you_mean(pairs: list[tuple[str, str]]) -> str:
    """'did you mean --coordinator?'; with several, each names the flag it is for."""
    if len(pairs) == 1:
        return f"did you mean {pairs[0][1]}?"
    return f"did you mean {', '.join(f'{suggestion} for {flag}' for flag, suggestion in pairs)}?"


def _closest_flag(flag: str, options: list[str]) -> str | None:
    """The option nearest `flag` (`--coordinatr=URL` -> `--coordinator`). Compared without their dashes:
    the shared `--` would make any two short long flags look alike."""
    by_name = {}
    for option in options:
        by_name.setdefault(option.lstrip("-"), option)
    name = _closest(flag.split("=", 1)[0].lstrip("-"), by_name)
    return by_name[name] if name is not None else None


def _unknown_flags(arg_strings: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The long flags among `arg_strings` that `parser` has no option for, nor one they abbreviate
    (argparse takes `--coord` for `--coordinator`). Short ones are left out: `-x3` may be a value."""
    known = parser._option_string_actions
    return [
        arg
        for arg in arg_strings
        if arg.startswith("--")
        and len(arg) > 2
        and not any(option.startswith(arg.split("=", 1)[0]) for option in known)
    ]


def _chosen_parsers(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """The parsers a parsed command line went through, innermost first: `parser`, then the
    subcommand each one chose (its subparsers' `dest` in `namespace` names it)."""
    chosen = [parser]
    while (subparser := _chosen_subparser(chosen[-1], namespace)) is not None:
        chosen.append(subparser)
    return chosen[::-1]


def _chosen_subparser(parser: argparse.ArgumentParser, namespace: argparse.Namespace):
    # argparse has no public way to list a parser's subcommands: its subparsers action holds them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(getattr(namespace, action.dest, None))
    return None


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
    parser = SuggestingParser(
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
    gets the arguments after its name in `args.passthrough` (SuggestingParser.parse_args)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        raise SystemExit(2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
