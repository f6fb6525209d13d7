"""`locoswarm generate`: a sample from a checkpoint or an exported model, with the run's tokenizer.

The contract (node/cli/generate.py): stdout is the prompt followed by the continuation; the same
seed gives the same text, in this process or another; temperature 0 is greedy, the seed unused;
a refusal is one line on stderr and exit code 2. The models are the tiny preset as initialised
(no training: the sampling is what is under test), saved with save_checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from locoswarm.cli import main as locoswarm
from node.cli import demo
from node.training.checkpoint import save_checkpoint
from node.training.model import PRESETS, build_model
from node.training.sampling import (
    ByteTokenizer,
    GenerateError,
    SampleConfig,
    generate_ids,
    generate_text,
    load_checkpoint_model,
    run_tokenizer,
)
from tests.fixtures.coordinator import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

PROMPT = "def "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generate") / "ckpt"
    save_checkpoint(directory, 3, build_model("tiny", seed=0), extra={"run_id": "test"})
    return directory


def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    code = locoswarm(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prints_the_prompt_and_its_continuation(checkpoint, capsys, single_thread):
    code, out, err = _generate(capsys, "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--tokens", "16")
    assert code == 0
    assert out.startswith(PROMPT) and out.endswith("\n") and len(out) > len(PROMPT) + 1
    assert f"checkpoint {checkpoint}, round 3" in err and "tokenizer bytes" in err
    model, _ = load_checkpoint_model(checkpoint)
    new = generate_ids(model, ByteTokenizer().encode(PROMPT), SampleConfig(max_new_tokens=16))
    assert len(new) == 16  # bytes have no end-of-text token: exactly --tokens
    assert out == generate_text(model, ByteTokenizer(), PROMPT, SampleConfig(max_new_tokens=16)) + "\n"


def test_same_seed_same_text_other_seed_other_text(checkpoint, capsys, single_thread):
    args = ("--checkpoint", str(checkpoint), "--prompt", PROMPT, "--tokens", "24", "--temperature", "1")
    first = _generate(capsys, *args, "--seed", "7")[1]
    assert _generate(capsys, *args, "--seed", "7")[1] == first
    assert _generate(capsys, *args, "--seed", "8")[1] != first  # 24 draws from ~uniform over 256 bytes


def test_greedy_is_the_argmax_every_step_whatever_the_seed(checkpoint, capsys, single_thread):
    args = ("--checkpoint", str(checkpoint), "--prompt", PROMPT, "--tokens", "12", "--temperature", "0")
    greedy = _generate(capsys, *args, "--seed", "1")[1]
    assert _generate(capsys, *args, "--seed", "2")[1] == greedy
    model, _ = load_checkpoint_model(checkpoint)
    ids = list(PROMPT.encode())
    with torch.no_grad():  # the plain reference: one argmax per step over the whole sequence
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == ByteTokenizer().decode(ids) + "\n"


def test_context_is_cut_to_the_models_window(single_thread):
    """A prompt plus continuation longer than max_seq_len runs on the last max_seq_len tokens."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=1, max_seq_len=16)
    model = build_model(cfg, seed=0).eval()
    new = generate_ids(model, list(range(40)), SampleConfig(max_new_tokens=20, temperature=0.0))
    assert len(new) == 20


