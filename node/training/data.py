"""Training data with no download: token streams, per-peer shards, deterministic batches.

Sources (`load_corpus(source)`, the CLI's `--data PATH`):

- `None` or `"stdlib"` (default): the `.py` files of this Python's standard library (found with
  `sysconfig`, test directories and site-packages left out), read as bytes. Real text that every
  machine already has; peers on the same Python minor version get the same tokens.
- a text file, or a directory of text files (searched recursively; hidden entries and files
  with a NUL byte in their first 8 KiB are skipped as binary): bytes as tokens.
- a `.bin` file, or a directory holding `.bin` files: pre-tokenized shards, memory-mapped.
  Format: the llm.c / modded-nanogpt header, 256 little-endian int32 (`[0]` magic 20240520,
  `[1]` version: 1 = uint16 tokens, 2 = uint32 tokens, `[2]` token count) followed by the
  tokens; `write_bin_shard` writes it. Shards made by `locoswarm data prepare`
  (node/training/shards.py) also say what their ids mean, in slots llm.c leaves zero (so llm.c
  readers still read them): `[3]` the tag 0x6F636F6C ("loco"), `[4]` its version 1, `[5]` the
  tokenizer's vocabulary size, `[6:14]` the tokenizer id (32 bytes: sha256 of the canonical
  tokenizer.json, `node.training.data.tokenizer_id`). A directory of such shards holds that
  tokenizer.json beside them, and it must have the shards' id. Headerless files are raw tokens
  whose width comes from the name: `*.u32.bin` / `*.uint32.bin` are uint32, anything else
  uint16 (nanoGPT's `train.bin`). Files with `val` in their name are the validation split.

Byte-level text has vocabulary 256. Train/validation split: by file, a file is validation when
the first 8 bytes of sha256(its relative path) read as a fraction fall under `val_fraction`
(5 %), so the split is the same on every machine and never depends on file order. When that
leaves either side empty (a single file, a tiny directory, `.bin` shards without a `val` file)
the last `val_fraction` of the tokens are validation instead. Concatenated text corpora are
cached as .npy under `$LOCOSWARM_CACHE` (default `~/.cache/locoswarm`), keyed by a digest of
the file list with sizes and modification times; an unwritable cache only costs the re-read.

Sampling: `TokenDataset.shard(i, n)` is the i-th of n contiguous, disjoint ranges of the
tokens, so peer i trains on its own data. `batches(...)` draws each step's windows uniformly
from the shard with a generator seeded by (seed, shard, step) alone, so a batch can be
recomputed, and training resumed, from its step number. `val_batches` is a fixed set of evenly
spaced windows over the validation split.

Matching the run: `check_vocabulary(dataset, vocab_size, tokenizer_id)` refuses data whose
tokenizer is not the run's (`TokenizerMismatch`) or whose ids the model cannot embed
(`VocabularyMismatch`: a declared vocabulary larger than the model's, or an id >= it, found by
one max over the dataset's arrays), each with a one-line message that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from node.training.model import autocast_for, lm_loss

log = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256
DEFAULT_VAL_FRACTION = 0.05
BIN_MAGIC = 20240520
BIN_HEADER_INTS = 256
BIN_HEADER_BYTES = BIN_HEADER_INTS * 4
_BIN_VERSION_DTYPE = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
SHARD_TAG = 0x6F636F6C  # b"loco" read as a little-endian int32: the header says what the ids mean
SHARD_TAG_VERSION = 1
_TOKENIZER_ID_BYTES = 32
_TAG_SLOT, _VOCAB_SLOT, _TOKENIZER_SLOT = 3, 5, 6  # int32 slots; the id fills slots 6..13
TOKENIZER_FILE = "tokenizer.json"  # beside prepared shards: the tokenizer their ids come from
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class DataError(Exception):
    """The training data cannot be used."""


class DataNotFound(DataError):
    """The data path does not exist or holds no usable file."""


class EmptyData(DataError):
    """There are no tokens, or too few for the sequence length asked for."""


class MalformedShard(DataError):
    """A .bin shard's header or size is inconsistent."""


class DataMismatch(DataError):
    """The data is fine, but not what this run's model trains on."""


class TokenizerMismatch(DataMismatch):
    """The shards were made with another tokenizer than the run's (or with none)."""


