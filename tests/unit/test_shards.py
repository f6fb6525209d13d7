"""Data for real runs: `data prepare` (text, JSONL, Parquet -> tagged shards), the shard header,
and the refusal of shards the run's model cannot train on (node, simulator)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomllib

from locoswarm.cli import main as locoswarm
from node.training.data import (
    DataError,
    TokenDataset,
    TokenizerMismatch,
    VocabularyMismatch,
    check_vocabulary,
    load_corpus,
    read_bin_header,
    write_bin_shard,
)
from node.training.peer import PeerTraining
from node.training.shards import BadInput, prepare, run_config_lines, special_tokens, tokenizer_id
from protocol.run_config import RunConfig

tokenizers = pytest.importorskip("tokenizers")
JSON_SOURCES = sorted(Path(json.__file__).parent.glob("*.py"))  # real text every Python has


def _documents() -> list[str]:
    """About 40 documents of Python source: the json package's files cut at blank lines."""
    return [block for path in JSON_SOURCES for block in path.read_text().split("\n\n\n") if block.strip()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The same documents three ways: text files, JSON lines, Parquet."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root = tmp_path_factory.mktemp("inputs")
    documents = _documents()
    (root / "text").mkdir()
    for i, document in enumerate(documents[:10]):
        (root / "text" / f"doc{i:02d}.txt").write_text(document)
    (root / "text" / "binary.dat").write_bytes(b"\0\1\2" * 100)  # skipped in a directory
    with open(root / "docs.jsonl", "w") as f:
        for document in documents[10:25]:
            f.write(json.dumps({"id": len(document), "body": document}) + "\n")
    pq.write_table(pa.table({"body": documents[25:], "n": list(range(len(documents) - 25))}), root / "docs.parquet")
    return root


@pytest.fixture(scope="module")
def prepared(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "data"
    return prepare(
        [inputs / "text", inputs / "docs.jsonl", inputs / "docs.parquet"],
        "bpe:700",
        out,
        text_column="body",
        shard_tokens=4000,
        val_fraction=0.2,
    )


def test_prepare_reads_every_format_and_writes_tagged_shards(prepared, inputs):
    out = Path(prepared.out_dir)
    documents = _documents()
    assert prepared.num_documents == len(documents)  # the binary file was skipped
    assert prepared.vocab_size == 700 and prepared.dtype == "uint16"
    assert prepared.tokenizer_id == tokenizer_id(out / "tokenizer.json")
    assert len(prepared.shards["train"]) > 1 and prepared.shards["val"]  # shard_tokens cuts several
    for name in prepared.shards["train"] + prepared.shards["val"]:
        header = read_bin_header(out / name)
        assert (header.vocab_size, header.tokenizer_id) == (700, prepared.tokenizer_id)
        assert header.num_tokens <= 4000
    assert json.loads((out / "data.json").read_text())["tokenizer_id"] == prepared.tokenizer_id

    corpus = load_corpus(out)
    assert corpus.train.tokenizer_id == prepared.tokenizer_id and corpus.train.vocab_size == 700
    assert len(corpus.train) == prepared.num_tokens["train"] and len(corpus.val) == prepared.num_tokens["val"]
    # Every document comes back, each followed by <|endoftext|>, split by document between train and val.
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = special_tokens(out / "tokenizer.json")["eos"][0]
    decoded = [
        tokenizer.decode(list(map(int, piece)), skip_special_tokens=False)
        for split in (corpus.train, corpus.val)
        for piece in np.split(split.tokens(), np.flatnonzero(split.tokens() == eos) + 1)
        if len(piece)
    ]
    assert sorted(d.removesuffix("<|endoftext|>") for d in decoded) == sorted(documents)


def test_prepare_with_a_given_tokenizer_is_deterministic(prepared, inputs, tmp_path):
    """The tokenizer.json of one preparation, given to another, gives the same id and tokens."""
    again = prepare(
        [inputs / "text", inputs / "docs.jsonl", inputs / "docs.parquet"],
        str(Path(prepared.out_dir) / "tokenizer.json"),
        tmp_path / "again",
        text_column="body",
        shard_tokens=4000,
        val_fraction=0.2,
    )
    assert again.tokenizer_id == prepared.tokenizer_id and again.num_tokens == prepared.num_tokens
    for name in prepared.shards["train"]:
        assert (Path(prepared.out_dir) / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    # The id is the canonical JSON's: the same tokenizer re-indented keeps it.
    document = json.loads((tmp_path / "again" / "tokenizer.json").read_text())
    (tmp_path / "indented.json").write_text(json.dumps(document, indent=4))
    assert tokenizer_id(tmp_path / "indented.json") == prepared.tokenizer_id


def test_prepare_refusals(inputs, tmp_path, prepared):
    with pytest.raises(BadInput, match="--text-column"):
        prepare([inputs / "docs.jsonl"], "bpe:300", tmp_path / "a")  # the key is "body", not "text"
    with pytest.raises(BadInput, match=r"no column 'text'.*--text-column"):
        prepare([inputs / "docs.parquet"], "bpe:300", tmp_path / "b")
    with pytest.raises(DataError, match="already holds .bin shards"):
        prepare([inputs / "text"], "bpe:300", prepared.out_dir)
    with pytest.raises(DataError, match="no tokenizer at"):
        prepare([inputs / "text"], str(tmp_path / "missing.json"), tmp_path / "c")
    with pytest.raises(ValueError, match="bpe:VOCAB takes a number"):
        prepare([inputs / "text"], "bpe:lots", tmp_path / "d")


def test_header_keeps_llm_c_fields_and_picks_the_dtype(tmp_path):
    identity = "ab" * 32
    tokens = np.arange(0, 70_000, 7)
    write_bin_shard(tmp_path / "wide.bin", tokens, None, vocab_size=70_000, tokenizer_id=identity)
    header = read_bin_header(tmp_path / "wide.bin")
    assert header.dtype == np.dtype("<u4") and (header.vocab_size, header.tokenizer_id) == (70_000, identity)
    raw = np.fromfile(tmp_path / "wide.bin", dtype="<i4", count=3)
    assert raw.tolist() == [20240520, 2, len(tokens)]  # what an llm.c reader looks at
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_bin_shard(tmp_path / "bad.bin", [5, 300], None, vocab_size=256)
    # Shards of two tokenizers in one directory are refused.
    write_bin_shard(tmp_path / "other.bin", np.arange(100), None, vocab_size=70_000, tokenizer_id="cd" * 32)
    with pytest.raises(TokenizerMismatch, match="different tokenizers"):
        load_corpus(tmp_path)


def _run(**model) -> RunConfig:
    return RunConfig.model_validate(
        {"name": "t", "model": {"preset": "tiny", **model}, "inner": {"steps": 2, "batch_size": 2, "seq_len": 16}}
    )


def test_check_vocabulary_refuses_what_the_model_cannot_embed(prepared, tmp_path):
    corpus = load_corpus(prepared.out_dir)
    identity = prepared.tokenizer_id
    check_vocabulary(corpus.train, 700, identity)
    check_vocabulary(corpus.train, 1024, None)  # a run that names no tokenizer takes ids that fit
    with pytest.raises(VocabularyMismatch, match="set model.vocab_size = 700"):
        check_vocabulary(corpus.train, 256, None)
    with pytest.raises(TokenizerMismatch, match="prepare the data with the run's tokenizer.json"):
        check_vocabulary(corpus.train, 700, "0" * 64)
    byte_text = TokenDataset([np.frombuffer(b"hello world" * 10, np.uint8)], vocab_size=256, name="text")
    with pytest.raises(TokenizerMismatch, match="no tokenizer"):
        check_vocabulary(byte_text, 700, identity)
    # The case: GPT-2 ids in an untagged .bin, on the byte-level tiny preset.
    write_bin_shard(tmp_path / "gpt2.bin", np.array([15496, 995, 50256] * 200), "uint16")
    gpt2 = load_corpus(tmp_path / "gpt2.bin")
    with pytest.raises(VocabularyMismatch, match="token id 50256 is outside the model's vocabulary of 256"):
        check_vocabulary(gpt2.train, 256, None)


def test_peer_refuses_mismatched_shards_and_embeds_the_runs_vocabulary(prepared, single_thread):
    corpus = load_corpus(prepared.out_dir)
    shard = corpus.train.shard(0, 2)
    with pytest.raises(VocabularyMismatch):  # the tiny preset's 256 bytes
        PeerTraining.build(_run(), "cpu", shard)
    with pytest.raises(TokenizerMismatch):
        PeerTraining.build(_run(vocab_size=700, tokenizer_id="1" * 64), "cpu", shard)
    training = PeerTraining.build(_run(vocab_size=700, tokenizer_id=prepared.tokenizer_id), "cpu", shard)
    assert training.model.embed.weight.shape == (700, 128)
    assert training.model.config.tokenizer_id == prepared.tokenizer_id
    result = training.train_round(0)
    assert np.isfinite(result.mean_loss)


def test_cli_prints_the_run_config_lines(inputs, tmp_path, capsys):
    out = tmp_path / "cli"
    code = locoswarm(
        [
            "data",
            "prepare",
            "--input",
            str(inputs / "text"),
            "--tokenizer",
            "bpe:400",
            "--out",
            str(out),
            "--shard-tokens",
            "100000",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "%|" not in captured.err  # no progress bar when stderr is not a terminal
    model = tomllib.loads(captured.out[captured.out.index("[model]") :])["model"]
    assert model == {"data": str(out), "vocab_size": 400, "tokenizer_id": tokenizer_id(out / "tokenizer.json")}
    run = RunConfig.model_validate({"name": "t", "model": {"preset": "tiny", **model}})
    assert (run.model.vocab_size, run.model.tokenizer_id) == (400, model["tokenizer_id"])
    assert (
        locoswarm(
            [
                "data",
                "prepare",
                "--input",
                str(tmp_path / "nothing"),
                "--tokenizer",
                "bpe:400",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "no such input" in capsys.readouterr().err


def test_run_config_lines_are_toml(prepared):
    parsed = tomllib.loads(run_config_lines(prepared))["model"]
    assert parsed["tokenizer_id"] == prepared.tokenizer_id and parsed["vocab_size"] == 700


def test_sim_trains_on_prepared_shards(prepared, single_thread):
    from tools.sim.engine import SimConfig, simulate

    cfg = SimConfig(
        algos=("sparseloco",),
        preset="tiny",
        num_peers=2,
        inner_steps=2,
        num_rounds=1,
        batch_size=2,
        seq_len=32,
        eval_batches=1,
        data=prepared.out_dir,
        threads=1,
    )
    summary = simulate(cfg, show_progress=False)
    assert summary["config"]["vocab_size"] == 700
    assert summary["config"]["tokenizer_id"] == prepared.tokenizer_id
    assert np.isfinite(summary["strategies"]["sparseloco"]["final_val_loss"])


def test_a_llama_style_tokenizer_gets_one_bos_per_document(inputs, tmp_path):
    """A tokenizer whose template puts <s> before every encoding (Llama's): documents are encoded
    without the template, start with <s> once and end with </s>, however many pieces they take."""
    tk = tokenizers
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(
        _documents(),
        tk.trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<unk>", "<s>", "</s>"],
            show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer.post_processor = tk.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(tmp_path / "llama.json"))
    prepared = prepare([inputs / "text"], str(tmp_path / "llama.json"), tmp_path / "out", val_fraction=0.0)
    assert (prepared.bos_id, prepared.eos_id) == (1, 2)
    tokens = load_corpus(tmp_path / "out").train.tokens()
    tokens = np.concatenate([tokens, load_corpus(tmp_path / "out").val.tokens()])
    assert tokens[0] == 1 and tokens[-1] == 2
    assert (tokens == 1).sum() == (tokens == 2).sum() == prepared.num_documents == 10
    assert not np.any((tokens[:-1] == 1) & (tokens[1:] == 1))
