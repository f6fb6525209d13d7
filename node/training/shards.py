"""Preparing data for a real run: text, JSONL or Parquet in, tagged token shards out.

    prepared = prepare(["fineweb/"], "bpe:32000", Path("data/fineweb"), text_column="text")
    print(run_config_lines(prepared))        # the [model] lines the run config needs
    (the command line is `locoswarm data prepare`, node/cli/data.py)

Inputs (`input_files`): files or directories (searched recursively, hidden entries skipped), read
by suffix: `.parquet` is Parquet (one document per row of the text column, as in FineWeb; needs
pyarrow), `.jsonl` / `.ndjson` / `.json` are JSON lines (one object per line, its text column),
anything else is a text file, one document (`.gz` of text or JSON lines is read through gzip).
In a directory, files with a NUL byte in their first 8 KiB and not Parquet are skipped as binary.

Tokenizers come from the `tokenizers` package: `bpe:VOCAB` trains a byte-level BPE of VOCAB
tokens (GPT-2's pre-tokenizer, every byte in its alphabet, so any text encodes; one special token,
`<|endoftext|>`) on the first `tokenizer_train_bytes` of the input, offline; any other spec is a
path to a tokenizer.json (or a directory holding one) the operator provides, e.g. a Hugging Face
model's. Either way the tokenizer.json is written into the output beside the shards, and its id
(`tokenizer_id`: sha256 of the file's canonical JSON, so re-indenting it keeps the id) goes into
every shard's header and into the run config, which is how a peer knows its shards are the run's.

Documents are encoded without the tokenizer's own templates (a Llama tokenizer would put a BOS
before every piece of a long file); a document starts with the tokenizer's BOS when it has one
distinct from its EOS, and ends with its EOS (`<|endoftext|>`, `</s>`, `<|end_of_text|>` or
`<eos>`), when it has one. A document is validation when the first 8 bytes of blake2b of its
(first megabyte of) text read as a fraction fall under `val_fraction`, so the split does not
depend on input order. Shards (node/training/data.py has the format) hold `shard_tokens` tokens
each, the last one fewer: `train_000000.bin`, ..., `val_000000.bin`, ...; uint16 when the
vocabulary has at most 65536 tokens, else uint32. `data.json` records what was made.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from node.training.data import (
    TOKENIZER_FILE,
    BadInput,
    DataError,
    DataNotFound,
    EmptyData,
    shard_dtype,
    tokenizer_id,
    write_bin_shard,
)

DATA_FILE = "data.json"  # what `prepare` made: tokenizer, vocabulary, shards, token counts
BPE_PREFIX = "bpe:"
END_OF_TEXT = "<|endoftext|>"
EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", END_OF_TEXT)
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's FineWeb shards: 200 MB of uint16
DEFAULT_VAL_FRACTION = 0.005
DEFAULT_TOKENIZER_TRAIN_BYTES = 1 << 30
PIECE_BYTES = 1 << 20  # a long text file is read and encoded in pieces of about this size
BATCH_BYTES = 8 << 20  # text handed to the tokenizer's (multi-threaded) batch encoder at once
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_BINARY_PROBE_BYTES = 8192


class MissingPackage(DataError):
    """A package that preparing data needs (tokenizers, pyarrow) is not installed."""


def _import(module: str, extra: str = "data"):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise MissingPackage(
            f"preparing data needs the {module.split('.')[0]} package: pip install 'locoswarm[{extra}]'"
        ) from None


# -- the tokenizer's id and special tokens -----------------------------------------------------


def special_tokens(path: str | os.PathLike) -> dict[str, tuple[int, str] | None]:
    """{"bos": (id, text), "eos": (id, text)} of a tokenizer.json's added tokens, found by their
    usual names (None where it has none)."""
    added = json.loads(Path(path).read_text("utf-8")).get("added_tokens") or []
    by_content = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}

    def first(names: Sequence[str]) -> tuple[int, str] | None:
        return next(((by_content[n], n) for n in names if isinstance(by_content.get(n), int)), None)

    return {"bos": first(BOS_NAMES), "eos": first(EOS_NAMES)}


def tokenizer_file(spec: str | os.PathLike) -> Path:
    """The tokenizer.json a spec names: the file, or a directory's tokenizer.json."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataNotFound(f"no tokenizer at {spec}: give `bpe:VOCAB` or a tokenizer.json (or its directory)")
    return path


