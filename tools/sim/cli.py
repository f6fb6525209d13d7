"""`locoswarm sim`: the multi-peer simulator's command line (the simulator is tools/sim/engine.py).

    locoswarm sim --algos sparseloco,diloco,ddp [--json] [--peers 4 --inner-steps 15 --rounds 20]
    locoswarm sim --data DIR        # shards from `locoswarm data prepare`: the model takes their vocabulary
    locoswarm sim --plot sim.png    # the figure there instead of OUT/val_loss.png
    locoswarm sim --from-out runs/sim [--plot sim.png]   # a saved run: its table and figure, no simulation

A run writes OUT/summary.json and the figure (tools/sim/plot.py: validation loss against rounds
and against bytes sent per peer), to --plot or else OUT/val_loss.png. matplotlib is optional: without
it a run still writes its summary and says how to install it, while an explicit --plot is refused
before anything is simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from protocol.config_file import describe_validation_error
from tools.sim import engine as simulator
from tools.sim import plot as sim_plot
from tools.sim.engine import ALGOS, SimConfig, simulate


def register(subparsers) -> None:
    parser = subparsers.add_parser("sim", help="simulate R peers in one process and compare strategies")
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run_cli(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    parser.add_argument("--algos", default=",".join(d.algos), help="comma-separated: sparseloco,diloco,ddp")
    parser.add_argument("--preset", default=d.preset)
    parser.add_argument("--peers", type=int, default=d.num_peers)
    parser.add_argument("--inner-steps", type=int, default=d.inner_steps, help="H")
    parser.add_argument("--rounds", type=int, default=d.num_rounds)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--top-k", type=int, default=d.top_k)
    parser.add_argument("--error-decay", type=float, default=d.error_decay)
    parser.add_argument("--overlap", action="store_true", help="one-round-delayed outer step")
    parser.add_argument(
        "--poison",
        default=None,
        help='arm the last peer with a poison fault spec, e.g. "poison@factor=1,mode=sign-flip"',
    )
    parser.add_argument(
        "--no-scoring", dest="scoring", action="store_false", help="no contribution scoring (nobody is excluded)"
    )
    parser.add_argument("--sparseloco-inner-lr", type=float, default=d.sparseloco_inner_lr)
    parser.add_argument("--diloco-inner-lr", type=float, default=d.diloco_inner_lr)
    parser.add_argument("--diloco-outer-lr", type=float, default=d.diloco_outer_lr)
    parser.add_argument("--ddp-lr", type=float, default=d.ddp_lr)
    parser.add_argument("--eval-every", type=int, default=d.eval_every_rounds, help="rounds between evaluations")
    parser.add_argument("--eval-batches", type=int, default=d.eval_batches)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--data",
        default=None,
        help="text file or directory (byte tokens), .bin shards, or a `locoswarm data prepare` "
        "directory, whose vocabulary the model takes (default: stdlib sources)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids the model embeds (default: the preset's, or what prepared shards record)",
    )
    parser.add_argument(
        "--max-contributors",
        default=",".join(map(str, d.max_contributors)),
        help="bounded rounds (outer.max_contributors): comma-separated M, one sparseloco run each; 0: unbounded",
    )
    parser.add_argument(
        "--decode-once",
        action="store_true",
        help="decode and aggregate each round once for every peer (many peers, few cores; needs --no-scoring)",
    )
    parser.add_argument("--threads", type=int, default=d.threads)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--out", default="runs/sim", help="where summary.json and (without --plot) val_loss.png go")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write the figure here (.png, .svg or .pdf; default OUT/val_loss.png): validation loss "
        "against rounds and against bytes sent per peer, one line per strategy; needs "
        "matplotlib (pip install 'locoswarm[plot]')",
    )
    parser.add_argument(
        "--from-out",
        default=None,
        metavar="DIR",
        help="simulate nothing: print the table of the run saved in DIR (its --out) and draw its "
        "figure (to --plot, default DIR/val_loss.png); the simulation's flags are refused with it",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    algos = tuple(a.strip() for a in args.algos.split(",") if a.strip())
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SystemExit(f"unknown strategy {unknown[0]!r}; choose from {', '.join(ALGOS)}")
    try:
        return _sim_config(args, algos)
    except ValidationError as e:
        raise SystemExit(f"error: {describe_validation_error(e)}") from None


def _sim_config(args: argparse.Namespace, algos: tuple[str, ...]) -> SimConfig:
    return SimConfig(
        algos=algos,
        preset=args.preset,
        num_peers=args.peers,
        inner_steps=args.inner_steps,
        num_rounds=args.rounds,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        top_k=args.top_k,
        error_decay=args.error_decay,
        overlap=args.overlap,
        sparseloco_inner_lr=args.sparseloco_inner_lr,
        diloco_inner_lr=args.diloco_inner_lr,
        diloco_outer_lr=args.diloco_outer_lr,
        ddp_lr=args.ddp_lr,
        eval_every_rounds=args.eval_every,
        eval_batches=args.eval_batches,
        seed=args.seed,
        data=args.data,
        vocab_size=args.vocab_size,
        poison=args.poison,
        scoring=args.scoring,
        max_contributors=_bounds(args.max_contributors),
        decode_once=args.decode_once,
        threads=args.threads,
        device=args.device,
    )


def _bounds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"error: --max-contributors {text!r}: give comma-separated integers, e.g. 8,16,32") from None


def run_cli(args: argparse.Namespace) -> int:
    if args.from_out is not None:
        return _show_saved(args)
    cfg = config_from_args(args)
    out = Path(args.out)
    figure = Path(args.plot) if args.plot else out / sim_plot.FIGURE_FILE
    if args.plot:  # asked for: refused now, not after the simulation
        _check_plot_path(figure)
    if not args.json:
        print("resolved config:", cfg.model_dump_json())
    from node.training.data import DataError

    try:
        summary = simulate(cfg, show_progress=True)
    except DataError as e:  # data missing, malformed, or not what the model embeds: the message says what to do
        raise SystemExit(f"error: {e}") from None
    write_summary(summary, out)
    _print_results(summary, args.json)
    drawn = _draw(summary, figure, required=bool(args.plot))
    if not args.json:
        print(f"wrote {out / sim_plot.SUMMARY_FILE}" + (f" and {figure}" if drawn else ""))
    return 0


def _show_saved(args: argparse.Namespace) -> int:
    """--from-out: the saved run's table and figure."""
    given = _simulation_flags_given(args)
    if given:
        raise SystemExit(
            f"error: --from-out shows a saved run; {', '.join(given)} would need a new simulation "
            "(drop --from-out to run one)"
        )
    out = Path(args.from_out)
    try:
        summary = sim_plot.read_summary(out)
    except sim_plot.PlotError as e:
        raise SystemExit(f"error: {e}") from None
    figure = Path(args.plot) if args.plot else out / sim_plot.FIGURE_FILE
    if args.plot:
        _check_plot_path(figure)
    try:
        _print_results(summary, args.json)
        drawn = _draw(summary, figure, required=bool(args.plot))
    except (KeyError, TypeError, ValueError) as e:  # hand-edited, or written by another version
        raise SystemExit(f"error: {out / sim_plot.SUMMARY_FILE} lacks what the table and figure need ({e!r})") from None
    if drawn and not args.json:
        print(f"wrote {figure}")
    return 0