class BadInput(DataError):
    """An input file cannot be read as what its suffix says (bad JSON, no text column...)."""


def tokenizer_id(path: str | os.PathLike) -> str:
    """sha256 hex of a tokenizer.json's canonical JSON (sorted keys, no spaces): its identity."""
    try:
        document = json.loads(Path(path).read_text("utf-8"))
    except (OSError, ValueError) as error:
        raise BadInput(f"cannot read the tokenizer {path}: {error}") from error
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class VocabularyMismatch(DataMismatch):
    """Token ids the model cannot embed: its vocabulary is smaller than the data's."""


def default_cache_dir() -> Path:
    if "LOCOSWARM_CACHE" in os.environ:
        return Path(os.environ["LOCOSWARM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "locoswarm"


def _slice_segments(segments: Sequence[np.ndarray], start: int, end: int) -> list[np.ndarray]:
    """Tokens [start, end) of the concatenation of `segments`, as views (no copy)."""
    out, offset = [], 0
    for segment in segments:
        lo, hi = max(start - offset, 0), min(end - offset, len(segment))
        if lo < hi:
            out.append(segment[lo:hi])
        offset += len(segment)
    return out


class TokenDataset:
    """A token stream held as one or more 1-D integer arrays (in memory or memory-mapped).

    Windows never cross from one array to the next, so a segment boundary may also be a
    document or file boundary the model should not see across.
    """

    def __init__(
        self,
        segments: Sequence[np.ndarray],
        *,
        vocab_size: int,
        name: str,
        shard_index: int = 0,
        num_shards: int = 1,
        tokenizer_id: str | None = None,
    ) -> None:
        self.segments = [s for s in segments if len(s)]
        self.vocab_size = vocab_size
        self.name = name
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.tokenizer_id = tokenizer_id  # sha256 of the tokenizer.json; None: bytes or untagged shards
        self.num_tokens = sum(len(s) for s in self.segments)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.name!r}, num_tokens={self.num_tokens}, vocab_size={self.vocab_size}, "
            f"shard={self.shard_index}/{self.num_shards})"
        )

    def tokens(self) -> np.ndarray:
        """All tokens as one array (a copy when there are several segments)."""
        if not self.segments:
            return np.empty(0, dtype=np.int64)
        return self.segments[0] if len(self.segments) == 1 else np.concatenate(self.segments)

    def shard(self, index: int, num_shards: int) -> TokenDataset:
        """The index-th of num_shards contiguous, disjoint ranges that together cover the data."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} outside [0, {num_shards})")
        start = self.num_tokens * index // num_shards
        end = self.num_tokens * (index + 1) // num_shards
        return TokenDataset(
            _slice_segments(self.segments, start, end),
            vocab_size=self.vocab_size,
            name=f"{self.name}[{index}/{num_shards}]",
            shard_index=index,
            num_shards=num_shards,
            tokenizer_id=self.tokenizer_id,
        )

    def _window_positions(self, seq_len: int) -> np.ndarray:
        """Cumulative count of valid window starts (seq_len + 1 tokens) per segment."""
        counts = np.array([max(len(s) - seq_len, 0) for s in self.segments], dtype=np.int64)
        cumulative = np.cumsum(counts)
        if not len(cumulative) or cumulative[-1] == 0:
            raise EmptyData(
                f"{self.name}: no run of {seq_len + 1} tokens to cut a sequence from "
                f"({self.num_tokens} tokens in {len(self.segments)} segments)"
            )
        return cumulative

    def _gather(self, flat_starts: np.ndarray, cumulative: np.ndarray, seq_len: int) -> np.ndarray:
        """(N, seq_len + 1) int64 windows for flat window indices, one fancy index per segment."""
        segment_ids = np.searchsorted(cumulative, flat_starts, side="right")
        local_starts = flat_starts - np.concatenate(([0], cumulative[:-1]))[segment_ids]
        offsets = np.arange(seq_len + 1)
        windows = np.empty((len(flat_starts), seq_len + 1), dtype=np.int64)
        for segment_id in np.unique(segment_ids):
            rows = segment_ids == segment_id
            windows[rows] = self.segments[segment_id][local_starts[rows, None] + offsets]
        return windows

    def batch(
        self, step: int, batch_size: int, seq_len: int, seed: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch for `step`: inputs and next-token targets, both (B, T) int64 on `device`."""
        cumulative = self._window_positions(seq_len)
        rng = np.random.default_rng([seed, self.num_shards, self.shard_index, step])
        flat_starts = rng.integers(0, cumulative[-1], size=batch_size)
        return _to_xy(self._gather(flat_starts, cumulative, seq_len), device)

    def batches(
        self,
        batch_size: int,
        seq_len: int,
        seed: int,
        device: torch.device | str = "cpu",
        start_step: int = 0,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless batches for steps start_step, start_step + 1, ... (see `batch`).

        Raises EmptyData here, not at the first next(), when no sequence fits.
        """
        self._window_positions(seq_len)

        def generate() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            step = start_step
            while True:
                yield self.batch(step, batch_size, seq_len, seed, device)
                step += 1

        return generate()

    def val_batches(
        self, batch_size: int, seq_len: int, num_batches: int, device: torch.device | str = "cpu"
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of num_batches batches: windows evenly spaced over the whole dataset."""
        cumulative = self._window_positions(seq_len)
        count = batch_size * num_batches
        flat_starts = np.linspace(0, cumulative[-1] - 1, num=count).round().astype(np.int64)
        for i in range(num_batches):
            chunk = flat_starts[i * batch_size : (i + 1) * batch_size]
            yield _to_xy(self._gather(chunk, cumulative, seq_len), device)


def _to_xy(windows: np.ndarray, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(windows)  # (B, T + 1)
    if torch.device(device).type == "cuda":
        tokens = tokens.pin_memory().to(device, non_blocking=True)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T), (B, T)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: TokenDataset,
    num_batches: int,
    *,
    batch_size: int = 8,
    seq_len: int = 128,
    device: torch.device | str | None = None,
) -> float:
    """Mean loss of `model` over the fixed validation batches of `dataset` (one host sync)."""
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    was_training = model.training
    model.eval()
    try:
        loss_sum = torch.zeros((), device=device)
        for x, y in dataset.val_batches(batch_size, seq_len, num_batches, device):
            with autocast_for(device):
                loss_sum += lm_loss(model, x, y)
        return (loss_sum / num_batches).item()
    finally:
        model.train(was_training)


