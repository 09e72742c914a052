"""Pre-training FLOPs counted the ELECTRA way (tools/count_flops.py, taco-count-flops).

    python tools/count_flops.py --model sas --model-size small --seq-length 128 \\
        --global-batch-size 512 --train-iters 250000          # SAS paper Table 1: 1.279e18

Models: sas (--disentangled-attention for SAS^DA), bert, electra (discriminator of the
preset's size, generator --generator-divisor times narrower, embeddings tied) and taco.
Sizes come from the same presets as pretraining (SAS's Table 5 for sas/bert/electra; for
ELECTRA-Small the embedding is 128 as in the paper), overridable with the size flags.
The convention (models/flops.py): matmuls 2mn, element-wise ops by ELECTRA's constants,
backward = forward, the MLM softmax on 15.625% of the tokens.
"""

from __future__ import annotations

import argparse
import sys

from megatron_taco.cli import tool_parser
from megatron_taco.models import flops
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.models.taco.config import TacoConfig

MODELS = ("sas", "bert", "electra", "taco")


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("count_flops.py", __doc__)
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--model-size", default="small", help="Preset (tiny, small, base).")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--train-iters", type=int, default=250_000)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--num-layers", type=int, help="Override the preset.")
    p.add_argument("--hidden-size", type=int, help="Override the preset (not TACO).")
    p.add_argument("--embedding-size", type=int, help="Override (ELECTRA-Small default 128).")
    p.add_argument("--disentangled-attention", action="store_true", help="SAS^DA.")
    p.add_argument(
        "--relative-span",
        type=int,
        help="SAS^DA: half the relative table's rows (default: the sequence length).",
    )
    p.add_argument(
        "--generator-divisor",
        type=int,
        default=4,
        help="ELECTRA: generator hidden = discriminator hidden / this (paper: 4 small, 3 base).",
    )
    return p


def _shape(args: argparse.Namespace):
    cfg = SasConfig.preset(args.model_size)
    hidden = args.hidden_size or cfg.hidden_size
    embedding = args.embedding_size or (
        128 if args.model == "electra" and args.model_size == "small" else cfg.embedding_size
    )
    heads = cfg.num_attention_heads if args.hidden_size is None else max(hidden // 64, 1)
    return flops.EncoderShape(
        layers=args.num_layers or cfg.num_layers,
        hidden=hidden,
        ffn=cfg.ffn_hidden_size if args.hidden_size is None else 4 * hidden,
        heads=heads,
        head_size=hidden // heads,
        embedding_size=embedding,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
    )


def count(args: argparse.Namespace) -> float:
    b, steps = args.global_batch_size, args.train_iters
    if args.model == "taco":
        overrides = {"num_layers": args.num_layers} if args.num_layers else {}
        cfg = TacoConfig.preset(args.model_size, vocab_size=args.vocab_size, **overrides)
        return flops.taco_electra_train_flops(cfg, args.seq_length, b, steps)
    shape = _shape(args)
    if args.model == "bert":
        return flops.bert_train_flops(shape, b, steps)
    if args.model == "electra":
        generator = flops.generator_shape(shape, args.generator_divisor)
        return flops.electra_train_flops(shape, generator, b, steps)
    return flops.sas_train_flops(
        shape,
        b,
        steps,
        disentangled_attention=args.disentangled_attention,
        relative_span=args.relative_span,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seq_length", "global_batch_size", "train_iters", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        total = count(args)
    except ValueError as e:  # ConfigError from a preset or size check
        parser.error(str(e))
    name = args.model.upper() + ("^DA" if args.disentangled_attention else "")
    print(
        f"{name} {args.model_size}: {total:.4g} train FLOPs ({args.train_iters} iterations x "
        f"batch {args.global_batch_size} x seq {args.seq_length}; "
        f"{total / args.train_iters:.4g} per iteration)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
