"""The inner-loop throughput bench (tools/bench/throughput.py) on the `tiny` preset on CPU:
the smoke test of what deploy/gpu_check.sh runs on the 1b preset on a CUDA card."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.throughput import main, peak_tflops_for

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def test_tiny_preset_runs_and_reports_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "2",
                "--warmup-steps",
                "0",
                "--batch-size",
                "1",
                "--seq-len",
                "32",
                "--peak-tflops",
                "1.0",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "throughput.json").read_text())
    assert printed == written
    assert written["preset"] == "tiny" and written["num_parameters"] == 836_736
    assert written["tokens_per_s"] > 0 and written["steps"] == 2 and written["activation_checkpointing"]
    # MFU = 6 N tokens/s over the peak (1 TFLOP/s given)
    assert written["mfu"] == pytest.approx(6 * 836_736 * written["tokens_per_s"] / 1e12)


def test_peak_lookup_prefers_the_longer_name():
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("NVIDIA L40S") == 362.0 and peak_tflops_for("NVIDIA L4") == 121.0
    assert peak_tflops_for("cpu") is None


def test_gpu_check_script_parses_and_refuses_without_cuda(tmp_path):
    script = ROOT / "deploy" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True).returncode == 0
    done = subprocess.run(
        ["bash", str(script)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": sys.executable},
    )
    assert done.returncode == 2 and "no CUDA device" in done.stderr
