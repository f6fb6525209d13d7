"""Data: the stdlib corpus split, shards, deterministic batches, .bin shards, user text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.training.data import (
    BIN_HEADER_BYTES,
    DataNotFound,
    EmptyData,
    MalformedShard,
    TokenDataset,
    evaluate,
    load_corpus,
    open_bin_shard,
    stdlib_files,
    write_bin_shard,
)
from node.training.model import build_model


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    return load_corpus(None, cache_dir=tmp_path_factory.mktemp("cache"))


def test_stdlib_split_deterministic_and_disjoint(stdlib, tmp_path):
    root, files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.relative_to(root).parts)
    assert stdlib.train.vocab_size == 256
    # 5 % of the files by hash; their share of bytes varies with file sizes.
    share = len(stdlib.val) / (len(stdlib.train) + len(stdlib.val))
    assert 0.01 < share < 0.2
    # A second load through a fresh cache directory gives the same tokens, split the same way.
    again = load_corpus("stdlib", cache_dir=tmp_path)
    assert np.array_equal(again.train.tokens(), stdlib.train.tokens())
    assert np.array_equal(again.val.tokens(), stdlib.val.tokens())
    # ... and the cached copy too.
    cached = load_corpus("stdlib", cache_dir=tmp_path)
    assert np.array_equal(cached.val.tokens(), stdlib.val.tokens())
    assert any(p.suffix == ".npy" for p in tmp_path.rglob("*"))
    # Disjoint by file: a long validation window does not occur in the training text.
    probe = bytes(np.asarray(stdlib.val.tokens()[1000:1200]))
    assert probe not in bytes(np.asarray(stdlib.train.tokens()))


def test_shards_disjoint_and_covering():
    data = TokenDataset(
        [np.arange(1000, dtype=np.uint16), np.arange(1000, 1037, dtype=np.uint16)], vocab_size=2000, name="t"
    )
    shards = [data.shard(i, 4) for i in range(4)]
    pieces = [s.tokens() for s in shards]
    assert np.array_equal(np.concatenate(pieces), data.tokens())
    assert sum(len(s) for s in shards) == len(data)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    with pytest.raises(ValueError):
        data.shard(4, 4)


def test_batches_deterministic(stdlib):
    shard = stdlib.train.shard(2, 4)
    first = list(zip(range(3), shard.batches(4, 64, seed=5)))
    second = list(zip(range(3), shard.batches(4, 64, seed=5)))
    for (_, (x1, y1)), (_, (x2, y2)) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == y1.shape == (4, 64) and x1.dtype == y1.dtype == torch.int64
        assert torch.equal(x1[:, 1:], y1[:, :-1])
    # Resuming at a step reproduces that step; other seeds, steps and shards differ.
    x3, _ = next(shard.batches(4, 64, seed=5, start_step=2))
    assert torch.equal(x3, first[2][1][0])
    assert not torch.equal(first[0][1][0], first[1][1][0])
    assert not torch.equal(next(shard.batches(4, 64, seed=6))[0], first[0][1][0])
    assert not torch.equal(stdlib.train.shard(1, 4).batch(0, 4, 64, seed=5)[0], first[0][1][0])


def test_batches_stay_inside_the_shard():
    data = TokenDataset([np.arange(10_000, dtype=np.uint32)], vocab_size=10_000, name="t")
    shard = data.shard(1, 4)  # tokens 2500..4999
    x, y = shard.batch(0, 64, 32, seed=0)
    assert x.min() >= 2500 and y.max() <= 4999


def test_windows_never_cross_segments():
    data = TokenDataset([np.zeros(40, dtype=np.uint8), np.ones(40, dtype=np.uint8)], vocab_size=2, name="t")
    x, y = data.batch(0, 256, 16, seed=0)
    rows = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.all((rows == rows[:, :1]).all(dim=1))


def test_val_batches_fixed(stdlib):
    a = list(stdlib.val.val_batches(4, 32, 3))
    b = list(stdlib.val.val_batches(4, 32, 3))
    assert len(a) == 3
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))


def test_evaluate_returns_mean_loss(stdlib):
    model = build_model("tiny", seed=0)
    loss = evaluate(model, stdlib.val, num_batches=2, batch_size=2, seq_len=32)
    assert 4.5 < loss < 6.5
    assert model.training


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_round_trip(tmp_path, dtype):
    high = 60_000 if dtype == "uint16" else 100_000
    tokens = np.random.default_rng(0).integers(0, high, size=5000)
    write_bin_shard(tmp_path / "train_000.bin", tokens, dtype)
    write_bin_shard(tmp_path / "val_000.bin", tokens[:700], dtype)
    mapped = open_bin_shard(tmp_path / "train_000.bin")
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.dtype(dtype)
    assert np.array_equal(mapped, tokens)
    corpus = load_corpus(tmp_path)
    assert np.array_equal(corpus.train.tokens(), tokens)
    assert np.array_equal(corpus.val.tokens(), tokens[:700])
    assert corpus.train.vocab_size == tokens.max() + 1
    x, _ = corpus.train.batch(0, 2, 16, seed=0)
    assert x.max() < high


def test_headerless_bin_by_suffix(tmp_path):
    tokens = np.arange(3000, dtype=np.uint32) * 1000
    tokens.tofile(tmp_path / "data.u32.bin")
    assert np.array_equal(open_bin_shard(tmp_path / "data.u32.bin"), tokens)
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "plain.bin")
    assert open_bin_shard(tmp_path / "plain.bin").dtype == np.uint16
    corpus = load_corpus(tmp_path / "plain.bin", vocab_size=4096)
    assert len(corpus.train) + len(corpus.val) == 3000 and len(corpus.val) == 150


def test_truncated_bin_rejected(tmp_path):
    write_bin_shard(tmp_path / "x.bin", np.arange(100), "uint16")
    data = (tmp_path / "x.bin").read_bytes()
    (tmp_path / "x.bin").write_bytes(data[: BIN_HEADER_BYTES + 50])
    with pytest.raises(MalformedShard):
        open_bin_shard(tmp_path / "x.bin")


def test_user_text_directory(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.md").write_text("nested text\n" * 20)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0\0binary")
    (tmp_path / ".hidden").write_text("secret")
    corpus = load_corpus(tmp_path, cache_dir=tmp_path / ".cache")
    text = bytes(np.asarray(corpus.train.tokens())) + bytes(np.asarray(corpus.val.tokens()))
    assert b"nested text" in text and b"PNG" not in text and b"secret" not in text
    assert len(text) == sum(len(f"document {i}\n") * 50 for i in range(40)) + len("nested text\n") * 20
    assert len(corpus.val) > 0 and len(corpus.train) > len(corpus.val)


def test_single_text_file_tail_split(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(path)
    assert len(corpus.val) == int(256 * 40 * 0.05)
    whole = np.concatenate([corpus.train.tokens(), corpus.val.tokens()])
    assert np.array_equal(whole, np.frombuffer(path.read_bytes(), np.uint8))


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(DataNotFound):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(EmptyData):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataNotFound):
        load_corpus(tmp_path / "emptydir")
    short = TokenDataset([np.arange(10, dtype=np.uint8)], vocab_size=256, name="short")
    with pytest.raises(EmptyData):
        short.batches(2, 32, seed=0)
    with pytest.raises(EmptyData):
        list(short.val_batches(2, 32, 1))