def _simulation_flags_given(args: argparse.Namespace) -> list[str]:
    """The flags on the command line that set up a simulation (--peers, --out...), found as the
    values that differ from a fresh parser's defaults."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and action.dest not in ("help", "json", "plot", "from_out")
        and getattr(args, action.dest, action.default) != action.default
    ]


def _check_plot_path(figure: Path) -> None:
    if figure.suffix.lower() not in sim_plot.FIGURE_SUFFIXES:
        raise SystemExit(f"error: --plot {figure}: give a path ending in {', '.join(sim_plot.FIGURE_SUFFIXES)}")
    try:
        sim_plot.check_matplotlib()
    except sim_plot.PlotError as e:
        raise SystemExit(f"error: {e}") from None


def write_summary(summary: dict, out: Path) -> Path:
    """A run's summary as OUT/summary.json, which `--from-out` reads back; its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / sim_plot.SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2))
    return path


def _draw(summary: dict, figure: Path, required: bool) -> bool:
    """Draw the figure; without matplotlib, a run that did not ask for one says so and goes on."""
    try:
        sim_plot.plot_summary(summary, figure)
    except sim_plot.PlotError as e:
        if required:
            raise SystemExit(f"error: {e}") from None
        print(f"no figure: {e}", file=sys.stderr)
        return False
    return True


# What the table and --json give per strategy (a saved run of an older version may lack the last ones).
SUMMARY_KEYS = (
    "final_val_loss",
    "tokens",
    "bytes_sent_per_peer_per_round",
    "wall_s",
    "bytes_received_per_peer_per_round",
    "max_contributors",
    "longest_wait_rounds",
)


def _print_results(summary: dict, as_json: bool) -> None:
    """The table of the strategies' results, or one JSON object of them."""
    per_strategy = {algo: {k: r[k] for k in SUMMARY_KEYS if k in r} for algo, r in summary["strategies"].items()}
    if as_json:
        print(json.dumps(per_strategy))
        return
    print(
        f"{'strategy':<15} {'val loss':>9} {'tokens':>11} {'sent/peer/round':>16} {'recv/peer/round':>16} {'wall s':>8}"
    )
    for algo, r in per_strategy.items():
        print(
            f"{algo:<15} {r['final_val_loss']:>9.4f} {r['tokens']:>11,} {r['bytes_sent_per_peer_per_round']:>16,.0f}"
            f" {r.get('bytes_received_per_peer_per_round', float('nan')):>16,.0f} {r['wall_s']:>8.1f}"
        )
    for algo, r in summary["strategies"].items():
        for peer_id, first_round in r.get("excluded", {}).items():
            reason = r["standings"][peer_id]["reason"]
            print(f"{algo}: {peer_id} excluded from round {first_round} on: {reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.sim.cli",
        description=simulator.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