def test_a_real_process_prints_the_same_sample(checkpoint, capsys, single_thread):
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--tokens", "20", "--seed", "5"]
    here = _generate(capsys, *args)[1]
    done = subprocess.run(
        [sys.executable, "-m", "locoswarm", "generate", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == here


def test_a_bad_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = _generate(capsys, "--checkpoint", str(tmp_path / "nothing"), "--prompt", PROMPT)
    assert (code, out) == (2, "")
    assert err == f"error: no checkpoint at {tmp_path / 'nothing'}\n"
    done = subprocess.run(
        [sys.executable, "-m", "locoswarm", "generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", PROMPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: no checkpoint at")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--tokens", "0"),
        ("--tokens", "1025"),
        ("--tokens", "ten"),
        ("--temperature", "-0.5"),
        ("--temperature", "nan"),
        ("--seed", "-1"),
    ],
)
def test_out_of_range_values_are_refused_by_the_parser(checkpoint, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        locoswarm(["generate", "--checkpoint", str(checkpoint), "--prompt", PROMPT, flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_sample_config_bounds():
    for bad in (
        {"max_new_tokens": 0},
        {"max_new_tokens": 1025},
        {"temperature": float("inf")},
        {"temperature": -1.0},
        {"seed": -1},
    ):
        with pytest.raises(ValueError):
            SampleConfig(**bad)
    with pytest.raises(GenerateError, match="no tokens"):
        generate_ids(build_model("tiny", 0), [], SampleConfig())


def test_an_exported_model_gives_the_checkpoints_text(checkpoint, tmp_path, capsys, single_thread):
    from node.training.hf import export_checkpoint

    export_checkpoint(checkpoint, tmp_path / "hf")
    args = ("--prompt", PROMPT, "--tokens", "16", "--seed", "2")
    code, out, err = _generate(capsys, "--model", str(tmp_path / "hf"), *args)
    assert code == 0 and "exported model" in err
    assert out == _generate(capsys, "--checkpoint", str(checkpoint), *args)[1]
    code, _, err = _generate(capsys, "--model", str(tmp_path), *args)
    assert code == 2 and err.startswith("error: no config.json in")


def test_a_tokenizer_run_needs_its_tokenizer(tmp_path, capsys, single_thread):
    pytest.importorskip("tokenizers")
    from node.training.shards import END_OF_TEXT, tokenizer_id, train_bpe, vocabulary_size

    texts = ["def main():\n    return 0\n" * 20, "import os\nimport sys\n" * 20]
    tokenizers = {}
    for name, size in (("run", 300), ("other", 280)):
        tokenizer = train_bpe(texts, size)
        tokenizers[name] = tmp_path / name / "tokenizer.json"
        tokenizers[name].parent.mkdir()
        tokenizer.save(str(tokenizers[name]))
    cfg = dataclasses.replace(
        PRESETS["tiny"],
        num_layers=1,
        vocab_size=vocabulary_size(train_bpe(texts, 300)),
        tokenizer_id=tokenizer_id(tokenizers["run"]),
    )
    save_checkpoint(tmp_path / "ckpt", 0, build_model(cfg, seed=0))
    args = ("--checkpoint", str(tmp_path / "ckpt"), "--prompt", "import ", "--tokens", "8")

    code, _, err = _generate(capsys, *args)
    assert code == 2 and "pass --tokenizer" in err and err.count("\n") == 1
    code, _, err = _generate(capsys, *args, "--tokenizer", str(tokenizers["other"]))
    assert code == 2 and "the model was trained on" in err
    code, out, err = _generate(capsys, *args, "--tokenizer", str(tokenizers["run"].parent))  # its directory
    assert code == 0 and out.startswith("import ") and str(tokenizers["run"]) in err
    assert END_OF_TEXT not in out  # the end of text ends the sample; it is not printed


def test_byte_level_needs_no_tokenizer_and_others_do():
    assert isinstance(run_tokenizer(PRESETS["tiny"], None), ByteTokenizer)
    with pytest.raises(GenerateError, match="pass --tokenizer"):
        run_tokenizer(dataclasses.replace(PRESETS["tiny"], vocab_size=300), None)


def test_the_demo_samples_its_final_model_and_never_fails_on_it(tmp_path, capsys, single_thread):
    """The demo's final model is node 0's --report safetensors (flat parameters, tied ones once)."""
    from safetensors.torch import save_file

    from node.training.params import flat_named_params

    model = build_model("tiny", seed=1)
    save_file(
        {n: p.detach().contiguous() for n, p in flat_named_params(model).items()},
        str(tmp_path / "node0.report.safetensors"),
    )
    sample = demo._sample(tmp_path / "node0.report.safetensors", "tiny")
    assert sample is not None and sample.startswith(demo.SAMPLE_PROMPT) and len(sample) > len(demo.SAMPLE_PROMPT)
    assert demo._sample(tmp_path / "missing.safetensors", "tiny") is None
    err = capsys.readouterr().err
    assert err.startswith("no sample from the final model:") and err.count("\n") == 1