@dataclass(frozen=True, slots=True)
class Corpus:
    train: TokenDataset
    val: TokenDataset
    description: str  # where the tokens came from, for logs and run summaries


def _in_validation(relative_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def _tail_split(segments: Sequence[np.ndarray], val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    total = sum(len(s) for s in segments)
    cut = total - max(1, int(total * val_fraction))
    return _slice_segments(segments, 0, cut), _slice_segments(segments, cut, total)


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its .py files (sorted, tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS and not d.startswith("."))
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return root, sorted(files)


def _text_files(root: Path) -> list[Path]:
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in names:
            path = Path(directory, name)
            if name.startswith(".") or not path.is_file():
                continue
            with open(path, "rb") as f:
                if b"\0" in f.read(8192):
                    continue
            files.append(path)
    return sorted(files)


def _files_corpus(root: Path, files: list[Path], name: str, cache_dir: Path | None, val_fraction: float) -> Corpus:
    """Byte tokens of `files` split by file, through the .npy cache."""
    if not files:
        raise DataNotFound(f"{name}: no text files under {root}")
    relative = [f.relative_to(root).as_posix() for f in files]
    key = hashlib.sha256(repr(val_fraction).encode())
    for rel, path in zip(relative, files):
        stat = path.stat()
        key.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    cache = (cache_dir or default_cache_dir()) / f"{name}-{key.hexdigest()[:16]}"
    description = f"{name}: {len(files)} files under {root}"
    try:
        train = np.load(cache / "train.npy", mmap_mode="r")
        val = np.load(cache / "val.npy", mmap_mode="r")
        return _byte_corpus([train], [val], name, description)
    except (OSError, ValueError):
        pass

    is_val = [_in_validation(rel, val_fraction) for rel in relative]
    parts = {
        split: b"".join(path.read_bytes() for path, v in zip(files, is_val) if v == (split == "val"))
        for split in ("train", "val")
    }
    train = np.frombuffer(parts["train"], dtype=np.uint8)
    val = np.frombuffer(parts["val"], dtype=np.uint8)
    if not len(train) and not len(val):
        raise EmptyData(f"{name}: the files under {root} are all empty")
    if not len(train) or not len(val):
        train_segments, val_segments = _tail_split([train, val], val_fraction)
        train, val = np.concatenate(train_segments), np.concatenate(val_segments)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for split, array in (("train", train), ("val", val)):
            temporary = cache / f".{split}.{os.getpid()}.npy"
            np.save(temporary, array)
            os.replace(temporary, cache / f"{split}.npy")
    except OSError as error:
        log.warning("not caching %s tokens in %s: %s", name, cache, error)
    return _byte_corpus([train], [val], name, description)


def _byte_corpus(train: list[np.ndarray], val: list[np.ndarray], name: str, description: str) -> Corpus:
    return Corpus(
        train=TokenDataset(train, vocab_size=BYTE_VOCAB_SIZE, name=f"{name}/train"),
        val=TokenDataset(val, vocab_size=BYTE_VOCAB_SIZE, name=f"{name}/val"),
        description=description,
    )


def stdlib_corpus(*, cache_dir: Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """The default corpus: this Python's standard library source, byte tokens."""
    root, files = stdlib_files()
    return _files_corpus(root, files, "stdlib", cache_dir, val_fraction)


def text_corpus(
    path: str | os.PathLike, *, cache_dir: Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION
) -> Corpus:
    """Byte tokens of a text file (tail split, memory-mapped) or a directory of text files."""
    path = Path(path)
    if path.is_dir():
        return _files_corpus(path, _text_files(path), f"text-{path.name or 'root'}", cache_dir, val_fraction)
    if not path.is_file():
        raise DataNotFound(f"no such data file or directory: {path}")
    if path.stat().st_size == 0:
        raise EmptyData(f"{path} is empty")
    train, val = _tail_split([np.memmap(path, dtype=np.uint8, mode="r")], val_fraction)
    return _byte_corpus(train, val, f"text-{path.name}", f"text file {path}")


def shard_dtype(vocab_size: int) -> np.dtype:
    """The narrowest shard dtype that holds ids 0..vocab_size-1: uint16 up to 65536 tokens, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_bin_shard(
    path: str | os.PathLike,
    tokens: np.ndarray,
    dtype: str | np.dtype | None = "uint16",
    *,
    vocab_size: int | None = None,
    tokenizer_id: str | None = None,
) -> None:
    """Write tokens as a .bin shard with the llm.c header (version 1 = uint16, 2 = uint32).

    With `vocab_size` (and `tokenizer_id`, 64 hex digits) the header also says what the ids
    mean; `dtype=None` then picks it from the vocabulary (`shard_dtype`)."""
    if dtype is None:
        if vocab_size is None:
            raise ValueError("dtype=None picks the dtype from vocab_size, which is missing")
        dtype = shard_dtype(vocab_size)
    dtype = np.dtype(dtype).newbyteorder("<")
    version = {np.dtype("<u2"): 1, np.dtype("<u4"): 2}.get(dtype)
    if version is None:
        raise ValueError(f"shards hold uint16 or uint32 tokens, not {dtype}")
    tokens = np.asarray(tokens)
    limit = np.iinfo(dtype).max if vocab_size is None else min(np.iinfo(dtype).max, vocab_size - 1)
    if tokens.size and (tokens.min() < 0 or tokens.max() > limit):
        raise ValueError(
            f"token ids outside the vocabulary of {vocab_size}"
            if limit == (vocab_size or 0) - 1
            else f"token ids do not fit in {dtype}"
        )
    if tokenizer_id is not None and vocab_size is None:
        raise ValueError("a shard's tokenizer id comes with its vocabulary size")
    header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
    header[:3] = (BIN_MAGIC, version, tokens.size)
    if vocab_size is not None:
        header[_TAG_SLOT : _VOCAB_SLOT + 1] = (SHARD_TAG, SHARD_TAG_VERSION, vocab_size)
        if tokenizer_id is not None:
            id_bytes = bytes.fromhex(tokenizer_id)
            if len(id_bytes) != _TOKENIZER_ID_BYTES:
                raise ValueError(f"a tokenizer id is {_TOKENIZER_ID_BYTES} bytes, got {len(id_bytes)}")
            header[_TOKENIZER_SLOT : _TOKENIZER_SLOT + _TOKENIZER_ID_BYTES // 4] = np.frombuffer(id_bytes, "<i4")
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """What a .bin shard's header (or, headerless, its name and size) says."""

    dtype: np.dtype
    num_tokens: int
    offset: int  # bytes before the first token
    vocab_size: int | None = None  # the tokenizer's vocabulary; None: not recorded
    tokenizer_id: str | None = None  # hex sha256 of the tokenizer.json; None: not recorded


def read_bin_header(path: str | os.PathLike) -> ShardHeader:
    """A .bin shard's header, checked against the file's size (see the module docstring)."""
    path = Path(path)
    size = path.stat().st_size
    if size >= BIN_HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=BIN_HEADER_INTS)
        if header[0] == BIN_MAGIC:
            dtype = _BIN_VERSION_DTYPE.get(int(header[1]))
            if dtype is None:
                raise MalformedShard(f"{path}: unknown shard version {header[1]}")
            expected = BIN_HEADER_BYTES + int(header[2]) * dtype.itemsize
            if header[2] < 0 or size != expected:
                raise MalformedShard(f"{path}: header says {header[2]} tokens ({expected} bytes), file has {size}")
            vocab_size = tokenizer_id = None
            if header[_TAG_SLOT] == SHARD_TAG:
                if header[_TAG_SLOT + 1] != SHARD_TAG_VERSION or header[_VOCAB_SLOT] < 1:
                    raise MalformedShard(
                        f"{path}: unknown tag version {header[_TAG_SLOT + 1]} or vocabulary size {header[_VOCAB_SLOT]}"
                    )
                vocab_size = int(header[_VOCAB_SLOT])
                id_bytes = header[_TOKENIZER_SLOT : _TOKENIZER_SLOT + _TOKENIZER_ID_BYTES // 4].tobytes()
                tokenizer_id = id_bytes.hex() if any(id_bytes) else None
            return ShardHeader(dtype, int(header[2]), BIN_HEADER_BYTES, vocab_size, tokenizer_id)
    wide = path.name.endswith((".u32.bin", ".uint32.bin"))
    dtype = np.dtype("<u4") if wide else np.dtype("<u2")
    if size % dtype.itemsize:
        raise MalformedShard(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return ShardHeader(dtype, size // dtype.itemsize, 0)


def open_bin_shard(path: str | os.PathLike, header: ShardHeader | None = None) -> np.ndarray:
    """A .bin shard's tokens, memory-mapped (see the module docstring for the format)."""
    header = header or read_bin_header(path)
    if header.num_tokens == 0:
        return np.empty(0, dtype=header.dtype)
    return np.memmap(path, dtype=header.dtype, mode="r", offset=header.offset, shape=(header.num_tokens,))


def bin_corpus(
    path: str | os.PathLike, *, vocab_size: int | None = None, val_fraction: float = DEFAULT_VAL_FRACTION
) -> Corpus:
    """Pre-tokenized .bin shards: a file, or every .bin file in a directory (sorted).

    The vocabulary is the one the shards' headers record; else `vocab_size`; else the largest
    token id, found by reading every shard once. Tagged shards must agree on their tokenizer, and
    a directory's tokenizer.json, if any, must be theirs.
    """
    path = Path(path)
    files = sorted(path.rglob("*.bin")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise DataNotFound(f"no .bin shards at {path}")
    headers = {f: read_bin_header(f) for f in files}
    tags = {(h.vocab_size, h.tokenizer_id) for h in headers.values()}
    if len(tags) > 1:
        described = ", ".join(
            sorted(f"{f.name}: {_describe_tag(h.vocab_size, h.tokenizer_id)}" for f, h in headers.items())
        )
        raise TokenizerMismatch(
            f"{path}: shards made with different tokenizers ({described}); "
            "keep one `locoswarm data prepare` output per directory"
        )
    declared_vocab, shards_tokenizer = tags.pop()
    if shards_tokenizer is not None and path.is_dir() and (path / TOKENIZER_FILE).is_file():
        beside = tokenizer_id(path / TOKENIZER_FILE)
        if beside != shards_tokenizer:
            raise TokenizerMismatch(
                f"{path}: {TOKENIZER_FILE} has id {beside[:12]}, the shards {shards_tokenizer[:12]}; "
                "prepare the shards again (`locoswarm data prepare`) or restore its tokenizer.json"
            )
    val_files = [f for f in files if "val" in f.name]
    train_files = [f for f in files if "val" not in f.name]
    if not train_files:
        raise DataNotFound(f"{path}: only validation shards ({[f.name for f in val_files]})")
    train = [open_bin_shard(f, headers[f]) for f in train_files]
    val = [open_bin_shard(f, headers[f]) for f in val_files]
    if not any(len(s) for s in train):
        raise EmptyData(f"{path}: the training shards hold no tokens")
    if not any(len(s) for s in val):
        train, val = _tail_split(train, val_fraction)
    vocab_size = declared_vocab or vocab_size
    if vocab_size is None:
        vocab_size = 1 + max(int(s.max()) for s in train + val if len(s))
    tag = f", {_describe_tag(declared_vocab, shards_tokenizer)}" if declared_vocab else ""
    return Corpus(
        train=TokenDataset(train, vocab_size=vocab_size, name=f"bin-{path.name}/train", tokenizer_id=shards_tokenizer),
        val=TokenDataset(val, vocab_size=vocab_size, name=f"bin-{path.name}/val", tokenizer_id=shards_tokenizer),
        description=f"{len(files)} .bin shards at {path}{tag}",
    )


def _describe_tag(vocab_size: int | None, tokenizer_id: str | None) -> str:
    if vocab_size is None:
        return "untagged"
    return f"vocabulary {vocab_size}, tokenizer {tokenizer_id[:12] if tokenizer_id else 'unnamed'}"


def check_vocabulary(dataset: TokenDataset, vocab_size: int, tokenizer_id: str | None = None) -> None:
    """Refuse `dataset` unless a model with `vocab_size` token ids, trained for the tokenizer
    `tokenizer_id` (None: the run names none, so any tokenizer whose ids fit), can train on it.

    Cheap: a dataset that records its tokenizer is compared by id and declared vocabulary first;
    then one max over the arrays whose dtype could hold an id >= vocab_size (memory-mapped shards
    are read once, byte text never)."""
    name = dataset.name
    prepare = "`locoswarm data prepare --tokenizer TOKENIZER.json --input ... --out DIR`"
    if tokenizer_id is not None and dataset.tokenizer_id != tokenizer_id:
        held = (
            f"tokenizer {dataset.tokenizer_id[:12]}"
            if dataset.tokenizer_id
            else "no tokenizer (byte text or untagged shards)"
        )
        raise TokenizerMismatch(
            f"{name} was made with {held}, the run trains on tokenizer {tokenizer_id[:12]}: prepare the data with "
            f"the run's tokenizer.json ({prepare}) and pass --data DIR, or use the run's own shards"
        )
    if dataset.tokenizer_id is not None and dataset.vocab_size > vocab_size:
        raise VocabularyMismatch(
            f"{name}: its tokenizer has {dataset.vocab_size} tokens, the model embeds {vocab_size}: set "
            f'model.vocab_size = {dataset.vocab_size} and model.tokenizer_id = "{dataset.tokenizer_id}" in the '
            "run config (as `locoswarm data prepare` printed)"
        )
    wide = [s for s in dataset.segments if np.iinfo(s.dtype).max >= vocab_size]
    top = max((int(s.max()) for s in wide), default=-1)
    if top >= vocab_size:
        raise VocabularyMismatch(
            f"{name}: token id {top} is outside the model's vocabulary of {vocab_size}: the data was tokenized "
            f"for a larger one; prepare it with {prepare} and set model.vocab_size and model.tokenizer_id to what "
            "it prints (or give the model that vocabulary: model.vocab_size, `locoswarm sim --vocab-size`)"
        )


def load_corpus(
    source: str | os.PathLike | None = None,
    *,
    cache_dir: Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    vocab_size: int | None = None,
) -> Corpus:
    """The corpus for `--data`: None or "stdlib", a text file or directory, or .bin shards."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source is None or str(source) == "stdlib":
        return stdlib_corpus(cache_dir=cache_dir, val_fraction=val_fraction)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataNotFound(f"no such data file or directory: {path}")
    if path.suffix == ".bin" or (path.is_dir() and any(path.rglob("*.bin"))):
        return bin_corpus(path, vocab_size=vocab_size, val_fraction=val_fraction)
    return text_corpus(path, cache_dir=cache_dir, val_fraction=val_fraction)
