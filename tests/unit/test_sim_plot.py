"""`locoswarm sim --plot` and `--from-out`: the figure of validation loss against rounds and against
bytes sent per peer (tools/sim/plot.py), drawn from a real tiny simulation.

The PNG is checked as pixels: its size from the header, something drawn in each panel, and every
strategy's line colour in both panels; the title, which the plotting function returns, holds the
run's settings. Without matplotlib, an asked-for figure is refused before anything is simulated.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from locoswarm.cli import main as locoswarm
from tests.fixtures.coordinator import REPO_ROOT
from tools.sim import cli as sim_cli
from tools.sim import plot as sim_plot

pytestmark = pytest.mark.timeout(120)

# The smallest run the simulator accepts, and every evaluation kept (3 per strategy).
TINY = [
    "--preset",
    "tiny",
    "--peers",
    "2",
    "--inner-steps",
    "1",
    "--rounds",
    "2",
    "--batch-size",
    "1",
    "--seq-len",
    "8",
    "--eval-every",
    "1",
    "--eval-batches",
    "1",
    "--threads",
    "1",
]
COLOUR_TOLERANCE = 0.02  # of 1.0 per channel: antialiased edges aside, a line is drawn in its exact colour
MIN_LINE_PIXELS = 20


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny simulation through the command line, with --plot: its out directory and figure."""
    root = tmp_path_factory.mktemp("sim")
    code = locoswarm(["sim", *TINY, "--out", str(root / "out"), "--plot", str(root / "figure.png")])
    assert code == 0
    return root / "out", root / "figure.png"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _panels(path):
    """The image's two halves (left: by round, right: by bytes) below the title, as RGB floats."""
    from matplotlib import image

    pixels = image.imread(str(path))[..., :3]  # (H, W, 3) in [0, 1]
    height, width, _ = pixels.shape
    body = pixels[int(height * 0.15) :]
    return pixels, body[:, : width // 2], body[:, width // 2 :]


def _count_colour(pixels, hex_colour: str) -> int:
    import numpy as np

    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=-1) < COLOUR_TOLERANCE).sum())


def test_the_figure_has_both_panels_every_strategy_and_the_settings(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, figure = tiny_run
    width_in, height_in = sim_plot.FIGURE_SIZE_IN
    assert _png_size(figure) == (int(width_in * sim_plot.FIGURE_DPI), int(height_in * sim_plot.FIGURE_DPI))
    pixels, by_round, by_bytes = _panels(figure)
    for panel in (by_round, by_bytes):
        assert (panel.min(axis=-1) < 0.9).mean() > 0.01  # axes, ticks, labels and lines, not a blank area
        for algo in ("sparseloco", "diloco", "ddp"):
            assert _count_colour(panel, sim_plot.STRATEGY_COLOURS[algo]) > MIN_LINE_PIXELS, algo
    assert (pixels[: int(pixels.shape[0] * 0.1)].min(axis=-1) < 0.5).any()  # the title's text

    summary = sim_plot.read_summary(out)
    title = sim_plot.plot_summary(summary, tmp_path / "again.png")
    assert title == sim_plot.figure_title(summary)
    for setting in (
        "2 peers",
        "H=1",
        "2 rounds",
        "preset tiny",
        "batch 1x8",
        "seed 0",
        "top_k 64",
        "error decay 0.95",
        "diloco outer lr 0.7",
        "data stdlib",
    ):
        assert setting in title


def test_points_by_round_and_by_bytes_sent(tiny_run):
    summary = sim_plot.read_summary(tiny_run[0])
    curves = {c.algo: c for c in sim_plot.strategy_curves(summary)}
    assert list(curves) == ["sparseloco", "diloco", "ddp"]
    for algo, curve in curves.items():
        result = summary["strategies"][algo]
        per_round = result["bytes_sent_per_peer_per_round"]
        assert curve.rounds == [0, 1, 2]
        assert curve.bytes_sent_per_peer == [0.0, per_round, 2 * per_round]
        assert curve.val_losses == [loss for _, loss in result["curve"]]
    assert curves["diloco"].bytes_per_peer_per_round > 30 * curves["sparseloco"].bytes_per_peer_per_round


def test_a_saved_run_is_shown_and_drawn_without_simulating(tiny_run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    out, _ = tiny_run
    monkeypatch.setattr(sim_cli, "simulate", _no_simulation)
    capsys.readouterr()
    assert locoswarm(["sim", "--from-out", str(out), "--plot", str(tmp_path / "saved.png")]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == [
        "strategy",
        "val",
        "loss",
        "tokens",
        "sent/peer/round",
        "recv/peer/round",
        "wall",
        "s",
    ]
    assert f"wrote {tmp_path / 'saved.png'}" in printed
    assert _png_size(tmp_path / "saved.png") == _png_size(tiny_run[1])

    assert locoswarm(["sim", "--from-out", str(out), "--json"]) == 0  # the figure to DIR/val_loss.png
    assert set(json.loads(capsys.readouterr().out)) == {"sparseloco", "diloco", "ddp"}
    assert (out / sim_plot.FIGURE_FILE).is_file()


def test_from_out_refuses_what_it_cannot_do(tiny_run, tmp_path):
    with pytest.raises(SystemExit, match="--peers, --rounds would need a new simulation"):
        locoswarm(["sim", "--from-out", str(tiny_run[0]), "--peers", "3", "--rounds", "5"])
    with pytest.raises(SystemExit, match="no summary.json in"):
        locoswarm(["sim", "--from-out", str(tmp_path)])
    (tmp_path / "summary.json").write_text('{"config": {}, "strategies": {"ddp": {}}}')
    with pytest.raises(SystemExit, match="lacks what the table and figure need"):
        locoswarm(["sim", "--from-out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"give a path ending in \.png"):
        locoswarm(["sim", *TINY, "--plot", str(tmp_path / "figure.txt")])


def test_without_matplotlib(tiny_run, tmp_path, capsys, monkeypatch):
    """An asked-for figure is refused before the simulation, in one line with the install command;
    a run that did not ask for one writes its summary and says why there is no figure."""
    for module in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, module, None)  # `import matplotlib` now raises ImportError
    monkeypatch.setattr(sim_cli, "simulate", _no_simulation)
    with pytest.raises(SystemExit) as refused:
        locoswarm(["sim", *TINY, "--out", str(tmp_path), "--plot", str(tmp_path / "figure.png")])
    assert str(refused.value.code) == "error: drawing the figure needs matplotlib: pip install 'locoswarm[plot]'"

    saved = sim_plot.read_summary(tiny_run[0])
    monkeypatch.setattr(sim_cli, "simulate", lambda cfg, show_progress: saved)
    assert locoswarm(["sim", *TINY, "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == saved
    assert not (tmp_path / "run" / sim_plot.FIGURE_FILE).exists()
    assert "no figure: drawing the figure needs matplotlib: pip install 'locoswarm[plot]'" in captured.err
    assert f"wrote {tmp_path / 'run' / 'summary.json'}\n" in captured.out


def test_matplotlib_is_not_imported_until_a_figure_is_drawn():
    code = (
        "import sys; from locoswarm.cli import parse_args; parse_args(['sim', '--plot', 'x.png']); "
        "assert 'matplotlib' not in sys.modules, 'imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _no_simulation(*args, **kwargs):
    raise AssertionError("simulated, but should not have")
