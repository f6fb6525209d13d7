"""`locoswarm export`: a node's checkpoint as a Hugging Face Llama model directory.

    locoswarm export --checkpoint ckpt/ --out hf-model/ [--tokenizer data/fineweb] [--dtype bfloat16]

It writes config.json, model.safetensors and, for a run on a tokenizer, tokenizer.json with its
tokenizer_config.json, loadable by transformers (`LlamaForCausalLM.from_pretrained(out)`,
`AutoTokenizer.from_pretrained(out)`); node/training/hf.py has the name map. The checkpoint is
a node's --checkpoint-dir: its parameters are the agreed global model of the round it starts.
"""

from __future__ import annotations

import argparse
import sys

EXIT_REFUSED = 2


def register(subparsers) -> None:
    export = subparsers.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face Llama model (config.json, model.safetensors)",
        description="Export a node checkpoint in the Hugging Face Llama layout, loadable by transformers.",
    )
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="a node's checkpoint directory")
    export.add_argument("--out", required=True, metavar="DIR", help="where the model directory goes")
    tokenizer = export.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the run's tokenizer.json, or the `locoswarm data prepare` directory holding it "
        "(needed when the run trained on a tokenizer)",
    )
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="export the weights without a tokenizer")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of model.safetensors (default float32, the master copy)",
    )
    export.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from node.training.checkpoint import CheckpointError
    from node.training.data import DataError
    from node.training.hf import WeightsError, export_checkpoint

    try:
        exported = export_checkpoint(
            args.checkpoint,
            args.out,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            require_tokenizer=not args.no_tokenizer,
        )
    except (CheckpointError, WeightsError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(
        f"wrote {', '.join(exported.files)} to {exported.out_dir} ({exported.num_parameters:,} parameters, "
        f"{args.dtype})"
    )
    print(f"load it with transformers: LlamaForCausalLM.from_pretrained({str(exported.out_dir)!r})")
    return 0
