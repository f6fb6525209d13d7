"""`locoswarm generate`: a sample of text from a trained model, to see what the swarm has learnt.

    locoswarm generate --checkpoint ckpt/ --prompt "def " [--tokens 200 --temperature 0.8 --seed 0]
    locoswarm generate --model hf-model/ --prompt "Once upon a time" [--tokenizer data/fineweb]

The model comes from a node's checkpoint (node/training/checkpoint.py: its meta.json records the
model config, the parameters are digest-checked) or from a directory `locoswarm export` wrote
(config.json and model.safetensors, node/training/hf.py). The tokenizer is the run's:

- byte-level text (vocabulary 256, no tokenizer id: the tiny, mini and small presets on the
  standard library or on text files) needs nothing; the prompt's UTF-8 bytes are its tokens;
- a run on `locoswarm data prepare` shards records its tokenizer's id in the model config; give
  --tokenizer, the tokenizer.json or the prepared directory holding it (an exported directory's own
  tokenizer.json is used by default), and it must have that id. Its text is encoded as `data
  prepare` encodes a document: no template, a BOS first where the tokenizer has one apart from EOS.

Contract: stdout gets the prompt followed by the continuation, one sample; what was loaded goes to
stderr. At most --tokens new tokens (1..1024), fewer when the tokenizer's end of text is drawn (it
is not printed). Temperature 0 is greedy (the seed then does not matter); otherwise tokens are
drawn from softmax(logits / T) with a CPU generator seeded by --seed, so the same model, prompt
and seed give the same text on one machine (another device's logits may round differently). The
context is the last max_seq_len tokens (the model has no cache: each new token runs the model over
the whole context). A refusal (no checkpoint, a tokenizer that is not the run's, bad values) is one
line on stderr and exit code 2, as `locoswarm export`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from node.training.sampling import (
    MAX_NEW_TOKENS,
    MAX_TEMPERATURE,
    GenerateError,
    SampleConfig,
    generate_text,
    load_checkpoint_model,
    load_exported_model,
    run_tokenizer,
)

EXIT_REFUSED = 2


# -- command line --------------------------------------------------------------------------------


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="print a sample of text from a checkpoint or an exported model",
        description="Sample text from a trained model with the run's tokenizer: the prompt, then the "
        "continuation, on stdout. Temperature 0 is greedy; the same --seed gives the same text.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a node's checkpoint directory (--checkpoint-dir)")
    source.add_argument("--model", metavar="DIR", help="a Hugging Face Llama directory `locoswarm export` wrote")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text the sample continues")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the run's tokenizer.json, or the `locoswarm data prepare` directory holding it "
        "(needed when the run trained on a tokenizer; byte-level models need none)",
    )
    d = SampleConfig()
    parser.add_argument(
        "--tokens",
        type=_bounded(int, 1, MAX_NEW_TOKENS),
        default=d.max_new_tokens,
        metavar="N",
        help=f"new tokens at most, 1..{MAX_NEW_TOKENS} (default {d.max_new_tokens})",
    )
    parser.add_argument(
        "--temperature",
        type=_bounded(float, 0.0, MAX_TEMPERATURE),
        default=d.temperature,
        metavar="T",
        help=f"0 is greedy; higher is more varied (default {d.temperature})",
    )
    parser.add_argument(
        "--seed",
        type=_bounded(int, 0, 2**63 - 1),
        default=d.seed,
        metavar="S",
        help=f"the sampling seed (default {d.seed})",
    )
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="torch device (default cpu)")
    parser.set_defaults(func=_generate)


def _bounded(kind: type, low: float, high: float):
    """An argparse type: `kind` within [low, high], refused by argparse with the range otherwise."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g}..{high:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _generate(args: argparse.Namespace) -> int:
    import torch

    from node.training.checkpoint import CheckpointError
    from node.training.data import DataError
    from node.training.hf import WeightsError

    sample = SampleConfig(max_new_tokens=args.tokens, temperature=args.temperature, seed=args.seed)
    try:
        if args.checkpoint is not None:
            model, described = load_checkpoint_model(args.checkpoint)
            tokenizer = run_tokenizer(model.config, args.tokenizer)
        else:
            model, described = load_exported_model(args.model)
            tokenizer = run_tokenizer(model.config, args.tokenizer, beside=Path(args.model).expanduser())
        try:
            model.to(torch.device(args.device))
        except (RuntimeError, AssertionError) as error:  # torch's words for a device it has not got
            raise GenerateError(f"device {args.device}: {error}") from None
        print(
            f"{described}; tokenizer {tokenizer.name}; {args.tokens} tokens at most, temperature "
            f"{args.temperature:g}, seed {args.seed}",
            file=sys.stderr,
        )
        text = generate_text(model, tokenizer, args.prompt, sample)
    except (GenerateError, CheckpointError, WeightsError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(text)
    return 0
