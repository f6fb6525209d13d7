"""`locoswarm data prepare`: text, JSONL or Parquet into token shards for a run.

    locoswarm data prepare --input corpus/ --tokenizer bpe:32000 --out data/corpus
    locoswarm data prepare --input fineweb/*.parquet --tokenizer llama/tokenizer.json --out data/fw

It writes the shards, the tokenizer.json and data.json into --out (node/training/shards.py says
how), then prints the [model] lines of the run config that make peers train on them: `data`,
`vocab_size` and `tokenizer_id` (a peer refuses shards of another tokenizer). Progress bars show
on a terminal only. What cannot be done is refused in one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

EXIT_REFUSED = 2


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="prepare training data: text, JSONL or Parquet into token shards")
    data_sub = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    prepare = data_sub.add_parser(
        "prepare",
        help="tokenize text, JSONL or Parquet files into shards a run trains on",
        description="Tokenize the inputs into .bin shards with a header naming the tokenizer, and print the run "
        "config lines for them. Inputs: files or directories; .parquet (a text column, as in "
        "FineWeb), .jsonl/.ndjson/.json (JSON lines), anything else a text file (one document).",
    )
    prepare.add_argument(
        "--input",
        dest="inputs",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH",
        help="input files or directories (repeatable)",
    )
    prepare.add_argument(
        "--tokenizer",
        required=True,
        metavar="SPEC",
        help="bpe:VOCAB trains a byte-level BPE on the input; or a tokenizer.json (or its directory)",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="where the shards and tokenizer.json go")
    prepare.add_argument("--text-column", default="text", help="the text's column (Parquet) or key (JSONL)")
    prepare.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 100M)")
    prepare.add_argument(
        "--val-fraction", type=float, default=None, help="fraction of documents held out for validation (default 0.005)"
    )
    prepare.add_argument(
        "--tokenizer-train-bytes",
        type=int,
        default=None,
        help="bpe:VOCAB trains on this many bytes of the input (default 1 GiB)",
    )
    prepare.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: on a terminal only)",
    )
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from node.training import shards
    from node.training.data import DataError

    options = {
        name: value
        for name, value in (
            ("shard_tokens", args.shard_tokens),
            ("val_fraction", args.val_fraction),
            ("tokenizer_train_bytes", args.tokenizer_train_bytes),
        )
        if value is not None
    }
    try:
        prepared = shards.prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            text_column=args.text_column,
            progress=args.progress,
            say=lambda line: print(line, file=sys.stderr),
            **options,
        )
    except (DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    tokens = prepared.num_tokens
    print(
        f"wrote {len(prepared.shards['train'])} train and {len(prepared.shards['val'])} validation shards "
        f"({tokens['train']:,} + {tokens['val']:,} tokens, {prepared.num_documents:,} documents) "
        f"to {prepared.out_dir}"
    )
    print(f"tokenizer {prepared.tokenizer_id[:12]}: {prepared.vocab_size} tokens; {prepared.out_dir}/tokenizer.json")
    print("\nfor the run config (peers on other machines: the same directory, or --data DIR on `node join`):\n")
    print(shards.run_config_lines(prepared))
    return 0