def vocabulary_size(tokenizer) -> int:
    """Ids a model must embed for `tokenizer` (a tokenizers.Tokenizer): its largest id + 1."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer of at most vocab_size tokens trained on `texts` (fewer when the
    text has fewer merges to offer)."""
    tk = _import("tokenizers")
    if vocab_size < 257:
        raise ValueError(
            f"a byte-level BPE needs a vocabulary of at least 257 (256 bytes and {END_OF_TEXT}), got {vocab_size}"
        )
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


# -- reading the inputs ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Piece:
    """Text from an input: a whole document, or part of a long one."""

    text: str
    starts_document: bool
    ends_document: bool
    input_bytes: int  # bytes of the input file read for it (compressed bytes for .gz), for progress


def _kind(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith(_JSONL_SUFFIXES) else "text"


def _is_binary(path: Path) -> bool:
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            return b"\0" in f.read(_BINARY_PROBE_BYTES)
    except (OSError, EOFError):  # a .gz that is not gzip
        return True


def input_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """The files to read: each input file, and every file under each input directory (sorted)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_file():
            files.append(path)
            continue
        if not path.is_dir():
            raise DataNotFound(f"no such input file or directory: {path}")
        for directory, subdirs, names in os.walk(path):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            for name in sorted(names):
                file = Path(directory, name)
                if name.startswith(".") or not file.is_file():
                    continue
                if _kind(file) == "parquet" or not _is_binary(file):
                    files.append(file)
    if not files:
        raise DataNotFound(f"no input files in {', '.join(map(str, inputs))}")
    return files


class _Counting(io.RawIOBase):
    """A read-only file that counts the bytes read through it (progress through gzip)."""

    def __init__(self, raw) -> None:
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        self.count += n or 0
        return n


def _open_counted(path: Path) -> tuple[io.BufferedReader | gzip.GzipFile, _Counting]:
    counting = _Counting(open(path, "rb"))
    if path.suffix == ".gz":
        return gzip.GzipFile(fileobj=io.BufferedReader(counting)), counting
    return io.BufferedReader(counting), counting


def _text_pieces(path: Path) -> Iterator[Piece]:
    """A text file as one document, in pieces cut after a newline (bytes that are not UTF-8 are
    replaced: a text file may hold a few)."""
    stream, counting = _open_counted(path)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may straddle two reads
    with stream, counting.raw:
        carry, reported, first = "", 0, True
        while True:
            block = stream.read(PIECE_BYTES)
            text = carry + decoder.decode(block, final=not block)
            if block:
                cut = text.rfind("\n") + 1 or len(text)
                text, carry = text[:cut], text[cut:]
            if text or not block:
                yield Piece(text, first, not block, counting.count - reported)
                reported, first = counting.count, False
            if not block:
                return


def _jsonl_pieces(path: Path, column: str) -> Iterator[Piece]:
    stream, counting = _open_counted(path)
    with stream, counting.raw:
        reported = 0
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise BadInput(f"{path} line {number}: not JSON ({error})") from None
            text = record.get(column) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise BadInput(
                    f"{path} line {number}: no text in {column!r} (it has {keys}); "
                    "name the text's key with --text-column"
                )
            yield Piece(text, True, True, counting.count - reported)
            reported = counting.count


def _parquet_pieces(path: Path, column: str) -> Iterator[Piece]:
    pq = _import("pyarrow.parquet")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid, OSError...
        raise BadInput(f"{path}: not a Parquet file ({error})") from None
    names = parquet.schema_arrow.names
    if column not in names:
        raise BadInput(f"{path}: no column {column!r} (it has {names}); name the text column with --text-column")
    size, rows = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    reported = done = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
        for text in batch.column(0).to_pylist():
            done += 1
            if text is None:
                continue
            if not isinstance(text, str):
                raise BadInput(f"{path}: column {column!r} holds {type(text).__name__}, not text")
            progress = size * done // rows
            yield Piece(text, True, True, progress - reported)
            reported = progress
    if size > reported:
        yield Piece("", False, False, size - reported)


def read_pieces(files: Sequence[Path], text_column: str = "text") -> Iterator[Piece]:
    """Every input's text, document by document (see the module docstring for the formats)."""
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            yield from _parquet_pieces(path, text_column)
        elif kind == "jsonl":
            yield from _jsonl_pieces(path, text_column)
        else:
            yield from _text_pieces(path)


# -- writing the shards ------------------------------------------------------------------------


class _ShardWriter:
    """One split's shards: tokens gathered in a fixed buffer, written when it fills."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, vocab_size: int, tokenizer_id: str) -> None:
        self.out_dir, self.split, self.vocab_size, self.tokenizer_id = out_dir, split, vocab_size, tokenizer_id
        self.buffer = np.empty(shard_tokens, dtype=shard_dtype(vocab_size))
        self.filled = 0
        self.files: list[str] = []
        self.num_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            take = min(len(ids), len(self.buffer) - self.filled)
            self.buffer[self.filled : self.filled + take] = ids[:take]
            self.filled += take
            ids = ids[take:]
            if self.filled == len(self.buffer):
                self.flush()

    def flush(self) -> None:
        if not self.filled:
            return
        name = f"{self.split}_{len(self.files):06d}.bin"
        temporary = self.out_dir / f".{name}.tmp"
        write_bin_shard(
            temporary,
            self.buffer[: self.filled],
            self.buffer.dtype,
            vocab_size=self.vocab_size,
            tokenizer_id=self.tokenizer_id,
        )
        os.replace(temporary, self.out_dir / name)
        self.files.append(name)
        self.num_tokens += self.filled
        self.filled = 0


def _in_validation(text: str, val_fraction: float) -> bool:
    digest = hashlib.blake2b(text[:PIECE_BYTES].encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < val_fraction


@dataclass(frozen=True, slots=True)
class PreparedData:
    """What `prepare` wrote (also DIR/data.json)."""

    out_dir: str
    tokenizer: str  # the spec it was given: bpe:VOCAB or the tokenizer.json's path
    tokenizer_id: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    dtype: str
    num_documents: int
    num_tokens: dict[str, int] = field(default_factory=dict)  # by split
    shards: dict[str, list[str]] = field(default_factory=dict)  # by split
    inputs: list[str] = field(default_factory=list)
    text_column: str = "text"


def run_config_lines(prepared: PreparedData) -> str:
    """The run config's [model] lines for this data (TOML)."""
    return "\n".join(
        [
            "[model]",
            f"data = {json.dumps(prepared.out_dir)}",
            f"vocab_size = {prepared.vocab_size}",
            f'tokenizer_id = "{prepared.tokenizer_id}"',
        ]
    )


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer_spec: str,
    out_dir: str | os.PathLike,
    *,
    text_column: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    tokenizer_train_bytes: int = DEFAULT_TOKENIZER_TRAIN_BYTES,
    progress: bool | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> PreparedData:
    """Tokenize `inputs` into shards in `out_dir` (see the module docstring); `progress` None
    shows bars only on a terminal."""
    if not 1 <= shard_tokens < 2**31:  # the header counts tokens in an int32
        raise ValueError(f"shard_tokens must be in [1, 2**31), got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tqdm = _import("tqdm").tqdm
    tk = _import("tokenizers")
    files = input_files(inputs)
    out = Path(out_dir).expanduser()
    if out.is_dir() and any(out.glob("*.bin")):
        raise DataError(f"{out} already holds .bin shards: write to an empty directory (or remove them)")
    out.mkdir(parents=True, exist_ok=True)
    total_bytes = sum(f.stat().st_size for f in files)
    disable = None if progress is None else not progress  # None: tqdm shows a bar on a terminal only

    if tokenizer_spec.startswith(BPE_PREFIX):
        try:
            requested = int(tokenizer_spec[len(BPE_PREFIX) :])
        except ValueError:
            raise ValueError(f"bad tokenizer {tokenizer_spec!r}: bpe:VOCAB takes a number, e.g. bpe:32000") from None
        budget = min(total_bytes, tokenizer_train_bytes)
        say(f"training a byte-level BPE of {requested} tokens on {budget:,} bytes of {len(files)} files")
        with tqdm(total=budget, unit="B", unit_scale=True, desc="training tokenizer", disable=disable) as bar:
            tokenizer = train_bpe(_limited(read_pieces(files, text_column), tokenizer_train_bytes, bar), requested)
        tokenizer.save(str(out / TOKENIZER_FILE))
    else:
        source = tokenizer_file(tokenizer_spec)
        try:
            tokenizer = tk.Tokenizer.from_file(str(source))
        except Exception as error:  # tokenizers raises a bare Exception for a bad file
            raise BadInput(f"{source} is not a tokenizer.json the tokenizers package can load: {error}") from None
        if source.resolve() != (out / TOKENIZER_FILE).resolve():
            shutil.copyfile(source, out / TOKENIZER_FILE)
    identity = tokenizer_id(out / TOKENIZER_FILE)
    vocab_size = vocabulary_size(tokenizer)
    special = {role: token and token[0] for role, token in special_tokens(out / TOKENIZER_FILE).items()}
    bos = special["bos"] if special["bos"] != special["eos"] else None
    say(f"tokenizer {identity[:12]}: {vocab_size} tokens, {shard_dtype(vocab_size).name} shards")

    writers = {split: _ShardWriter(out, split, shard_tokens, vocab_size, identity) for split in ("train", "val")}
    num_documents = 0
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=disable) as bar:
        for batch in _batches(read_pieces(files, text_column), val_fraction):
            encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
            encodings = encode([piece.text for piece, _ in batch], add_special_tokens=False)
            for (piece, split), encoding in zip(batch, encodings):
                bar.update(piece.input_bytes)
                if piece.starts_document and piece.ends_document and not piece.text:
                    continue  # an empty document (an empty file or record) leaves no separators either
                ids = encoding.ids
                if piece.starts_document and bos is not None:
                    ids = [bos, *ids]
                if piece.ends_document and special["eos"] is not None:
                    ids = [*ids, special["eos"]]
                writers[split].add(np.asarray(ids, dtype=np.int64))
                num_documents += piece.ends_document
    for writer in writers.values():
        writer.flush()
    train, val = writers["train"], writers["val"]
    if not train.files and val.files:  # every document fell in validation: train on them (the loader splits)
        for i, name in enumerate(val.files):
            os.replace(out / name, out / f"train_{i:06d}.bin")
        train.files, train.num_tokens = [f"train_{i:06d}.bin" for i in range(len(val.files))], val.num_tokens
        val.files, val.num_tokens = [], 0
    if not train.files:
        raise EmptyData(f"no tokens in {', '.join(map(str, inputs))}")
    prepared = PreparedData(
        out_dir=str(out),
        tokenizer=tokenizer_spec,
        tokenizer_id=identity,
        vocab_size=vocab_size,
        bos_id=special["bos"],
        eos_id=special["eos"],
        dtype=shard_dtype(vocab_size).name,
        num_documents=num_documents,
        num_tokens={s: w.num_tokens for s, w in writers.items()},
        shards={s: w.files for s, w in writers.items()},
        inputs=[str(f) for f in files],
        text_column=text_column,
    )
    (out / DATA_FILE).write_text(json.dumps(asdict(prepared), indent=2) + "\n")
    return prepared


def _limited(pieces: Iterator[Piece], max_bytes: int, bar) -> Iterator[str]:
    """The pieces' texts until max_bytes of input are read (the tokenizer's training sample)."""
    read = 0
    for piece in pieces:
        if read >= max_bytes:
            return
        read += piece.input_bytes
        bar.update(piece.input_bytes)
        if piece.text:
            yield piece.text


def _batches(pieces: Iterator[Piece], val_fraction: float) -> Iterator[list[tuple[Piece, str]]]:
    """Pieces with their split ("train" or "val", decided at each document's first piece), in
    lists of about BATCH_BYTES of text for the batch encoder."""
    batch: list[tuple[Piece, str]] = []
    size, split = 0, "train"
    for piece in pieces:
        if piece.starts_document:
            split = "val" if _in_validation(piece.text, val_fraction) else "train"
        batch.append((piece, split))
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
