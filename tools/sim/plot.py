"""The simulator's figure: validation loss against rounds and against bytes sent per peer.

    summary = read_summary(Path("runs/sim"))          # what `locoswarm sim --out runs/sim` saved
    title = plot_summary(summary, Path("sim.png"))    # two panels side by side; returns the title
    (the command line is `locoswarm sim --plot PATH`, or `--from-out DIR` for a saved run)

Left panel: validation loss against rounds. Right panel: the same points against the bytes each
peer has sent so far, on a log axis (the strategies differ by orders of magnitude), so the panel
starts at the first evaluation after round 0. One line per strategy, in a fixed colour per
strategy in both panels. The title holds the run's settings.

Where the points come from (a `summary.json`, tools/sim/engine.py): each strategy's `curve` holds
(tokens seen by the swarm, validation loss) pairs, and every round adds R * H * B * T tokens
(ddp's evaluations fall on the same round boundaries), so a point's round is its tokens over that.
Bytes sent by round r are r times the run's mean per round (`bytes_sent_per_peer_per_round`): exact
for diloco and ddp, whose payloads have a fixed size, and within a few bytes a round for sparseloco.

matplotlib is an optional dependency (`pip install 'locoswarm[plot]'`): it is imported only when a
figure is drawn, and never through pyplot, so drawing neither needs a display nor changes the
process's backend (a Figure saved as PNG renders through Agg).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SUMMARY_FILE = "summary.json"
FIGURE_FILE = "val_loss.png"
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
FIGURE_SIZE_IN = (12.0, 4.8)
FIGURE_DPI = 100  # 1200 x 480 pixels
# Fixed per strategy, so one strategy has one colour in both panels and in every figure.
STRATEGY_COLOURS = {"sparseloco": "#1f77b4", "diloco": "#ff7f0e", "ddp": "#2ca02c"}
OTHER_COLOUR = "#7f7f7f"
INSTALL_HINT = "pip install 'locoswarm[plot]'"


class PlotError(Exception):
    """The figure cannot be drawn: matplotlib is missing, or the saved run cannot be read."""


@dataclass(frozen=True, slots=True)
class StrategyCurve:
    """One strategy's evaluations, as the two panels plot them."""

    algo: str
    rounds: list[int]  # the round each evaluation followed (0: before training)
    bytes_sent_per_peer: list[float]  # bytes each peer had sent by then
    val_losses: list[float]
    bytes_per_peer_per_round: float


def read_summary(out_dir: Path) -> dict:
    """The summary.json `locoswarm sim --out out_dir` wrote; PlotError names what is wrong."""
    path = out_dir / SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlotError(f"no {SUMMARY_FILE} in {out_dir}: give the --out directory of a `locoswarm sim` run") from None
    except (OSError, ValueError) as error:
        raise PlotError(f"cannot read {path}: {error}") from None
    if not isinstance(summary, dict) or not {"config", "strategies"} <= summary.keys():
        raise PlotError(f"{path} is not a simulator summary (it has no config and strategies)")
    return summary


def strategy_curves(summary: Mapping) -> list[StrategyCurve]:
    """Each strategy's points by round and by bytes sent per peer (see the module docstring)."""
    config = summary["config"]
    tokens_per_round = config["num_peers"] * config["inner_steps"] * config["batch_size"] * config["seq_len"]
    curves = []
    for algo, result in summary["strategies"].items():
        per_round = float(result["bytes_sent_per_peer_per_round"])
        rounds = [round(tokens / tokens_per_round) for tokens, _ in result["curve"]]
        curves.append(
            StrategyCurve(
                algo=algo,
                rounds=rounds,
                bytes_sent_per_peer=[r * per_round for r in rounds],
                val_losses=[float(loss) for _, loss in result["curve"]],
                bytes_per_peer_per_round=per_round,
            )
        )
    return curves


def figure_title(summary: Mapping) -> str:
    """The run's settings, two lines: the swarm and schedule, then the strategies' knobs and data."""
    c = summary["config"]
    swarm = (
        f"locoswarm sim: {c['num_peers']} peers, H={c['inner_steps']}, {c['num_rounds']} rounds, "
        f"preset {c['preset']}, batch {c['batch_size']}x{c['seq_len']}, seed {c['seed']}"
    )
    algos = c.get("algos") or list(summary["strategies"])
    knobs = [f"top_k {c['top_k']}", f"error decay {c['error_decay']}"] if "sparseloco" in algos else []
    knobs += [f"diloco outer lr {c['diloco_outer_lr']}"] * ("diloco" in algos)
    knobs += ["overlap"] * bool(c.get("overlap")) + [f"poison {c['poison']}"] * bool(c.get("poison"))
    knobs += ["no scoring"] * (c.get("scoring") is False)
    knobs.append(f"data {c.get('data') or 'stdlib'}")
    return f"{swarm}\n{', '.join(knobs)}"


def check_matplotlib() -> None:
    """Raise PlotError with the install line when matplotlib is missing (before a long run, not after)."""
    _figure_class()


def plot_summary(summary: Mapping, path: Path) -> str:
    """Draw `summary` (what tools.sim.engine.simulate returns, or a saved summary.json) into `path`
    (.png, .svg or .pdf; its directory is made); returns the figure's title."""
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise PlotError(f"{path}: the figure is written as {', '.join(FIGURE_SUFFIXES)}; give a path ending in one")
    figure_class = _figure_class()
    from matplotlib.ticker import MaxNLocator

    title = figure_title(summary)
    unit = "token" if summary["config"].get("tokenizer_id") else "byte"
    figure = figure_class(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    by_round, by_bytes = figure.subplots(1, 2, sharey=True)
    for curve in strategy_curves(summary):
        style = {"color": STRATEGY_COLOURS.get(curve.algo, OTHER_COLOUR), "marker": "o", "ms": 3, "lw": 1.5}
        label = f"{curve.algo} ({_format_bytes(curve.bytes_per_peer_per_round)}/peer/round)"
        by_round.plot(curve.rounds, curve.val_losses, label=label, **style)
        sent = [(b, loss) for b, loss in zip(curve.bytes_sent_per_peer, curve.val_losses) if b > 0]
        if sent:  # a log axis has no place for round 0's zero bytes
            by_bytes.plot(*zip(*sent), **style)
    by_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_round.set_xlabel("round")
    by_round.legend()
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("bytes sent per peer, cumulative (log scale)")
    by_bytes.tick_params(labelleft=True)  # sharey hides them; each panel reads on its own
    for axes in (by_round, by_bytes):
        axes.set_ylabel(f"validation loss (nats/{unit})")
        axes.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
    except OSError as error:
        raise PlotError(f"cannot write {path}: {error.strerror or error}") from None
    return title


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(f"drawing the figure needs matplotlib: {INSTALL_HINT}") from None
    return Figure


def _format_bytes(num_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"
