"""taco-word-order-probe (tools/word_order_probe.py): the TACO paper's Figure 1 probe,
megatron_taco/evaluation/figure1.py, whose docstring is this command's help."""

from __future__ import annotations

import argparse
import sys

from megatron_taco.arguments import add_dataclass_args, dataclass_from_args, run_cli
from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.cli import tool_parser
from megatron_taco.evaluation import figure1
from megatron_taco.evaluation.figure1 import ProbeConfig, run


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        "word_order_probe.py",
        figure1.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(figure1.__doc__.split("\n\n")[3:]),
        allow_abbrev=False,
    )
    p.add_argument(
        "--load",
        action="extend",
        nargs="+",
        required=True,
        help="Our checkpoint directory (a --save of pre-training) or a transformers model "
        "directory; repeat for several models.",
    )
    add_dataclass_args(p, ProbeConfig, "word-order probe")
    return p


def main(argv: list[str] | None = None) -> int:
    def body(args: argparse.Namespace) -> None:
        run(dataclass_from_args(ProbeConfig, args, load=tuple(args.load)))

    return run_cli(build_parser(), argv, body, user_errors=(CheckpointError, ImportError, OSError))


if __name__ == "__main__":
    sys.exit(main())
